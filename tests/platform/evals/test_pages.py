"""The pages: suites and task sets, versions with their download, the promotion form with both checks and
field errors, freezing by maintainers, bulk promotion, calibration."""

from __future__ import annotations

import hashlib
import json

import pytest
from django.urls import reverse

from flywheel.evals import promotion

pytestmark = pytest.mark.django_db


@pytest.fixture
def members(make_user, make_membership, project):
    viewer, reviewer = make_user("vera"), make_user("rex")
    make_membership(viewer, project, "viewer")
    make_membership(reviewer, project, "reviewer")
    return {"viewer": viewer, "reviewer": reviewer}


def _form(corrected: dict, target: str, action: str = "check", **extra) -> dict:
    data = {"target": target, "action": action, "message_index": corrected["message_index"],
            "expect": corrected["expect"], "expected_calls": json.dumps(corrected["expected_calls"]),
            "answer_match": "exact", "env_type": "single_turn", **extra}
    return data


def test_the_form_is_prefilled_from_what_the_agent_did(client_for, members, project, trajectory, suite):
    page = client_for(members["reviewer"]).get(reverse("promotion_form", args=[project.slug, trajectory.pk]))
    assert page.status_code == 200
    html = page.content.decode()
    assert "&quot;amount&quot;: 500.0" in html  # expected calls start from the agent's call, escaped
    assert f'value="suite:{suite.pk}"' in html
    assert "Run the checks" in html
    # The trajectory page links to it for reviewers, not for viewers.
    detail = reverse("trajectory_detail", args=[project.slug, trajectory.pk])
    assert 'id="promote"' in client_for(members["reviewer"]).get(detail).content.decode()
    assert 'id="promote"' not in client_for(members["viewer"]).get(detail).content.decode()
    assert client_for(members["viewer"]).get(reverse("promotion_form", args=[project.slug, trajectory.pk])).status_code == 403


def test_checks_then_save_from_the_page(client_for, members, project, trajectory, suite, corrected):
    client = client_for(members["reviewer"])
    url = reverse("promotion_form", args=[project.slug, trajectory.pk])
    checked = client.post(url, _form(corrected, f"suite:{suite.pk}"))
    html = checked.content.decode()
    assert checked.status_code == 200
    assert 'id="check-original" data-passed="false"' in html and "wrong_arguments" in html
    assert 'id="check-reference" data-passed="true"' in html
    assert suite.cases.count() == 0  # checking saves nothing
    saved = client.post(url, _form(corrected, f"suite:{suite.pk}", action="save"))
    assert saved.status_code == 302 and saved["Location"] == reverse("suite_detail", args=[project.slug, suite.pk])
    case = suite.cases.get()
    assert case.created_by == members["reviewer"]
    detail = client.get(saved["Location"]).content.decode()
    assert case.row_id in detail and "v1" in detail


def test_field_errors_show_on_the_form_never_a_500(client_for, members, project, trajectory, suite, corrected):
    client = client_for(members["reviewer"])
    url = reverse("promotion_form", args=[project.slug, trajectory.pk])
    bad = {**corrected, "expected_calls": [{"name": "refund", "arguments": {"amount": {"regex": "(a)\\1"}}}]}
    for data in (_form(bad, f"suite:{suite.pk}", action="save"), _form(corrected, "suite:999999"),
                 _form(corrected, f"suite:{suite.pk}", expected_calls="[{oops"),
                 _form(corrected, f"suite:{suite.pk}", message_index="x", env_type="nope")):
        response = client.post(url, data)
        assert response.status_code == 422, data
        assert 'class="form-errors"' in response.content.decode()
    html = client.post(url, _form(bad, f"suite:{suite.pk}")).content.decode()
    assert 'data-errors="expected_calls"' in html and "regex" in html
    assert suite.cases.count() == 0


def test_unchanged_expectation_warns_on_the_page(client_for, members, project, trajectory, suite):
    client = client_for(members["reviewer"])
    url = reverse("promotion_form", args=[project.slug, trajectory.pk])
    same = {"message_index": 4, "expect": "calls",
            "expected_calls": [{"name": "refund", "arguments": {"order_id": "A-1001", "amount": 500.0}}]}
    html = client.post(url, _form(same, f"suite:{suite.pk}", action="save")).content.decode()
    assert 'id="warning"' in html and "passes the agent&#x27;s original output" in html
    assert suite.cases.count() == 0
    client.post(url, _form(same, f"suite:{suite.pk}", action="save", accept_passing_original="on"))
    assert suite.cases.count() == 1


