"""The retraining loop's latencies on PostgreSQL and Redis, with a real Celery worker and the real trainer
(the tiny CPU model):

- click to first step: from `job_confirm` (the button) to the trainer's first step event in the database,
  split at the worker's claim of the job; beside it, the baseline: the same trainer run by hand from the
  same job directory, from its start to its first step line;
- event to page: from a step event's row being written by the worker to the job's curves endpoint (what
  the job page polls) showing that step; beside it, a bare single-row INSERT and one GET of the endpoint;
- promotion and rollback (p50/p95 over --repeats): `model_promote` and `model_rollback`, each one database
  transaction with the MLflow alias written inside it; beside them, the same transaction without MLflow
  (a bare alias update and history row).

    .venv/bin/python bench/loop.py [--database-url postgres://postgres@127.0.0.1:5432/postgres]
                                   [--broker-url redis://127.0.0.1:6379/6] [--repeats 20] [--jobs 3]
                                   [--model DIR]

A scratch database is made on the server --database-url names and dropped afterwards; the worker's queues
take a key prefix of their own on the Redis --broker-url names. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
PY = sys.executable

# A job of one prompt group a step, no holdout: the figures are the platform's, not the model's.
JOB_CONFIG = {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "max_new_tokens": 24,
              "eval_interval": 1000, "eval_on_start": False, "learning_rate": 1e-4, "r": 4, "alpha": 8,
              "num_threads": 1}
PAGE_POLL_S = 3.0  # the job page's curves poll, 3 s after each answer
WORKER_SETTINGS = '''import json, os
from flywheel.settings import *  # noqa: F403
CELERY_BROKER_TRANSPORT_OPTIONS = json.loads(os.environ["FLYWHEEL_BENCH_BROKER_OPTIONS"])
'''


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summary(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 1), "p95_ms": round(pct(ms, 0.95), 1),
            "max_ms": round(max(ms), 1)}


def line(name: str, s: dict[str, float]) -> str:
    return f"  {name:<50} p50 {s['p50_ms']:>9.1f} ms   p95 {s['p95_ms']:>9.1f} ms   (n={s['n']})"


@contextmanager
def worker(env: dict[str, str], log: Path):
    """`celery worker` on the default and gpu queues, as the platform runs it (one process, one job)."""
    command = [PY, "-m", "celery", "-A", "flywheel", "worker", "-Q", "default,gpu", "-P", "solo", "-c", "1",
               "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO",
               "-n", f"bench-{uuid.uuid4().hex[:6]}@%h"]
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while " ready." not in log.read_text(errors="replace"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the worker did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait(condition, timeout: float, what: str, interval: float = 0.005):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(interval)


def tiny_model(path: str | None, var_dir: Path) -> Path:
    if path:
        return Path(path)
    from trainer.tiny import build_tiny

    folder = Path(tempfile.gettempdir()) / "flywheel-bench-tiny"
    if not (folder / "tiny.json").exists():
        print("building the tiny model (once; a minute or two) ...", flush=True)
        build_tiny(folder)
    return folder


def setup_project(model: Path):
    from flywheel.accounts.services import project_create
    from flywheel.environments.models import TaskSet, TaskSetVersion
    from flywheel.evals import rows as row_shape
    from flywheel.registry.services import base_model_register
    from trainer.envs.workplace import generate_tasks

    project = project_create(slug=f"bench-{uuid.uuid4().hex[:6]}", name="Loop bench")
    production = base_model_register(project=project, name="tiny", path=str(model))
    rows = []
    for i, task in enumerate(generate_tasks(16, seed=0, split="train", difficulty="single")):
        call = next(m for m in task["solution"] if m.get("tool_calls"))["tool_calls"][0]["function"]
        rows.append({"id": f"task-{i}", "messages": task["messages"], "tools": task["tools"],
                     "verifier": {"type": "tool_call", "expected_calls": [
                         {"name": call["name"], "arguments": json.loads(call["arguments"])}]}, "origin": {}})
    task_set = TaskSet.objects.create(project=project, name="bench tasks")
    version = TaskSetVersion.objects.create(task_set=task_set, number=1, rows=rows, size=len(rows),
                                            content_hash=row_shape.content_hash(rows))
    return project, production, version


def ready_job(project, version, max_steps: int):
    from flywheel.training.models import JobStatus, TrainingJob
    from flywheel.training.services import job_create

    job = job_create(project=project, task_set_version=version, config={**JOB_CONFIG, "max_steps": max_steps})
    return wait(lambda: TrainingJob.objects.filter(pk=job.pk, status=JobStatus.READY).first(), 120,
                "the job to be measured (no holdout: at once)")


def finished(job_id: int, timeout: float = 600):
    from flywheel.training.models import JobStatus, TrainingJob

    job = wait(lambda: TrainingJob.objects.filter(pk=job_id, status__in=(
        JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)).first(), timeout, "the job to end", 0.2)
    if job.status != JobStatus.SUCCEEDED:
        raise SystemExit(f"job {job.pk} {job.status}: {job.error}")
    return job


def click_to_first_step(project, version, jobs: int) -> dict[str, Any]:
    from flywheel.training.models import JobEvent, TrainingJob
    from flywheel.training.services import job_confirm, job_dir

    to_claim, to_step, bare = [], [], []
    for _ in range(jobs):
        job = ready_job(project, version, max_steps=2)
        clicked = time.time()
        job_confirm(job=job)
        first = wait(lambda job=job: JobEvent.objects.filter(job=job, kind="step").order_by("id").first(), 300,
                     "the first step")
        started = TrainingJob.objects.get(pk=job.pk).started_at.timestamp()
        to_claim.append(started - clicked)
        to_step.append(first.at.timestamp() - clicked)
        finished(job.pk)
        # The baseline: the same trainer on the same job directory, started by hand (a fresh directory copy,
        # so that it does not resume the finished run).
        folder = job_dir(job)
        scratch = Path(tempfile.mkdtemp(prefix="flywheel-bench-bare-"))
        for name in ("spec.json", "train.jsonl"):
            (scratch / name).write_bytes((folder / name).read_bytes())
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "FLYWHEEL_ENV_ENTRY_POINTS": "0"}
        t0 = time.time()
        process = subprocess.Popen([PY, "-m", "trainer", "train", "--spec", str(scratch / "spec.json")],
                                   cwd=scratch, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        for raw in process.stdout:
            if b'"event": "step"' in raw:
                bare.append(time.time() - t0)
                break
        process.wait()
    return {"click_to_claim": summary(to_claim), "click_to_first_step": summary(to_step),
            "bare_trainer_to_first_step": summary(bare)}


def _follow(client, url: str, job, steps: int, pause: float) -> tuple[list[float], list[float]]:
    """GET the curves endpoint until it shows every step, `pause` seconds after each answer. Per step: from
    its event row's write (`at`, the worker's clock: this host's) to the answer that first showed it."""
    from flywheel.training.models import JobEvent

    lags, gets = [], []
    shown = 0
    while shown < steps:
        t0 = time.time()
        data = client.get(url).json()
        answered = time.time()
        gets.append(answered - t0)
        seen = data["train"]["step"]
        if len(seen) > shown:
            at = dict(JobEvent.objects.filter(job=job, kind="step", step__in=seen[shown:])
                      .values_list("step", "at"))
            lags += [answered - at[s].timestamp() for s in seen[shown:]]
            shown = len(seen)
        if data["status"] in ("failed", "cancelled"):
            raise SystemExit(f"job {job.pk} {data['status']}")
        time.sleep(pause)
    return lags, gets


