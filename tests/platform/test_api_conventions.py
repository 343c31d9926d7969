"""What every part of the API shares: one home for its parts (no app's API module imports another app's),
one version a client can read, a schema built once per process, and one shape for a wrong field."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PLATFORM = Path(__file__).resolve().parents[2] / "platform"


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PLATFORM).with_suffix("").parts)


def _is_app_api(module: str) -> bool:
    """flywheel.<app>.<...>.<name with "api"> (the shared package flywheel.api is no app's)."""
    parts = module.split(".")
    return len(parts) >= 3 and parts[0] == "flywheel" and parts[1] != "api" and "api" in parts[-1]


def foreign_api_imports(module: str, source: str) -> list[str]:
    """The API modules of other apps that `module`'s source imports (`import x`, `from x import y`, also a
    module imported by name from its package: `from flywheel.evals import api`)."""
    app = module.split(".")[1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found += [name for name in names if _is_app_api(name) and name.split(".")[1] != app]
    return sorted(set(found))


def test_the_import_check_finds_a_foreign_api_import():
    # The check itself must be able to fail: each form of importing another app's API module is found.
    for source in ("from flywheel.training.api import train_auth", "from flywheel.trajectories import api",
                   "import flywheel.evals.run_api", "from flywheel.failures.clustering.api import router"):
        assert foreign_api_imports("flywheel.registry.api", source), source
    assert foreign_api_imports("flywheel.evals.run_api", "from flywheel.evals.api import router") == []
    assert foreign_api_imports("flywheel.evals.run_api", "from flywheel.api.auth import read_auth") == []


def test_no_app_api_module_imports_another_apps():
    modules = {_module_name(path): path for path in (PLATFORM / "flywheel").rglob("*.py")}
    api_modules = sorted(name for name in modules if _is_app_api(name))
    assert {"flywheel.trajectories.api", "flywheel.evals.run_api", "flywheel.failures.clustering.api"} <= set(api_modules)
    wrong = {name: foreign for name in api_modules
             if (foreign := foreign_api_imports(name, modules[name].read_text()))}
    assert not wrong, f"API modules importing another app's API module (use flywheel.api): {wrong}"



def _imports(source: str) -> list[str]:
    """The modules and the names `source` imports (`from x import y` gives both x and x.y)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return found


def test_routers_are_gathered_by_the_top_floor_and_imports_point_one_way():
    """The shared package flywheel.api imports no app's API module, and no app's API module reaches for the
    `api` instance to register itself: the URLconf (flywheel.api_urls) imports every router and adds it.
    A registry that imports what registers with it is an import circle across every app."""
    import importlib

    from ninja import Router

    import flywheel.api_urls

    modules = {_module_name(path): path for path in (PLATFORM / "flywheel").rglob("*.py")}
    upward = {name: found for name in modules if name.startswith("flywheel.api.")
              if (found := [i for i in _imports(modules[name].read_text()) if _is_app_api(i) and i in modules])}
    assert not upward, f"The shared API package imports an app's API module: {upward}"
    app_apis = sorted(name for name in modules if _is_app_api(name))
    registering = [name for name in app_apis if "flywheel.api.api" in _imports(modules[name].read_text())]
    assert not registering, f"API modules that add themselves to `api` (let flywheel.api_urls do it): {registering}"
    # And the top floor does gather them: every router an app's API module defines is mounted.
    mounted = {id(router) for _prefix, router in flywheel.api_urls.api._routers}
    unmounted = [f"{name}.{attr}" for name in app_apis
                 for attr, value in vars(importlib.import_module(name)).items()
                 if isinstance(value, Router) and id(value) not in mounted]
    assert not unmounted, f"Routers no one mounts: {unmounted}"

@pytest.mark.django_db
def test_the_version_is_one_constant_a_client_reads_without_a_key(client, settings):
    from flywheel.api import API_VERSION, platform_version

    settings.FLYWHEEL_MAX_BATCH_RECORDS = 7
    answer = client.get("/api/v1/version")
    assert answer.status_code == 200
    assert answer.json() == {"api_version": API_VERSION, "platform_version": platform_version(), "limits": {
        "max_batch_records": 7, "max_request_bytes": settings.FLYWHEEL_MAX_REQUEST_BYTES}}
    assert API_VERSION == "1" and platform_version() not in ("", "unknown")
    schema = client.get("/api/v1/openapi.json").json()
    assert schema["info"]["version"] == API_VERSION
    assert schema["paths"]["/api/v1/version"]["get"].get("security") in (None, [])


@pytest.mark.django_db
def test_the_schema_is_built_once_per_process(client, monkeypatch):
    from ninja import NinjaAPI

    from flywheel.api_urls import api

    builds = []
    build = NinjaAPI.get_openapi_schema

    def counted(self, **kwargs):
        builds.append(kwargs)
        return build(self, **kwargs)

    monkeypatch.setattr(NinjaAPI, "get_openapi_schema", counted)
    api._schemas.clear()
    first = client.get("/api/v1/openapi.json").json()
    for _ in range(3):
        assert client.get("/api/v1/openapi.json").json() == first
    assert len(builds) == 1
    # What the hand-written ingestion body points at is published, and so is every new operation.
    assert "TrajectoryIn" in first["components"]["schemas"]
    for path in ("/api/v1/training-jobs/{job_id}/curves", "/api/v1/training-jobs/compare", "/api/v1/eval-runs/compare",
                 "/api/v1/gate-settings", "/api/v1/training-recipe", "/api/v1/base-models"):
        assert path in first["paths"], path


@pytest.mark.django_db
def test_a_service_refusal_and_a_parse_error_have_one_shape(api_client, project, make_api_key):
    key = make_api_key(project, scopes=["train", "read"])
    # pydantic refuses a number that is not one; the service refuses a recipe field: the same shape, by path.
    parsed = api_client.post("/api/v1/training-jobs", {"task_set": "three", "task_set_version": 1}, key=key)
    refused = api_client.put("/api/v1/training-recipe", {"config": {"beta": -1}}, key=key)
    for answer, loc in ((parsed, ["body", "task_set"]), (refused, ["body", "config", "beta"])):
        assert answer.status_code == 422, answer.content
        problem = answer.json()["detail"][0]
        assert problem["loc"] == loc and problem["msg"] and problem["type"]
    # A query parameter's path names it alone, as before.
    listed = api_client.get("/api/v1/training-jobs", {"limit": 0}, key=key)
    assert listed.status_code == 422 and listed.json()["detail"][0]["loc"] == ["query", "limit"]


@pytest.mark.django_db
def test_a_body_that_is_no_object_is_a_422_on_every_operation(api_client, project, make_api_key):
    """Ninja's Schema reads fields as attributes of whatever it is given, so `[null, null]` passed as an
    object with every field left out: a body with no required field (a rollback, a clustering run, a
    queue claim) did its work on it. Every operation whose body is an object refuses it; one with no
    required field names the whole body."""
    from flywheel.api_urls import api

    schema = api.get_openapi_schema(path_prefix="")
    components = schema["components"]["schemas"]
    key = make_api_key(project, scopes=["ingest", "read", "review", "train", "promote"])
    checked, lax = 0, []
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            ref = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            model = components.get(ref.get("$ref", "").rsplit("/", 1)[-1], {})
            if model.get("type") != "object":
                continue  # no body, or one written by hand (ingestion takes an array on purpose)
            url = "/api/v1" + re.sub(r"\{[^}]+\}", "1", path.removeprefix("/api/v1"))
            answer = getattr(api_client, method)(url, [None, None], key=key)
            checked += 1
            detail = answer.json().get("detail") if answer.status_code == 422 else None
            locs = [d.get("loc") for d in detail if isinstance(d, dict)] if isinstance(detail, list) else detail
            if answer.status_code != 422 or (not model.get("required") and locs != [["body"]]):
                lax.append(f"{method.upper()} {path}: {answer.status_code} {locs}")
    assert checked >= 20 and lax == [], lax


def test_no_two_api_models_share_a_name():
    """The schema names a model by its class name: two of one name would publish one under the other's."""
    import importlib
    import inspect

    from pydantic import BaseModel

    import flywheel.api_urls  # noqa: F401  (loads every app's API module)

    seen: dict[str, str] = {}
    clashes = []
    for path in sorted((PLATFORM / "flywheel").rglob("*.py")):
        name = _module_name(path)
        if not (_is_app_api(name) or name.startswith("flywheel.api") or name == "flywheel.trajectories.schemas"):
            continue
        module = importlib.import_module(name.removesuffix(".__init__"))
        for cls_name, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseModel) and cls.__module__ == module.__name__:
                if seen.setdefault(cls_name, module.__name__) != module.__name__:
                    clashes.append(f"{cls_name}: {seen[cls_name]} and {module.__name__}")
    assert not clashes, clashes


def _integers(schema: dict, components: dict, path: tuple = ()) -> list[tuple[tuple, dict]]:
    """(path, schema) of every integer in `schema`: through $ref, anyOf/oneOf/allOf, array items, properties."""
    if "$ref" in schema:
        schema = components[schema["$ref"].rsplit("/", 1)[-1]]
    found = [(path, schema)] if schema.get("type") == "integer" else []
    for branch in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(branch, []):
            found += _integers(sub, components, path)
    if "items" in schema:
        found += _integers(schema["items"], components, (*path, "[]"))
    for name, sub in schema.get("properties", {}).items():
        found += _integers(sub, components, (*path, name))
    return found


def test_every_integer_a_path_or_query_takes_and_every_id_in_a_body_is_bounded():
    """An integer that names a row is looked up in a column of fixed range: past it SQLite cannot even bind
    the value (OverflowError, a 500). So the schema bounds each (flywheel.api.ids), and validation refuses
    one outside with a 422 naming it, before any query."""
    from flywheel.api_urls import api

    schema = api.get_openapi_schema(path_prefix="")
    components = schema["components"]["schemas"]
    checked, unbounded = 0, []
    for route, operations in schema["paths"].items():
        for method, operation in operations.items():
            found = []
            for parameter in operation.get("parameters", []):
                found += _integers(parameter["schema"], components, (parameter["in"], parameter["name"]))
            for content in operation.get("requestBody", {}).get("content", {}).values():
                found += [(path, s) for path, s in _integers(content.get("schema", {}), components, ("body",))
                          if path[0] != "body" or str(path[-1] if path[-1] != "[]" else path[-2]).endswith(("_id", "_ids"))]
            for path, integer in found:
                checked += 1
                if "minimum" not in integer or "maximum" not in integer:
                    unbounded.append(f"{method.upper()} {route} {'.'.join(map(str, path))}")
    assert checked >= 40 and unbounded == [], unbounded


def _strings(schema: dict, components: dict, path: tuple = ()) -> list[tuple[tuple, dict]]:
    """(path, schema) of every free string in `schema` (no enum, no format): as `_integers` walks."""
    if "$ref" in schema:
        schema = components[schema["$ref"].rsplit("/", 1)[-1]]
    found = [(path, schema)] if schema.get("type") == "string" and not {"enum", "format"} & set(schema) else []
    for branch in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(branch, []):
            found += _strings(sub, components, path)
    if "items" in schema:
        found += _strings(schema["items"], components, (*path, "[]"))
    for name, sub in schema.get("properties", {}).items():
        found += _strings(sub, components, (*path, name))
    if isinstance(schema.get("additionalProperties"), dict):
        found += _strings(schema["additionalProperties"], components, (*path, "*"))
    return found


def test_every_string_a_request_carries_is_stated_to_hold_no_nul():
    """PostgreSQL's text and jsonb cannot hold a NUL: each string a body or a query carries is typed with
    flywheel.api.text, whose pattern says so (and whose validation refuses one). Ingestion stores a NUL in an
    agent's text as U+FFFD, by its contract, so its hand-written bodies are left out."""
    from flywheel.api_urls import api

    schema = api.get_openapi_schema(path_prefix="")
    components = schema["components"]["schemas"]
    checked, unstated = 0, []
    for route, operations in schema["paths"].items():
        for method, operation in operations.items():
            if method == "post" and route.endswith(("/trajectories", "/otlp/v1/traces")):
                continue
            found = []
            for parameter in operation.get("parameters", []):
                found += _strings(parameter["schema"], components, (parameter["in"], parameter["name"]))
            for content in operation.get("requestBody", {}).get("content", {}).values():
                found += _strings(content.get("schema", {}), components, ("body",))
            for path, string in found:
                checked += 1
                pattern = string.get("pattern")
                if pattern is None or re.search(pattern, "a\x00b") or re.search(pattern, "\x00"):
                    unstated.append(f"{method.upper()} {route} {'.'.join(map(str, path))}: {pattern!r}")
    assert checked >= 50 and unstated == [], unstated