def test_version_page_download_and_freeze(client_for, members, user, project, trajectory, suite, corrected):
    promotion.trajectory_promote(trajectory=trajectory, data=corrected, target=suite, user=user)
    version = suite.versions.get()
    page_url = reverse("suite_version", args=[project.slug, suite.pk, 1])
    html = client_for(members["viewer"]).get(page_url).content.decode()
    assert version.content_hash in html and 'id="freeze"' not in html  # viewers do not freeze
    download = client_for(members["viewer"]).get(reverse("suite_export", args=[project.slug, suite.pk, 1]))
    body = b"".join(download.streaming_content) if download.streaming else download.content
    assert hashlib.sha256(body).hexdigest() == version.content_hash
    assert "attachment" in download["Content-Disposition"]
    freeze = reverse("suite_freeze", args=[project.slug, suite.pk, 1])
    assert client_for(members["reviewer"]).post(freeze).status_code == 403
    assert client_for(user).post(freeze).status_code == 302  # the owner maintains the project
    version.refresh_from_db()
    assert version.frozen_by == user
    assert "frozen" in client_for(members["viewer"]).get(page_url).content.decode()


def test_lists_create_and_task_variants(client_for, members, user, project, ingest, refund_record, task_set, corrected):
    client = client_for(members["reviewer"])
    created = client.post(reverse("suite_create", args=[project.slug]), {"name": "Holdout A", "kind": "holdout"})
    assert created.status_code == 302
    dup = client.post(reverse("suite_create", args=[project.slug]), {"name": "Holdout A", "kind": "holdout"})
    assert dup.status_code == 422 and "already has" in dup.content.decode()
    assert "Holdout A" in client_for(members["viewer"]).get(reverse("suite_list", args=[project.slug])).content.decode()
    assert "Refund tasks" in client.get(reverse("taskset_list", args=[project.slug])).content.decode()

    # Variants: other order ids the project's agent used for refund, and rephrasings.
    ingest(refund_record("other-1", order="Z-77", request="unrelated 1"), refund_record("other-2", order="Z-78", request="unrelated 2"))
    t = ingest(refund_record("var-1", order="A-1001"))
    data = {**corrected, "expected_calls": [{"name": "refund", "arguments": {"order_id": "A-1001", "amount": 50}}]}
    task, _ = promotion.trajectory_promote(trajectory=t, data=data, target=task_set, user=user)
    response = client.post(reverse("task_variants", args=[project.slug, task_set.pk, task.pk]))
    assert response.status_code == 302
    variants = list(task.variants.all())
    by_kind = {v.variant_kind for v in variants}
    assert by_kind == {"argument", "rephrase"}
    swapped = [v for v in variants if v.variant_kind == "argument"]
    assert {v.verifier["expected_calls"][0]["arguments"]["order_id"] for v in swapped} == {"Z-77", "Z-78"}
    for v in swapped:
        order = v.verifier["expected_calls"][0]["arguments"]["order_id"]
        assert order in v.prompt_text and json.loads(v.reference["tool_calls"][0]["function"]["arguments"])["order_id"] == order
        assert v.trajectory_id == t.pk and v.row()["origin"]["trajectory_id"] == t.pk  # inherits the origin
    assert task_set.versions.order_by("-number").first().size == 1 + len(variants)
    html = client.get(reverse("taskset_detail", args=[project.slug, task_set.pk])).content.decode()
    assert "variant of" in html