def event_to_page(project, version, steps: int) -> dict[str, Any]:
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import Client
    from django.urls import reverse

    from flywheel.accounts.services import membership_set
    from flywheel.training.services import job_confirm

    settings.ALLOWED_HOSTS = ["testserver", "localhost"]
    user = get_user_model().objects.create_user(username=f"viewer-{uuid.uuid4().hex[:6]}", password="x")
    membership_set(project=project, user=user, role="viewer")
    client = Client()
    client.force_login(user)
    out: dict[str, Any] = {}
    # Polled back to back (what the server adds), then as the job page polls: 3 s after each answer
    # (static/flywheel/training.js).
    for name, pause in (("event_to_page", 0.0), ("event_to_page_as_polled", PAGE_POLL_S)):
        job = ready_job(project, version, max_steps=steps)
        job_confirm(job=job)
        lags, gets = _follow(client, reverse("training_job_curves", args=[project.slug, job.pk]), job, steps, pause)
        finished(job.pk)
        out[name] = summary(lags)
        if pause == 0.0:
            out["curves_get"] = summary(gets)
    # Baseline: a bare single-row INSERT of the same table, committed (autocommit), as the worker writes one.
    inserts = []
    with connection.cursor() as cursor:
        for i in range(50):
            t0 = time.time()
            cursor.execute("INSERT INTO training_jobevent (job_id, attempt, kind, step, data, at) "
                           "VALUES (%s, 0, 'bench', %s, '{}', now())", [job.pk, i])
            inserts.append(time.time() - t0)
        cursor.execute("DELETE FROM training_jobevent WHERE job_id = %s AND kind = 'bench'", [job.pk])
    out["bare_insert"] = summary(inserts)
    return out


