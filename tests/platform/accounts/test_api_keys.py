"""API keys: shown once, stored hashed, scoped, revocable, managed by maintainers from the settings page."""

import hashlib

import pytest
from django.urls import reverse

from flywheel.accounts.models import ApiKey
from flywheel.accounts.selectors import api_key_authenticate
from flywheel.accounts.services import api_key_create, api_key_revoke


@pytest.fixture
def maintainer_client(client_for, user):
    return client_for(user)


def test_a_created_key_is_shown_once_and_only_its_hash_is_stored(maintainer_client, project):
    response = maintainer_client.post(
        reverse("api_key_create", args=[project.slug]), {"name": "prod agent", "scopes": ["ingest"]}
    )
    assert response.status_code == 201
    assert response["Cache-Control"] == "no-store"
    key = ApiKey.objects.get(project=project)
    page = response.content.decode()
    raw = page.split('id="issued-key" readonly value="')[1].split('"')[0]
    assert raw.startswith(f"fw_{key.prefix}_")
    assert key.digest == hashlib.sha256(raw.encode()).hexdigest()
    stored = [str(v) for v in ApiKey.objects.filter(pk=key.pk).values().get().values()]
    assert raw not in stored

    again = maintainer_client.get(reverse("project_settings", args=[project.slug])).content.decode()
    assert raw not in again
    assert f"fw_{key.prefix}_" in again  # the list shows the prefix only
    assert api_key_authenticate(raw_key=raw) == key


def test_scopes_are_what_the_maintainer_ticked(maintainer_client, project):
    maintainer_client.post(reverse("api_key_create", args=[project.slug]), {"name": "reader", "scopes": ["read"]})
    maintainer_client.post(
        reverse("api_key_create", args=[project.slug]), {"name": "both", "scopes": ["ingest", "read"]}
    )
    assert dict(ApiKey.objects.values_list("name", "scopes")) == {"reader": ["read"], "both": ["ingest", "read"]}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"name": "no scopes"}, "Choose at least one scope."),
        ({"name": "bad", "scopes": ["admin"]}, "Select a valid choice"),
        ({"scopes": ["read"]}, "name: This field is required."),
    ],
)
def test_invalid_key_forms_say_what_is_wrong(maintainer_client, project, data, message):
    response = maintainer_client.post(reverse("api_key_create", args=[project.slug]), data)
    assert response.status_code == 422
    assert message in response.content.decode()
    assert not ApiKey.objects.exists()


def test_an_unknown_scope_is_refused_by_the_service(project):
    with pytest.raises(ValueError):
        api_key_create(project=project, name="x", scopes=["write"])


def test_revoked_keys_stop_working_and_show_as_revoked(maintainer_client, project, api_key):
    assert api_key_authenticate(raw_key=api_key) is not None
    response = maintainer_client.post(reverse("api_key_revoke", args=[project.slug, api_key.api_key.pk]))
    assert response.status_code == 200
    assert api_key_authenticate(raw_key=api_key) is None
    page = response.content.decode()
    assert "is revoked" in page
    assert 'class="acc-revoked"' in page
    # Revoking twice keeps the first time.
    first = ApiKey.objects.get().revoked_at
    api_key_revoke(api_key=ApiKey.objects.get())
    assert ApiKey.objects.get().revoked_at == first


def test_a_key_of_another_project_cannot_be_revoked_from_this_one(maintainer_client, project, make_project, make_api_key):
    other_key = make_api_key(make_project("other"))
    response = maintainer_client.post(reverse("api_key_revoke", args=[project.slug, other_key.api_key.pk]))
    assert response.status_code == 404
    assert api_key_authenticate(raw_key=other_key) is not None


def test_last_used_is_shown_once_the_key_is_used(maintainer_client, project, api_key):
    page = maintainer_client.get(reverse("project_settings", args=[project.slug])).content.decode()
    assert "never" in page
    api_key_authenticate(raw_key=api_key)
    page = maintainer_client.get(reverse("project_settings", args=[project.slug])).content.decode()
    assert "0\xa0minutes ago" in page


def test_htmx_gets_the_keys_section_only(maintainer_client, project):
    response = maintainer_client.post(
        reverse("api_key_create", args=[project.slug]), {"name": "ci", "scopes": ["ingest"]}, headers={"HX-Request": "true"}
    )
    page = response.content.decode()
    assert page.lstrip().startswith('<section class="acc-card" id="api-keys">')
    assert "<html" not in page
    assert 'id="issued-key"' in page


@pytest.mark.parametrize("raw", ["", "fw_nope", "Bearer x", "fw_" + "a" * 60])
def test_unknown_keys_do_not_authenticate(db, raw):
    assert api_key_authenticate(raw_key=raw) is None


RECORD = {"external_id": "k-1", "messages": [{"role": "user", "content": "hi"}]}


def test_scopes_and_revocation_hold_at_the_api(api_client, project, make_api_key):
    read_only, ingest_only = make_api_key(project, scopes=["read"]), make_api_key(project, scopes=["ingest"])
    assert api_client.post("/api/v1/trajectories", RECORD, key=read_only).status_code == 403
    assert api_client.get("/api/v1/trajectories", key=ingest_only).status_code == 403
    assert api_client.post("/api/v1/trajectories", RECORD, key=ingest_only).status_code == 200
    assert api_client.get("/api/v1/trajectories", key=read_only).status_code == 200

    api_key_revoke(api_key=read_only.api_key)
    assert api_client.get("/api/v1/trajectories", key=read_only).status_code == 401
    assert api_client.get("/api/v1/trajectories", key=None).status_code == 401


def test_the_settings_page_explains_every_scope_a_key_can_hold(maintainer_client, project):
    from django.utils.html import escape

    from flywheel.accounts.models import Scope

    page = maintainer_client.get(reverse("project_settings", args=[project.slug])).content.decode()
    hint = page.split('class="muted acc-hint acc-scopes"')[1].split("</dl>")[0]
    for scope in Scope:
        assert f'<span class="tag">{scope.value}</span></dt><dd>{escape(scope.label)}</dd>' in hint, scope