def test_calibration_page(client_for, members, project, ingest, refund_record):
    from flywheel.evals.calibration import calibration_run_process
    from flywheel.failures.review import trajectory_outcome_set

    good = [ingest(refund_record(f"g-{i}", amount=50.0)) for i in range(3)]
    bad = [ingest(refund_record(f"b-{i}", amount=500.0)) for i in range(2)]
    for t in good:
        trajectory_outcome_set(trajectory=t, outcome="success", user=members["reviewer"])
    for t in bad:
        trajectory_outcome_set(trajectory=t, outcome="failure", user=members["reviewer"])
    # One labeled success the verifier will fail: a disagreement, linked.
    odd = ingest(refund_record("odd", amount=55.0))
    trajectory_outcome_set(trajectory=odd, outcome="success", user=members["reviewer"])
    spec = {"type": "tool_call", "expected_calls": [{"name": "refund", "arguments": {"order_id": {"any": True}, "amount": 50}}]}
    url = reverse("calibration", args=[project.slug])
    viewer = client_for(members["viewer"])
    # The form's spec goes to a worker: the page answers at once with its progress, polling while it waits.
    started = viewer.post(reverse("calibration_start", args=[project.slug]), {"verifier": json.dumps(spec)})
    assert started.status_code == 302
    from flywheel.evals.calibration_models import VerifierCalibration

    run = VerifierCalibration.objects.get(project=project)
    assert started["Location"].startswith(f"{url}?run={run.pk}")
    waiting = viewer.get(started["Location"]).content.decode()
    assert 'data-status="queued"' in waiting and f'hx-get="{url}runs/{run.pk}/"' in waiting
    assert "&quot;expected_calls&quot;" in waiting  # the form shows the spec it scores
    calibration_run_process(run_id=run.pk)  # what the worker does
    fragment = viewer.get(reverse("calibration_status", args=[project.slug, run.pk])).content.decode()
    assert 'data-status="done"' in fragment and "hx-get" not in fragment
    page = viewer.get(started["Location"])
    html = page.content.decode()
    assert page.status_code == 200
    assert 'data-cell="success-pass">3<' in html and 'data-cell="success-fail">1<' in html
    assert 'data-cell="failure-fail">2<' in html and 'data-cell="failure-pass">0<' in html
    assert 'id="precision">1.000<' in html and 'id="recall">0.750<' in html
    assert 'id="kappa">0.667<' in html  # (5/6 - 1/2) / (1 - 1/2)
    assert f'data-trajectory="{odd.pk}"' in html and 'id="too-few"' in html
    bad_spec = viewer.post(reverse("calibration_start", args=[project.slug]),
                           {"verifier": '{"type": "regex", "pattern": "(a)\\\\1"}'})
    assert bad_spec.status_code == 422 and 'data-field="verifier"' in bad_spec.content.decode()
    assert VerifierCalibration.objects.count() == 1  # nothing queued for a spec that does not compile


def test_freezing_a_leaking_version_lists_the_conflicts(client_for, user, project, trajectory, ingest, refund_record,
                                                         task_set, suite, corrected):
    from flywheel.evals.rows import last_user_request, prompt_digest

    promotion.trajectory_promote(trajectory=trajectory, data=corrected, target=task_set, user=user)
    # A case asking the same thing, written straight to the suite (as a row older than the guard would be).
    messages = [{"role": "user", "content": "please refund 50.00 on order A-1001; the mug arrived broken"}]
    suite.cases.create(messages=messages, verifier={"type": "exact", "expected": "x"},
                       prompt_digest=prompt_digest(messages), prompt_text=last_user_request(messages))
    response = client_for(user).post(reverse("taskset_freeze", args=[project.slug, task_set.pk, 1]))
    html = response.content.decode()
    assert response.status_code == 409 and 'id="conflicts"' in html and 'data-rule="prompt"' in html
    assert "Refunds" in html and task_set.versions.get().frozen_at is None


def test_the_form_asks_for_a_reason_where_the_guard_is_unsure(client_for, members, user, project, ingest,
                                                            refund_record, suite, task_set, corrected):
    loan = ingest(refund_record("u-1", request="Renew my library books."))
    promotion.trajectory_promote(trajectory=loan, data=corrected, target=suite, user=user)
    extension = ingest(refund_record("u-2", request="Can you extend the loan on my library books?"))
    client = client_for(members["reviewer"])
    url = reverse("promotion_form", args=[project.slug, extension.pk])
    html = client.post(url, _form(corrected, f"taskset:{task_set.pk}")).content.decode()
    assert 'id="leakage-confirm"' in html and 'name="leakage_reason"' in html and "Renew my library books." in html
    refused = client.post(url, _form(corrected, f"taskset:{task_set.pk}", action="save"))
    assert refused.status_code == 422 and task_set.tasks.count() == 0 and 'id="not-saved"' in refused.content.decode()
    reason = "One renews the books, the other asks about the loan period"
    saved = client.post(url, _form(corrected, f"taskset:{task_set.pk}", action="save", leakage_reason=reason))
    assert saved.status_code == 302
    assert task_set.tasks.get().leakage_confirmation["by"] == members["reviewer"].username
    assert reason in client.get(saved["Location"]).content.decode()  # the task set's page shows who and why
