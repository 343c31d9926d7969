"""The failure-mode pages as reviewers use them: modes and their page, the taxonomy, assigning from a
trajectory's page, bulk assignment from the list, and the review queue's actions."""

from __future__ import annotations

import re

import pytest
from django.contrib.messages import get_messages
from django.urls import reverse

from flywheel.failures import services
from flywheel.failures.models import FailureMode, FailureModeAssignment, QueueClaim, TaxonomyCategory
from flywheel.trajectories.models import Trajectory

HTMX = {"HX-Request": "true"}


@pytest.fixture
def reviewer(make_user, make_membership, project):
    person = make_user("rita")
    make_membership(person, project, "reviewer")
    return person


@pytest.fixture
def viewer(make_user, make_membership, project):
    person = make_user("vic")
    make_membership(person, project, "viewer")
    return person


def _flash(response) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]


def test_modes_list_and_page_show_counts_weeks_and_signals(client_for, project, user, make_trajectories, add_signal):
    trajectories = make_trajectories(project, 3)
    add_signal(trajectories[0], kind="tool_error")
    add_signal(trajectories[1], kind="tool_error")
    add_signal(trajectories[1], kind="loop", message_index=1)
    mode = services.failure_mode_create(project=project, name="<b>Refund</b> fails", category_key="wrong_arguments", user=user)
    services.failure_mode_assign(failure_mode=mode, trajectories=trajectories[:2], user=user)
    client = client_for(user)
    page = client.get(reverse("failure_mode_list", args=[project.slug])).content.decode()
    assert "&lt;b&gt;Refund&lt;/b&gt; fails" in page and "<b>Refund" not in page
    assert f'?mode={mode.pk}">2</a>' in page
    response = client.get(reverse("failure_mode_detail", args=[project.slug, mode.pk]))
    page = response.content.decode()
    assert response.status_code == 200
    assert page.count('id="row-') == 2 and f'id="row-{trajectories[2].pk}"' not in page
    assert '<tr data-signal="tool_error">' in page and '<td class="num">2</td><td class="num">2</td>' in page
    assert '<tr data-signal="loop">' in page
    assert page.count('class="bar"') == 12  # twelve weeks of bars, inline SVG
    assert " style=" not in page and "<script>" not in page


def test_creating_a_mode_twice_is_a_field_error_on_the_page(client_for, project, reviewer):
    client = client_for(reviewer)
    url = reverse("failure_mode_create", args=[project.slug])
    response = client.post(url, {"name": "Loops", "category": "bad_planning"})
    mode = FailureMode.objects.get(project=project, name="Loops")
    assert response.status_code == 302 and response["Location"].endswith(f"/failures/{mode.pk}/")
    again = client.post(url, {"name": "Loops", "category": "bad_planning"})
    assert again.status_code == 422 and "already has a failure mode named" in again.content.decode()


def test_maintainers_edit_the_taxonomy_and_cannot_delete_a_category_in_use(client_for, project, user, reviewer):
    fmt = TaxonomyCategory.objects.get(project=project, key="format")
    services.failure_mode_create(project=project, name="Bad JSON", category_key="format", user=user)
    assert client_for(reviewer).post(reverse("taxonomy_category_update", args=[project.slug, fmt.pk]), {"name": "x"}).status_code == 403
    client = client_for(user)
    client.post(reverse("taxonomy_category_update", args=[project.slug, fmt.pk]), {"name": "Malformed output", "description": "JSON"})
    fmt.refresh_from_db()
    assert (fmt.name, fmt.key) == ("Malformed output", "format")
    response = client.post(reverse("taxonomy_category_delete", args=[project.slug, fmt.pk]), follow=True)
    assert TaxonomyCategory.objects.filter(pk=fmt.pk).exists()
    assert "is used by failure modes (Bad JSON)" in response.content.decode()


def test_a_reviewer_assigns_and_unassigns_on_the_trajectory_page_with_history(client_for, project, user, reviewer, viewer, make_trajectories):
    trajectory = make_trajectories(project, 1)[0]
    mode = services.failure_mode_create(project=project, name="Refund fails", category_key="wrong_arguments", user=user)
    url = reverse("trajectory_mode_assign", args=[project.slug, trajectory.pk])
    assert client_for(viewer).post(url, {"mode": mode.pk}).status_code == 403
    client = client_for(reviewer)
    bad = client.post(url, {"mode": mode.pk, "message_index": "9"}, headers=HTMX)
    assert bad.status_code == 422 and "No message 9" in bad.content.decode()
    ok = client.post(url, {"mode": mode.pk, "message_index": "2", "note": "wrong id"}, headers=HTMX)
    assert ok.status_code == 200
    fragment = ok.content.decode()
    assert "Refund fails" in fragment and 'href="#m2"' in fragment and "by rita" in fragment
    assert 'id="history" hx-swap-oob="true"' in fragment and "none</span> → <span class=\"history-after\">Refund fails" in fragment
    # A new mode named in the same form is created and assigned.
    client.post(url, {"new_name": "Apologises", "category": "other"}, headers=HTMX)
    assert set(trajectory.failure_assignments.values_list("failure_mode__name", flat=True)) == {"Refund fails", "Apologises"}
    client.post(reverse("trajectory_mode_unassign", args=[project.slug, trajectory.pk, mode.pk]), headers=HTMX)
    page = client.get(reverse("trajectory_detail", args=[project.slug, trajectory.pk])).content.decode()
    assert "Review history (3)" in page and 'data-mode="' in page


