"""A regression suite built from production's reliable passes: which cases are kept (the Wilson bound, not a
single pass), the suite's new version, and the page and API that start it."""

from __future__ import annotations

import pytest
from django.urls import reverse

from flywheel.evals import runs
from flywheel.evals.models import EvalSuite
from flywheel.evals.regression import regression_build_start, reliable_cases
from flywheel.evals.run_models import EvalRunStatus
from flywheel.evals.services import suite_create, version_create
from flywheel.registry import services as registry

pytestmark = pytest.mark.django_db


def test_a_case_is_kept_only_when_its_lower_bound_reaches_the_rate():
    cases = [{"id": "always", "pass_rate": 1.0}, {"id": "once-missed", "pass_rate": 15 / 16},
             {"id": "half", "pass_rate": 0.5}, {"id": "counted", "passes": 16, "n": 16, "pass_rate": 1.0}]
    kept, measured = reliable_cases(cases, samples=16)
    assert kept == ["always", "counted"]
    assert measured["once-missed"]["passes"] == 15 and not measured["once-missed"]["kept"]
    assert measured["always"]["lower"] == pytest.approx(1 / (1 + 1.6448536**2 / 16), abs=1e-4)
    # Eight samples passed every time are not enough at 95%: 0.747 < 0.8.
    assert reliable_cases([{"id": "a", "pass_rate": 1.0}], samples=8)[0] == []


@pytest.fixture
def regression_suite(project, user, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    registry.base_model_register(project=project, name="base", path=str(model), user=user)
    suite = suite_create(project=project, name="regressions", kind="regression", user=user)
    for i in range(4):
        suite.items.create(messages=[{"role": "user", "content": f"request {i}"}], tools=[],
                           verifier={"type": "exact", "expected": f"answer {i}"}, prompt_digest=f"d{i}",
                           prompt_text=f"request {i}", created_by=user)
    version_create(collection=suite, user=user, note="candidates")
    return suite


def test_the_suite_keeps_what_production_passed_reliably(project, user, regression_suite):
    run = regression_build_start(project=project, suite=regression_suite, user=user)
    assert (run.purpose, run.samples, run.status) == ("regression_build", 16, EvalRunStatus.QUEUED)
    ids = [item.row_id for item in regression_suite.items.order_by("pk")]
    # What the worker stores when the trainer's evaluate finished: per-case rates over 16 samples.
    rates = [1.0, 15 / 16, 1.0, 0.25]
    runs._store_results(run, [{"id": i, "passed": r > 0.5, "pass_rate": r} for i, r in zip(ids, rates, strict=True)])
    runs._on_success(run)
    run.refresh_from_db()
    version = regression_suite.versions.order_by("-number").first()
    assert version.number == 2 and [row["id"] for row in version.rows] == [ids[0], ids[2]]
    assert "2 of 4 cases at 16 samples" in version.note
    assert run.options["version"] == 2 and run.options["kept"] == 2
    assert regression_suite.versions.get(number=1).size == 4  # the candidates stay in the older version
    runs._on_success(run)  # a second delivery changes nothing
    assert regression_suite.versions.count() == 2


def test_only_a_regression_suite_with_enough_samples_is_built(project, user, regression_suite):
    from django.core.exceptions import ValidationError

    holdout = suite_create(project=project, name="holdout", kind="holdout", user=user)
    with pytest.raises(ValidationError, match="Only a regression suite"):
        regression_build_start(project=project, suite=holdout, user=user)
    with pytest.raises(ValidationError) as exc:
        regression_build_start(project=project, suite=regression_suite, samples=8, user=user)
    assert "8 samples cannot show" in exc.value.message_dict["samples"][0]


def test_the_page_and_the_api_start_a_build(project, user, regression_suite, client_for, api_client, make_api_key,
                                            make_user, make_membership):
    page = client_for(user).get(reverse("suite_detail", args=[project.slug, regression_suite.pk])).content.decode()
    assert 'id="build-regression"' in page
    response = client_for(user).post(reverse("suite_regression_build", args=[project.slug, regression_suite.pk]),
                                     {"samples": "16", "min_rate": "0.8"})
    assert response.status_code == 302 and "/evals/runs/" in response["Location"]
    reviewer = make_user("reviewer-only")
    make_membership(reviewer, project, "reviewer")
    assert client_for(reviewer).post(reverse("suite_regression_build", args=[project.slug, regression_suite.pk]),
                                     {"samples": "16"}).status_code == 403
    key = make_api_key(project, scopes=["train"])
    url = f"/api/v1/eval-suites/{regression_suite.pk}/regression-builds"
    created = api_client.post(url, {"samples": 20, "min_rate": 0.8}, key=key)
    assert created.status_code == 201 and created.json()["status"] == "queued"
    refused = api_client.post(url, {"samples": 4}, key=key)
    assert refused.status_code == 422
    assert [e["loc"] for e in refused.json()["detail"]] == [["body", "samples"]]
    assert api_client.post(url, {}, key=make_api_key(project, scopes=["read"])).status_code == 403
    assert api_client.post(f"/api/v1/eval-suites/{EvalSuite.objects.order_by('-pk').first().pk + 1}/regression-builds",
                           {}, key=key).status_code == 404
