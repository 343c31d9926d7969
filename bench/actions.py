"""Slow actions a person meets in the first hour, timed as they were and as they are: the first "Run checks"
of the promotion form and the first Promote on a gate page in a fresh web process, the Save, and the login.

    .venv/bin/python bench/actions.py [--tasks 180] [--samples 3]

Seeds a scratch SQLite database in a temporary folder with a project of the workplace demo's shape (a task
set of `--tasks` workplace requests, a regression suite, and one failed trajectory whose request is in
neither), then times, each in a fresh process (what the first person after `make run` meets):

- `before`: the first Run checks with no stored request vectors and no sentence model loaded (the demo's seed
  made none, the web process loaded the model inside the request);
- `vectors stored`: the same, after `request_vectors_fill` (the demo's seed now runs it on the worker);
- `after`: vectors stored and the model loaded as the web process started (`wsgi.py`'s preload; timed once
  it finished, as a person opening the form some seconds after the start finds it), then Save;
- the first Promote on a gate page (a project of the loop demo's shape, bench/demo_pages.py's seed), in the
  `before` process (MLflow imported and its client made inside the request) and in the `after` one (made as
  the process started);
- the login's POST with the configured password hasher, and the hash alone.

Prints each figure, the before/after ratios and a JSON line. Never a timed assertion.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PASSWORD = "a-long-enough-bench-password-1"


def _setup(database_url: str, var_dir: Path) -> None:
    os.environ["DATABASE_URL"] = database_url
    os.environ["FLYWHEEL_VAR_DIR"] = str(var_dir)
    os.environ.setdefault("CELERY_BROKER_URL", f"filesystem://{var_dir}/broker")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "flywheel.settings")
    os.environ["FLYWHEEL_TRIAGE"] = "false"
    os.environ["FLYWHEEL_PRELOAD"] = "false"  # the child starts what it times itself, when asked
    sys.path.insert(0, str(ROOT / "platform"))
    import django

    django.setup()
    from django.conf import settings

    settings.ALLOWED_HOSTS = ["*"]


def seed(n_tasks: int, var_dir: Path) -> dict:
    from django.contrib.auth import get_user_model

    from flywheel.accounts.services import project_create
    from flywheel.environments.services import task_set_create
    from flywheel.evals import rows as row_shape
    from flywheel.evals.services import suite_create, version_create
    from flywheel.training.demo import _row
    from flywheel.trajectories.ingest import ingest_trajectories
    from flywheel.trajectories.models import Trajectory
    from trainer.envs.workplace import generate_tasks

    admin = get_user_model().objects.create_user("bench-admin", password=PASSWORD)  # the configured hasher
    project = project_create(slug="bench-actions", name="Bench actions", owner=admin)
    tasks = generate_tasks(n_tasks + 1, seed=21, split="train", difficulty="single")
    task_set = task_set_create(project=project, name="Workplace failures", user=admin)
    for i, task in enumerate(tasks[:n_tasks]):
        row = _row(task, f"req-{i}")
        task_set.items.create(messages=row["messages"], tools=row["tools"], verifier=row["verifier"],
                              prompt_digest=row_shape.prompt_digest(row["messages"]),
                              prompt_text=row_shape.last_user_request(row["messages"])[:2000], created_by=admin)
    version_create(collection=task_set, user=admin, note="bench")
    suite = suite_create(project=project, name="Workplace regressions", kind="regression", user=admin)
    last = _row(tasks[n_tasks], "failed")
    expected = last["verifier"]["expected_calls"][0]
    wrong = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": expected["name"], "arguments": json.dumps({k: "?" for k in expected["arguments"]})}}]}
    ingest_trajectories(project=project, source="bench", records=[{
        "external_id": "bench-failed", "messages": [*last["messages"], wrong], "tools": last["tools"],
        "outcome": "failure"}])
    trajectory = Trajectory.objects.get(project=project, external_id="bench-failed")
    # A second project with a finished job whose candidate passed the gate, for the Promote on its gate page
    # (bench/demo_pages.py's seed of the loop demo's shape; one candidate per scenario).
    sys.path.insert(0, str(ROOT / "bench"))
    from demo_pages import seed_loop_shape

    from flywheel.registry.models import GateDecision

    loop = seed_loop_shape(slug="bench-gate", name="Bench gate", owner=admin, jobs=3, var_dir=var_dir)
    GateDecision.objects.filter(project=loop).update(passed=True)
    candidates = list(GateDecision.objects.filter(project=loop).order_by("pk").values_list("candidate__number", flat=True))
    return {"slug": project.slug, "trajectory": trajectory.pk, "suite": suite.pk, "expected": [expected],
            "message_index": len(last["messages"]), "gate_slug": loop.slug, "candidates": candidates}


def _form(plan: dict, action: str) -> dict:
    return {"target": f"suite:{plan['suite']}", "action": action, "message_index": str(plan["message_index"]),
            "expect": "calls", "expected_calls": json.dumps(plan["expected"]), "env_type": "single_turn"}


def child(plan: dict, preload: bool, candidate: int) -> dict:
    """One fresh web process: (optionally) the preload as wsgi.py starts it, then the first Promote on a gate
    page, the first Run checks and a Save."""
    from django.contrib.auth import get_user_model
    from django.test import Client
    from django.urls import get_resolver

    get_resolver().url_patterns  # noqa: B018  (wsgi.py loads the URLconf as the process starts)
    out: dict = {}
    if preload:
        from flywheel.failures.clustering.embedding import preload_shared_model
        from flywheel.registry.mlflow_bridge import preload_client

        t0 = time.perf_counter()
        threads = [preload_client(), preload_shared_model()]
        for thread in threads:
            thread.join()
        out["preload_s"] = round(time.perf_counter() - t0, 2)
    client = Client()
    client.force_login(get_user_model().objects.get(username="bench-admin"))
    t0 = time.perf_counter()
    response = client.post(f"/p/{plan['gate_slug']}/models/v{candidate}/promote", {"reason": "bench"})
    out["first_promote_s"] = round(time.perf_counter() - t0, 2)
    if response.status_code != 302:
        raise SystemExit(f"promote: {response.status_code}")
    url = f"/p/{plan['slug']}/t/{plan['trajectory']}/promote"
    for label, action in (("first_check_s", "check"), ("second_check_s", "check"), ("save_s", "save")):
        t0 = time.perf_counter()
        response = client.post(url, _form(plan, action))
        out[label] = round(time.perf_counter() - t0, 2)
        expected = 302 if action == "save" else 200
        if response.status_code != expected:
            raise SystemExit(f"{action}: {response.status_code} {response.content[-3000:]!r}")
        if action == "save":
            break
        if label == "first_check_s" and not preload:
            break  # the scenarios without the preload time the first check alone
    return out


def login(samples: int) -> dict:
    from django.contrib.auth import get_user_model
    from django.contrib.auth.hashers import check_password
    from django.test import Client

    encoded = get_user_model().objects.get(username="bench-admin").password
    hashes, posts = [], []
    for _ in range(samples):
        t0 = time.perf_counter()
        check_password(PASSWORD, encoded)
        hashes.append(time.perf_counter() - t0)
        client = Client()
        t0 = time.perf_counter()
        response = client.post("/accounts/login/", {"username": "bench-admin", "password": PASSWORD})
        posts.append(time.perf_counter() - t0)
        if response.status_code != 302:
            raise SystemExit(f"login answered {response.status_code}")
    return {"hasher": encoded.split("$", 1)[0], "hash_s": round(statistics.median(hashes), 2),
            "login_post_s": round(statistics.median(posts), 2)}


def _back_to_production_v1(plan: dict) -> None:
    """Roll the gate project back to v1, the production every candidate was judged against (a decision
    judged against another production is stale and cannot promote)."""
    from flywheel.accounts.models import Project
    from flywheel.registry import services as registry
    from flywheel.registry.models import ModelVersion

    project = Project.objects.get(slug=plan["gate_slug"])
    registry.model_rollback(project=project, reason="bench", to_version=ModelVersion.objects.get(project=project, number=1))


def run_child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=900, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=180, help="tasks in the task set (the demo's: about 165)")
    parser.add_argument("--samples", type=int, default=3, help="logins timed (median)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--preload", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--candidate", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--database-url", help=argparse.SUPPRESS)
    parser.add_argument("--var-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _setup(args.database_url, Path(args.var_dir))
        print(json.dumps(child(json.loads(args.child), args.preload, args.candidate)))
        return

    var_dir = Path(tempfile.mkdtemp(prefix="flywheel-bench-actions-"))
    database_url = f"sqlite:///{var_dir / 'flywheel.sqlite3'}"
    _setup(database_url, var_dir)
    from django.core.management import call_command

    from flywheel.evals.leakage import request_vectors_fill
    from flywheel.evals.models import RequestVector

    call_command("migrate", verbosity=0)
    plan = seed(args.tasks, var_dir)
    common = ["--database-url", database_url, "--var-dir", str(var_dir), "--child", json.dumps(plan)]
    before = run_child([*common, "--candidate", str(plan["candidates"][0])])
    RequestVector.objects.all().delete()  # the check above stored them: start again from none
    t0 = time.perf_counter()
    filled = request_vectors_fill()
    fill_s = round(time.perf_counter() - t0, 2)
    _back_to_production_v1(plan)
    stored = run_child([*common, "--candidate", str(plan["candidates"][1])])
    _back_to_production_v1(plan)
    after = run_child([*common, "--preload", "--candidate", str(plan["candidates"][2])])
    logins = login(args.samples)
    results = {"tasks": args.tasks, "before_first_check_s": before["first_check_s"],
               "before_first_promote_s": before["first_promote_s"],
               "vectors_fill_s_on_the_worker": fill_s, "vectors_filled": filled,
               "stored_first_check_s": stored["first_check_s"], **{f"after_{k}": v for k, v in after.items()},
               **logins}
    print(f"first Run checks, fresh process, {args.tasks} tasks:")
    print(f"  before (no vectors, model loaded in the request)  {before['first_check_s']:6.2f} s")
    print(f"  vectors stored by the seed ({filled} in {fill_s:.1f} s on the worker) {stored['first_check_s']:6.2f} s")
    print(f"  after (vectors stored, model preloaded at start: {after['preload_s']:.1f} s beside the first "
          f"requests)  {after['first_check_s']:6.2f} s   ratio before/after "
          f"{before['first_check_s'] / max(after['first_check_s'], 1e-3):.1f}x")
    print(f"first Promote on a gate page, fresh process: before {before['first_promote_s']:.2f} s, after "
          f"(MLflow's client made at start) {after['first_promote_s']:.2f} s   ratio "
          f"{before['first_promote_s'] / max(after['first_promote_s'], 1e-3):.1f}x")
    print(f"  second Run checks {after['second_check_s']:.2f} s; Save {after['save_s']:.2f} s")
    print(f"login POST {logins['login_post_s']:.2f} s, of which the password hash ({logins['hasher']}) "
          f"{logins['hash_s']:.2f} s")
    print(json.dumps(results))
    import shutil

    shutil.rmtree(var_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
