"""Every accounts page checks who is asking: anonymous users log in, non-members get 404, members
without the role get 403."""

import pytest
from django.urls import reverse

# (method, url name, needs the maintainer role)
PAGES = [
    ("get", "project_settings", False),
    ("post", "member_add", True),
    ("post", "member_update", True),
    ("post", "member_remove", True),
    ("post", "api_key_create", True),
    ("post", "api_key_revoke", True),
]


def _url(name, project, member, key):
    kwargs = {"project_slug": project.slug}
    if name in {"member_update", "member_remove"}:
        kwargs["user_id"] = member.pk
    if name == "api_key_revoke":
        kwargs["key_id"] = key.api_key.pk
    return reverse(name, kwargs=kwargs)


@pytest.fixture
def setting(make_user, make_project, make_membership, make_api_key):
    owner = make_user("owner")
    project = make_project("acme", owner=owner)
    viewer = make_user("viewer")
    make_membership(viewer, project, "viewer")
    reviewer = make_user("reviewer")
    make_membership(reviewer, project, "reviewer")
    return {"owner": owner, "project": project, "viewer": viewer, "reviewer": reviewer, "key": make_api_key(project)}


@pytest.mark.parametrize(("method", "name", "maintainer_only"), PAGES)
def test_anonymous_users_are_sent_to_log_in(client, setting, method, name, maintainer_only):
    url = _url(name, setting["project"], setting["viewer"], setting["key"])
    response = getattr(client, method)(url)
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("login") + "?next=")


@pytest.mark.parametrize(("method", "name", "maintainer_only"), PAGES)
def test_non_members_get_404_so_slugs_do_not_leak(client_for, make_user, setting, method, name, maintainer_only):
    url = _url(name, setting["project"], setting["viewer"], setting["key"])
    response = getattr(client_for(make_user("outsider")), method)(url, {"role": "maintainer", "name": "x"})
    assert response.status_code == 404


@pytest.mark.parametrize(("method", "name", "maintainer_only"), [p for p in PAGES if p[2]])
@pytest.mark.parametrize("role", ["viewer", "reviewer"])
def test_only_maintainers_change_members_and_keys(client_for, setting, method, name, maintainer_only, role):
    url = _url(name, setting["project"], setting["viewer"], setting["key"])
    response = getattr(client_for(setting[role]), method)(
        url, {"role": "maintainer", "username": role, "name": "mine", "scopes": ["read"]}
    )
    assert response.status_code == 403
    assert "maintainer role" in response.content.decode()
    setting["viewer"].refresh_from_db()
    assert setting["project"].memberships.get(user=setting["viewer"]).role == "viewer"
    assert setting["project"].api_keys.count() == 1
    assert setting["project"].api_keys.get().revoked_at is None


def test_viewers_see_members_but_not_keys(client_for, setting):
    response = client_for(setting["viewer"]).get(reverse("project_settings", args=["acme"]))
    assert response.status_code == 200
    page = response.content.decode()
    assert 'data-member="owner"' in page
    assert 'id="api-keys"' not in page
    assert setting["key"].api_key.prefix not in page
    assert "<select" not in page  # no role forms for a viewer


def test_project_list_shows_only_the_users_projects(client_for, make_user, make_project, make_membership):
    alice, bob = make_user("alice"), make_user("bob")
    make_project("alpha", name="Alpha agent", owner=alice)
    beta = make_project("beta", name="Beta agent", owner=bob)
    make_project("gamma", name="Gamma agent", owner=bob)
    make_membership(alice, beta, "viewer")

    response = client_for(alice).get(reverse("project_list"))
    page = response.content.decode()
    assert response.status_code == 200
    assert "Alpha agent" in page and "Beta agent" in page
    assert "Gamma agent" not in page
    assert "Maintainer" in page and "Viewer" in page


def test_project_list_needs_a_login(client):
    response = client.get("/")
    assert response.status_code == 302
    assert response["Location"] == reverse("login") + "?next=/"


def test_login_page_logs_in_and_goes_to_the_project_list(client, make_user):
    make_user("carol", password="a-long-password")
    page = client.get(reverse("login"))
    assert page.status_code == 200
    assert 'name="username"' in page.content.decode()
    response = client.post(reverse("login"), {"username": "carol", "password": "a-long-password"})
    assert response.status_code == 302
    assert response["Location"] == reverse("project_list")
    client.logout()
    wrong = client.post(reverse("login"), {"username": "carol", "password": "nope"})
    assert "do not match" in wrong.content.decode()


def test_pages_carry_no_inline_script_or_style(client_for, setting):
    # The CSP forbids them; a page that had one would break in the browser.
    for url in (reverse("project_list"), reverse("project_settings", args=["acme"])):
        response = client_for(setting["owner"]).get(url)
        page = response.content.decode()
        assert "<script>" not in page and " style=" not in page and "<style" not in page
        assert "script-src 'self'" in response["Content-Security-Policy"]


