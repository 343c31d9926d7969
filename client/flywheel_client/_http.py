"""The one place requests are sent: the key, the User-Agent, and bounded retries.

Retried: 429 and 503 (the server's rate limit and a database that is away), after the Retry-After the server
asks for (seconds or an HTTP date, capped at `max_wait_s`), else after an exponential backoff; a connection that
could not be made; and, for requests that are safe to repeat, a connection lost mid-request. A training job's
start is not safe to repeat (a lost answer may hide a started job), so it is only retried when nothing was sent."""

from __future__ import annotations

import email.utils
import logging
import platform
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx2 as httpx

from flywheel_client import __version__
from flywheel_client.errors import ApiError, ServerUnreachable

log = logging.getLogger("flywheel_client")

USER_AGENT = f"flywheel-client/{__version__} python/{platform.python_version()}"
RETRY_STATUSES = frozenset({429, 503})


def retry_after_seconds(value: str | None, *, now: float | None = None) -> float | None:
    """Retry-After as seconds from now: a number of seconds, or an HTTP date. None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class Transport:
    """An httpx client bound to one server and key, retrying as the module says."""

    def __init__(self, url: str, key: str | None, *, timeout: float = 30.0, max_retries: int = 5,
                 max_wait_s: float = 60.0, sleep: Callable[[float], None] = time.sleep,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = url.rstrip("/")
        self.max_retries = max_retries
        self.max_wait_s = max_wait_s
        self._sleep = sleep
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout,
                                    follow_redirects=False, transport=transport)

    def close(self) -> None:
        self._client.close()

    def _backoff(self, attempt: int) -> float:
        return min(self.max_wait_s, 0.5 * 2**attempt) * (0.5 + random.random() / 2)

    def request(self, method: str, path: str, *, json: Any = None, content: bytes | None = None,
                params: Mapping[str, Any] | None = None, headers: Mapping[str, str] | None = None,
                idempotent: bool = True, ok: tuple[int, ...] = ()) -> httpx.Response:
        """Send, retrying as the module says; an error status not in `ok` raises ApiError."""
        attempt = 0
        while True:
            try:
                response = self._client.request(method, path, json=json, content=content, params=params,
                                                headers=headers)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                # Nothing reached the server: safe to send again whatever the request.
                error: Exception | None = exc
            except httpx.TransportError as exc:
                if not idempotent:
                    raise ServerUnreachable(f"{method} {path}: the connection was lost before the answer ({exc}); "
                                            "not sent again, since the request may have been carried out") from exc
                error = exc
            else:
                error = None
            if error is not None:
                if attempt >= self.max_retries:
                    raise ServerUnreachable(f"{method} {self.base_url}{path}: no answer after {attempt + 1} "
                                            f"tries: {error}") from error
                wait = self._backoff(attempt)
                log.info("%s %s: %s; trying again in %.1fs", method, path, error, wait)
            elif response.status_code in RETRY_STATUSES and attempt < self.max_retries:
                asked = retry_after_seconds(response.headers.get("Retry-After"))
                wait = min(self.max_wait_s, asked) if asked is not None else self._backoff(attempt)
                log.info("%s %s answered %s; trying again in %.1fs", method, path, response.status_code, wait)
            else:
                if response.status_code >= 400 and response.status_code not in ok:
                    raise api_error(method, path, response)
                return response
            attempt += 1
            self._sleep(wait)


def api_error(method: str, path: str, response: httpx.Response) -> ApiError:
    try:
        body = response.json()
    except ValueError:
        body = None
    detail = body.get("detail", body) if isinstance(body, dict) else (body if body is not None else
                                                                      response.text[:500] or response.reason_phrase)
    return ApiError(method=method, path=path, status_code=response.status_code, detail=detail, body=body)
