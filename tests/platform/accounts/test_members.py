"""Maintainers add members, change their roles and remove them; a project always keeps a maintainer."""

import pytest
from django.urls import reverse

from flywheel.accounts.models import Membership
from flywheel.accounts.services import MembershipError, membership_remove, membership_set


@pytest.fixture
def owner_client(client_for, user):
    return client_for(user)


def test_a_maintainer_adds_an_existing_user_with_a_role(owner_client, project, make_user):
    make_user("dana")
    response = owner_client.post(reverse("member_add", args=[project.slug]), {"username": "dana", "role": "reviewer"})
    assert response.status_code == 200
    assert Membership.objects.get(project=project, user__username="dana").role == "reviewer"
    assert 'data-member="dana"' in response.content.decode()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"username": "ghost", "role": "viewer"}, "there is no user named &#x27;ghost&#x27;"),
        ({"username": "dana", "role": "owner"}, "role: Select a valid choice"),
    ],
)
def test_adding_a_member_explains_what_is_wrong(owner_client, project, make_user, data, message):
    make_user("dana")
    response = owner_client.post(reverse("member_add", args=[project.slug]), data)
    assert response.status_code == 422
    assert message in response.content.decode()
    assert project.memberships.count() == 1


def test_adding_someone_twice_is_refused(owner_client, project, make_user, make_membership):
    make_membership(make_user("dana"), project, "viewer")
    response = owner_client.post(reverse("member_add", args=[project.slug]), {"username": "dana", "role": "reviewer"})
    assert response.status_code == 422
    assert "already a member" in response.content.decode()
    assert Membership.objects.get(user__username="dana").role == "viewer"


def test_a_maintainer_changes_a_role_and_removes_a_member(owner_client, project, make_user, make_membership):
    dana = make_user("dana")
    make_membership(dana, project, "viewer")
    response = owner_client.post(reverse("member_update", args=[project.slug, dana.pk]), {"role": "maintainer"})
    assert response.status_code == 200
    assert Membership.objects.get(user=dana).role == "maintainer"

    response = owner_client.post(reverse("member_remove", args=[project.slug, dana.pk]))
    assert response.status_code == 200
    assert not Membership.objects.filter(user=dana).exists()
    assert 'data-member="dana"' not in response.content.decode()


def test_the_last_maintainer_can_neither_leave_nor_step_down(owner_client, project, user):
    for url, data in [
        (reverse("member_update", args=[project.slug, user.pk]), {"role": "viewer"}),
        (reverse("member_remove", args=[project.slug, user.pk]), {}),
    ]:
        response = owner_client.post(url, data, headers={"HX-Request": "true"})
        assert response.status_code == 422
        page = response.content.decode()
        assert "last maintainer" in page
        assert page.lstrip().startswith('<section class="acc-card" id="members">')
    assert Membership.objects.get(user=user).role == "maintainer"


def test_with_a_second_maintainer_the_first_may_step_down(project, user, make_user, make_membership):
    make_membership(make_user("erin"), project, "maintainer")
    membership_set(project=project, user=user, role="viewer")
    with pytest.raises(MembershipError):
        membership_remove(project=project, user=Membership.objects.get(role="maintainer").user)


def test_a_member_of_another_project_cannot_be_changed_from_this_one(owner_client, project, make_project, make_user):
    other_owner = make_user("frank")
    make_project("other", owner=other_owner)
    response = owner_client.post(reverse("member_update", args=[project.slug, other_owner.pk]), {"role": "viewer"})
    assert response.status_code == 404
    assert Membership.objects.get(user=other_owner).role == "maintainer"
