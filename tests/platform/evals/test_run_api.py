"""Eval runs from a script, past starting one (tests/platform/evals/test_runs.py): the list (newest first,
filtered by status, model version, suite and suite version, page by page) and two runs compared as the
comparison page compares them, each in the key's project only."""

from __future__ import annotations

import pytest

from flywheel.evals import runs
from flywheel.evals.models import EvalSuite
from flywheel.registry.models import BaseModel, ModelVersion


def _case(case_id: str, passed: bool) -> dict:
    return {"id": case_id, "passed": passed, "pass_rate": 1.0 if passed else 0.0, "mean_reward": float(passed),
            "failures": {} if passed else {"wrong_tool": 1}, "samples": [{"passed": passed}]}


@pytest.fixture
def world(project, make_api_key, make_project):
    base = BaseModel.objects.create(project=project, name="tiny", path="/models/tiny")
    v1 = ModelVersion.objects.create(project=project, number=1, base=base)
    v2 = ModelVersion.objects.create(project=project, number=2, base=base)
    suite = EvalSuite.objects.create(project=project, name="holdout", kind="holdout")
    first = suite.versions.create(number=1, rows=[], size=0, content_hash="0" * 64)
    second = suite.versions.create(number=2, rows=[], size=0, content_hash="1" * 64)
    record = runs.eval_run_record
    made = {
        "a": record(project=project, model_version=v1, suite_version=first, metrics={},
                    cases=[_case(f"case-{i}", i == 0) for i in range(4)]),
        "b": record(project=project, model_version=v2, suite_version=first, metrics={},
                    cases=[_case(f"case-{i}", i != 3) for i in range(4)]),
        "c": record(project=project, model_version=v2, suite_version=second, metrics={}, cases=[_case("case-0", True)]),
    }
    return {**made, "suite": suite, "read": make_api_key(project, scopes=["read"]),
            "other": make_api_key(make_project("elsewhere"), scopes=["read"])}


def test_runs_are_listed_newest_first_and_filtered(api_client, world):
    url, key = "/api/v1/eval-runs", world["read"]
    everything = api_client.get(url, key=key).json()
    assert [r["id"] for r in everything["items"]] == [world[k].pk for k in "cba"]
    newest = everything["items"][0]
    assert (newest["model_version"], newest["suite"], newest["suite_version"], newest["status"]) == (
        2, world["suite"].pk, 2, "succeeded")
    suite = world["suite"].pk

    def ids(**params):
        answer = api_client.get(url, params, key=key)
        assert answer.status_code == 200, answer.content
        return [r["id"] for r in answer.json()["items"]]

    assert ids(model_version=2) == [world["c"].pk, world["b"].pk]
    assert ids(suite=suite, suite_version=1) == [world["b"].pk, world["a"].pk]
    assert ids(suite=suite + 1000) == [] and ids(status="queued") == []
    page = api_client.get(url, {"limit": 2}, key=key).json()
    assert len(page["items"]) == 2 and ids(cursor=page["next_cursor"]) == [world["a"].pk]
    assert ids(suite_version=2) == [world["c"].pk]
    assert api_client.get(url, key=world["other"]).json()["items"] == []


def test_two_runs_compared_as_the_page_compares_them(api_client, world):
    url, key = "/api/v1/eval-runs/compare", world["read"]
    answer = api_client.get(url, {"ids": [world["a"].pk, world["b"].pk]}, key=key)
    assert answer.status_code == 200, answer.content
    body = answer.json()
    expected = runs.eval_compare(a=world["a"], b=world["b"])
    assert (body["fixed"], body["broken"]) == (expected["fixed"], expected["broken"]) == (2, 0)
    assert body["p_b_better"] == pytest.approx(expected["p_b_better"])
    assert (body["a"]["model_version"], body["b"]["model_version"]) == (1, 2)
    assert [(r["case_id"], r["change"]) for r in body["rows"]] == [
        ("case-0", ""), ("case-1", "fixed"), ("case-2", "fixed"), ("case-3", "")]
    assert body["rows"][1]["a"]["passed"] is False and body["rows"][1]["b"]["passed"] is True

    other_version = api_client.get(url, {"ids": [world["a"].pk, world["c"].pk]}, key=key)
    assert other_version.status_code == 422 and other_version.json()["detail"][0]["loc"] == ["query", "ids"]
    assert api_client.get(url, {"ids": [world["a"].pk]}, key=key).status_code == 422
    assert api_client.get(url, {"ids": [world["a"].pk, 10**9]}, key=key).status_code == 404
    assert api_client.get(url, {"ids": [world["a"].pk, world["b"].pk]}, key=world["other"]).status_code == 404


@pytest.mark.parametrize("outside", [2**63, -(2**63) - 1, 0, -1, 38333908473300881156079616])
def test_a_run_id_outside_the_id_range_is_a_422_naming_it(api_client, world, outside):
    """SQLite raised OverflowError on an id past 64 bits in the `IN` of the comparison (a 500); an id is
    1 to 2**63 - 1 on every backend, so the schema says so and the parameter is refused by its position."""
    answer = api_client.get("/api/v1/eval-runs/compare", {"ids": [world["a"].pk, outside]}, key=world["read"])
    assert answer.status_code == 422, answer.content
    assert [problem["loc"] for problem in answer.json()["detail"]] == [["query", "ids", 1]]
