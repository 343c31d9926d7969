"""Page latency on the demo: the training pages and the eval-run comparison, each beside a baseline.

    .venv/bin/python bench/demo_pages.py [--jobs 20] [--samples 7] [--database-url URL] [--keep]

Seeds a scratch database (SQLite in a temporary folder, as `make run` uses; or the PostgreSQL server that
`--database-url` names, in a scratch database dropped at the end), then GETs each page through Django's test
client, logged in as the demo's admin, and prints its median over `--samples` requests (after one warm-up)
with its query count, beside the same page on a baseline project, and the ratio. Never a timed assertion:
the tests guard the query counts instead.

The seed: `demo_seed()`, the `make run` seed of the demo project (its twelve conversations, failure modes
and policy), and, instead of the loop demo's own seed (the worker builds the tiny model and plays 300
requests with it: minutes on a CPU), two projects of the loop demo's shape made with the ORM: a task set of 35
failures, a 100-case holdout sampled 8 times, a 20-case regression suite, and finished jobs with 40 steps of
curves, a holdout evaluation every 10 steps, checkpoints, production's and the candidate's eval runs and the
gate's decision (computed by `gate_evaluate` on the seeded results). `workplace` has `--jobs` jobs; the
baseline project `workplace-base` has 2.

The first request of a page in a fresh process is timed too (`cold`, in a subprocess per page): a page that
imports a heavy module on first use (scipy.stats costs about a second) is slow once per process, which is
what a person walking through a freshly started `make run` sees. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parents[1]
BASELINE_JOBS = 2
HOLDOUT_CASES = 100
SAMPLES_PER_CASE = 8
STEPS = 40


def _setup_django(database_url: str, var_dir: Path) -> None:
    os.environ["DATABASE_URL"] = database_url
    os.environ["FLYWHEEL_VAR_DIR"] = str(var_dir)
    os.environ.setdefault("CELERY_BROKER_URL", f"filesystem://{var_dir}/broker")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "flywheel.settings")
    os.environ["FLYWHEEL_TRIAGE"] = "false"
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.conf import settings

    settings.ALLOWED_HOSTS = ["*"]
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def _rows(prefix: str, n: int) -> list[dict]:
    tools = [{"type": "function", "function": {"name": "update_ticket", "parameters": {
        "type": "object", "properties": {"ticket_id": {"type": "string"}, "status": {"type": "string"}}}}}]
    return [{"id": f"{prefix}-{i}", "messages": [{"role": "user", "content": f"Close ticket T-{1000 + i}, please."}],
             "tools": tools, "verifier": {"type": "tool_call", "expected_calls": [
                 {"name": "update_ticket", "arguments": {"ticket_id": f"T-{1000 + i}", "status": "closed"}}]}}
            for i in range(n)]


def _version(model, owner, rows: list[dict], **owner_fields):
    from django.utils import timezone

    from flywheel.environments.models import TaskSetVersion
    from flywheel.evals import rows as row_shape

    collection = owner.objects.create(**owner_fields)
    key = "task_set" if model is TaskSetVersion else "suite"
    return model.objects.create(**{key: collection}, number=1, rows=rows, size=len(rows), frozen_at=timezone.now(),
                                content_hash=row_shape.content_hash(rows))


def _cases(rows: list[dict], rng: random.Random, skill: float) -> list[dict]:
    """Per-case results in the shape `python -m trainer evaluate` writes, SAMPLES_PER_CASE samples each."""
    out = []
    for row in rows:
        p = min(1.0, max(0.0, skill + rng.uniform(-0.3, 0.3)))
        samples = [{"passed": rng.random() < p, "messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"function": {"name": "update_ticket", "arguments": json.dumps({"ticket_id": "T-1", "status": "open"})}}]}]}
            for _ in range(SAMPLES_PER_CASE)]
        passes = sum(s["passed"] for s in samples)
        out.append({"id": row["id"], "passed": passes * 2 > len(samples), "pass_rate": passes / len(samples),
                    "passes": passes, "n": len(samples), "latency_ms": 800 + rng.random() * 400,
                    "mean_completion_tokens": 30 + rng.random() * 10, "samples": samples})
    return out


def seed_loop_shape(*, slug: str, name: str, owner, jobs: int, var_dir: Path, seed: int = 0):
    """A project of the loop demo's shape with `jobs` finished jobs (see the module's docstring)."""
    from flywheel.accounts.services import project_create
    from flywheel.environments.models import TaskSet, TaskSetVersion
    from flywheel.evals.models import EvalSuite, EvalSuiteVersion
    from flywheel.evals.runs import eval_run_record
    from flywheel.registry import services as registry
    from flywheel.registry.gate import CaseResult, gate_evaluate, power_of
    from flywheel.registry.models import GateDecision
    from flywheel.training.demo import DEMO_RECIPE
    from flywheel.training.models import Checkpoint, JobEvent, JobStatus, TrainingJob
    from flywheel.training.services import config_check, defaults_save

    rng = random.Random(seed)
    project = project_create(slug=slug, name=name, owner=owner)
    folder = var_dir / "models" / slug
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    production = registry.base_model_register(project=project, name="tiny (demo)", path=str(folder), user=owner)
    train = _version(TaskSetVersion, TaskSet, _rows("req", 35), project=project, name="Workplace failures")
    holdout = _version(EvalSuiteVersion, EvalSuite, _rows("hold", HOLDOUT_CASES), project=project,
                       name="Workplace holdout", kind="holdout")
    regression = _version(EvalSuiteVersion, EvalSuite, _rows("reg", 20), project=project,
                          name="Workplace regressions", kind="regression")
    defaults_save(project=project, config=DEMO_RECIPE, user=owner)
    production_cases = _cases(holdout.rows, rng, 0.33)
    production_regression = _cases(regression.rows, rng, 0.6)
    for n in range(jobs):
        config = {"learning_rate": [1e-3, 2e-3, 5e-4][n % 3], "max_steps": STEPS, "eval_interval": 10}
        if n % 2:
            config["num_prompts_per_step"] = 32
        merged = config_check(algorithm="grpo", config=config, project=project)
        candidate = registry.model_version_create(project=project, base=production.base, user=owner,
                                                  description=f"job {n + 1}")
        job = TrainingJob.objects.create(
            project=project, task_set_version=train, holdout_version=holdout, regression_version=regression,
            base_version=production, candidate_version=candidate, config=merged, status=JobStatus.SUCCEEDED,
            step=STEPS, max_steps=STEPS, created_by=owner, result={"best_step": STEPS},
            advice={"metrics": {"success_rate": 0.33, "invalid_output_rate": 0.01, "unsafe_action_rate": 0.0,
                                "n": HOLDOUT_CASES * SAMPLES_PER_CASE}, "recommendation": "train", "reason": ""},
        )
        skill = 0.33 + 0.1 * rng.random()
        events = [JobEvent(job=job, attempt=1, kind="step", step=s, data={
            "reward_mean": skill * s / STEPS + rng.random() * 0.05, "kl": 0.0, "completion_length": 30 + rng.random()})
            for s in range(1, STEPS + 1)]
        for s in range(10, STEPS + 1, 10):
            metrics = {"success_rate": 0.33 + (skill - 0.33) * s / STEPS, "invalid_output_rate": 0.01,
                       "unsafe_action_rate": 0.0}
            events.append(JobEvent(job=job, attempt=1, kind="eval", step=s, data={"split": "holdout", "metrics": metrics}))
            Checkpoint.objects.create(job=job, step=s, path=f"checkpoints/step-{s:06d}", holdout=metrics,
                                      best=s == STEPS)
        JobEvent.objects.bulk_create(events)
        candidate_cases = _cases(holdout.rows, rng, skill)
        candidate_regression = _cases(regression.rows, rng, 0.6)
        eval_run_record(project=project, model_version=production, suite_version=holdout, cases=production_cases,
                        metrics={"success_rate": 0.33}, job=job, step=0)
        eval_run_record(project=project, model_version=candidate, suite_version=holdout, cases=candidate_cases,
                        metrics={"success_rate": skill}, job=job, step=STEPS)
        results = {k: [CaseResult.from_eval_case(c) for c in v] for k, v in (
            ("production", production_cases), ("candidate", candidate_cases),
            ("production_regression", production_regression), ("candidate_regression", candidate_regression))}
        outcome = gate_evaluate(**results, looks=STEPS // 10)
        report = outcome.to_dict() | {"power": power_of(results["production"]),
                                      "measurement": {"step": STEPS, "looks": list(range(10, STEPS + 1, 10)),
                                                      "fresh": False, "seed": None}}
        from flywheel.registry.gate import GateRules

        GateDecision.objects.create(project=project, job=job, candidate=candidate, production=production,
                                    passed=outcome.passed, rules=GateRules().__dict__, report=report)
    return project


def seed(*, jobs: int, var_dir: Path):
    from flywheel.seed.demo import demo_seed

    demo = demo_seed()
    from django.contrib.auth import get_user_model

    admin = get_user_model().objects.get(username=demo.username)
    big = seed_loop_shape(slug="workplace-bench", name="Workplace (bench)", owner=admin, jobs=jobs, var_dir=var_dir)
    base = seed_loop_shape(slug="workplace-base", name="Workplace (baseline)", owner=admin, jobs=BASELINE_JOBS,
                           var_dir=var_dir, seed=1)
    return admin, demo.project, big, base


def pages(demo, big, base) -> list[tuple[str, str, str | None]]:
    """(label, url, the baseline's url) for each page."""
    from flywheel.evals.run_models import EvalRun
    from flywheel.training.models import TrainingJob

    def runs(project):
        job = TrainingJob.objects.filter(project=project).order_by("id").first()
        a, b = EvalRun.objects.filter(job=job).order_by("id")[:2]
        return f"/p/{project.slug}/evals/runs/compare?a={a.pk}&b={b.pk}"

    def ids(project):
        return "&".join(f"ids={pk}" for pk in TrainingJob.objects.filter(project=project).values_list("pk", flat=True))

    def first(project):
        return TrainingJob.objects.filter(project=project).order_by("id").values_list("pk", flat=True).first()

    return [
        ("demo: training list (no job)", f"/p/{demo.slug}/training/", None),
        ("training list", f"/p/{big.slug}/training/", f"/p/{base.slug}/training/"),
        ("job page", f"/p/{big.slug}/training/{first(big)}/", f"/p/{base.slug}/training/{first(base)}/"),
        ("job curves (JSON)", f"/p/{big.slug}/training/{first(big)}/curves", f"/p/{base.slug}/training/{first(base)}/curves"),
        ("compare all jobs", f"/p/{big.slug}/training/compare?{ids(big)}", f"/p/{base.slug}/training/compare?{ids(base)}"),
        ("eval runs list", f"/p/{big.slug}/evals/runs/", f"/p/{base.slug}/evals/runs/"),
        ("eval runs compare (100 cases)", runs(big), runs(base)),
    ]


def measure(client, url: str, samples: int) -> tuple[float, int]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    client.get(url)  # warm-up
    times = []
    for _ in range(samples):
        with CaptureQueriesContext(connection) as captured:
            t0 = time.perf_counter()
            response = client.get(url)
            times.append((time.perf_counter() - t0) * 1000)
        if response.status_code != 200:
            raise SystemExit(f"GET {url} answered {response.status_code}")
    return statistics.median(times), len(captured.captured_queries)


def cold(url: str, database_url: str, var_dir: Path) -> float:
    """The first request of `url` in a fresh process, after one request to the project's home page (the
    parts every page shares)."""
    out = subprocess.run([sys.executable, __file__, "--cold", url, "--database-url", database_url,
                          "--var-dir", str(var_dir)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"cold {url}: {out.stderr[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def _cold_child(url: str) -> None:
    from django.contrib.auth import get_user_model
    from django.test import Client

    client = Client()
    client.force_login(get_user_model().objects.get(username="admin"))
    client.get("/" + url.split("/")[1] + "/" + url.split("/")[2] + "/")
    t0 = time.perf_counter()
    response = client.get(url)
    elapsed = (time.perf_counter() - t0) * 1000
    if response.status_code != 200:
        raise SystemExit(f"GET {url} answered {response.status_code}")
    print(elapsed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=20, help="jobs in the measured project (the baseline has 2)")
    parser.add_argument("--samples", type=int, default=7)
    parser.add_argument("--database-url", help="a PostgreSQL server (postgres://…): a scratch database on it")
    parser.add_argument("--keep", action="store_true", help="keep the scratch database and folder")
    parser.add_argument("--no-cold", action="store_true", help="skip the first-request timings")
    parser.add_argument("--cold", help=argparse.SUPPRESS)
    parser.add_argument("--var-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.cold:
        _setup_django(args.database_url, Path(args.var_dir))
        _cold_child(args.cold)
        return

    var_dir = Path(tempfile.mkdtemp(prefix="flywheel-bench-pages-"))
    scratch = None
    if args.database_url:
        parts = urlsplit(args.database_url)
        scratch = f"flywheel_bench_demo_{uuid.uuid4().hex[:8]}"
        import psycopg

        with psycopg.connect(urlunsplit(parts._replace(path="/postgres")), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{scratch}"')
        database_url = urlunsplit(parts._replace(path=f"/{scratch}"))
    else:
        database_url = f"sqlite:///{var_dir / 'flywheel.sqlite3'}"
    try:
        _setup_django(database_url, var_dir)
        from django.core.management import call_command
        from django.test import Client

        t0 = time.perf_counter()
        call_command("migrate", verbosity=0)
        admin, demo, big, base = seed(jobs=args.jobs, var_dir=var_dir)
        print(f"seeded in {time.perf_counter() - t0:.0f}s ({database_url.split(':')[0]}): demo, "
              f"{big.slug} with {args.jobs} jobs, {base.slug} with {BASELINE_JOBS}", flush=True)
        client = Client()
        client.force_login(admin)
        print(f"\n{'page':32} {'median ms':>9} {'queries':>7} {'cold ms':>8}   "
              f"{'baseline ms':>11} {'queries':>7}  {'ratio':>5}")
        results = []
        for label, url, baseline_url in pages(demo, big, base):
            ms, queries = measure(client, url, args.samples)
            row = {"page": label, "url": url, "median_ms": round(ms, 1), "queries": queries}
            if not args.no_cold:
                row["cold_ms"] = round(cold(url, database_url, var_dir), 1)
            if baseline_url:
                base_ms, base_queries = measure(client, baseline_url, args.samples)
                row |= {"baseline_url": baseline_url, "baseline_median_ms": round(base_ms, 1),
                        "baseline_queries": base_queries, "ratio": round(ms / base_ms, 2)}
            results.append(row)
            cold_col = f"{row['cold_ms']:8.1f}" if "cold_ms" in row else f"{'—':>8}"
            base_cols = (f"{row['baseline_median_ms']:11.1f} {row['baseline_queries']:7d}  {row['ratio']:5.2f}"
                         if baseline_url else f"{'—':>11} {'—':>7}  {'—':>5}")
            print(f"{label:32} {ms:9.1f} {queries:7d} {cold_col}   {base_cols}", flush=True)
        worst = max(max(r["median_ms"], r.get("cold_ms", 0)) for r in results)
        print(f"\nslowest (median or cold): {worst:.0f} ms; baseline: the same pages on a project with "
              f"{BASELINE_JOBS} jobs (ratio = this page's median / the baseline's)")
        print(json.dumps({"jobs": args.jobs, "baseline_jobs": BASELINE_JOBS, "samples": args.samples,
                          "database": database_url.split(":")[0], "results": results}))
    finally:
        if args.keep:
            print(f"kept: {var_dir} {database_url}")
        else:
            from django.db import connections

            connections.close_all()
            if scratch:
                import psycopg

                with psycopg.connect(urlunsplit(urlsplit(args.database_url)._replace(path="/postgres")),
                                     autocommit=True) as conn:
                    conn.execute(f'DROP DATABASE IF EXISTS "{scratch}" WITH (FORCE)')
            import shutil

            shutil.rmtree(var_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
