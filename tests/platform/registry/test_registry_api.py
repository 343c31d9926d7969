"""The registry's settings from a script: the gate's rules and automatic promotion, and base models, with the
scopes the Models page's roles have (`read` reads, `promote` changes) and 422 naming the field at fault."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from flywheel.registry import selectors


@pytest.fixture
def keys(make_api_key, project, make_project):
    return {"read": make_api_key(project, scopes=["read"]), "promote": make_api_key(project, scopes=["promote", "read"]),
            "train": make_api_key(project, scopes=["train", "read"]),
            "other": make_api_key(make_project("elsewhere"), scopes=["promote", "read"])}


def test_the_gate_settings_are_read_and_replaced(api_client, keys, project):
    url = "/api/v1/gate-settings"
    start = api_client.get(url, key=keys["read"]).json()
    assert start == {"rules": selectors.gate_rules_of(project=project), "own": {}, "auto_promote": False}
    assert start["rules"]["confidence"] == 0.95

    body = {"rules": {"confidence": 0.9, "test": "mcnemar", "require_regression": False}, "auto_promote": True}
    assert api_client.put(url, body, key=keys["read"]).status_code == 403
    assert api_client.put(url, body, key=keys["train"]).status_code == 403
    saved = api_client.put(url, body, key=keys["promote"])
    assert saved.status_code == 200, saved.content
    assert saved.json()["own"] == {"confidence": 0.9, "test": "mcnemar", "require_regression": False}
    assert (saved.json()["rules"]["confidence"], saved.json()["rules"]["test"]) == (0.9, "mcnemar")
    assert saved.json()["auto_promote"] is True
    config = selectors.settings_of(project=project)
    assert config.auto_promote and config.gate_rules["test"] == "mcnemar"
    # What the page shows is what the API set; another project's key sees its own project's.
    assert api_client.get(url, key=keys["read"]).json() == saved.json()
    assert api_client.get(url, key=keys["other"]).json()["own"] == {}

    # A rule not sent takes its default again (the body replaces).
    again = api_client.put(url, {"rules": {"success_margin": 0.02}, "auto_promote": False}, key=keys["promote"])
    assert again.json()["own"] == {"success_margin": 0.02} and again.json()["rules"]["test"] == "permutation"
    # How many holdout cases the latency probe times is a rule too (0 turns the probe off).
    off = api_client.put(url, {"rules": {"latency_cases": 0}, "auto_promote": False}, key=keys["promote"])
    assert off.json()["own"] == {"latency_cases": 0} and off.json()["rules"]["latency_cases"] == 0


@pytest.mark.parametrize(("rules", "field"), [
    ({"confidence": 1.5}, "rules.confidence"),
    ({"test": "t-test"}, "rules.test"),
    ({"latency_tolerance": "fast"}, "rules.latency_tolerance"),
    ({"latency_cases": 2.5}, "rules.latency_cases"),
    ({"invalid_test": "noninferiority", "invalid_tolerance": 0}, "rules.invalid_tolerance"),
    ({"no_such_rule": 1}, "rules.no_such_rule"),
])
def test_a_wrong_rule_is_a_422_naming_it_and_nothing_changes(api_client, keys, project, rules, field):
    answer = api_client.put("/api/v1/gate-settings", {"rules": rules, "auto_promote": True}, key=keys["promote"])
    assert answer.status_code == 422, answer.content
    assert ["body", *field.split(".")] in [d["loc"] for d in answer.json()["detail"]]
    config = selectors.settings_of(project=project)
    assert (config.gate_rules, config.auto_promote) == ({}, False)


def test_auto_promote_must_be_stated(api_client, keys):
    answer = api_client.put("/api/v1/gate-settings", {"rules": {}}, key=keys["promote"])
    assert answer.status_code == 422 and answer.json()["detail"][0]["loc"] == ["body", "auto_promote"]


def test_a_base_model_is_registered_and_becomes_the_first_production(api_client, keys, project, tiny_model,
                                                                     celery_worker, settings):
    settings.FLYWHEEL_MODEL_CHECK_TIMEOUT_S = 3.0  # the worker checks the folder; an idle one answers at once
    url = "/api/v1/base-models"
    folder = Path(settings.FLYWHEEL_MODELS_DIR) / project.slug  # the project's own folder of models
    shutil.rmtree(folder, ignore_errors=True)
    tiny_model = shutil.copytree(tiny_model, folder / "tiny")
    outside = api_client.post(url, {"name": "tiny", "path": "/root"}, key=keys["promote"])
    assert outside.status_code == 422 and outside.json()["detail"][0]["loc"] == ["body", "path"]
    assert outside.json()["detail"][0]["msg"].startswith("/root is not a usable model folder under the models directory")
    body = {"name": "tiny", "path": str(tiny_model)}
    assert api_client.post(url, body, key=keys["read"]).status_code == 403
    created = api_client.post(url, body, key=keys["promote"])
    assert created.status_code == 201, created.content
    assert created.json() == {"version": 1, "base_model": "tiny", "base_model_path": str(tiny_model), "production": True}
    assert selectors.production_of(project=project).number == 1
    assert api_client.get("/api/v1/models/production", key=keys["read"]).json()["version"] == 1

    nul = api_client.post(url, {"name": "a\x00b", "path": str(tiny_model)}, key=keys["promote"])
    assert nul.status_code == 422 and nul.json()["detail"][0]["loc"] == ["body", "name"]  # never a 500
    twice = api_client.post(url, body, key=keys["promote"])
    assert twice.status_code == 422 and twice.json()["detail"][0]["loc"] == ["body", "name"]
    empty = folder / "empty"
    empty.mkdir()
    for path in ("relative/path", str(empty)):
        bad = api_client.post(url, {"name": "other", "path": path}, key=keys["promote"])
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "path"], bad.content
    # The worker's check names what the folder lacks, and nothing is saved.
    assert "config" in api_client.post(url, {"name": "other", "path": str(empty)}, key=keys["promote"]).json()[
        "detail"][0]["msg"]
    assert [v.number for v in selectors.versions_of(project=project)] == [1]
    second = api_client.post(url, {"name": "tiny-2", "path": str(tiny_model)}, key=keys["promote"]).json()
    assert (second["version"], second["production"]) == (2, False)  # production stays where it was


@pytest.mark.parametrize("body, field", [
    ({"rules": {}, "auto_promote": 0}, "auto_promote"),
    ({"rules": {}, "auto_promote": "true"}, "auto_promote"),
    ({"rules": {"require_regression": 1}, "auto_promote": False}, "rules.require_regression"),
    ({"rules": [None], "auto_promote": False}, "rules"),
    ([None, None], ""),
])
def test_a_boolean_is_true_or_false_and_the_body_an_object(api_client, keys, project, body, field):
    """0, 1 or "true" for a boolean was taken as one, and an array body as an object: a client's mistake that
    silently set (or kept) automatic promotion. Each is a 422 naming the field (or the whole body)."""
    answer = api_client.put("/api/v1/gate-settings", body, key=keys["promote"])
    assert answer.status_code == 422, answer.content
    assert ["body", *filter(None, field.split("."))] in [d["loc"] for d in answer.json()["detail"]]
    config = selectors.settings_of(project=project)
    assert (config.gate_rules, config.auto_promote) == ({}, False)


@pytest.mark.parametrize("body, field", [
    ({"canary_auto": 1}, "canary_auto"), ({"watch_rollback": "no"}, "watch_rollback"), ([], ""), (5, ""),
])
def test_the_live_rules_take_only_booleans_and_an_object(api_client, keys, body, field):
    answer = api_client.put("/api/v1/live-rules", body, key=keys["promote"])
    assert answer.status_code == 422, answer.content
    assert answer.json()["detail"][0]["loc"] == ["body", *filter(None, [field])]
    assert api_client.put("/api/v1/live-rules", {"canary_auto": True}, key=keys["promote"]).json()["canary_auto"] is True
