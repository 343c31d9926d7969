"""Fixtures shared by the whole suite: model factories, an API client, and a real Celery worker.

Tests run against whatever DATABASE_URL and CELERY_BROKER_URL name: SQLite and a filesystem broker when
they are unset, PostgreSQL and Redis in CI (`.ci/run`). In CI (CI=true) a missing service fails the
session or the test; it never skips. Outside CI a test that needs a service it cannot have skips, saying so.

Every test session gets its own scratch `var/` (MLflow store, job and model folders, broker folders) and
its own broker namespace, so tests never touch the developer's `make run` data, and two sessions sharing
one Redis never take each other's tasks.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit

import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO_DIR = TESTS_DIR.parent
T = TypeVar("T")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def _fail_or_skip(reason: str) -> None:
    """Skip outside CI; fail in CI, where every service must be there."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: a missing service is a failure, not a skip)", pytrace=False)
    pytest.skip(reason)


# --------------------------------------------------------------------------------------------------
# Session set-up: the CI guard and per-session isolation.
# --------------------------------------------------------------------------------------------------


def _check_ci_services() -> None:
    """In CI the suite must run on PostgreSQL and Redis; anything else fails the session at once."""
    database_url = os.environ.get("DATABASE_URL", "")
    broker_url = os.environ.get("CELERY_BROKER_URL", "")
    problems = []
    if not database_url.startswith(("postgres://", "postgresql://")):
        problems.append(f"DATABASE_URL must point at PostgreSQL in CI, got {database_url or '(unset)'!r}")
    else:
        import psycopg

        parts = urlsplit(database_url)
        try:
            psycopg.connect(
                host=parts.hostname or None,
                port=parts.port or 5432,
                user=parts.username or None,
                password=parts.password or None,
                dbname="postgres",
                connect_timeout=5,
            ).close()
        except psycopg.Error as exc:
            problems.append(f"PostgreSQL at {parts.hostname}:{parts.port} is unreachable: {exc}")
    if not broker_url.startswith(("redis://", "rediss://")):
        problems.append(f"CELERY_BROKER_URL must point at Redis in CI, got {broker_url or '(unset)'!r}")
    else:
        import redis

        try:
            redis.Redis.from_url(broker_url, socket_connect_timeout=3, socket_timeout=3).ping()
        except redis.RedisError as exc:
            problems.append(f"Redis at {broker_url} is unreachable: {exc}")
    if problems:
        raise pytest.UsageError("CI=true but the services are not there:\n  " + "\n  ".join(problems))


@dataclass(frozen=True)
class TestSession:
    """What one test process (one xdist worker) uses: its scratch folder and its broker namespace."""

    var_dir: Path
    broker_url: str
    broker_options: dict[str, Any]
    worker_id: str


