"""The loop's demo project (`make run`): a workplace assistant played by the tiny model itself, so that its
failures are real failures of a real policy. After the demo model is built and registered as production, the
worker runs it on workplace requests, ingests what it did as trajectories (a verifier says success or failure),
promotes the failures into a task set (all but a few, left for a person to promote into a regression case), and
makes a holdout suite of other requests: a new user can train with one click, read the gate's report, promote
and roll back, all on a CPU. Idempotent: found by name."""

from __future__ import annotations

import json
import subprocess
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.db import transaction
from django.utils import timezone

from flywheel.accounts.models import Project, Role
from flywheel.accounts.services import membership_set, project_create
from flywheel.registry import serving

LOOP_SLUG = "workplace"
# The demo project's own training recipe, measured on its data (300 requests played, 176 failures, a
# 99-case holdout sampled 8 times at temperature 1, one thread, AMD EPYC): 40 GRPO steps at 1e-3 moved holdout
# success 0.327 -> 0.428; 80 steps 0.441; 60 steps at 2e-3 0.428; 32 prompts a step for 40 steps 0.433; SFT on
# the failures' references 0.377 (60 steps at 1e-3) and 0.414 (50 steps at 3e-3, invalid outputs up from
# 1.4% to 2.3%); SFT then GRPO 0.408. At temperature 0.5 the same GRPO adapter gains little (0.470 -> 0.492):
# what GRPO buys the tiny model is mostly a sharper distribution, not new answers. Four of the nine kinds of
# request (create a task or an event, send an email, reassign) it never gets right in one call (0 of 30-38
# played): it cannot copy a name or a title from the request, so no reward ever reaches them and the holdout's
# ceiling for any recipe is near the five kinds that name ids, dates and statuses.
# The holdout is evaluated at the start and every 10 steps, so that the job's curve shows the rise (one point at
# step 40 before). Measured on the seeded demo (seed 0, two busy shared cores): each evaluation about 10 s, the
# job 7.8 -> 8.2 min; the gate judged the best of the 4 checkpoints (step 30) on fresh samples, 0.3275 -> 0.4163,
# p = 0.0001 against its alpha split over the 4 looks (0.0125); at 40 steps alone 0.4288.
# Seeds 0-2 (bench/efficacy.py): +0.089, +0.095, +0.095, and after one more task (`--promote 1`) +0.089, +0.101,
# +0.101; invalid outputs rise from 1.25% to 1.5-3.0% either way (the gate tolerates a point). A format reward
# (format_reward 0.1) cut the mean rise on the second task set from 2.4% to 1.6% and the gain to +0.086: about one
# standard error of either, so the recipe keeps none.
DEMO_RECIPE = {
    "learning_rate": 1e-3, "max_steps": 40, "num_prompts_per_step": 16, "num_generations_per_prompt": 8,
    "max_new_tokens": 48, "temperature": 1.0, "loss_type": "grpo", "beta": 0.0, "scale_rewards": "group",
    "r": 16, "alpha": 32, "train_batch_size": 64, "eval_interval": 10, "eval_on_start": True,
    "eval_samples_per_prompt": 8, "eval_temperature": 1.0, "num_threads": 1,
}
# The demo's live rules, met by its own traffic (flywheel.seed.traffic, 40 requests a minute) in minutes rather
# than the days of real traffic the defaults are for: a canary on 20% judged once each arm has 30 trajectories and
# promotable when its failure rate is shown at most 25 points above production's (the always-valid bound on the
# increase falls below 0.25 near 50 canary trajectories at the tiny model's 60% failures; below the default five
# points it would take about 1,600), and a watch passed once production served 200, with a 10% holdback.
DEMO_LIVE_RULES = {"canary_weight": 0.2, "canary_min_per_arm": 30, "canary_tolerance": 0.25,
                   "watch_trajectories": 200, "watch_holdback": 0.1}
TASK_SET_NAME = "Workplace requests the model got wrong"
HOLDOUT_NAME = "Workplace holdout"
REGRESSION_NAME = "Workplace regressions"


def loop_project(*, owner) -> Project:
    project = Project.objects.filter(slug=LOOP_SLUG).first()
    if project is None:
        project = project_create(
            slug=LOOP_SLUG, name="Workplace assistant (tiny model)", owner=owner,
            description="The whole loop on a CPU: the tiny model's own failures on workplace requests, a task "
                        "set and a holdout made from them, and the tiny model in production (demo data).",
        )
    else:
        membership_set(project=project, user=owner, role=Role.MAINTAINER)
    return project


def demo_row(task: dict[str, Any], row_id: str) -> dict[str, Any]:
    """A single-turn tool-call row from a workplace task: the request and the first call of its solution."""
    call = next(m for m in task["solution"] if m.get("tool_calls"))["tool_calls"][0]["function"]
    return {"id": row_id, "messages": task["messages"], "tools": task["tools"],
            "verifier": {"type": "tool_call", "expected_calls": [
                {"name": call["name"], "arguments": json.loads(call["arguments"])}]}}


