"""Failure modes, their assignments and the review history, through the services every door calls."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from flywheel.accounts.services import project_create
from flywheel.failures import review, services
from flywheel.failures.history import review_history
from flywheel.failures.models import FailureModeAssignment, ReviewChange, TaxonomyCategory
from flywheel.trajectories.models import FailureCategory, Trajectory
from flywheel.trajectories.selectors import TrajectoryFilters, trajectory_queryset


def test_a_new_project_gets_the_fields_categories(db):
    project = project_create(slug="fresh")
    keys = list(TaxonomyCategory.objects.filter(project=project).values_list("key", flat=True))
    assert keys == FailureCategory.values
    assert services.taxonomy_seed(project=project) == 0  # seeding again adds nothing


def test_a_mode_needs_a_known_category_and_a_name_of_its_own(project, user):
    mode = services.failure_mode_create(project=project, name="Refund loop", category_key="bad_planning", user=user)
    assert mode.category.key == "bad_planning" and mode.status == "open"
    with pytest.raises(ValidationError) as exc:
        services.failure_mode_create(project=project, name="Refund loop", category_key="other", user=user)
    assert "name" in exc.value.message_dict
    with pytest.raises(ValidationError) as exc:
        services.failure_mode_create(project=project, name="X", category_key="nope", user=user)
    assert "category" in exc.value.message_dict and "wrong_tool" in str(exc.value)
    with pytest.raises(ValidationError) as exc:
        services.failure_mode_create(project=project, name="a\x00b", category_key="other", user=user)
    assert "name" in exc.value.message_dict


def test_a_category_in_use_cannot_be_deleted(project, user):
    services.failure_mode_create(project=project, name="Bad JSON", category_key="format", user=user)
    used = TaxonomyCategory.objects.get(project=project, key="format")
    with pytest.raises(ValidationError, match="Bad JSON"):
        services.taxonomy_category_delete(category=used)
    unused = services.taxonomy_category_create(project=project, name="Slow tool")
    assert unused.key == "slow_tool"
    services.taxonomy_category_delete(category=unused)
    assert not TaxonomyCategory.objects.filter(pk=unused.pk).exists()
    with pytest.raises(ValidationError) as exc:
        services.taxonomy_category_create(project=project, name="Format")
    assert "key" in exc.value.message_dict


def test_assigning_never_adds_a_trajectory_twice_and_counts_only_the_new(project, user, make_trajectories, make_project):
    trajectories = make_trajectories(project, 6)
    mode = services.failure_mode_create(project=project, name="Refund fails", category_key="wrong_arguments", user=user)
    ids = [t.pk for t in trajectories]
    assert services.failure_mode_assign(failure_mode=mode, trajectories=ids[:2], user=user) == 2
    assert services.failure_mode_assign(failure_mode=mode, trajectories=trajectories[1:4], user=user) == 2
    # The list's own filter as a queryset: a subquery, the ones carrying it already left alone.
    everything = trajectory_queryset(project=project, filters=TrajectoryFilters())
    assert services.failure_mode_assign(failure_mode=mode, trajectories=everything, user=user) == 2
    assert services.failure_mode_assign(failure_mode=mode, trajectories=everything, user=user) == 0
    assert FailureModeAssignment.objects.filter(failure_mode=mode).count() == 6
    # Another project's trajectory is never assigned, even by id.
    other = make_trajectories(make_project("other"), 1, prefix="o")[0]
    assert services.failure_mode_assign(failure_mode=mode, trajectories=[other.pk], user=user) == 0
    assert services.failure_mode_unassign(failure_mode=mode, trajectories=ids[:3], user=user) == 3
    assert services.failure_mode_unassign(failure_mode=mode, trajectories=ids[:3], user=user) == 0
    assert FailureModeAssignment.objects.filter(failure_mode=mode).count() == 3


def test_assigning_by_filter_respects_the_filter(project, user, make_trajectories):
    make_trajectories(project, 3, prefix="eu", agent="eu-bot")
    make_trajectories(project, 2, prefix="us", agent="us-bot")
    mode = services.failure_mode_create(project=project, name="EU refunds", category_key="other", user=user)
    matching = trajectory_queryset(project=project, filters=TrajectoryFilters.from_params({"agent": "eu-bot"}))
    assert services.failure_mode_assign(failure_mode=mode, trajectories=matching, user=user) == 3
    carried = set(Trajectory.objects.filter(failure_assignments__failure_mode=mode).values_list("agent", flat=True))
    assert carried == {"eu-bot"}
    # The list filters by mode with the same filter type.
    by_mode = trajectory_queryset(project=project, filters=TrajectoryFilters.from_params({"mode": str(mode.pk)}))
    assert by_mode.count() == 3


def test_a_selection_of_nothing_assigns_and_unassigns_nothing(project, user, make_trajectories):
    """No ids, or a queryset Django knows is empty, has no `IN (...)` to write (EmptyResultSet): nothing
    changes and the count is 0, as for a filter that matches nothing."""
    trajectory = make_trajectories(project, 1)[0]
    mode = services.failure_mode_create(project=project, name="M", category_key="other", user=user)
    assert services.failure_mode_assign(failure_mode=mode, trajectories=[trajectory], user=user) == 1
    for nothing in ([], set(), Trajectory.objects.none(), Trajectory.objects.filter(pk__in=[])):
        assert services.failure_mode_assign(failure_mode=mode, trajectories=nothing, user=user, message_index=0) == 0
        assert services.failure_mode_unassign(failure_mode=mode, trajectories=nothing, user=user) == 0
    assert FailureModeAssignment.objects.filter(failure_mode=mode).count() == 1
    assert ReviewChange.objects.filter(trajectory=trajectory).count() == 1


def test_a_message_index_past_the_end_is_a_field_error(project, user, make_trajectories):
    trajectory = make_trajectories(project, 1)[0]
    mode = services.failure_mode_create(project=project, name="M", category_key="other", user=user)
    with pytest.raises(ValidationError) as exc:
        services.failure_mode_assign(failure_mode=mode, trajectories=[trajectory], user=user, message_index=4)
    assert "message_index" in exc.value.message_dict and "has 4" in str(exc.value)
    assert services.failure_mode_assign(failure_mode=mode, trajectories=[trajectory], user=user, message_index=3) == 1


def test_every_review_change_is_in_the_history_with_before_and_after(project, user, make_user, make_trajectories):
    trajectory = make_trajectories(project, 1)[0]
    other = make_user("bea")
    a = services.failure_mode_create(project=project, name="A", category_key="other", user=user)
    b = services.failure_mode_create(project=project, name="B", category_key="other", user=user)
    review.trajectory_outcome_set(trajectory=trajectory, outcome="failure", user=user)
    review.trajectory_outcome_set(trajectory=trajectory, outcome="failure", user=user)  # no change: not recorded
    services.failure_mode_assign(failure_mode=b, trajectories=[trajectory], user=user)
    services.failure_mode_assign(failure_mode=a, trajectories=[trajectory], user=other)
    tag = review.trajectory_tag_add(trajectory=trajectory, name="refunds", user=other)
    review.trajectory_tag_remove(trajectory=trajectory, tag=tag, user=user)
    services.failure_mode_unassign(failure_mode=b, trajectories=[trajectory], user=other)
    history = [(c.field, c.before, c.after, c.user.username) for c in reversed(review_history(trajectory=trajectory))]
    assert history == [
        ("outcome", "", "failure", user.username),
        ("modes", [], ["B"], user.username),
        ("modes", ["B"], ["A", "B"], "bea"),
        ("tags", [], ["refunds"], "bea"),
        ("tags", ["refunds"], [], user.username),
        ("modes", ["A", "B"], ["A"], "bea"),
    ]


def test_reverting_a_change_puts_back_what_it_replaced(project, user, make_trajectories):
    trajectory = make_trajectories(project, 1)[0]
    a = services.failure_mode_create(project=project, name="A", category_key="other", user=user)
    b = services.failure_mode_create(project=project, name="B", category_key="other", user=user)
    services.failure_mode_assign(failure_mode=a, trajectories=[trajectory], user=user)
    services.failure_mode_assign(failure_mode=b, trajectories=[trajectory], user=user)
    adding_a = ReviewChange.objects.filter(trajectory=trajectory).order_by("id").first()
    services.review_change_revert(change=adding_a, user=user)  # B, assigned later, stays
    assert list(trajectory.failure_assignments.values_list("failure_mode__name", flat=True)) == ["B"]
    review.trajectory_outcome_set(trajectory=trajectory, outcome="success", user=user)
    first = ReviewChange.objects.filter(trajectory=trajectory, field="outcome").latest("id")
    review.trajectory_outcome_set(trajectory=trajectory, outcome="failure", user=user)
    with pytest.raises(ValidationError, match="changed again"):
        services.review_change_revert(change=first, user=user)


def test_the_demo_project_has_modes_with_trajectories_and_seeding_twice_adds_nothing(db, settings, tmp_path):
    from flywheel.failures.demo import DEMO_MODES, failure_demo_seed
    from flywheel.seed.demo import demo_seed

    settings.VAR_DIR = tmp_path
    seed = demo_seed()
    modes = FailureModeAssignment.objects.filter(failure_mode__project=seed.project)
    assert modes.values("failure_mode").distinct().count() == len(DEMO_MODES)
    assert modes.count() == sum(len(ids) for *_, ids in DEMO_MODES)
    assert failure_demo_seed(project=seed.project, user=None) == 0
