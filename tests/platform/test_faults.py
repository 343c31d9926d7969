"""Faults, on services of the test's own (never the PostgreSQL and Redis the rest of the suite shares):

- PostgreSQL restarted while clients ingest through gunicorn: every answer is 200 or 503 with a Retry-After
  (never a 500, never a dropped connection), a client that sends each 503 again gets every batch stored
  exactly once, whole.
- Redis stopped while an upload commits: the upload is kept, queued, and the page says it waits; once Redis
  is back, the sweep that Celery beat runs sends it and a worker ingests it.

Each prints what the client saw (`pytest -s`)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from django.conf import settings
from django.urls import reverse

REPO_DIR = Path(settings.BASE_DIR)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(condition, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            pytest.fail(f"{what} not after {timeout:.0f}s\n{tail}", pytrace=False)
        time.sleep(0.1)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


# --------------------------------------------------------------------------------------------------
# PostgreSQL of the test's own.
# --------------------------------------------------------------------------------------------------


@dataclass
class OwnPostgres:
    bin_dir: Path
    data_dir: Path
    port: int
    log: Path
    as_user: list[str]

    def pg_ctl(self, *args: str) -> None:
        command = [*self.as_user, str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-l", str(self.log), *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"pg_ctl {' '.join(args)}: {done.stdout}{done.stderr}{self.log.read_text()[-2000:]}"

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/flywheel"


@pytest.fixture
def own_postgres(needs_service) -> Iterator[OwnPostgres]:
    """A PostgreSQL server in a temporary folder on a free port: initdb, then pg_ctl start. initdb refuses
    to run as root, so as root the server is the `postgres` user's."""
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name))
    needs_service(bool(versions), "PostgreSQL's server binaries (/usr/lib/postgresql/<version>/bin) are not installed")
    bin_dir = versions[-1].parent
    as_user: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="flywheel-faults-pg-"))
    if os.geteuid() == 0:
        as_user = ["runuser", "-u", "postgres", "--"]
        shutil.chown(root, "postgres", "postgres")
    server = OwnPostgres(bin_dir, root / "data", _free_port(), root / "server.log", as_user)
    try:
        made = subprocess.run(
            [*as_user, str(bin_dir / "initdb"), "-D", str(server.data_dir), "-U", "postgres", "-A", "trust", "--no-sync"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert made.returncode == 0, made.stderr
        options = f"-p {server.port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off"
        server.pg_ctl("-o", options, "-w", "start")
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=server.port, user="postgres", dbname="postgres", autocommit=True) as db:
            db.execute("CREATE DATABASE flywheel")
        yield server
    finally:
        subprocess.run(
            [*as_user, str(bin_dir / "pg_ctl"), "-D", str(server.data_dir), "-m", "immediate", "stop"],
            capture_output=True, timeout=60,
        )  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class Seen:
    """What the clients saw."""

    statuses: Counter = field(default_factory=Counter)
    retries: int = 0
    problems: list[str] = field(default_factory=list)
    stored: dict[str, str] = field(default_factory=dict)  # external_id -> the content acknowledged
    lock: threading.Lock = field(default_factory=threading.Lock)


def _post(url: str, key: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _client(base: str, key: str, name: str, seen: Seen, done: threading.Event) -> None:
    """Send batches of 20 new trajectories until `done`; send each 503 again until it is stored."""
    batch = -1
    while not done.is_set():
        batch += 1
        records = [
            {
                "external_id": f"{name}-{batch}-{i}",
                "messages": [{"role": "user", "content": f"content of {name}-{batch}-{i}"}],
                "metadata": {"client": name, "batch": batch},
            }
            for i in range(20)
        ]
        body = json.dumps(records).encode()
        for attempt in range(200):
            try:
                status, headers, answer = _post(f"{base}/api/v1/trajectories", key, body)
            except OSError as exc:  # a connection the app dropped or reset
                with seen.lock:
                    seen.problems.append(f"{name} batch {batch}: {type(exc).__name__}: {exc}")
                return
            with seen.lock:
                seen.statuses[status] += 1
                if attempt:
                    seen.retries += 1
            if status == 200:
                result = json.loads(answer)
                if result.get("accepted") != 20:
                    with seen.lock:
                        seen.problems.append(f"{name} batch {batch}: {result}")
                with seen.lock:
                    seen.stored.update({r["external_id"]: r["messages"][0]["content"] for r in records})
                break
            if status != 503 or not headers.get("Retry-After", "").isdigit():
                with seen.lock:
                    seen.problems.append(f"{name} batch {batch}: {status} {headers} {answer[:300]!r}")
                return
            time.sleep(0.2)  # the client's choice: sooner than Retry-After says, to keep the test short
        else:
            with seen.lock:
                seen.problems.append(f"{name} batch {batch}: still 503 after 200 tries")
            return
        done.wait(0.05)


def test_postgresql_restarted_during_ingestion_answers_503_and_a_retry_stores_once(own_postgres, tmp_path):
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "flywheel.settings",
        "DATABASE_URL": own_postgres.url,
        "CELERY_BROKER_URL": "filesystem://",
        "FLYWHEEL_VAR_DIR": str(tmp_path / "var"),
        "FLYWHEEL_API_RATE_PER_S": "100000",  # the clients here are not what is measured
        "FLYWHEEL_API_BURST": "100000",
        "PYTHONUNBUFFERED": "1",
    }
    migrated = subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=REPO_DIR, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert migrated.returncode == 0, migrated.stderr
    made = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c",
         "from flywheel.accounts.services import project_create, api_key_create;"
         "print(api_key_create(project=project_create(slug='faults'), name='faults').raw_key)"],
        cwd=REPO_DIR, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip().splitlines()[-1]

    port = _free_port()
    web_log = tmp_path / "gunicorn.log"
    with open(web_log, "wb") as log:
        web = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "flywheel.wsgi", "--bind", f"127.0.0.1:{port}", "--workers", "2",
             "--timeout", "120"],
            cwd=REPO_DIR, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    seen = Seen()
    done = threading.Event()
    try:

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{base}/healthz", timeout=5) as response:
                    return response.status == 200
            except OSError:
                return False

        _wait(healthy, 120, "gunicorn serving", web_log)
        clients = [threading.Thread(target=_client, args=(base, key, f"c{n}", seen, done)) for n in range(3)]
        for client in clients:
            client.start()
        _wait(lambda: seen.statuses[200] >= 6 or seen.problems, 120, "the first batches stored", web_log)

        # A restart in the middle of the traffic: the server stops its backends (fast shutdown) and comes back.
        own_postgres.pg_ctl("-m", "fast", "-w", "restart")
        after_restart = seen.statuses[200]
        _wait(lambda: seen.statuses[200] >= after_restart + 6 or seen.problems, 120, "batches stored after the restart", web_log)

        # While it is down, an API request and a page both say so, with Retry-After; an immediate stop this
        # time, as a crash would.
        own_postgres.pg_ctl("-m", "immediate", "-w", "stop")
        status, headers, answer = _post(f"{base}/api/v1/trajectories", key, b"[]")
        down_api = (status, headers.get("Retry-After"), json.loads(answer).get("detail", ""))
        page = urllib.request.Request(f"{base}/", headers={"Cookie": "sessionid=abcdefghijklmnopqrstuvwxyz012345"})
        try:
            urllib.request.urlopen(page, timeout=30)
            down_page: tuple = ("no error",)
        except urllib.error.HTTPError as exc:
            down_page = (exc.code, exc.headers.get("Retry-After"), exc.read().decode())
        time.sleep(1)  # the clients meet the stopped server too
        own_postgres.pg_ctl("-o", f"-p {own_postgres.port} -k {own_postgres.data_dir.parent} -c listen_addresses=127.0.0.1 -c fsync=off", "-w", "start")
        after_stop = seen.statuses[200]
        _wait(lambda: seen.statuses[200] >= after_stop + 6 or seen.problems, 120, "batches stored after the start", web_log)

        done.set()
        for client in clients:
            client.join(timeout=300)
        assert not any(client.is_alive() for client in clients)
    finally:
        done.set()
        _stop(web)
    print(
        f"\nPostgreSQL restart (fast) and stop (immediate) under 3 clients: answers {dict(seen.statuses)}, "
        f"{seen.retries} retries, {len(seen.stored)} trajectories acknowledged; while stopped the API answered "
        f"{down_api[:2]} and a page {down_page[:2]}"
    )

    assert not seen.problems, seen.problems
    assert set(seen.statuses) <= {200, 503}
    assert down_api[:2] == (503, "5") and "database is unavailable" in down_api[2]
    assert down_page[:2] == (503, "5") and "Try again shortly" in down_page[2]
    assert seen.statuses[503] >= 1 and seen.retries >= 1
    assert len(seen.stored) % 20 == 0 and len(seen.stored) >= 18 * 20

    import psycopg

    with psycopg.connect(own_postgres.url.replace("postgres://", "postgresql://")) as db:
        rows = db.execute(
            "SELECT external_id, messages->0->>'content', count(*) OVER (PARTITION BY external_id)"
            " FROM trajectories_trajectory"
        ).fetchall()
    assert len(rows) == len(seen.stored)  # nothing more, nothing half-written
    assert {external_id: content for external_id, content, _ in rows} == seen.stored
    assert {copies for _, _, copies in rows} == {1}
    assert "Internal Server Error" not in web_log.read_text(errors="replace")