def promote_and_rollback(project, production, repeats: int) -> dict[str, Any]:
    from django.db import transaction

    from flywheel.registry import services as registry
    from flywheel.registry.models import AliasAssignment, AliasEvent, GateDecision

    promotions, rollbacks, bare = [], [], []
    for i in range(repeats):
        version = registry.model_version_create(project=project, base=production.base, description=f"bench {i}")
        GateDecision.objects.create(project=project, candidate=version, production=production, passed=True)
        registry.alias_move(project=project, alias="candidate", version=version)  # registered in MLflow
        t0 = time.perf_counter()
        registry.model_promote(project=project, version=version, reason="bench")
        promotions.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        registry.model_rollback(project=project, reason="bench")
        rollbacks.append(time.perf_counter() - t0)
        # Baseline: the same rows written in one transaction, without the lock, the checks or MLflow.
        t0 = time.perf_counter()
        with transaction.atomic():
            AliasEvent.objects.create(project=project, alias="candidate", kind="set", to_version=version,
                                      reason="bench", mlflow_state="done", webhook_state="done")
            AliasAssignment.objects.filter(project=project, alias="candidate").update(version=version)
        bare.append(time.perf_counter() - t0)
    return {"promotion": summary(promotions), "rollback": summary(rollbacks), "bare_alias_write": summary(bare)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default=os.environ.get("BENCH_DATABASE_URL",
                                                                 "postgres://postgres@127.0.0.1:5432/postgres"),
                        help="a PostgreSQL server (its admin database): a scratch database is made there")
    parser.add_argument("--broker-url", default=os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/6"))
    parser.add_argument("--repeats", type=int, default=20, help="promotions and rollbacks")
    parser.add_argument("--jobs", type=int, default=3, help="clicks timed to the first step")
    parser.add_argument("--steps", type=int, default=20, help="steps of the job whose events are followed")
    parser.add_argument("--model", help="a tiny model folder (default: built once under the temp dir)")
    args = parser.parse_args()
    from ingest import bench_env, scratch_database

    var_dir = Path(tempfile.mkdtemp(prefix="flywheel-bench-loop-"))
    settings_dir = var_dir / "settings"
    settings_dir.mkdir()
    (settings_dir / "bench_worker_settings.py").write_text(WORKER_SETTINGS)
    options = {"global_keyprefix": f"fwbench-{uuid.uuid4().hex[:8]}:"}
    with scratch_database(args.database_url) as db_url:
        env = bench_env(db_url, FLYWHEEL_VAR_DIR=str(var_dir), CELERY_BROKER_URL=args.broker_url,
                        FLYWHEEL_BENCH_BROKER_OPTIONS=json.dumps(options), LOG_LEVEL="INFO",
                        DJANGO_SETTINGS_MODULE="bench_worker_settings",
                        PYTHONPATH=os.pathsep.join([str(settings_dir), str(ROOT)]))
        os.environ.update({k: env[k] for k in ("DATABASE_URL", "FLYWHEEL_VAR_DIR", "CELERY_BROKER_URL",
                                                "FLYWHEEL_BENCH_BROKER_OPTIONS", "DEBUG", "DATABASE_CONN_MAX_AGE")})
        os.environ["DJANGO_SETTINGS_MODULE"] = "flywheel.settings"
        import django

        django.setup()
        from flywheel.celery import app as celery_app

        celery_app.conf.update(broker_url=args.broker_url, broker_transport_options=options)
        model = tiny_model(args.model, var_dir)
        project, production, version = setup_project(model)
        try:
            # The moves too run with the worker up: each queues the sync that mirrors and announces it.
            with worker(env, var_dir / "worker.log"):
                click = click_to_first_step(project, version, args.jobs)
                page = event_to_page(project, version, args.steps)
                moves = promote_and_rollback(project, production, args.repeats)
        finally:
            import redis

            broker = redis.Redis.from_url(args.broker_url)
            for key in broker.scan_iter(match=options["global_keyprefix"] + "*"):
                broker.delete(key)

    figures = {**click, **page, **moves}
    print(f"loop bench on PostgreSQL ({args.database_url.rsplit('@', 1)[-1]}) and Redis ({args.broker_url}), "
          "a real worker and the tiny model on CPU")
    print("click to the trainer's first step:")
    print(line("confirm -> worker claims the job", click["click_to_claim"]))
    print(line("confirm -> first step event in the database", click["click_to_first_step"]))
    print(line("baseline: trainer by hand -> first step line", click["bare_trainer_to_first_step"]))
    print("trainer event to the page:")
    print(line("event row written -> curves answer shows it", page["event_to_page"]))
    print(line("  the same, polled as the page does (every 3 s)", page["event_to_page_as_polled"]))
    print(line("one GET of the curves endpoint", page["curves_get"]))
    print(line("baseline: a bare single-row INSERT", page["bare_insert"]))
    print("promotion and rollback:")
    print(line("model_promote (database + MLflow alias)", moves["promotion"]))
    print(line("model_rollback (database + MLflow alias)", moves["rollback"]))
    print(line("baseline: the alias rows alone, one transaction", moves["bare_alias_write"]))
    ratios = {
        "click_to_first_step_vs_bare_trainer": round(
            click["click_to_first_step"]["p50_ms"] / click["bare_trainer_to_first_step"]["p50_ms"], 2),
        "event_to_page_vs_bare_insert": round(page["event_to_page"]["p50_ms"] / page["bare_insert"]["p50_ms"], 1),
        "promotion_vs_rollback": round(moves["promotion"]["p50_ms"] / moves["rollback"]["p50_ms"], 2),
        "promotion_vs_bare_alias_write": round(moves["promotion"]["p50_ms"] / moves["bare_alias_write"]["p50_ms"], 1),
    }
    print("ratios (p50): " + ", ".join(f"{k} {v}x" for k, v in ratios.items()))
    print(json.dumps({"figures": figures, "ratios": ratios}))


if __name__ == "__main__":
    main()