# --- every project route, from the URLconf --------------------------------------------------------------

PROJECT_PREFIX = "p/<slug:project_slug>/"


def _routes(patterns=None, prefix=""):
    """Every route of the URLconf as its full pattern string, e.g. p/<slug:project_slug>/t/<int:trajectory_id>/."""
    from django.urls import URLPattern, URLResolver, get_resolver

    for entry in get_resolver().url_patterns if patterns is None else patterns:
        route = prefix + str(entry.pattern)
        if isinstance(entry, URLResolver):
            yield from _routes(entry.url_patterns, route)
        elif isinstance(entry, URLPattern):
            yield route


def _model_rows(project):
    """A model version, a gate decision and a training job of the project (rows only)."""
    from flywheel.environments.models import TaskSet
    from flywheel.evals.models import EvalSuite
    from flywheel.evals.run_models import EvalRun
    from flywheel.registry.models import BaseModel, GateDecision, ModelVersion
    from flywheel.training.models import TrainingJob

    version = ModelVersion.objects.create(
        project=project, number=1, base=BaseModel.objects.create(project=project, name="tiny", path="/m")
    )
    decision = GateDecision.objects.create(project=project, candidate=version, production=version, passed=False)
    task_set_version = TaskSet.objects.create(project=project, name="t").versions.create(
        number=1, rows=[], size=0, content_hash="0" * 64
    )
    job = TrainingJob.objects.create(project=project, task_set_version=task_set_version, base_version=version)
    job.checkpoints.create(step=3, path="/jobs/x/checkpoint-3")
    suite = EvalSuite.objects.create(project=project, name="runs", kind="holdout")
    eval_run = EvalRun.objects.create(project=project, model_version=version, suite_version=suite.versions.create(
        number=1, rows=[], size=0, content_hash="0" * 64))
    from django.utils import timezone

    from flywheel.registry.models import LiveCheck

    check = LiveCheck.objects.create(project=project, kind="canary", subject=version, baseline=version,
                                     started_at=timezone.now(), ends_at=timezone.now())
    return {"version_number": version.number, "decision_id": decision.pk, "job_id": job.pk, "step": 3,
            "eval_run_id": eval_run.pk, "check_id": check.pk}


@pytest.fixture
def project_urls(setting):
    """Each route under /p/<slug>/ with every parameter naming a real object of the project, so that a view
    that forgot the access check would answer 200 (or act), not 404 for want of the object."""
    import re

    from flywheel.failures.services import failure_mode_create, taxonomy_category_create
    from flywheel.trajectories.ingest import ingest_trajectories
    from flywheel.trajectories.models import Tag, Trajectory, TriageRun, Upload

    project = setting["project"]
    record = {"external_id": "t-1", "messages": [{"role": "user", "content": "hi"}]}
    assert ingest_trajectories(project=project, records=[record]).accepted == 1
    values = {
        "project_slug": project.slug,
        "trajectory_id": Trajectory.objects.get(project=project).pk,
        "tag_id": Tag.objects.create(project=project, name="t").pk,
        "upload_id": Upload.objects.create(project=project, filename="a.jsonl", content=b"{}", status="failed").pk,
        "user_id": setting["viewer"].pk,
        "key_id": setting["key"].api_key.pk,
        "run_id": TriageRun.objects.create(project=project, version=1, status="done").pk,
        "mode_id": failure_mode_create(project=project, name="m", category_key="other", user=setting["owner"]).pk,
        "category_id": taxonomy_category_create(project=project, name="unused").pk,
        **_clustering_values(project),
        **_model_rows(project),
        "server_id": _environment_server(project).pk,
        "calibration_id": _calibration(project).pk,
    }
    values.update(_eval_values(project))
    urls = []
    for route in _routes():
        if not route.startswith(PROJECT_PREFIX):
            continue
        names = re.findall(r"<(?:\w+:)?(\w+)>", route)
        missing = [name for name in names if name not in values]
        assert not missing, f"{route}: add an object of the project for {missing} to this fixture"
        urls.append("/" + re.sub(r"<(?:\w+:)?(\w+)>", lambda m: str(values[m.group(1)]), route))
    assert len(urls) >= 10, urls  # the settings, review and upload routes were all found
    return urls


def _clustering_values(project):
    """A finished clustering run and a pending suggestion of it."""
    from flywheel.failures.clustering.models import ClusteringRun, ClusterSuggestion

    run = ClusteringRun.objects.create(project=project, status="done", stage="done")
    suggestion = ClusterSuggestion.objects.create(run=run, project=project, size=0, label="l", trajectory_ids=[])
    return {"clustering_id": run.pk, "suggestion_id": suggestion.pk}