def _train_rows(n_train: int) -> list[dict[str, Any]]:
    """The requests the demo plays, as task rows `req-<i>` (their trajectories are `workplace-req-<i>`)."""
    from trainer.envs.workplace import generate_tasks

    return [demo_row(t, f"req-{i}") for i, t in enumerate(generate_tasks(n_train, seed=21, split="train", difficulty="single"))]


def expected_calls_of(trajectory, n_train: int = 300) -> list[dict[str, Any]]:
    """The calls the request of one of the demo's trajectories asks for (its task row's expected calls): what a
    reviewer types into the promotion form to correct the agent's call. `n_train` as the demo was seeded."""
    index = int(trajectory.external_id.removeprefix("workplace-req-"))
    return _train_rows(n_train)[index]["verifier"]["expected_calls"]


def play(model_dir: Path, rows: list[dict[str, Any]], progress=None, chunk: int = 100, *, adapter_path: str = "",
         seed: int = 7) -> list[dict[str, Any]]:
    """The model's (with `adapter_path`, that adapter's) answer to each row, scored: `python -m trainer evaluate`,
    one sample a row at temperature 1, `chunk` rows a run so that `progress(text)` can say how far it is."""
    from flywheel.evals.runs import evaluate_command
    from flywheel.supervise import exit_with_parent, trainer_env
    from trainer import jobdir
    from trainer.config import write_jsonl

    cases: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="flywheel-demo-") as tmp:
        for start in range(0, len(rows), chunk):
            if progress:
                progress(f"Playing {len(rows)} workplace requests with the demo model: {start} done.")
            suite, out = Path(tmp) / "rows.jsonl", Path(tmp) / "cases.jsonl"
            write_jsonl(suite, rows[start:start + chunk])
            subprocess.run(evaluate_command(model_path=str(model_dir), adapter_path=adapter_path, suite=suite,
                                            out=out, samples=1, temperature=1.0, seed=seed + start),
                           check=True, capture_output=True, timeout=1800, env=trainer_env(),
                           preexec_fn=exit_with_parent)  # noqa: PLW1509 (needed: no player outlives a killed worker)
            cases += jobdir.read_cases(out)
    return cases


