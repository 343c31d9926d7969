"""A database that is away (restarting, failing over, out of connections, locked) answers 503 with a
Retry-After, never 500: the request did nothing (each write is one transaction), and the client should send
it again. Pages get this from `DatabaseUnavailableMiddleware`; the JSON API from its exception handler
(`flywheel.api.errors`), which answers in the API's error shape.

The broken connection is marked so that Django closes it when the request ends; with CONN_HEALTH_CHECKS a
kept connection is also checked before the next request reuses it, so that request reconnects."""

from __future__ import annotations

import logging
from collections.abc import Callable

import psycopg
from django.db import InterfaceError, OperationalError, connections
from django.http import HttpRequest, HttpResponse

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 5
MESSAGE = f"The database is unavailable for the moment; nothing was stored. Send the request again in {RETRY_AFTER_S} seconds."

# Django wraps what its own cursors raise; ingestion's PostgreSQL upsert uses a psycopg cursor of its own,
# whose errors arrive unwrapped.
UNAVAILABLE: tuple[type[Exception], ...] = (
    OperationalError,
    InterfaceError,
    psycopg.OperationalError,
    psycopg.InterfaceError,
)


def is_unavailable(exc: BaseException) -> bool:
    return isinstance(exc, UNAVAILABLE)


def database_unavailable(request: HttpRequest, exc: BaseException, response: HttpResponse) -> HttpResponse:
    """Log `exc`, let the connections go, and give `response` (a 503) its Retry-After."""
    logger.warning("database unavailable during %s %s: %s: %s", request.method, request.path, type(exc).__name__, exc)
    for connection in connections.all(initialized_only=True):
        # Checked, and closed if broken, when the request ends (Django's close_if_unusable_or_obsolete).
        connection.errors_occurred = True
    response.status_code = 503
    response["Retry-After"] = str(RETRY_AFTER_S)
    return response


def _page() -> str:
    from django.templatetags.static import static

    # The icon named, as every page names it, so that the browser does not ask for /favicon.ico (a 404).
    return (
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>Try again shortly</title>"
        f"<link rel=\"icon\" href=\"{static('flywheel/favicon.svg')}\" type=\"image/svg+xml\"></head>"
        "<body><h1>Try again shortly</h1><p>The database is unavailable for the moment; nothing was changed. "
        f"Reload the page in {RETRY_AFTER_S} seconds.</p></body></html>"
    )


class DatabaseUnavailableMiddleware:
    """503 + Retry-After for a page whose view met a database that is away. The page is plain HTML: a
    template might reach for the database (the user, the session) again."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not is_unavailable(exception):
            return None
        return database_unavailable(request, exception, HttpResponse(_page(), content_type="text/html; charset=utf-8"))
