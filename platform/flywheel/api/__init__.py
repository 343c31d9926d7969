"""The JSON API: the Ninja instance (`api`) and the parts every app's endpoints share.

`auth` (key authentication and scopes), `errors` (error shapes, field errors, handlers), `ids` (the bounded
types of every id and version number a request names), `text` (the NUL-free types of every string and free
JSON a request carries), `pagination` (keyset pages) and `collections` (the endpoints eval suites and task
sets share) live here. An app's own endpoints live on routers in its `api`
modules, which import this package and never another app's; the URLconf (flywheel.api_urls) adds every
router to `api`, so this package imports no app's API module."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from django.conf import settings
from django.http import HttpRequest
from ninja import Field, NinjaAPI, Router, Schema
from ninja.schema import DjangoGetter
from pydantic import model_validator
from pydantic_core import PydanticCustomError

from flywheel.api import errors

# The version in the URL (/api/v1/), in the schema's info.version and in GET /api/v1/version: one constant
# the Python client checks before it sends anything.
API_VERSION = "1"

DESCRIPTION = (
    "Authenticate with a project API key: `Authorization: Bearer KEY`. A key belongs to one project, so no "
    "URL names a project: every call reads and writes the key's project. Optionally pass `?project=SLUG` "
    "as a guard; a slug other than the key's project is refused with 403. Scopes: `ingest` for the POST "
    "endpoints of ingestion, `read` for the GET ones, `review` for failure modes, the review queue and "
    "promotion into suites and task sets, `train` for training jobs, eval runs, the training recipe and environment servers, "
    "`promote` for moving production, the gate's rules and base models (403 without). No key or an unknown "
    "or revoked one: 401. A body over FLYWHEEL_MAX_REQUEST_BYTES (or a batch over "
    "FLYWHEEL_MAX_BATCH_RECORDS records): 413, naming the limit.\n\n"
    "Versioned things are named the same way everywhere: a task set or an eval suite by its id, one of its "
    "versions by its number within it (`{\"task_set\": 3, \"task_set_version\": 2}`), a model version by its "
    "number (v4 is 4). Every answer names them the same way, and every record an answer creates or accepts "
    "carries its id. A wrong field is a 422 whose `detail` gives its path (`loc`) and what is wrong (`msg`)."
)


class ObjectIn(Schema):
    """A request body that must be a JSON object. Ninja's Schema reads a model's fields as attributes of
    whatever it is given, so a body of `[null, null]` (or `5`) would pass as "every field left out" when
    every field has a default: refused here as a 422 on the whole body (loc ["body"])."""

    @model_validator(mode="before")
    @classmethod
    def _an_object(cls, data: Any) -> Any:
        # Schema's own validator (it wraps this one) hands the value over in a DjangoGetter.
        value = data._obj if isinstance(data, DjangoGetter) else data
        if not isinstance(value, dict):
            raise PydanticCustomError("dict_type", "The body must be a JSON object, not {kind}",
                                      {"kind": _json_kind(value)})
        return data


def _json_kind(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number",
            type(None): "null"}.get(type(value), type(value).__name__)


def platform_version() -> str:
    try:
        return importlib.metadata.version("flywheel")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


class FlywheelAPI(NinjaAPI):
    """NinjaAPI with its OpenAPI schema built once per process (each build walks every operation and
    model: a fifth of a second), and with components that no operation's signature names (a request body
    written by hand, such as ingestion's JSON-or-NDJSON one) added with `add_component`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Set first: NinjaAPI's own __init__ adds its default router.
        self._schemas: dict[str, Any] = {}
        self._components: list[type] = []
        super().__init__(*args, **kwargs)

    def add_component(self, model: type) -> None:
        """Publish a pydantic model under #/components/schemas/<its name>."""
        self._components.append(model)
        self._schemas.clear()

    def add_router(self, *args: Any, **kwargs: Any) -> None:
        super().add_router(*args, **kwargs)
        self._schemas.clear()

    def validation_error_from_error_contexts(self, error_contexts: list[Any]) -> Any:
        """A body field's path without the handler's parameter name (`["body", "config", "beta"]`, not
        `["body", "body", "config", "beta"]`): the path a service's field error has (errors.field_errors)."""
        exc = super().validation_error_from_error_contexts(error_contexts)
        # Ninja renames a flattened parameter's path only when the error is on the field itself: an item of a
        # list (`?ids=1&ids=x`) kept the handler's parameter name, ["query", "query", "ids", 1]. Renamed here by
        # the longest known prefix, to ["query", "ids", 1]. Ninja's errors are in the contexts' order.
        raw = [(context.model, tuple(error["loc"])) for context in error_contexts
               for error in context.pydantic_validation_error.errors(include_url=False)]
        for error, (model, loc) in zip(exc.errors, raw, strict=True):
            renames = model.__ninja_flatten_map_reverse__
            prefix = next((n for n in range(len(loc), 0, -1) if loc[:n] in renames), None)
            if prefix is not None:
                error["loc"] = (model.__ninja_param_source__, *renames[loc[:prefix]], *loc[prefix:])
        for error in exc.errors:
            loc = tuple(error["loc"])
            if len(loc) >= 2 and loc[0] == "body":  # ["body", "body"]: the whole body (ObjectIn) -> ["body"]
                error["loc"] = (loc[0], *loc[2:])
        return exc

    def get_openapi_schema(self, *, path_prefix: str | None = None, path_params: dict[str, Any] | None = None) -> Any:
        if path_prefix is None:
            path_prefix = self.get_root_path(path_params or {})
        schema = self._schemas.get(path_prefix)
        if schema is None:
            schema = super().get_openapi_schema(path_prefix=path_prefix, path_params=path_params)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in self._components:
                generated = model.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, definition in generated.pop("$defs", {}).items():
                    components.setdefault(name, definition)
                components.setdefault(model.__name__, generated)
            self._schemas[path_prefix] = schema
        return schema


api = FlywheelAPI(title="Flywheel API", version=API_VERSION, urls_namespace="api", description=DESCRIPTION)
errors.install(api)


class LimitsOut(Schema):
    max_batch_records: int = Field(description="Records a POST of trajectories may carry (FLYWHEEL_MAX_BATCH_RECORDS)")
    max_request_bytes: int = Field(description="Bytes a request body may have (FLYWHEEL_MAX_REQUEST_BYTES)")


class ApiVersionOut(Schema):
    api_version: str
    platform_version: str
    limits: LimitsOut = Field(description="What one request may carry: a client sizes its batches by them")


meta_router = Router(tags=["meta"])


@meta_router.get("/version", auth=None, response={200: ApiVersionOut}, summary="The API's and the platform's version",
                 description="No key needed. A client checks `api_version` before anything else: a different one "
                             "means another API than the one it was written for.")
def version(request: HttpRequest) -> dict[str, Any]:
    return {"api_version": API_VERSION, "platform_version": platform_version(),
            "limits": {"max_batch_records": settings.FLYWHEEL_MAX_BATCH_RECORDS,
                       "max_request_bytes": settings.FLYWHEEL_MAX_REQUEST_BYTES}}
