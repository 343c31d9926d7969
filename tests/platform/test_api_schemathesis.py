"""Schema-driven fuzzing of the JSON API with schemathesis: every operation of /api/v1/openapi.json, called
in-process on the real WSGI application and database, with a valid key of the project and with none. Each
answer must be documented (status code, content type, body schema), and none may be a 5xx.

The key's project holds one of each object (`world`: a trajectory, a failure mode, a task set and an eval suite
at v1, model versions, training jobs, eval runs, a clustering with a suggestion, an environment server). Each
parameter that names one is pointed at a real one or left as generated, as hypothesis draws, so every operation
is fuzzed past its 404 as well as on it. The stateful test chains operations by the links schemathesis infers
(an id one answer carries into the next request), starting from the same project.

Bounded for the suite: FLYWHEEL_FUZZ_EXAMPLES examples per operation and key (default 25). A longer run, as
`make fuzz` does (on SQLite, and again with DATABASE_URL on PostgreSQL: SQLite cannot bind an integer past 64
bits where PostgreSQL compares it, so each finds what the other does not):
    FLYWHEEL_FUZZ_EXAMPLES=1000 .venv/bin/python -m pytest -n 0 -s tests/platform/test_api_schemathesis.py
The number of requests each operation got is printed at the end (-s shows it)."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import pytest
import schemathesis
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from schemathesis.core.parameters import ParameterLocation

from flywheel.wsgi import application

EXAMPLES = int(os.environ.get("FLYWHEEL_FUZZ_EXAMPLES", "25"))
CALLS: Counter[str] = Counter()  # requests per (operation, key), for the report


@pytest.fixture(scope="module", autouse=True)
def _report() -> Iterator[None]:
    yield
    total = sum(CALLS.values())
    lines = [f"  {n:5d}  {name}" for name, n in sorted(CALLS.items())]
    print(f"\nschemathesis: {total} requests (FLYWHEEL_FUZZ_EXAMPLES={EXAMPLES})\n" + "\n".join(lines))


@pytest.fixture(autouse=True)
def _app(db, settings) -> Iterator[None]:
    """The real app on the test database."""
    from django.core import signals
    from django.db import close_old_connections

    # Helper limits that would answer 429 to a fuzzer's pace are tested on their own.
    settings.FLYWHEEL_API_RATE_PER_S = 0
    settings.FLYWHEEL_API_AUTH_FAILURES_PER_MIN = 0
    # No worker runs here: a base model's folder check waits this long for one, then names the path.
    settings.FLYWHEEL_MODEL_CHECK_TIMEOUT_S = 0.1
    # As Django's test client does: a request must not close the connection that holds the test's
    # transaction (the WSGI handler closes old connections when a request starts and ends).
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)


@dataclass
class World:
    """The real objects a parameter may be pointed at: candidates by parameter name, per location; `operation`
    holds those of one operation's query only (the two comparisons' `ids` name different kinds)."""

    path: dict[str, list[Any]]
    query: dict[str, list[Any]]
    body: dict[str, list[Any]]
    operation: dict[str, dict[str, list[Any]]] = field(default_factory=dict)


@pytest.fixture
def world(project, user) -> World:
    return world_build(project=project, user=user)


def world_build(*, project: Any, user: Any) -> World:
    """One of each object in `project` (two where a comparison needs two), made by the services where they
    are cheap and as rows where they would need a worker: the jobs and runs never run. Also seeds a server's
    database for a fuzz run from outside (schemathesis's command line)."""
    from flywheel.environments.models import EnvironmentServer
    from flywheel.environments.services import task_set_create
    from flywheel.evals import runs
    from flywheel.evals.calibration_models import VerifierCalibration
    from flywheel.evals.services import suite_create, version_create
    from flywheel.failures.clustering.models import ClusteringRun, ClusterSuggestion
    from flywheel.failures.services import failure_mode_assign, failure_mode_create
    from flywheel.registry.models import AliasAssignment, BaseModel, GateDecision, ModelVersion
    from flywheel.training.models import TrainingJob
    from flywheel.trajectories.ingest import ingest_trajectories
    from flywheel.trajectories.models import Trajectory

    call = {"id": "c1", "type": "function", "function": {"name": "refund", "arguments": json.dumps({"id": 1})}}
    record = {"external_id": "t-1", "agent": "support-bot", "model_version": "support-v1", "outcome": "failure",
              "messages": [{"role": "user", "content": "Refund order 1"},
                           {"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "c1", "content": "error: refund failed"},
                           {"role": "assistant", "content": "Sorry, I could not do that."}],
              "tools": [{"type": "function", "function": {"name": "refund", "parameters": {"type": "object"}}}]}
    assert ingest_trajectories(project=project, records=[record]).accepted == 1
    trajectory = Trajectory.objects.get(project=project, external_id="t-1")
    mode = failure_mode_create(project=project, name="Refund fails", category_key="other", user=user)
    failure_mode_assign(failure_mode=mode, trajectories=[trajectory], user=user)

    verifier = {"type": "exact", "expected": "Your refund is on its way."}
    suite = suite_create(project=project, name="holdout", kind="holdout")
    suite.cases.create(trajectory=trajectory, messages=trajectory.messages[:1], verifier=verifier)
    suite_v1 = version_create(collection=suite)
    server = EnvironmentServer.objects.create(project=project, name="gym", url="http://gym.invalid:8000")
    task_set = task_set_create(project=project, name="tasks")
    task = task_set.tasks.create(messages=[{"role": "user", "content": "Refund order 2"}], verifier=verifier)
    task_set_v1 = version_create(collection=task_set)

    base = BaseModel.objects.create(project=project, name="tiny", path="/models/tiny")
    v1 = ModelVersion.objects.create(project=project, number=1, base=base)
    v2 = ModelVersion.objects.create(project=project, number=2, base=base)
    AliasAssignment.objects.create(project=project, alias="production", version=v1)
    jobs = [TrainingJob.objects.create(project=project, task_set_version=task_set_v1, holdout_version=suite_v1,
                                       base_version=v1, status=status, candidate_version=candidate, max_steps=10)
            for status, candidate in (("succeeded", v2), ("running", None))]
    GateDecision.objects.create(project=project, job=jobs[0], candidate=v2, production=v1, passed=True)
    case = {"id": "case-1", "passed": True, "pass_rate": 1.0, "mean_reward": 1.0, "failures": {},
            "samples": [{"passed": True}]}
    eval_runs = [runs.eval_run_record(project=project, model_version=version, suite_version=suite_v1, metrics={},
                                      cases=[case]) for version in (v1, v2)]
    clustering = ClusteringRun.objects.create(project=project, status="done", stage="done")
    suggestion = ClusterSuggestion.objects.create(run=clustering, project=project, size=1, label="refunds",
                                                  trajectory_ids=[trajectory.pk])
    calibration = VerifierCalibration.objects.create(project=project, verifier=verifier, status="failed",
                                                     error="stopped")
    numbers = [1, 2]  # model versions v1 and v2; v1 of the suite and the task set
    return World(
        path={"trajectory_id": [trajectory.pk], "mode_id": [mode.pk], "task_set_id": [task_set.pk],
              "task_id": [task.pk], "suite_id": [suite.pk], "number": numbers, "job_id": [j.pk for j in jobs],
              "eval_run_id": [r.pk for r in eval_runs], "clustering_id": [clustering.pk],
              "suggestion_id": [suggestion.pk], "calibration_id": [calibration.pk]},
        query={"failure_mode": [mode.pk], "suite": [suite.pk], "suite_version": [1], "model_version": numbers},
        body={"trajectory_id": [trajectory.pk], "trajectory_ids": [[trajectory.pk]], "failure_mode_id": [mode.pk],
              "task_set": [task_set.pk], "task_set_version": [1], "suite": [suite.pk], "suite_version": [1],
              "holdout": [suite.pk], "holdout_version": [1], "model_version": numbers, "to_version": numbers,
              "version": numbers, "server": [server.pk]},
        operation={"/api/v1/eval-runs/compare": {"ids": [[r.pk for r in eval_runs]]},
                   "/api/v1/training-jobs/compare": {"ids": [[j.pk for j in jobs]]}},
    )


def _point_at_world(case, world: World, data) -> None:
    """Point each of the case's parameters that names an object at a real one, or leave it as generated, as
    hypothesis draws. A part generated to be invalid stays as it is (the check that it is refused would
    otherwise judge a valid one), and a query's or a body's value is replaced only by one of the same type
    (a trajectory's `model_version` is a string, a run's a number)."""
    query = {**world.query, **world.operation.get(case.path, {})}
    body = case.body if isinstance(case.body, dict) else {}
    for location, values, candidates in (("path", case.path_parameters, world.path), ("query", case.query, query),
                                         ("body", body, world.body)):
        if case.meta is not None and case.meta.is_negative_at(ParameterLocation(location)):
            continue
        for name in sorted(set(values or {}) & set(candidates)):
            if location != "path" and type(values[name]) is not type(candidates[name][0]):
                continue
            chosen = data.draw(st.none() | st.sampled_from(candidates[name]), label=f"{location}.{name}")
            if chosen is not None:
                values[name] = chosen


# Loaded from the app itself, as a client would: the schema /api/v1/openapi.json publishes (no database is
# read to serve it). schemathesis.pytest.from_fixture would load it lazily, but its node ids break on pytest 9.
schema = schemathesis.openapi.from_wsgi("/api/v1/openapi.json", application)
schema.config.generation.update(
    # Each test sends the Authorization header itself (a valid key, or none): a generated or removed one
    # would make a "missing header" case that the test's own key then turns valid again.
    with_security_parameters=False,
    # Query parameters the schema does not name are ignored, as most HTTP APIs do (`?project=SLUG`, the
    # guard the API's description explains, is one), so a request is not invalid for carrying one.
    allow_extra_parameters=False,
)
# Bodies the schema declares as a string (NDJSON) or binary (OTLP protobuf) go out as they are generated.
schemathesis.serializer.alias("application/x-ndjson", "text/plain")
schemathesis.serializer.alias("application/x-protobuf", "application/octet-stream")


FUZZ_SETTINGS = hypothesis_settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same examples on every run of the suite; a longer run explores further
    suppress_health_check=list(HealthCheck),
)


def test_every_object_a_path_names_is_in_the_world(world, every_scope_key, client):
    """An operation whose path names an object the world lacks would be fuzzed on its 404 only: each one,
    its path pointed at the world's first candidates, finds its objects (whatever it then says of an empty
    body)."""
    missing = []
    for route, operations in schema.raw_schema["paths"].items():
        names = re.findall(r"\{(\w+)\}", route)
        if not names:
            continue
        if not set(names) <= set(world.path):
            missing.append(f"{route}: the world has no {sorted(set(names) - set(world.path))}")
            continue
        url = re.sub(r"\{(\w+)\}", lambda m: str(world.path[m.group(1)][0]), route)
        for method in operations:
            answer = client.generic(method.upper(), url, b"{}", content_type="application/json",
                                    headers={"Authorization": f"Bearer {every_scope_key}"})
            if answer.status_code == 404:
                missing.append(f"{method.upper()} {url}: {answer.content[:200]!r}")
    assert not missing, missing


# A NUL in a string the API stores: PostgreSQL's text and jsonb cannot hold one (SQLite can), so the write
# failed with a 500 there. Each operation refuses it with a 422 naming the field (flywheel.api.text), except
# ingestion, whose contract stores it as U+FFFD.
NUL = "a\x00b"
STORES_NUL_REPLACED = {("POST", "/trajectories"), ("POST", "/otlp/v1/traces")}
# Bodies an operation takes whose required parts the schema cannot state (exactly one of two fields, a
# verifier spec): with a minimal one it would stop before storing anything.
VALID_BODIES = {
    ("POST", "/verifier-calibrations"): lambda world: {"verifier": {"type": "exact", "expected": "Your refund."}},
    **{("POST", f"/{kind}/{{{name}}}/promotions"): lambda world: {"external_id": "t-1"}
       for kind, name in (("eval-suites", "suite_id"), ("task-sets", "task_set_id"))},
    **{("POST", f"/{kind}/{{{name}}}/promotions/bulk"): lambda world: {"external_ids": ["t-1"]}
       for kind, name in (("eval-suites", "suite_id"), ("task-sets", "task_set_id"))},
    **{("POST", f"/failure-modes/{{mode_id}}/{action}"): lambda world: {"trajectory_ids": world.body["trajectory_ids"][0]}
       for action in ("assign", "unassign")},
}


def _resolved(node: dict) -> dict:
    while "$ref" in node:
        node = schema.raw_schema["components"]["schemas"][node["$ref"].rsplit("/", 1)[-1]]
    return node


def _minimal(node: dict, name: str, world: World) -> Any:
    """A value of `node`'s schema with only its required parts: a real object where the world has one."""
    node = _resolved(node)
    branches = [b for b in node.get("anyOf", node.get("oneOf", [])) if _resolved(b).get("type") != "null"]
    if branches:
        return _minimal(branches[0], name, world)
    if "enum" in node:
        return node["enum"][0]
    kind = node.get("type")
    if kind == "object":
        return {key: _minimal(sub, key, world) for key, sub in node.get("properties", {}).items()
                if key in node.get("required", [])}
    if kind == "integer":
        return world.body[name][0] if name in world.body and type(world.body[name][0]) is int \
            else node.get("minimum", 1)
    return {"string": "x" * max(1, node.get("minLength", 1)), "number": node.get("minimum", 0), "boolean": False,
            "array": []}.get(kind)


def _texts(node: dict, path: tuple = ()) -> list[tuple[tuple, bool]]:
    """(path, free-form) of each string a value of `node` may hold: a string field (an array's item as index
    0), or a field of any JSON (free-form), where a string may sit at any depth."""
    node = _resolved(node)
    found = []
    for branch in node.get("anyOf", node.get("oneOf", [])):
        found += [item for item in _texts(branch, path) if item not in found]
    kind = node.get("type")
    if kind == "string" and "enum" not in node and "format" not in node:
        found.append((path, False))
    elif kind == "array":
        found += _texts(node.get("items", {}), (*path, 0))
    elif kind == "object" and "properties" in node:
        for key, sub in node["properties"].items():
            found += _texts(sub, (*path, key))
    elif (kind == "object" or (kind is None and not node.get("anyOf") and "enum" not in node)) and path:
        found.append((path, True))
    return found


def _nul_in_last_string(value: Any) -> Any:
    """`value` with a NUL added to its last string, the rest as it was (a verifier spec stays one); None when
    it holds no string."""
    if isinstance(value, str):
        return value + "\x00"
    if isinstance(value, dict | list):
        for key in reversed(list(value) if isinstance(value, dict) else range(len(value))):
            changed = _nul_in_last_string(value[key])
            if changed is not None:
                copy = dict(value) if isinstance(value, dict) else list(value)
                copy[key] = changed
                return copy
    return None


def _with_nul(value: Any) -> Any:
    """A JSON value holding a NUL: `value` with one in a string, or with one added."""
    changed = _nul_in_last_string(value)
    if changed is not None:
        return changed
    return {**value, "note": NUL} if isinstance(value, dict) else [*value, NUL] if isinstance(value, list) else NUL


def _put(body: dict, path: tuple, value: Any) -> None:
    for i, key in enumerate(path[:-1]):
        nxt = [] if isinstance(path[i + 1], int) else {}
        if isinstance(key, int):
            body += [nxt] * (key + 1 - len(body))
        elif not isinstance(body.get(key), type(nxt)):
            body[key] = nxt
        body = body[key]
    if isinstance(path[-1], int):
        body[:] = [*body[:path[-1]], value]
    else:
        body[path[-1]] = value


def _names(error: dict, loc: list) -> bool:
    """Whether a 422 names the field at `loc` (or one inside it): by path, or, in a promotion's refusal, by
    name among its `errors`."""
    if isinstance(error.get("detail"), list):
        return any(problem["loc"][:len(loc)] == loc for problem in error["detail"])
    return loc[0] == "body" and str(loc[1]) in error.get("errors", {})


def test_a_nul_in_any_string_a_request_carries_is_a_422_naming_it(world, every_scope_key, client):
    """Each string field of each operation's body and query, and a string anywhere inside a field of free
    JSON, gets a NUL, the rest of the request being one the operation takes: a 422 whose `loc` names that
    field (or the field of JSON it sits in), never a 5xx."""
    from django.db import transaction

    client.raise_request_exception = False  # a 500 is an answer here, and each call is rolled back
    headers = {"Authorization": f"Bearer {every_scope_key}"}
    checked, wrong = 0, []
    for route, operations in schema.raw_schema["paths"].items():
        url = re.sub(r"\{(\w+)\}", lambda m: str(world.path[m.group(1)][-1]), route)
        for method, operation in operations.items():
            key = (method.upper(), route.removeprefix("/api/v1"))
            targets = [(("query", p["name"]), False) for p in operation.get("parameters", []) if p["in"] == "query"
                       for path, free in _texts(p["schema"]) if not free]
            content = operation.get("requestBody", {}).get("content", {}).get("application/json")
            base = {}
            if content is not None:
                base = VALID_BODIES[key](world) if key in VALID_BODIES else _minimal(content.get("schema", {}), "", world)
                targets += [(("body", *path), free) for path, free in _texts(content.get("schema", {}))]
            for (where, *path), free in targets:
                body, query = json.loads(json.dumps(base)), {}
                if where == "query":
                    query[path[0]] = NUL
                else:
                    current = base
                    for step in path:
                        current = current.get(step) if isinstance(current, dict) else None
                    if path and isinstance(path[0], int) is not isinstance(body, list):
                        body = [] if isinstance(path[0], int) else {}  # the other form of a body of either
                    _put(body, tuple(path), _with_nul(current) if free else NUL)
                with transaction.atomic():
                    answer = client.generic(method.upper(), url + ("?" + urlencode(query) if query else ""),
                                            json.dumps(body) if content is not None else b"",
                                            content_type="application/json", headers=headers)
                    transaction.set_rollback(True)
                checked += 1
                loc = [where, *path]
                named = answer.status_code == 422 and _names(answer.json(), loc)
                if answer.status_code >= 500 or (key not in STORES_NUL_REPLACED and not named):
                    wrong.append(f"{key[0]} {key[1]} {'.'.join(map(str, loc))}: {answer.status_code} "
                                 f"{answer.content[:300]!r}")
    assert checked >= 100 and wrong == [], "\n".join(wrong)


# Ingestion bodies: their published schema cannot state every rule of the record contract (a tool message
# needs tool_call_id or name; the OTLP JSON body is declared as any ExportTraceServiceRequest), so a body the
# schema allows may still be refused, with the documented 422 (each record named) or 400. Every other check,
# no 5xx above all, holds there too. A verifier spec is the same: its schema is an object, its rules (a type
# the trainer knows, matchers, RE2 patterns) are checked by trainer.verifiers and refused field by field.
# The training recipe's `config` is an object of GRPOConfig fields, checked by the trainer's own config class;
# a base model's `path` must be a model folder on the workers' disk; and a non-inferiority test of the gate
# needs a tolerance above 0, which no one rule's schema can say. An environment server's `url` must be under an
# allowed prefix and answer /reset.
LOOSE_BODIES = {("POST", "/trajectories"), ("POST", "/otlp/v1/traces"), ("POST", "/verifier-calibrations"),
                ("PUT", "/training-recipe"), ("POST", "/base-models"), ("PUT", "/gate-settings"),
                ("POST", "/environment-servers")}
# A query parameter that is a list of any strings (online eval's `model_version`) reads every value as text:
# an invalid `false` or `12` that schemathesis generates goes out as the string "false", which is valid, and
# the check that invalid data is refused would count it as accepted.
TEXT_LIST_QUERIES = {("GET", "/online-eval/scores")}


def _is_protobuf(case) -> bool:
    # OTLP/HTTP answers a protobuf request's errors as a protobuf google.rpc.Status, which the schema does not
    # declare yet (it lists the JSON one only): see the report of issue 10.
    return case.method.upper() == "POST" and case.path == "/api/v1/otlp/v1/traces" \
        and case.media_type == "application/x-protobuf"


def _call(case, headers: dict[str, str]) -> None:
    CALLS[f"{case.method} {case.path} ({'key' if headers else 'no key'})"] += 1
    operation = (case.method.upper(), case.path.removeprefix("/api/v1"))
    excluded = []
    if operation in LOOSE_BODIES:
        excluded.append(schemathesis.checks.positive_data_acceptance)
    if operation in TEXT_LIST_QUERIES:
        excluded.append(schemathesis.checks.negative_data_rejection)
    if _is_protobuf(case):
        excluded.append(schemathesis.checks.content_type_conformance)
    case.call_and_validate(headers=headers, excluded_checks=excluded or None)


@schema.parametrize()
@schema.given(data=st.data())
@FUZZ_SETTINGS
def test_every_operation_with_a_valid_key(case, data, api_key, world):
    _point_at_world(case, world, data)
    _call(case, {"Authorization": f"Bearer {api_key}"})


@schema.parametrize()
@FUZZ_SETTINGS
def test_every_operation_without_a_key(case):
    _call(case, {})


# Past the scope check: a key with every scope reaches each write (review, train, promote). What such a
# request meets depends on the data, which the schema cannot say (an id of no record, a name the project has:
# a 422 naming the field), so here the answer must be documented and no 5xx, without the two checks of
# which requests the schema says are valid.
CONFORMANCE = [schemathesis.checks.not_a_server_error, schemathesis.checks.status_code_conformance,
               schemathesis.checks.content_type_conformance, schemathesis.checks.response_schema_conformance]


def _conformance(case) -> list:
    return [check for check in CONFORMANCE
            if not (check is schemathesis.checks.content_type_conformance and _is_protobuf(case))]


@pytest.fixture
def every_scope_key(project, user) -> str:
    """A key with every scope, made by `user`: the queue holds its claims for that person."""
    from flywheel.accounts.models import Scope
    from flywheel.accounts.services import api_key_create

    return api_key_create(project=project, name="fuzz", scopes=Scope.values, created_by=user).raw_key


@schema.parametrize()
@schema.given(data=st.data())
@FUZZ_SETTINGS
def test_every_operation_with_every_scope(case, data, every_scope_key, world):
    _point_at_world(case, world, data)
    CALLS[f"{case.method} {case.path} (every scope)"] += 1
    case.call_and_validate(headers={"Authorization": f"Bearer {every_scope_key}"}, checks=_conformance(case))


def test_sequences_of_operations_with_every_scope(every_scope_key, world):
    """The stateful phase: scenarios of up to ten calls, each feeding the ids its answers carry into the
    next (the links schemathesis infers from the schema), from the world's objects (a list's answer leads to
    them) and from what earlier calls made. The same checks as above on every answer."""
    from django.db import transaction

    headers = {"Authorization": f"Bearer {every_scope_key}"}

    class Sequences(schema.as_state_machine()):
        # Each scenario starts from the world as the fixture made it: what one scenario wrote would change what
        # the next one's answers (and so its steps) are, and hypothesis replays a scenario to shrink it.
        def setup(self) -> None:
            self.savepoint = transaction.savepoint()

        def teardown(self) -> None:
            transaction.savepoint_rollback(self.savepoint)

        def get_call_kwargs(self, case) -> dict[str, Any]:
            CALLS[f"{case.method} {case.path} (sequence)"] += 1
            return {"headers": headers}

        def validate_response(self, response, case, additional_checks=None, **kwargs: Any) -> None:
            case.validate_response(response, checks=_conformance(case), transport_kwargs=kwargs or None)

    from hypothesis.errors import FlakyStrategyDefinition

    try:
        Sequences.run(settings=hypothesis_settings(FUZZ_SETTINGS, stateful_step_count=10))
    except FlakyStrategyDefinition:
        # A scenario replayed by hypothesis took another turn than when it was first drawn: on a loaded machine
        # (the suite on 2 cores beside other tests) about one run in six. An answer that depends on something
        # outside the rolled-back database (time, the shared broker) is not a finding of this test; a server
        # error or an undocumented answer is, and a second run still reports those.
        Sequences.run(settings=hypothesis_settings(FUZZ_SETTINGS, stateful_step_count=10))