def _unique_requests(tasks: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The first `n` tasks whose requests differ (normalised): a holdout of distinct requests."""
    from flywheel.evals import rows as row_shape

    seen: set[str] = set()
    out = []
    for task in tasks:
        digest = row_shape.prompt_digest(task["messages"])
        if digest not in seen:
            seen.add(digest)
            out.append(task)
        if len(out) == n:
            break
    return out


# Every tenth failure stays out of the task set, so that the demo has failures a person can still promote into
# a regression case (the leakage guard refuses a failure that is already a task, or whose request is one).
LEFT_FOR_REVIEW_EVERY = 10


def _clear_of(rows: list[dict[str, Any]], others: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows` less those the leakage guard would hold for the same request as one of `others`: the same
    normalised request, or a reworded one, certain or unsure (`leakage.conflicts_between`, the rules a job's
    start and a promotion apply). Workplace requests of one kind reworded ('Delete task T3 "Design api docs".'
    and 'Remove "Design api docs" (T3).') are one request to the guard: the demo must not put them on both
    sides, or the one click is refused before it starts."""
    from flywheel.evals import leakage
    from flywheel.evals import rows as row_shape

    def candidate(row: dict[str, Any]) -> Any:
        return leakage.Candidate(str(row["id"]), None, row_shape.prompt_digest(row["messages"]),
                                 row_shape.last_user_request(row["messages"]))

    held = {c.candidate for c in leakage.conflicts_between([candidate(r) for r in rows], [candidate(o) for o in others])}
    return [row for row in rows if str(row["id"]) not in held]


def _left_for_review(failed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The failures kept out of the task set: every LEFT_FOR_REVIEW_EVERY-th (none of fewer than two), less
    any the guard would refuse as a regression case beside the failures that do become tasks."""
    if len(failed) < 2:
        return []
    picked = failed[1::LEFT_FOR_REVIEW_EVERY]
    return _clear_of(picked, [r for r in failed if r not in picked])


def loop_demo_seeded(project: Project) -> bool:
    """Whether `loop_demo_seed` has finished on the project: its task set, suites and recipe are made together."""
    from flywheel.environments.models import TaskSet

    return TaskSet.objects.filter(project=project, name=TASK_SET_NAME).exists()


def loop_demo_seed(*, project: Project, model_dir: Path, user=None, n_train: int = 300, n_holdout: int = 100,
                   n_regression: int = 20, progress=None) -> dict:
    """Trajectories from the model's own play, failures promoted into a task set (but those `_left_for_review`
    keeps out), a holdout of other requests
    (distinct, from the held-out split) and a regression suite of requests production got right, each with a
    first version, and the project's training recipe. Nothing is done twice."""
    from flywheel.environments.services import task_set_create
    from flywheel.evals import rows as row_shape
    from flywheel.evals.services import suite_create, version_create
    from flywheel.registry.canary import live_rules_set
    from flywheel.training.services import defaults_save
    from flywheel.trajectories.ingest import ingest_trajectories
    from flywheel.trajectories.models import Trajectory
    from trainer.envs.workplace import generate_tasks

    if loop_demo_seeded(project):
        return {"seeded": False}
    train_rows = _train_rows(n_train)
    cases = {str(c["id"]): c for c in play(model_dir, train_rows, progress)}
    if progress:
        progress(f"Recording {len(train_rows)} trajectories and promoting the failures.")
    records = []
    # Production's traffic of the last day: served under v1's adapter name, which maps to v1 by itself, so the
    # Models page draws its live metrics at once.
    served_by = serving.adapter_name(project.slug, 1)
    now = timezone.now()
    for i, row in enumerate(train_rows):
        case = cases[row["id"]]
        answer = ((case.get("samples") or [{}])[0].get("messages") or [])
        records.append({
            "external_id": f"workplace-{row['id']}", "agent": "workplace-assistant", "model_version": served_by,
            "started_at": (now - timedelta(hours=24) * (len(train_rows) - i) / len(train_rows)).isoformat(),
            "messages": row["messages"] + answer, "tools": row["tools"],
            "outcome": "success" if case["passed"] else "failure",
            "metadata": {"demo": True, "failure": (case.get("samples") or [{}])[0].get("failure")},
        })
    ingest_trajectories(project=project, records=records, source="demo")
    by_external = {t.external_id: t for t in Trajectory.objects.filter(project=project, external_id__startswith="workplace-")}

    def item_fields(row: dict[str, Any], trajectory=None) -> dict[str, Any]:
        return {"messages": row["messages"], "tools": row["tools"], "verifier": row["verifier"],
                "trajectory": trajectory, "prompt_digest": row_shape.prompt_digest(row["messages"]),
                "prompt_text": row_shape.last_user_request(row["messages"])[:2000], "created_by": user}

    with transaction.atomic():
        task_set = task_set_create(project=project, name=TASK_SET_NAME, user=user,
                                   description="The tiny model's failed workplace requests, with the expected call.")
        failed = [row for row in train_rows if not cases[row["id"]]["passed"]]
        passed = [row for row in train_rows if cases[row["id"]]["passed"]]
        left_out = _left_for_review(failed)
        # Fewer than a dozen failures would give GRPO little to learn from: top up with requests it passed.
        topped = passed[: max(0, 24 - (len(failed) - len(left_out)))]
        chosen = [row for row in failed if row not in left_out] + topped
        for row in chosen:
            task_set.items.create(**item_fields(row, by_external.get(f"workplace-{row['id']}")))
        version_create(collection=task_set, user=user, note="the demo's failures")
        holdout = suite_create(project=project, name=HOLDOUT_NAME, kind="holdout", user=user,
                               description="Workplace requests the model never trains on.")
        pool = _unique_requests(generate_tasks(n_holdout * 2, seed=22, split="holdout", difficulty="single"), n_holdout * 2)
        held = _clear_of([demo_row(task, f"hold-{i}") for i, task in enumerate(pool)], chosen)[:n_holdout]
        for row in held:
            holdout.items.create(**item_fields(row))
        version_create(collection=holdout, user=user, note="the demo's holdout")
        regression = suite_create(project=project, name=REGRESSION_NAME, kind="regression", user=user,
                                  description="Requests production gets right and must keep getting right.")
        # Requests production got right when played, none of them in the task set. At temperature 1 the tiny
        # model passes almost none reliably (2 of 124 at 12 of 12 samples), so the suite is not filtered by
        # "Build from production's passes"; the gate's regression rule (the whole suite's failed samples and each
        # case's, exact conditional tests) tells a loss from noise at any pass rate.
        trained = {row_shape.prompt_digest(r["messages"]) for r in chosen}
        kept = _clear_of([r for r in passed if r not in topped and row_shape.prompt_digest(r["messages"]) not in trained],
                         chosen)
        for row in kept[:n_regression]:
            regression.items.create(**item_fields(row, by_external.get(f"workplace-{row['id']}")))
        version_create(collection=regression, user=user, note="requests production got right when played")
        defaults_save(project=project, config=DEMO_RECIPE, user=user)
        live_rules_set(project=project, data=DEMO_LIVE_RULES)
    # The leakage guard's vectors of every request on both sides, made here on the worker: else the first
    # promotion check runs the sentence model over them all in a person's request (8 s for 180 requests).
    from flywheel.evals.leakage import request_vectors_fill

    if progress:
        progress("Reading the task set's and the suites' requests for the leakage guard.")
    request_vectors_fill(projects=[project])
    return {"seeded": True, "trajectories": len(records), "failed": len(failed), "tasks": len(chosen),
            "left_for_review": len(left_out), "holdout": len(held), "regression": min(n_regression, len(kept))}


def loop_demo_suites(project: Project) -> dict[str, Any]:
    from flywheel.environments.models import TaskSet
    from flywheel.evals.models import EvalSuite

    return {"task_set": TaskSet.objects.filter(project=project, name=TASK_SET_NAME).first(),
            "holdout": EvalSuite.objects.filter(project=project, name=HOLDOUT_NAME).first(),
            "regression": EvalSuite.objects.filter(project=project, name=REGRESSION_NAME).first()}