def test_bulk_assignment_of_all_matching_respects_the_filter_and_never_doubles(client_for, project, user, reviewer, make_trajectories):
    eu = make_trajectories(project, 4, prefix="eu", agent="eu-bot")
    make_trajectories(project, 3, prefix="us", agent="us-bot")
    mode = services.failure_mode_create(project=project, name="EU", category_key="other", user=user)
    client = client_for(reviewer)
    list_page = client.get(reverse("trajectory_list", args=[project.slug]), {"agent": "eu-bot"}).content.decode()
    assert 'name="filter_qs" value="agent=eu-bot"' in list_page and 'form="bulk"' in list_page
    assert "all 4 matching" in list_page
    url = reverse("failure_mode_bulk_assign", args=[project.slug])
    picked = client.post(url, {"mode": mode.pk, "ids": [eu[0].pk, eu[1].pk], "filter_qs": "agent=eu-bot"})
    assert "added to 2 trajectories selected" in " ".join(_flash(picked))
    everything = client.post(url, {"mode": mode.pk, "all_matching": "1", "filter_qs": "agent=eu-bot"})
    assert everything["Location"].endswith("?agent=eu-bot")
    assert "added to 2 trajectories matching the filter" in " ".join(_flash(everything))
    assert set(Trajectory.objects.filter(failure_assignments__failure_mode=mode).values_list("agent", flat=True)) == {"eu-bot"}
    assert FailureModeAssignment.objects.filter(failure_mode=mode).count() == 4
    nothing = client.post(url, {"mode": mode.pk, "filter_qs": ""})
    assert "Tick some trajectories first" in " ".join(_flash(nothing))


def test_the_queue_claims_assigns_at_a_message_completes_undoes_and_skips(client_for, project, user, reviewer, make_trajectories, add_signal):
    first, second = make_trajectories(project, 2)
    add_signal(first, severity=3)  # most severe first, although older
    mode = services.failure_mode_create(project=project, name="Refund fails", category_key="wrong_arguments", user=user)
    client = client_for(reviewer)
    queue_url = reverse("queue_page", args=[project.slug])
    empty = client.get(queue_url).content.decode()
    assert "Claim the next one" in empty and "<strong data-done>0</strong> done" in empty
    client.post(reverse("queue_claim", args=[project.slug]))
    page = client.get(queue_url).content.decode()
    assert f'data-queue-item="{first.pk}"' in page and 'data-key="1"' in page and "Refund fails" in page
    assert 'disabled title="Promotion' in page or 'data-key="e"' in page
    assert QueueClaim.objects.get(trajectory=first).user == reviewer
    # 1 at message 2: assigned there.
    response = client.post(reverse("queue_assign", args=[project.slug, first.pk]), {"mode": mode.pk, "message_index": "2"})
    assert response["Location"].endswith("?m=2")
    assert FailureModeAssignment.objects.get(failure_mode=mode, trajectory=first).message_index == 2
    # Enter: completed, and the next one claimed.
    client.post(reverse("queue_complete", args=[project.slug, first.pk]))
    assert Trajectory.objects.get(pk=first.pk).reviewed_outcome == "failure"
    assert QueueClaim.objects.get(user=reviewer).trajectory_id == second.pk
    assert "<strong data-done>1</strong> done" in client.get(queue_url).content.decode()
    # u: the completion is undone and the first item comes back to this reviewer.
    client.post(reverse("queue_undo", args=[project.slug]))
    assert Trajectory.objects.get(pk=first.pk).reviewed_outcome == ""
    assert QueueClaim.objects.get(user=reviewer).trajectory_id == first.pk
    # u again: the assignment is undone.
    client.post(reverse("queue_undo", args=[project.slug]))
    assert not FailureModeAssignment.objects.filter(trajectory=first).exists()
    # s: skipped, the next one claimed.
    client.post(reverse("queue_skip", args=[project.slug, first.pk]))
    assert QueueClaim.objects.get(user=reviewer).trajectory_id == second.pk
    # Someone else's item cannot be completed from here.
    other = client_for(user)
    response = other.post(reverse("queue_complete", args=[project.slug, second.pk]), follow=True)
    assert "claimed by another reviewer" in response.content.decode()
    assert Trajectory.objects.get(pk=second.pk).reviewed_outcome == ""