def _eval_values(project):
    """An eval suite with a case and a task set with a task, each at v1 (`number`)."""
    from flywheel.environments.services import task_set_create
    from flywheel.evals.services import suite_create, version_create

    verifier = {"type": "exact", "expected": "x"}
    suite = suite_create(project=project, name="s")
    task_set = task_set_create(project=project, name="ts")
    case = suite.cases.create(messages=[{"role": "user", "content": "a"}], verifier=verifier)
    task = task_set.tasks.create(messages=[{"role": "user", "content": "b"}], verifier=verifier)
    version_create(collection=suite)
    version_create(collection=task_set)
    return {"suite_id": suite.pk, "case_id": case.pk, "task_set_id": task_set.pk, "task_id": task.pk, "number": 1}


def _calibration(project):
    from flywheel.evals.calibration_models import VerifierCalibration

    return VerifierCalibration.objects.create(project=project, verifier={"type": "exact", "expected": "x"},
                                              status="failed", error="stopped")


def _environment_server(project):
    from flywheel.environments.models import EnvironmentServer

    return EnvironmentServer.objects.create(project=project, name="gym", url="http://gym.invalid:8000")


def _answer(client, url):
    """The response to the method the route takes: GET, or POST where GET is not allowed."""
    response = client.get(url)
    return client.post(url) if response.status_code == 405 else response


def test_every_project_route_sends_anonymous_users_to_log_in(client, project_urls):
    for url in project_urls:
        response = _answer(client, url)
        assert response.status_code == 302, url
        assert response["Location"].startswith(reverse("login") + "?next="), url


def test_every_project_route_is_404_to_a_non_member(client_for, make_user, project_urls):
    client = client_for(make_user("outsider"))
    for url in project_urls:
        assert _answer(client, url).status_code == 404, url


# --- the Django admin: superusers only ------------------------------------------------------------------


@pytest.fixture
def foreign_trajectory(make_project):
    """A trajectory of a project the staff user below is no member of."""
    from flywheel.trajectories.ingest import ingest_trajectories
    from flywheel.trajectories.models import Trajectory

    project = make_project("secret-project")
    record = {"external_id": "secret-trace", "messages": [{"role": "user", "content": "the secret plan"}]}
    assert ingest_trajectories(project=project, records=[record]).accepted == 1
    return Trajectory.objects.get(project=project)


@pytest.fixture
def staff(make_user, make_project, make_membership):
    """Staff with every model permission, a maintainer of another project than `foreign_trajectory`'s:
    before the admin was for superusers only, exactly the user who could read any project there."""
    from django.contrib.auth.models import Permission

    user = make_user("staffer", is_staff=True)
    user.user_permissions.set(Permission.objects.all())
    make_project("own-project", owner=user)
    return user


def _admin_urls(trajectory):
    return [
        "/admin/",
        "/admin/trajectories/",
        "/admin/trajectories/trajectory/",
        f"/admin/trajectories/trajectory/{trajectory.pk}/change/",
        "/admin/trajectories/comment/",
        "/admin/accounts/apikey/",
        "/admin/auth/user/",
    ]


def test_staff_without_superuser_get_no_admin_page(client_for, staff, foreign_trajectory):
    client = client_for(staff)
    for url in _admin_urls(foreign_trajectory):
        response = client.get(url)
        assert response.status_code == 302, url
        assert response["Location"].startswith("/admin/login/?next="), url
    login_page = client.get("/admin/login/", follow=True).content.decode()
    assert "secret" not in login_page and "You are authenticated as staffer, but are not authorized" in login_page


def test_staff_without_superuser_cannot_log_in_to_the_admin(client, staff):
    response = client.post("/admin/login/?next=/admin/", {"username": "staffer", "password": "test-password-123"})
    assert response.status_code == 200  # the form again, not a redirect into the admin
    assert "for a superuser account" in response.content.decode()
    assert "_auth_user_id" not in client.session


def test_superusers_use_the_admin(client, make_user, foreign_trajectory):
    make_user("root", is_staff=True, is_superuser=True)
    response = client.post("/admin/login/?next=/admin/", {"username": "root", "password": "test-password-123"})
    assert response.status_code == 302 and response["Location"] == "/admin/"
    for url in _admin_urls(foreign_trajectory):
        assert client.get(url).status_code == 200, url
    page = client.get("/admin/trajectories/trajectory/").content.decode()
    assert "secret-trace" in page


def test_the_project_list_says_a_worker_seen_seconds_ago_was_seen_within_the_last_minute(client_for, user, project):
    from datetime import timedelta

    from django.utils import timezone

    from flywheel.accounts.models import WorkerHeartbeat

    beat = WorkerHeartbeat.objects.create(hostname="local@box", seen_at=timezone.now(), tasks_seen=1)
    page = client_for(user).get("/").content.decode()
    assert "last seen within the last minute" in page and "0\xa0minutes" not in page
    WorkerHeartbeat.objects.filter(pk=beat.pk).update(seen_at=timezone.now() - timedelta(minutes=5))
    assert "last seen 5\xa0minutes ago" in client_for(user).get("/").content.decode()