def _isolate_session(config: pytest.Config) -> TestSession:
    from django.conf import settings

    from flywheel.celery import app as celery_app

    worker_id = getattr(config, "workerinput", {}).get("workerid", "main")
    var_dir = Path(tempfile.mkdtemp(prefix=f"flywheel-test-{worker_id}-"))
    # Subprocesses the tests start (the Celery worker, manage.py, the trainer) read the same folder.
    os.environ["FLYWHEEL_VAR_DIR"] = str(var_dir)
    settings.VAR_DIR = var_dir
    settings.STATIC_ROOT = var_dir / "static"
    settings.FLYWHEEL_JOBS_DIR = var_dir / "jobs"
    settings.FLYWHEEL_MODELS_DIR = var_dir / "models"
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        settings.MLFLOW_TRACKING_URI = f"sqlite:///{var_dir / 'mlflow.db'}"
        settings.MLFLOW_ARTIFACT_ROOT = str(var_dir / "mlartifacts")

    # Automatic triage (a message after every ingest) is off unless a test turns it on (the triage tests do):
    # elsewhere its tasks would run on the session's worker while the test database is flushed after a test.
    os.environ["FLYWHEEL_TRIAGE"] = "false"
    settings.FLYWHEEL_TRIAGE = False

    # The suite's stand-in servers (webhook receivers, environment servers, judge endpoints) listen on
    # 127.0.0.1: the operator's outbound allowlist lists that address, as a deployment lists its internal hosts.
    # Only the address: "localhost" and every other loopback or private address stay refused
    # (tests/platform/test_outbound.py overrides the list to test refusals of 127.0.0.1 itself).
    os.environ["FLYWHEEL_OUTBOUND_ALLOWLIST"] = "127.0.0.1"
    settings.FLYWHEEL_OUTBOUND_ALLOWLIST = ["127.0.0.1"]

    # Web processes a test starts (gunicorn, runserver) load nothing ahead (the sentence model, MLflow).
    os.environ["FLYWHEEL_PRELOAD"] = "false"
    settings.FLYWHEEL_PRELOAD = False

    # PBKDF2's deliberate slowness costs about a second a user on two busy cores; tests need no such defence.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

    broker_url = settings.CELERY_BROKER_URL
    if broker_url.startswith("filesystem://"):
        queue = var_dir / "broker" / "queue"
        processed = var_dir / "broker" / "processed"
        queue.mkdir(parents=True)
        processed.mkdir(parents=True)
        options: dict[str, Any] = {
            "data_folder_in": str(queue),
            "data_folder_out": str(queue),
            "processed_folder": str(processed),
            "control_folder": str(var_dir / "broker" / "control"),
            "store_processed": False,
            "polling_interval": 0.1,
        }
    elif broker_url.startswith(("redis://", "rediss://")):
        # A key prefix makes this session's queues its own on a Redis that other sessions share.
        options = {"global_keyprefix": f"fwtest-{uuid.uuid4().hex[:8]}-{worker_id}:"}
    else:
        options = dict(getattr(settings, "CELERY_BROKER_TRANSPORT_OPTIONS", {}) or {})
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = options
    celery_app.conf.update(broker_url=broker_url, broker_transport_options=options)
    # Drop producer pools made with the old options, should anything have been sent already.
    celery_app._pool = None
    celery_app.amqp._producer_pool = None
    return TestSession(var_dir=var_dir, broker_url=broker_url, broker_options=options, worker_id=worker_id)


_session_key = pytest.StashKey[TestSession]()


