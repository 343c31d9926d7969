"""The Clusters page: who may do what, the run's progress partial, suggestions shown escaped, and the
reviewer's actions."""

from __future__ import annotations

import pytest

from flywheel.failures.clustering import services
from flywheel.failures.clustering.models import ClusteringRun, Decision
from flywheel.failures.models import FailureMode

HOSTILE = "<script>window.__pwned=1</script>"


@pytest.fixture
def done_run(db, embedder, project, user, labeled_failures):
    labeled_failures(project, 10, ["stock_timeout", "sql_syntax_error"])
    run = services.clustering_run_start(project=project, user=user)
    return services.clustering_run_process(run_id=run.pk)


@pytest.fixture
def members(make_user, make_membership, project):
    out = {}
    for role in ("viewer", "reviewer"):
        out[role] = make_user()
        make_membership(out[role], project, role)
    return out


def test_the_page_shows_each_suggestion_with_representatives_escaped(client_for, done_run, members, project):
    suggestion = done_run.suggestions.first()
    assert [e["id"] for e in suggestion.examples] == suggestion.representative_ids
    suggestion.examples[0] |= {"request": HOSTILE, "result": HOSTILE}  # agent text, as a request may hold
    suggestion.save(update_fields=["examples"])
    response = client_for(members["viewer"]).get(f"/p/{project.slug}/clusters/")
    assert response.status_code == 200
    html = response.content.decode()
    assert html.count('class="cl-sugg panel"') == 2
    assert f"/p/{project.slug}/t/{suggestion.representative_ids[0]}/" in html
    assert html.count("&lt;script&gt;window.__pwned=1&lt;/script&gt;") == 2 and HOSTILE not in html
    assert suggestion.examples[1]["step"].split(" ")[0] in html  # the failing call shown beside the request
    assert "Accept as new mode" not in html  # viewers read only
    assert 'max="100" value="100"' in html
    # Failures and groups are different units; the counts say which is which.
    counts = " ".join(html.split('class="cl-counts"')[1].split("</p>")[0].replace("<span class=\"count\">", "")
                      .replace("</span>", "").split())
    assert counts == (f">Of {done_run.total} failures: {done_run.attached} close to existing modes · "
                      f"{done_run.noise} in no group · the rest in {done_run.clusters} new groups")


def test_a_viewer_cannot_decide_or_start(client_for, done_run, members, project):
    suggestion = done_run.suggestions.first()
    viewer = client_for(members["viewer"])
    assert viewer.post(f"/p/{project.slug}/clusters/s/{suggestion.pk}/accept").status_code == 403
    assert viewer.post(f"/p/{project.slug}/clusters/runs", {"days": "30"}).status_code == 403
    assert done_run.suggestions.filter(decision=Decision.PENDING).count() == 2


def test_a_reviewer_accepts_a_suggestion_as_a_new_mode(client_for, done_run, members, project):
    suggestion = done_run.suggestions.first()
    response = client_for(members["reviewer"]).post(
        f"/p/{project.slug}/clusters/s/{suggestion.pk}/accept", {"name": "Quotes time out", "category": "other"}
    )
    assert response.status_code == 302
    mode = FailureMode.objects.get(project=project, name="Quotes time out")
    assert mode.category.key == "other" and mode.assignments.count() == suggestion.size
    page = client_for(members["reviewer"]).get(response["Location"]).content.decode()
    assert "Accepted as a new mode" in page and "Quotes time out" in page


def test_merge_needs_a_mode_of_the_project_and_a_dismiss_twice_is_refused(client_for, done_run, members, project):
    reviewer = client_for(members["reviewer"])
    first, second = done_run.suggestions.all()
    response = reviewer.post(f"/p/{project.slug}/clusters/s/{first.pk}/merge", {"mode": "999999"})
    assert response.status_code == 422 and "Choose a failure mode" in response.content.decode()
    assert reviewer.post(f"/p/{project.slug}/clusters/s/{second.pk}/dismiss").status_code == 302
    again = reviewer.post(f"/p/{project.slug}/clusters/s/{second.pk}/dismiss")
    assert again.status_code == 409 and "already decided" in again.content.decode()


def test_starting_a_run_checks_the_form_and_queues_one(client_for, members, project):
    reviewer = client_for(members["reviewer"])
    bad = reviewer.post(f"/p/{project.slug}/clusters/runs", {"days": "0", "limit": "x"})
    assert bad.status_code == 422
    assert "days: a whole number from 1 to 3,650, not 0." in bad.content.decode()
    assert "limit: a whole number from 2 to" in bad.content.decode() and ", not x." in bad.content.decode()
    assert reviewer.post(f"/p/{project.slug}/clusters/runs", {}).status_code == 422  # days must be stated
    ok = reviewer.post(f"/p/{project.slug}/clusters/runs", {"days": "7", "signal": "tool_error"})
    run = ClusteringRun.objects.get(project=project)
    assert ok.status_code == 302 and f"?run={run.pk}" in ok["Location"]
    assert run.status == "queued" and run.filter["days"] == 7 and run.filter["signal"] == "tool_error"
    busy = reviewer.post(f"/p/{project.slug}/clusters/runs", {"days": "7"})
    assert busy.status_code == 409 and "already on its way" in busy.content.decode()


def test_the_progress_partial_polls_while_active_and_reloads_the_page_when_done(client_for, members, project, user):
    viewer = client_for(members["viewer"])
    run = services.clustering_run_start(project=project, user=user)
    ClusteringRun.objects.filter(pk=run.pk).update(status="running", stage="embedding", total=200, done=100)
    partial = viewer.get(f"/p/{project.slug}/clusters/runs/{run.pk}/?polling=1")
    html = partial.content.decode()
    assert "hx-trigger=\"every 1s\"" in html and "Embedding signatures</span>, 100 of 200" in html and "(55%)" in html
    assert "HX-Refresh" not in partial.headers
    ClusteringRun.objects.filter(pk=run.pk).update(status="failed", error="Failed while clustering: boom")
    ended = viewer.get(f"/p/{project.slug}/clusters/runs/{run.pk}/?polling=1")
    assert ended.headers["HX-Refresh"] == "true" and "hx-trigger" not in ended.content.decode()
    page = client_for(members["reviewer"]).get(f"/p/{project.slug}/clusters/").content.decode()
    assert "Failed while clustering: boom" in page and f"Retry run #{run.pk}" in page
