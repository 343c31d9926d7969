"""The API's error shapes and handlers: every error is `{"detail": "..."}`, but a request that does not
validate (422), whose `detail` lists each wrong field with its path, whether pydantic found it in the body
or a service refused it (`field_errors`). A database that is away is 503 with Retry-After.

An endpoint whose protocol prescribes another error body (OTLP/HTTP's google.rpc.Status) registers its own
renderer with `error_format`."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from ninja import Field, Schema
from ninja.errors import HttpError

from flywheel import db_errors
from flywheel.supervise import Refused


class ErrorOut(Schema):
    detail: str


class ValidationErrorOut(Schema):
    """What the API answers (422) when a parameter or a field does not validate: one entry per problem."""

    detail: list[dict[str, Any]] = Field(
        description="Each problem: `loc` (e.g. [\"body\", \"config\", \"beta\"] or [\"query\", \"q\"]), `msg` "
                    "(what is wrong), `type`"
    )


# The answers every endpoint may give besides its own: no or a wrong key, another project's object, a
# parameter that does not parse or a field a service refused, too many requests, the database away.
ERRORS: dict[int, Any] = {400: ErrorOut, 401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 409: ErrorOut,
                          422: ValidationErrorOut, 429: ErrorOut, 503: ErrorOut}


def field_errors(exc: ValidationError, *, where: str = "body") -> dict[str, Any]:
    """A service's ValidationError in the shape of a 422: one entry per field, its dotted name as the path
    (`config.beta` -> ["body", "config", "beta"]); an error on no field points at the whole `where`."""
    if hasattr(exc, "error_dict"):
        problems = [([where, *key.split(".")] if key != "__all__" else [where], messages)
                    for key, messages in exc.message_dict.items()]
    else:
        problems = [([where], exc.messages)]
    return {"detail": [{"loc": loc, "msg": "; ".join(map(str, messages)), "type": "value_error"}
                       for loc, messages in problems]}


def json_response(payload: Any, status: int = 200) -> HttpResponse:
    # Built by hand: the ingest answer is already plain data, and skipping the response model saves a
    # validation pass per request.
    return HttpResponse(
        json.dumps(payload, separators=(",", ":")), status=status, content_type="application/json"
    )


# (applies to the request?, renders the HttpError) for endpoints with an error body of their own.
_FORMATS: list[tuple[Callable[[HttpRequest], bool], Callable[[HttpRequest, HttpError], HttpResponse]]] = []


def error_format(applies: Callable[[HttpRequest], bool],
                 render: Callable[[HttpRequest, HttpError], HttpResponse]) -> None:
    _FORMATS.append((applies, render))


def install(api: Any) -> None:
    """The handlers on `api`: HttpError in the endpoint's shape (a 429's Retry-After kept), a service's
    ValidationError as 422 field errors, a job's or run's refusal (flywheel.supervise.Refused) as 409 with its
    reason, a database that is away as 503."""

    def http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
        for applies, render in _FORMATS:
            if applies(request):
                response = render(request, exc)
                break
        else:
            response = api.create_response(request, {"detail": str(exc)}, status=exc.status_code)
        for name, value in getattr(exc, "headers", {}).items():
            response[name] = value
        return response

    def validation_error(request: HttpRequest, exc: ValidationError) -> HttpResponse:
        # A GET has no body: what a service refused there came from the query.
        return json_response(field_errors(exc, where="query" if request.method == "GET" else "body"), status=422)

    def refused(request: HttpRequest, exc: Refused) -> HttpResponse:
        return http_error(request, HttpError(409, str(exc)))

    def database_unavailable(request: HttpRequest, exc: Exception) -> HttpResponse:
        return db_errors.database_unavailable(request, exc, http_error(request, HttpError(503, db_errors.MESSAGE)))

    api.add_exception_handler(HttpError, http_error)
    api.add_exception_handler(ValidationError, validation_error)
    api.add_exception_handler(Refused, refused)
    for unavailable in db_errors.UNAVAILABLE:
        api.add_exception_handler(unavailable, database_unavailable)
