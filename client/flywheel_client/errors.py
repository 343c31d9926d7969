"""What the client raises: one base class, and the API's refusals with the server's own words."""

from __future__ import annotations

from typing import Any


class FlywheelError(Exception):
    """Anything the client could not do; the message says what and why."""


class ServerUnreachable(FlywheelError):
    """No answer from the server after the retries (refused connection, timeout, reset)."""


class IncompatibleServer(FlywheelError):
    """The server speaks another major version of the API than this client."""


class ApiError(FlywheelError):
    """The API answered with an error status. `detail` is the server's explanation (a string, or the list of
    field errors of a 422) and `body` the whole JSON answer, when there was one."""

    def __init__(self, *, method: str, path: str, status_code: int, detail: Any, body: Any = None) -> None:
        self.method = method
        self.path = path
        self.status_code = status_code
        self.detail = detail
        self.body = body
        super().__init__(f"{method} {path} answered {status_code}: {describe(detail)}")


def describe(detail: Any) -> str:
    """The server's `detail` as one readable line: a list of field errors becomes `field: message; ...`."""
    if isinstance(detail, list):
        parts = []
        for item in detail:
            if isinstance(item, dict):
                loc = item.get("loc") or item.get("field") or []
                where = ".".join(str(p) for p in loc if p not in ("body", "query", "path")) if isinstance(loc, list) \
                    else str(loc)
                message = item.get("msg") or item.get("message") or ""
                parts.append(f"{where}: {message}" if where else str(message))
            else:
                parts.append(str(item))
        return "; ".join(parts)
    return str(detail)