def pytest_configure(config: pytest.Config) -> None:
    if in_ci() and not hasattr(config, "workerinput"):
        _check_ci_services()
    config.stash[_session_key] = _isolate_session(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    session = config.stash.get(_session_key, None)
    if session is not None:
        shutil.rmtree(session.var_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def test_session(request: pytest.FixtureRequest) -> TestSession:
    """This process's scratch folder (`var_dir`) and broker (`broker_url`, `broker_options`)."""
    return request.config.stash[_session_key]


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix: None, test_session: TestSession) -> None:
    """SQLite tests use a file, not memory, so that a worker subprocess can open the same database."""
    from django.conf import settings

    db = settings.DATABASES["default"]
    if db["ENGINE"] == "django.db.backends.sqlite3":
        db.setdefault("TEST", {})["NAME"] = str(test_session.var_dir / "test.sqlite3")


# --------------------------------------------------------------------------------------------------
# Services a test may need.
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def needs_service() -> Callable[[bool, str], None]:
    """`needs_service(available, "what is missing")`: skip the test outside CI, fail it in CI."""

    def check(available: bool, reason: str) -> None:
        if not available:
            _fail_or_skip(reason)

    return check


@pytest.fixture
def needs_postgres(db: None) -> None:
    """For tests whose subject only PostgreSQL has (concurrent upserts, its query plans)."""
    from django.db import connection

    if connection.vendor != "postgresql":
        _fail_or_skip(f"needs PostgreSQL (DATABASE_URL points at {connection.vendor})")


@pytest.fixture(scope="session")
def chromium_executable() -> str:
    """Path of Debian's Chromium for browser tests (`.ci/run` installs it)."""
    path = os.environ.get("CHROMIUM_PATH") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        _fail_or_skip("Chromium is not installed (apt-get install -y chromium)")
    return path


# --------------------------------------------------------------------------------------------------
# Factories. They go through the services, as the application does.
# --------------------------------------------------------------------------------------------------

_counter = itertools.count(1)
DEFAULT_PASSWORD = "test-password-123"


@pytest.fixture
def make_user(db: None) -> Callable[..., Any]:
    """`make_user(username=None, *, password=DEFAULT_PASSWORD, **fields) -> User`."""
    from django.contrib.auth import get_user_model

    def make(username: str | None = None, *, password: str = DEFAULT_PASSWORD, **fields: Any) -> Any:
        username = username or f"user{next(_counter)}"
        return get_user_model().objects.create_user(username=username, password=password, **fields)

    return make


@pytest.fixture
def make_project(db: None) -> Callable[..., Any]:
    """`make_project(slug=None, *, name="", owner=None) -> Project`; the owner becomes a maintainer."""
    from flywheel.accounts.services import project_create

    def make(slug: str | None = None, *, name: str = "", owner: Any = None, description: str = "") -> Any:
        slug = slug or f"project-{next(_counter)}"
        return project_create(slug=slug, name=name or slug.replace("-", " ").title(), owner=owner, description=description)

    return make


@pytest.fixture
def make_membership(db: None) -> Callable[..., Any]:
    """`make_membership(user, project, role="viewer") -> Membership` (sets the role if one exists)."""
    from flywheel.accounts.services import membership_set

    def make(user: Any, project: Any, role: str = "viewer") -> Any:
        return membership_set(project=project, user=user, role=role)

    return make


class RawKey(str):
    """A raw API key (use it as the Bearer token), with the stored `ApiKey` row at `.api_key`."""

    api_key: Any


@pytest.fixture
def make_api_key(db: None) -> Callable[..., RawKey]:
    """`make_api_key(project, *, scopes=("ingest", "read"), name="test key") -> RawKey` (a str)."""
    from flywheel.accounts.services import api_key_create

    def make(project: Any, *, scopes: Iterable[str] = ("ingest", "read"), name: str = "test key") -> RawKey:
        issued = api_key_create(project=project, name=name, scopes=list(scopes))
        raw = RawKey(issued.raw_key)
        raw.api_key = issued.api_key
        return raw

    return make


@pytest.fixture
def user(make_user: Callable[..., Any]) -> Any:
    return make_user()


@pytest.fixture
def project(make_project: Callable[..., Any], user: Any) -> Any:
    """A project that `user` maintains."""
    return make_project(owner=user)


@pytest.fixture
def api_key(make_api_key: Callable[..., RawKey], project: Any) -> RawKey:
    """A raw key of `project` with both scopes."""
    return make_api_key(project)


@pytest.fixture
def client_for(db: None) -> Callable[[Any], Any]:
    """`client_for(user) -> django.test.Client` logged in as `user` (None: anonymous)."""
    from django.test import Client

    def make(user: Any) -> Any:
        client = Client()
        if user is not None:
            client.force_login(user)
        return client

    return make


# --------------------------------------------------------------------------------------------------
# The JSON API.
# --------------------------------------------------------------------------------------------------

_UNSET: Any = object()


class ApiClient:
    """Django's test client speaking to /api/v1 with a Bearer key.

    `key` on the client is the default; each call may pass `key=` (None sends no Authorization header)."""

    def __init__(self, key: str | None = None) -> None:
        from django.test import Client

        self.client = Client()
        self.key = key

    def with_key(self, key: str | None) -> ApiClient:
        return ApiClient(key)

    def _headers(self, key: Any, headers: dict[str, str] | None) -> dict[str, str]:
        key = self.key if key is _UNSET else key
        merged = dict(headers or {})
        if key is not None:
            merged.setdefault("Authorization", f"Bearer {key}")
        return merged

    def get(self, path: str, params: dict[str, Any] | None = None, *, key: Any = _UNSET, headers: dict[str, str] | None = None) -> Any:
        return self.client.get(path, params or {}, headers=self._headers(key, headers))

    def post(
        self,
        path: str,
        data: Any = None,
        *,
        key: Any = _UNSET,
        content_type: str = "application/json",
        body: bytes | str | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """POST `data` as JSON, or `body` as it is with `content_type`."""
        payload = body if body is not None else json.dumps(data)
        return self.client.post(path, payload, content_type=content_type, headers=self._headers(key, headers))

    def put(self, path: str, data: Any = None, *, key: Any = _UNSET) -> Any:
        """PUT `data` as JSON."""
        return self.client.put(path, json.dumps(data), content_type="application/json", headers=self._headers(key, None))

    def post_ndjson(self, path: str, records: Iterable[dict[str, Any]], *, key: Any = _UNSET) -> Any:
        body = "".join(json.dumps(record) + "\n" for record in records)
        return self.post(path, body=body, content_type="application/x-ndjson", key=key)


@pytest.fixture
def api_client(db: None) -> ApiClient:
    """An `ApiClient` with no default key: pass `key=` per call, or use `api_client.with_key(key)`."""
    return ApiClient()


# --------------------------------------------------------------------------------------------------
# A real Celery worker.
# --------------------------------------------------------------------------------------------------


def _database_url_for_subprocess() -> str:
    """A DATABASE_URL naming the database this test process uses now (the test database)."""
    from django.db import connection

    db = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{db['NAME']}"
    if connection.vendor == "postgresql":
        auth = quote(db.get("USER") or "", safe="")
        if db.get("PASSWORD"):
            auth += ":" + quote(db["PASSWORD"], safe="")
        host = db.get("HOST") or "localhost"
        port = db.get("PORT") or 5432
        return f"postgres://{auth}@{host}:{port}/{quote(db['NAME'], safe='')}"
    raise RuntimeError(f"no DATABASE_URL for a {connection.vendor} test database")


@pytest.fixture
def subprocess_env(transactional_db: None, test_session: TestSession) -> dict[str, str]:
    """Environment for a subprocess (`manage.py ...`, a script) that must see this test's database.

    The test gets `transactional_db`, so what it writes is committed and visible to the subprocess."""
    return {
        **os.environ,
        "DATABASE_URL": _database_url_for_subprocess(),
        "CELERY_BROKER_URL": test_session.broker_url,
        "FLYWHEEL_VAR_DIR": str(test_session.var_dir),
    }


@dataclass
class CeleryWorker:
    """A `celery -A flywheel worker` subprocess consuming the `default` and `gpu` queues."""

    process: subprocess.Popen
    log_path: Path
    _offset: int = 0
    _received: set[str] = field(default_factory=set)
    _ended: set[str] = field(default_factory=set)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def assert_alive(self) -> None:
        if self.process.poll() is not None:
            pytest.fail(f"the Celery worker exited with {self.process.returncode}:\n{self.log_tail()}", pytrace=False)

    def wait_for(self, condition: Callable[[], T], timeout: float = 30.0, interval: float = 0.05) -> T:
        """Poll `condition` until it returns something truthy; fail with the worker's log on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            self.assert_alive()
            if time.monotonic() > deadline:
                pytest.fail(f"not done after {timeout:.0f}s; worker log:\n{self.log_tail()}", pytrace=False)
            time.sleep(interval)


    def wait_idle(self, timeout: float = 60.0) -> None:
        """Wait until every task the worker received has ended (its log says so), so that the database is
        not flushed under a task still writing (PostgreSQL then detects a deadlock between the flush's
        TRUNCATE and the task's INSERT). Gives up quietly after `timeout`: the test itself has ended."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            self._read_log()
            if self._received <= self._ended:
                return
            time.sleep(0.1)

    def _read_log(self) -> None:
        """Task ids received and ended, read on from where the last call stopped (the log only grows)."""
        with self.log_path.open("rb") as fh:
            fh.seek(self._offset)
            chunk = fh.read()
        cut = chunk.rfind(b"\n") + 1  # a half-written last line is read next time
        self._offset += cut
        text = chunk[:cut].decode("utf-8", "replace")
        self._received.update(_TASK_RECEIVED.findall(text))
        self._ended.update(_TASK_ENDED.findall(text))


_TASK_RECEIVED = re.compile(r"Task [\w.]+\[([0-9a-f-]+)\] received")
_TASK_ENDED = re.compile(r"Task [\w.]+\[([0-9a-f-]+)\] (?:succeeded|raised|retry|failed)")
# The worker this test process started, if any: tests that queue work without waiting for it (a move's
# sync, sent on commit) leave it running, and the next flush must not race it.
_STARTED_WORKERS: list[CeleryWorker] = []


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Before a test's fixtures are torn down (its database flushed), let this process's worker finish."""
    for worker in _STARTED_WORKERS:
        worker.wait_idle(timeout=30)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()  # SIGTERM: warm shutdown
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


@pytest.fixture(scope="session")
def _celery_worker_process(
    django_db_setup: None, django_db_blocker: Any, test_session: TestSession
) -> Iterator[CeleryWorker]:
    # Depends on django_db_setup so that it stops before the test database is dropped.
    if test_session.broker_url.startswith(("redis://", "rediss://")):
        import redis

        try:
            redis.Redis.from_url(test_session.broker_url, socket_connect_timeout=3).ping()
        except redis.RedisError as exc:
            pytest.fail(f"CELERY_BROKER_URL={test_session.broker_url} is unreachable: {exc}", pytrace=False)
    with django_db_blocker.unblock():
        database_url = _database_url_for_subprocess()
    log_path = test_session.var_dir / "celery-worker.log"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "celery_worker_settings",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")])),
        "DATABASE_URL": database_url,
        "CELERY_BROKER_URL": test_session.broker_url,
        "FLYWHEEL_TEST_BROKER_OPTIONS": json.dumps(test_session.broker_options),
        "FLYWHEEL_VAR_DIR": str(test_session.var_dir),
        "CELERY_TASK_ALWAYS_EAGER": "false",
    }
    command = [
        sys.executable, "-m", "celery", "-A", "flywheel", "worker",
        "-Q", "default,gpu", "-P", "solo", "-c", "1",
        "--without-gossip", "--without-mingle", "--without-heartbeat",
        "-l", "INFO", "-n", f"test-{test_session.worker_id}-{os.getpid()}@%h",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO_DIR, env=env, stdout=log, stderr=subprocess.STDOUT)
    worker = CeleryWorker(process=process, log_path=log_path)
    _STARTED_WORKERS.append(worker)
    try:
        deadline = time.monotonic() + 120
        while " ready." not in worker.log():
            worker.assert_alive()
            if time.monotonic() > deadline:
                pytest.fail(f"the Celery worker did not start in 120s:\n{worker.log_tail()}", pytrace=False)
            time.sleep(0.1)
        yield worker
    finally:
        _stop(process)


@pytest.fixture
def celery_worker(_celery_worker_process: CeleryWorker, transactional_db: None) -> CeleryWorker:
    """A real worker (one per test process, started on first use) on this session's broker and test database.

    Tasks it runs see only committed rows, so the test gets `transactional_db`; queue work the way the
    application does (`transaction.on_commit(...)`) and wait with `celery_worker.wait_for(lambda: ...)`.
    Wait for what you queued before the test ends: the database is flushed after each test (and
    `pytest_runtest_teardown` waits for the tasks still running before it is)."""
    _celery_worker_process.assert_alive()
    return _celery_worker_process


# --------------------------------------------------------------------------------------------------
# The tiny CPU model: built once per machine (cached by the hash of the code that builds it).
# --------------------------------------------------------------------------------------------------

# The model depends on these files only: a change to any of them rebuilds it.
TINY_SOURCES = ["trainer/tiny.py", "trainer/sft.py", "trainer/envs/workplace/tasks.py",
                "trainer/envs/workplace/world.py", "trainer/envs/workplace/tools.py"]


def _tiny_key() -> str:
    import hashlib

    h = hashlib.sha256()
    for rel in TINY_SOURCES:
        h.update((REPO_DIR / rel).read_bytes())
    return h.hexdigest()[:16]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ready tiny model directory (the path `trainer.models.load_model` takes)."""
    import torch

    from trainer.tiny import build_tiny

    # pytest-of-<user>/ outlives one session's basetemp; that is the "cached under a tmp dir".
    cache = tmp_path_factory.getbasetemp().parent / f"flywheel-tiny-{_tiny_key()}"
    if not (cache / "tiny.json").exists():
        threads = torch.get_num_threads()
        torch.set_num_threads(int(os.environ.get("FLYWHEEL_TEST_THREADS", "1")))
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        build_tiny(tmp)
        shutil.rmtree(cache, ignore_errors=True)
        tmp.rename(cache)
        torch.set_num_threads(threads)
    return cache
