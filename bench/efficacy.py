"""Does the loop deliver a better model? The workplace demo end to end on the CPU with every default, for
several seeds of the training job: the demo model (built once, or --model), its play seeded into the demo
project (trajectories, the task set of its failures, the holdout, the regression suite, the project's recipe),
then one job as the one-click button starts it (the project's recipe, the gate's default rules), run by the
same worker functions a Celery worker runs (tasks executed in this process), judged by the gate.

Per seed: production's holdout success before, the candidate's after (both measured by the gate's command,
8 samples a case), the gate's verdict with the rule that refused it, and minutes. Baseline: production,
measured the same way; the gain is the candidate's success minus production's on the same cases.

    .venv/bin/python bench/efficacy.py [--seeds 0 1 2] [--model DIR] [--workdir DIR]
        [--algorithm sft_grpo] [--config max_steps=50 sft_steps=10 ...]
        [--size 21m --device cuda [--warm-steps 2000]]

`--size` (one of `trainer.tiny.SIZES`) warm-starts the demo's recipe as a Qwen2 of that size on `--device` (a
GPU: the demo's ceiling with a model that can afford to learn to copy names from requests) instead of using
the shipped tiny model; the jobs' trainers then run where torch finds a GPU, bf16 there.

`--algorithm` and `--config` (GRPOConfig fields, JSON values, over the project's recipe) try another recipe on
the same seeded project; run the default beside it for the named baseline (the button's recipe).

SQLite and a scratch folder; nothing outside it is touched. The last line is JSON:
{"seeds", "holdout_before", "holdout_after", "gain", "gate_passed", "minutes", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--model", help="a demo model folder (else the shipped one, copied to --workdir/tiny-demo)")
    parser.add_argument("--rebuild", action="store_true",
                        help="build the demo model on this machine instead of copying the shipped one")
    parser.add_argument("--size", help="warm-start a Qwen2 of this size (trainer.tiny.SIZES) as the demo model")
    parser.add_argument("--device", default="cpu", help="where --size's warm start runs (cuda on a GPU)")
    parser.add_argument("--warm-steps", type=int, default=2000, help="--size's warm-start steps")
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a new temporary one)")
    parser.add_argument("--algorithm", default="grpo", help="grpo (the button's), sft, dpo or sft_grpo")
    parser.add_argument("--config", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="GRPOConfig fields over the project's recipe (values read as JSON)")
    parser.add_argument("--promote", type=int, default=0, metavar="N",
                        help="first promote N of the failures the demo leaves out into the task set, as a "
                             "reviewer following the README would (the job then trains on its new version)")
    args = parser.parse_args()
    overrides = {}
    for item in args.config:
        name, _, value = item.partition("=")
        try:
            overrides[name] = json.loads(value)
        except json.JSONDecodeError:
            overrides[name] = value

    work = Path(args.workdir or tempfile.mkdtemp(prefix="flywheel-efficacy-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ["FLYWHEEL_VAR_DIR"] = str(work / "var")
    os.environ["DATABASE_URL"] = f"sqlite:///{work / 'efficacy.sqlite3'}"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "flywheel.settings")
    sys.path.insert(0, str(ROOT / "platform"))
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    from flywheel.celery import app

    app.conf.task_always_eager = True  # the worker's functions, run here, in order
    call_command("migrate", verbosity=0)
    from flywheel.registry import services as registry
    from flywheel.registry.demo import DEMO_MODEL_NAME, build_demo_model
    from flywheel.registry.models import BaseModel, GateDecision
    from flywheel.training import services as training
    from flywheel.training.demo import loop_demo_seed, loop_demo_suites, loop_project
    from flywheel.training.models import TrainingJob

    t0 = time.perf_counter()
    if args.model:
        model_dir = Path(args.model)
    elif args.size:
        from trainer.tiny import SIZES, build_tiny

        model_dir = work / f"demo-{args.size}"
        if not (model_dir / "tiny.json").exists():
            build_tiny(model_dir, arch="qwen2", device=args.device, steps=args.warm_steps, **SIZES[args.size])
    else:
        model_dir = build_demo_model(work / "tiny-demo", rebuild=args.rebuild)
    built_s = time.perf_counter() - t0
    user = get_user_model().objects.filter(username="bench").first() or \
        get_user_model().objects.create_user("bench", password="bench-password-1")
    project = loop_project(owner=user)
    if not BaseModel.objects.filter(project=project, name=DEMO_MODEL_NAME).exists():
        registry.base_model_register(project=project, name=DEMO_MODEL_NAME, path=str(model_dir), user=user)
    t1 = time.perf_counter()
    seeded = loop_demo_seed(project=project, model_dir=model_dir, user=user)
    seed_s = time.perf_counter() - t1
    suites = loop_demo_suites(project)
    print(f"model {model_dir} ({built_s:.0f} s); seeded {seeded} in {seed_s:.0f} s", flush=True)
    if args.promote:
        promoted = promote_left_out(project, suites["task_set"], args.promote, user)
        print(f"promoted {promoted} into the task set: version {suites['task_set'].versions.count()}, "
              f"{suites['task_set'].versions.order_by('-number').first().size} tasks", flush=True)

    results = []
    for seed in args.seeds:
        t = time.perf_counter()
        job = training.job_create(
            project=project, task_set_version=suites["task_set"].versions.order_by("-number").first(),
            holdout_version=suites["holdout"].versions.order_by("-number").first(),
            regression_version=suites["regression"].versions.order_by("-number").first(),
            algorithm=args.algorithm, config={**overrides, "seed": seed}, user=user, confirm=True)
        job = TrainingJob.objects.get(pk=job.pk)
        decision = GateDecision.objects.filter(job=job).first()
        minutes = (time.perf_counter() - t) / 60
        if decision is None:
            print(f"seed {seed}: job {job.status}: {job.error[:500]}", flush=True)
            results.append({"seed": seed, "status": job.status, "minutes": round(minutes, 2)})
            continue
        rules = {r["name"]: r for r in decision.report.get("rules", [])}
        success = rules.get("holdout success", {})
        invalid = next((r for name, r in rules.items() if name.startswith("invalid")), {})
        refused = [name for name, r in rules.items() if not r["passed"]]
        row = {"seed": seed, "holdout_before": success.get("production"), "holdout_after": success.get("candidate"),
               "gain": round((success.get("candidate") or 0) - (success.get("production") or 0), 4),
               "invalid_before": invalid.get("production"), "invalid_after": invalid.get("candidate"),
               "gate_passed": decision.passed, "refused_by": refused, "minutes": round(minutes, 2),
               "detail": success.get("detail", "")}
        results.append(row)
        print(f"seed {seed}: holdout {row['holdout_before']} -> {row['holdout_after']} ({row['gain']:+.4f}); "
              f"invalid outputs {row['invalid_before']} -> {row['invalid_after']}; "
              f"gate {'passed' if decision.passed else 'refused by ' + ', '.join(refused)}; {minutes:.1f} min; "
              f"{row['detail']}", flush=True)
        if decision.passed:
            # Promotion and rollback work on the result, as a person would click them.
            registry.model_promote(project=project, version=decision.candidate, user=user, reason="bench")
            registry.model_rollback(project=project, user=user, reason="bench: back to the demo model")

    judged = [r for r in results if "gain" in r]

    def mean(key: str) -> float | None:
        return round(statistics.mean(r[key] for r in judged), 4) if judged else None

    print(json.dumps({"algorithm": args.algorithm, "config": overrides, "size": args.size or ("--model" if args.model else "shipped"), "promoted": args.promote,
                      "task_set_version": suites["task_set"].versions.count(), "seeds": len(args.seeds), "holdout_before": mean("holdout_before"),
                      "holdout_after": mean("holdout_after"), "gain": mean("gain"),
                      "gain_min": min((r["gain"] for r in judged), default=None),
                      "invalid_before": mean("invalid_before"), "invalid_after": mean("invalid_after"),
                      "gate_passed": sum(bool(r.get("gate_passed")) for r in results),
                      "minutes": mean("minutes"), "seed_minutes": round(seed_s / 60, 2),
                      "build_minutes": round(built_s / 60, 2), "per_seed": results}))
    return 0


def promote_left_out(project, task_set, n: int, user) -> int:
    """Promote `n` of the failures the demo kept out of its task set into it, each with the form's prefill
    corrected to its request's expected call (README: "left for you to promote"). The promotion service
    checks each as the page does (the verifier, the leakage guard) and makes a new version per row."""
    from flywheel.evals import promotion
    from flywheel.training.demo import expected_calls_of
    from flywheel.trajectories.models import Trajectory

    in_tasks = set(task_set.items.exclude(trajectory=None).values_list("trajectory_id", flat=True))
    left = Trajectory.objects.filter(project=project, outcome="failure", external_id__startswith="workplace-req-")
    left = left.exclude(pk__in=in_tasks).order_by("pk")
    done = 0
    for trajectory in left:
        if done == n:
            break
        data = {**promotion.promotion_prefill(trajectory=trajectory), "expected_calls": expected_calls_of(trajectory)}
        try:
            promotion.trajectory_promote(trajectory=trajectory, data=data, target=task_set, user=user)
        except promotion.PromotionRefused as refused:
            print(f"not promoted: #{trajectory.pk}: {refused}", flush=True)
            continue
        done += 1
    return done


if __name__ == "__main__":
    raise SystemExit(main())
