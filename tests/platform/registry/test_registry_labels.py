"""What the Models page and the dashboard say about a version after the gate and after rollbacks: a refused
version reads "refused by the gate" with a link to the decision, the rollback button names the version a
rollback really goes to (and is gone when there is none), and a rolled-back version's lineage says so."""

from __future__ import annotations

import pytest
from django.urls import reverse

from flywheel.registry import selectors, services
from flywheel.registry.models import AliasEvent, BaseModel, GateDecision


@pytest.fixture
def versions(project, user):
    """v1 (the base, production first), v2 and v3 (passed the gate), v4 (refused by it)."""
    base = BaseModel.objects.create(project=project, name="tiny", path="/models/tiny")
    v1 = services.model_version_create(project=project, base=base, user=user)
    services.alias_move(project=project, alias="production", version=v1, user=user, reason="First model.")
    v2, v3, v4 = (services.model_version_create(project=project, base=base, user=user, lineage={"job": n})
                  for n in (1, 2, 3))
    GateDecision.objects.create(project=project, candidate=v2, production=v1, passed=True)
    GateDecision.objects.create(project=project, candidate=v3, production=v1, passed=True)
    refused = GateDecision.objects.create(project=project, candidate=v4, production=v1, passed=False)
    return v1, v2, v3, v4, refused


def _page(client, project) -> str:
    response = client.get(reverse("registry_page", args=[project.slug]))
    assert response.status_code == 200
    return response.content.decode()


def _row(html: str, number: int) -> str:
    return html.split(f'id="version-{number}"')[1].split("</tr>")[0]


def test_a_refused_version_says_so_and_links_its_decision(project, versions, client_for, user):
    _, _, _, _, refused = versions
    html = _page(client_for(user), project)
    row = _row(html, 4)
    assert "refused by the gate" in row and "not gated" not in row
    assert reverse("registry_gate", args=[project.slug, refused.pk]) in row
    assert "Promote" in _row(html, 2)  # passed: promoted with one click


def test_the_rollback_button_names_where_a_rollback_really_goes(project, versions, client_for, user):
    v1, v2, v3, _, _ = versions
    client = client_for(user)
    assert 'id="rollback"' not in _page(client, project)  # v1 was the first: nothing to go back to
    services.model_promote(project=project, version=v2, user=user)
    GateDecision.objects.create(project=project, candidate=v3, production=v2, passed=True)
    services.model_promote(project=project, version=v3, user=user)
    assert "Roll back to v2</button>" in _page(client, project)

    # Rolled back to v2: the next rollback goes to v1 (what v2 replaced), not forth to v3.
    assert services.model_rollback(project=project, user=user).to_version == v2
    html = _page(client, project)
    assert "Roll back to v1</button>" in html and "Roll back to v3</button>" not in html
    assert selectors.rollback_target(project=project) == v1
    response = client.post(reverse("registry_rollback", args=[project.slug]), {"reason": "still broken"})
    assert response.status_code == 302
    assert selectors.production_of(project=project) == v1
    assert 'id="rollback"' not in _page(client, project)
    kinds = [(e.kind, e.to_version.number) for e in AliasEvent.objects.filter(project=project).order_by("at", "id")]
    assert kinds == [("set", 1), ("promote", 2), ("promote", 3), ("rollback", 2), ("rollback", 1)]


def test_a_rolled_back_version_s_lineage_says_what_happened(project, versions, client_for, user):
    _, v2, _, _, _ = versions
    client = client_for(user)
    url = reverse("flywheel_dashboard", args=[project.slug])
    services.model_promote(project=project, version=v2, user=user)
    serving = client.get(url, {"version": 2}).content.decode()
    assert "in production</span>" in serving and "rolled back" not in serving
    services.model_rollback(project=project, user=user, reason="tickets rose")
    html = client.get(url, {"version": 2}).content.decode()
    served = html.split('id="lineage-served"')[1].split("</span>")[0]
    assert "served in production from" in served and "then rolled back at" in served and "(to v1)" in served
    assert "in production</span>" not in html.split('id="lineage"')[1].split("</section>")[0]


def test_a_candidate_that_became_production_is_not_offered_as_the_candidate(project, versions, client_for, user):
    _, v2, _, _, _ = versions
    services.alias_move(project=project, alias="candidate", version=v2, user=user, reason="the job's best")
    panel = _page(client_for(user), project).split('id="alias-candidate"')[1].split("</div>")[0]
    assert "gate passed" in panel and 'id="candidate-serving"' not in panel
    services.model_promote(project=project, version=v2, user=user)
    panel = _page(client_for(user), project).split('id="alias-candidate"')[1].split("</div>")[0]
    assert 'id="candidate-serving"' in panel and "is production now" in panel and "gate passed" not in panel