def test_viewers_cannot_open_the_queue(client_for, project, viewer):
    assert client_for(viewer).get(reverse("queue_page", args=[project.slug])).status_code == 403


def test_outcome_and_tag_changes_refresh_the_history_beside_them(client_for, project, reviewer, make_trajectories):
    trajectory = make_trajectories(project, 1)[0]
    client = client_for(reviewer)
    outcome = client.post(reverse("trajectory_outcome_set", args=[project.slug, trajectory.pk]), {"outcome": "failure"}, headers=HTMX)
    fragment = outcome.content.decode()
    assert 'id="history" hx-swap-oob="true"' in fragment and "not reviewed</span> → <span class=\"badge o-failure\">failure" in fragment
    tags = client.post(reverse("trajectory_tag_add", args=[project.slug, trajectory.pk]), {"name": "refunds"}, headers=HTMX)
    assert 'id="history" hx-swap-oob="true"' in tags.content.decode() and "history-after\">refunds" in tags.content.decode()
    page = client.get(reverse("trajectory_detail", args=[project.slug, trajectory.pk])).content.decode()
    assert page.count('id="history"') == 1 and "hx-swap-oob" not in page


def test_every_new_page_renders_without_inline_script_or_style(client_for, project, user, make_trajectories):
    # The CSP forbids both; the week bars are SVG attributes, not style.
    trajectory = make_trajectories(project, 1)[0]
    mode = services.failure_mode_create(project=project, name="M", category_key="other", user=user)
    services.failure_mode_assign(failure_mode=mode, trajectories=[trajectory], user=user)
    client = client_for(user)
    client.post(reverse("queue_claim", args=[project.slug]))
    for name, args in (
        ("failure_mode_list", [project.slug]),
        ("failure_mode_detail", [project.slug, mode.pk]),
        ("taxonomy_page", [project.slug]),
        ("queue_page", [project.slug]),
        ("trajectory_list", [project.slug]),
        ("trajectory_detail", [project.slug, trajectory.pk]),
    ):
        response = client.get(reverse(name, args=args))
        page = response.content.decode()
        assert response.status_code == 200, name
        assert "<script>" not in page and " style=" not in page and "<style" not in page, name


def test_a_modes_page_lists_the_eval_cases_and_tasks_promoted_from_it(client_for, project, user, make_trajectories):
    from flywheel.environments.models import Task
    from flywheel.environments.services import task_set_create
    from flywheel.evals.models import EvalCase
    from flywheel.evals.services import suite_create

    carried, other = make_trajectories(project, 2)
    mode = services.failure_mode_create(project=project, name="M", category_key="other", user=user)
    services.failure_mode_assign(failure_mode=mode, trajectories=[carried], user=user)
    suite = suite_create(project=project, name="Refund regressions")
    task_set = task_set_create(project=project, name="Refund tasks")
    from_mode = EvalCase.objects.create(suite=suite, failure_mode=mode)  # promoted from the whole mode
    unrelated = EvalCase.objects.create(suite=suite, trajectory=other)
    from_trajectory = Task.objects.create(task_set=task_set, trajectory=carried)  # from one of its trajectories
    page = client_for(user).get(reverse("failure_mode_detail", args=[project.slug, mode.pk])).content.decode()
    assert f"{from_mode.row_id}</span> in Refund regressions" in page
    assert f"{from_trajectory.row_id}</span> in Refund tasks" in page
    assert f">{unrelated.row_id}<" not in page


def test_the_trajectory_list_marks_what_was_promoted_into_a_task_set_or_a_suite(client_for, project, user, make_trajectories):
    """A reviewer looking for a failure to promote sees which are already a task or an eval case (the leakage
    guard refuses those), and which are still only failures."""
    from flywheel.environments.models import Task
    from flywheel.environments.services import task_set_create
    from flywheel.evals.models import EvalCase
    from flywheel.evals.services import suite_create

    task, case, both, plain = make_trajectories(project, 4)
    task_set = task_set_create(project=project, name="Tasks")
    suite = suite_create(project=project, name="Regressions")
    Task.objects.create(task_set=task_set, trajectory=task)
    Task.objects.create(task_set=task_set, trajectory=both)
    EvalCase.objects.create(suite=suite, trajectory=case)
    EvalCase.objects.create(suite=suite, trajectory=both)
    page = client_for(user).get(reverse("trajectory_list", args=[project.slug])).content.decode()

    def badges(trajectory) -> list[str]:
        row = page.split(f'id="row-{trajectory.pk}"')[1].split("</tr>")[0]
        return re.findall(r'class="badge b-promoted"[^>]*>([^<]+)<', row)

    assert (badges(task), badges(case), badges(both), badges(plain)) == (["task"], ["eval case"], ["task", "eval case"], [])