# --------------------------------------------------------------------------------------------------
# Redis of the test's own.
# --------------------------------------------------------------------------------------------------


def _redis(port: int, folder: Path) -> subprocess.Popen:
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(folder)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    import redis

    def up() -> bool:
        assert process.poll() is None, "redis-server exited"
        try:
            return redis.Redis(port=port, socket_connect_timeout=1).ping()
        except redis.RedisError:
            return False

    _wait(up, 30, f"redis-server on port {port}")
    return process


def test_redis_stopped_while_an_upload_commits_keeps_it_and_the_sweep_sends_it_later(
    subprocess_env, needs_service, tmp_path, client_for, make_user, make_project, monkeypatch
):
    from flywheel.celery import app as celery_app
    from flywheel.trajectories import upload as upload_module
    from flywheel.trajectories.models import Trajectory, Upload, UploadStatus

    needs_service(shutil.which("redis-server") is not None, "redis-server is not installed")
    port = _free_port()
    broker_url = f"redis://127.0.0.1:{port}/0"
    redis_server = _redis(port, tmp_path)
    worker_log = tmp_path / "worker.log"
    env = {
        **subprocess_env,
        "DJANGO_SETTINGS_MODULE": "flywheel.settings",
        "CELERY_BROKER_URL": broker_url,
        "CELERY_TASK_ALWAYS_EAGER": "false",
        "FLYWHEEL_SWEEP_INTERVAL_S": "1",
        "FLYWHEEL_REQUEUE_AFTER_S": "2",
        "PYTHONUNBUFFERED": "1",
    }
    with open(worker_log, "wb") as log:
        # The worker with beat embedded, as `make run` starts it.
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "flywheel", "worker", "-B", "-s", str(tmp_path / "beat-schedule"),
             "-Q", "default", "-P", "solo", "--without-gossip", "--without-mingle", "--without-heartbeat",
             "-l", "INFO", "-n", f"faults-{os.getpid()}@%h"],
            cwd=REPO_DIR, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    # This process sends to the test's Redis too. Celery reads CELERY_BROKER_URL from the environment
    # before its configuration.
    saved = (celery_app.conf.broker_url, celery_app.conf.broker_transport_options)
    monkeypatch.setenv("CELERY_BROKER_URL", broker_url)
    celery_app.conf.update(broker_url=broker_url, broker_transport_options={})
    assert celery_app.conf.broker_url == broker_url
    celery_app._pool = None
    celery_app.amqp._producer_pool = None
    try:
        _wait(lambda: " ready." in worker_log.read_text(errors="replace"), 120, "the worker", worker_log)
        redis_server.terminate()  # Redis goes away
        redis_server.wait(timeout=30)

        user = make_user()
        project = make_project(owner=user)
        monkeypatch.setattr(upload_module, "INLINE_MAX_BYTES", 10)  # in this process: queue it for a worker
        upload = upload_module.upload_create(
            project=project, filename="a.jsonl", content=b"".join(
                json.dumps({"external_id": f"t-{i}", "messages": [{"role": "user", "content": f"hello {i}"}]}).encode() + b"\n"
                for i in range(3)
            ),
        )
        upload.refresh_from_db()
        assert (upload.status, upload.error) == (UploadStatus.QUEUED, "")  # committed, kept, waiting
        page = client_for(user).get(reverse("upload_detail", args=[project.slug, upload.pk])).content.decode()
        assert "Waiting for a worker" in page
        time.sleep(3)  # past FLYWHEEL_REQUEUE_AFTER_S: the sweeps beat sends now find no broker
        assert Upload.objects.get(pk=upload.pk).status == UploadStatus.QUEUED

        redis_server = _redis(port, tmp_path)  # Redis is back, empty: the message is not in it
        _wait(
            lambda: Upload.objects.filter(pk=upload.pk, status=UploadStatus.DONE).exists(), 120,
            "the upload ingested after Redis came back", worker_log,
        )  # fmt: skip
        done = Upload.objects.get(pk=upload.pk)
        assert (done.attempt, done.accepted, done.created) == (1, 3, 3)
        assert Trajectory.objects.filter(project=project).count() == 3
        assert "flywheel.outbox_sweep" in worker_log.read_text(errors="replace")
        print(f"\nRedis stopped at commit: the upload stayed queued; ingested {(done.finished_at - done.created_at).total_seconds():.1f}s after it was made")
    finally:
        celery_app.conf.update(broker_url=saved[0], broker_transport_options=saved[1])
        celery_app._pool = None
        celery_app.amqp._producer_pool = None
        _stop(worker)
        _stop(redis_server)
