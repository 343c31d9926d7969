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


def test_two_adds_of_one_user_at_once_one_wins_and_the_other_is_refused(
    transactional_db, needs_service, client_for, project, user, make_user
):
    """Both requests pass the "already a member?" check before either inserts: the unique constraint
    decides, and the loser is told so (422), never a 500 and never a silent change of the winner's role."""
    import threading

    from django.db import connection, connections, transaction

    needs_service(connection.vendor == "postgresql", f"needs PostgreSQL (DATABASE_URL points at {connection.vendor})")
    dana = make_user("dana")
    url = reverse("member_add", args=[project.slug])
    answers: dict[str, object] = {}

    def add(role: str) -> None:
        try:
            response = client_for(user).post(url, {"username": "dana", "role": role})
            answers[role] = (response.status_code, response.content.decode())
        except Exception as exc:  # a 500 raises in the test client
            answers[role] = exc
        finally:
            connections.close_all()

    threads = [threading.Thread(target=add, args=(role,)) for role in ("viewer", "reviewer")]
    # Hold the row's key in an open transaction, so that both adds get past their check and wait on the
    # insert; let go once both wait, and they insert at the same moment.
    with transaction.atomic():
        Membership.objects.create(project=project, user=dana, role="maintainer")
        for thread in threads:
            thread.start()
        with connection.cursor() as cursor:
            for _ in range(600):
                # The statistics are read once per transaction unless the snapshot is dropped.
                cursor.execute("SELECT pg_stat_clear_snapshot()")
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )
                if cursor.fetchone()[0] >= 2:
                    break
                threading.Event().wait(0.05)
            else:
                pytest.fail(f"the two adds did not both reach the insert: {answers}")
        transaction.set_rollback(True)
    for thread in threads:
        thread.join(timeout=60)

    statuses = sorted(answer[0] if isinstance(answer, tuple) else answer for answer in answers.values())
    assert statuses == [200, 422], answers
    winner = next(role for role, answer in answers.items() if answer[0] == 200)
    loser = next(role for role, answer in answers.items() if answer[0] == 422)
    assert "dana is already a member" in answers[loser][1]
    assert Membership.objects.get(project=project, user=dana).role == winner
