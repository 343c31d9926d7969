"""The loop's demo project: the tiny model's own play becomes trajectories, its failures a task set, and other
requests a holdout and a regression suite, from which a job can start at once; seeding twice adds nothing."""

from __future__ import annotations

from flywheel.evals import promotion
from flywheel.registry import services as registry
from flywheel.training import services
from flywheel.training.demo import (
    DEMO_RECIPE,
    expected_calls_of,
    loop_demo_seed,
    loop_demo_suites,
    loop_project,
)
from flywheel.trajectories.models import Trajectory


def test_the_loop_demo_is_made_from_the_models_own_play(user, tiny_model):
    project = loop_project(owner=user)
    registry.base_model_register(project=project, name="tiny (demo)", path=str(tiny_model), user=user)
    seeded = loop_demo_seed(project=project, model_dir=tiny_model, user=user, n_train=12, n_holdout=6,
                            n_regression=3)
    assert seeded["seeded"] and seeded["trajectories"] == 12
    trajectories = Trajectory.objects.filter(project=project)
    assert trajectories.count() == 12
    assert trajectories.filter(outcome="failure").count() == seeded["failed"]
    # The model's own answer is in each trajectory, after the request.
    assert all(t.messages[-1]["role"] == "assistant" for t in trajectories)
    suites = loop_demo_suites(project)
    task_version = suites["task_set"].versions.get()
    failed_ids = set(trajectories.filter(outcome="failure").values_list("id", flat=True))
    promoted = {row["origin"]["trajectory_id"] for row in task_version.rows}
    # Every failure became a task but those left for a person to promote into a regression case.
    assert seeded["left_for_review"] >= 1
    left = failed_ids - promoted
    assert len(left) == seeded["left_for_review"]
    assert suites["holdout"].versions.get().size == 6
    regression = suites["regression"].versions.get()
    assert regression.size == seeded["regression"] <= 3
    # The regression cases are requests production got right, none of them trained on.
    passed_ids = set(trajectories.filter(outcome="success").values_list("id", flat=True))
    assert {row["origin"]["trajectory_id"] for row in regression.rows} <= passed_ids - promoted
    # The project trains with its own recipe, the one measured to move this demo; its holdout curve has a point
    # at the start and every few steps, not a single dot at the end.
    assert services.project_defaults(project) == DEMO_RECIPE
    assert DEMO_RECIPE["eval_on_start"] and DEMO_RECIPE["max_steps"] // DEMO_RECIPE["eval_interval"] >= 4
    job = services.job_create(project=project, task_set_version=task_version,
                              holdout_version=suites["holdout"].versions.get(),
                              regression_version=suites["regression"].versions.get(), user=user)
    assert job.status == "evaluating"
    assert loop_demo_seed(project=project, model_dir=tiny_model, user=user) == {"seeded": False}
    assert Trajectory.objects.filter(project=project).count() == 12

    # A failure left out is promoted into the regression suite with the form's defaults: the leakage guard
    # finds it on no task.
    trajectory = trajectories.get(pk=min(left))
    data = {**promotion.promotion_prefill(trajectory=trajectory),  # corrected to the request's expected call
            "expected_calls": expected_calls_of(trajectory, n_train=12)}
    case, check = promotion.trajectory_promote(trajectory=trajectory, data=data, target=suites["regression"], user=user)
    assert check.conflicts == [] and check.doubts == [] and case.trajectory_id == trajectory.pk
    assert suites["regression"].versions.count() == 2


def test_a_seeding_stopped_while_the_model_played_is_finished_by_the_next_make_run(user, tiny_model, tmp_path):
    import subprocess

    import pytest

    from flywheel.demo_status import demo_status_of
    from flywheel.registry.demo import DEMO_MODEL_NAME
    from flywheel.registry.models import BaseModel
    from flywheel.seed.demo import demo_model_build, registry_demo_seed

    project = loop_project(owner=user)
    # What a `make run` stopped while the worker played leaves: the model registered, no task set.
    registry.base_model_register(project=project, name=DEMO_MODEL_NAME, path=str(tiny_model), user=user)
    assert registry_demo_seed(project=project)  # queued again, and the pages say it waits for the worker
    assert demo_status_of(project=project).startswith("Waiting for the gpu worker")
    # A play that fails (here the model's folder has gone) says so on the pages, and the task fails.
    BaseModel.objects.filter(project=project).update(path=str(tmp_path / "gone"))
    with pytest.raises(subprocess.CalledProcessError):
        demo_model_build(project_id=project.pk, n_train=12, n_holdout=6, n_regression=3)
    assert demo_status_of(project=project).startswith("Seeding the demo stopped (CalledProcessError")
    assert not Trajectory.objects.filter(project=project).exists()

    BaseModel.objects.filter(project=project).update(path=str(tiny_model))
    assert demo_model_build(project_id=project.pk, n_train=12, n_holdout=6, n_regression=3) == "played"
    assert demo_status_of(project=project) is None
    assert Trajectory.objects.filter(project=project).count() == 12
    assert services.project_defaults(project) == DEMO_RECIPE
    assert set(loop_demo_suites(project)) >= {"task_set", "holdout", "regression"}
    # Done: the next `make run` queues nothing, and a task queued before runs as a no-op.
    assert not registry_demo_seed(project=project)
    assert demo_model_build(project_id=project.pk) == "registered already"
    assert BaseModel.objects.filter(project=project).count() == 1


def test_the_pages_say_what_the_worker_is_doing_while_it_seeds(user, client_for):
    from django.urls import reverse

    from flywheel.demo_status import demo_status_of, demo_status_set

    project = loop_project(owner=user)
    demo_status_set(project=project, text="Playing 300 workplace requests with the demo model: 100 done.")
    for name in ("trajectory_list", "registry_page", "flywheel_dashboard", "taskset_list", "suite_list", "training_jobs"):
        page = client_for(user).get(reverse(name, args=[project.slug])).content.decode()
        assert "Playing 300 workplace requests with the demo model: 100 done." in page, name
        assert "No trajectories match" not in page and "No model yet" not in page
        assert "No trajectories yet" not in page, name
    demo_status_set(project=project, text=None)
    assert demo_status_of(project=project) is None
    assert "No trajectories match" in client_for(user).get(reverse("trajectory_list", args=[project.slug])).content.decode()
    assert "No trajectories yet" in client_for(user).get(reverse("flywheel_dashboard", args=[project.slug])).content.decode()


def test_the_demo_puts_no_reworded_request_on_both_sides(db):
    """Seen on the seeded demo: the one click was refused at the job's start because a task ('Delete task T3
    "Design api docs".') and a regression case ('Remove "Design api docs" (T3).') are one request reworded.
    The seed keeps such rows off the eval side (and keeps a failure left for review apart from the tasks)."""
    from flywheel.training.demo import _clear_of

    def row(row_id: str, text: str) -> dict:
        return {"id": row_id, "messages": [{"role": "user", "content": text}]}

    tasks = [row("req-1", 'Delete task T3 "Design api docs".'), row("req-2", "Mark invoice INV-7 as paid.")]
    cases = [row("req-3", 'Remove "Design api docs" (T3).'), row("req-4", "Move the standup to 10am on May 3."),
             row("req-5", "mark invoice inv-7 as paid")]
    assert [r["id"] for r in _clear_of(cases, tasks)] == ["req-4"]
