"""Django settings. Everything configurable comes from the environment through `flywheel.env`;
the defaults make `make run` work on one machine with nothing set (SQLite, a filesystem broker,
MLflow on a local SQLite store)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import dj_database_url

from flywheel.env import MissingSetting, get_env, get_list

BASE_DIR = Path(__file__).resolve().parent.parent.parent  # the repository root
VAR_DIR = Path(get_env("FLYWHEEL_VAR_DIR", str(BASE_DIR / "var")))
VAR_DIR.mkdir(parents=True, exist_ok=True)

# Production (docker-compose) sets FLYWHEEL_ENV=production: then SECRET_KEY is required and DEBUG is off.
PRODUCTION = get_env("FLYWHEEL_ENV", "development") == "production"
DEBUG = get_env("DEBUG", not PRODUCTION, cast=bool)
SECRET_KEY = get_env("SECRET_KEY") if PRODUCTION else get_env("SECRET_KEY", "dev-insecure-key-not-for-production")
# Earlier keys, after a rotation: they still verify sessions and open the secrets they sealed (flywheel.sealed).
SECRET_KEY_FALLBACKS = get_list("SECRET_KEY_FALLBACKS", [])
ALLOWED_HOSTS = get_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = get_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "flywheel.accounts.apps.SuperuserAdminConfig",  # django.contrib.admin, for superusers only
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_htmx",
    "ninja",  # serves the API docs page's Swagger UI from its own static files, not a CDN
    "axes",  # login attempts limited per client address and per account (AXES_* below)
    "flywheel.accounts",
    "flywheel.trajectories",
    "flywheel.failures",
    "flywheel.failures.clustering",
    "flywheel.evals",
    "flywheel.environments",
    "flywheel.registry",
    "flywheel.training",
    "flywheel.seed",  # no models: the demo seeding above every app, its command and task
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # A database that is away answers 503 + Retry-After, not 500 (flywheel.db_errors).
    "flywheel.db_errors.DatabaseUnavailableMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "flywheel.accounts.middleware.ContentSecurityPolicyMiddleware",
    # Under DEBUG, the project's 404 page instead of Django's technical one (whose inline style the CSP blocks).
    "flywheel.accounts.middleware.NotFoundPageMiddleware",
    # Last, as django-axes asks: it turns a refused login into the lockout page.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "flywheel.urls"
WSGI_APPLICATION = "flywheel.wsgi.application"
ASGI_APPLICATION = "flywheel.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": dj_database_url.parse(
        get_env("DATABASE_URL", f"sqlite:///{VAR_DIR / 'flywheel.sqlite3'}"),
        conn_max_age=get_env("DATABASE_CONN_MAX_AGE", 60, cast=int),
        # A kept connection is checked before a request reuses it: after a database restart the next
        # request reconnects instead of failing on the dead connection.
        conn_health_checks=True,
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # `make run`: the web server and the worker write one file. WAL lets readers go on beside the writer.
    # A transaction that reads then writes (the portable upsert) must take the write lock when it begins:
    # a deferred one that reads first cannot wait for a writer when it upgrades, and SQLite answers
    # "database is locked" at once. Then "timeout" (seconds) is how long a writer waits for its turn.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        init_command="PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        transaction_mode="IMMEDIATE",
        timeout=get_env("SQLITE_BUSY_TIMEOUT_S", 30, cast=int),
    )
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
# AxesStandaloneBackend first: it refuses a locked-out address or account before any password is checked.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "project_list"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
# Where collectstatic writes and whitenoise serves from. The image collects at build time into a folder
# of the image (Dockerfile), not under the data volume, which would hide what the build put there.
STATIC_ROOT = Path(get_env("FLYWHEEL_STATIC_ROOT", str(VAR_DIR / "static")))
# Development and tests serve straight from the finders; production serves what collectstatic collected.
WHITENOISE_USE_FINDERS = not PRODUCTION
WHITENOISE_AUTOREFRESH = DEBUG

SESSION_COOKIE_HTTPONLY = True
CSRF_COOKIE_HTTPONLY = False  # htmx reads it to send X-CSRFToken
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
if PRODUCTION:
    # Production runs behind a TLS-terminating proxy (README, "Production"), which must set
    # X-Forwarded-Proto itself and drop what the client sent.
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    # Browsers send HSTS only over HTTPS; 0 turns it off (say, while trying TLS out).
    SECURE_HSTS_SECONDS = get_env("SECURE_HSTS_SECONDS", 365 * 24 * 3600, cast=int)

# Ingestion limits. A request over the limit is refused with 413 naming the limit.
FLYWHEEL_MAX_REQUEST_BYTES = get_env("FLYWHEEL_MAX_REQUEST_BYTES", 20 * 1024 * 1024, cast=int)
FLYWHEEL_MAX_BATCH_RECORDS = get_env("FLYWHEEL_MAX_BATCH_RECORDS", 5000, cast=int)
# What one OTLP trace may grow to across exports (a long-lived trace must not grow without bound); spans and
# messages past these are dropped, and the export's answer says so in partial_success.
FLYWHEEL_OTLP_MAX_SPANS_PER_TRACE = get_env("FLYWHEEL_OTLP_MAX_SPANS_PER_TRACE", 2000, cast=int)
FLYWHEEL_OTLP_MAX_MESSAGES_PER_TRACE = get_env("FLYWHEEL_OTLP_MAX_MESSAGES_PER_TRACE", 1000, cast=int)
# A JSONL file uploaded in the UI is held in memory and in one database row while it is ingested.
FLYWHEEL_MAX_UPLOAD_BYTES = get_env("FLYWHEEL_MAX_UPLOAD_BYTES", 5 * FLYWHEEL_MAX_REQUEST_BYTES, cast=int)
DATA_UPLOAD_MAX_MEMORY_SIZE = FLYWHEEL_MAX_REQUEST_BYTES + 1024 * 1024

# Live evidence (flywheel.trajectories.vouch, flywheel.registry.evidence): how long after the router's answer a
# trajectory may first arrive with its evidence token and still be vouched for, and the most one API key's
# vouched trajectories may count of an arm when more than one key sends them (1 turns the cap off).
FLYWHEEL_EVIDENCE_TTL_HOURS = get_env("FLYWHEEL_EVIDENCE_TTL_HOURS", 24.0, cast=float)
FLYWHEEL_EVIDENCE_KEY_SHARE = get_env("FLYWHEEL_EVIDENCE_KEY_SHARE", 0.5, cast=float)
if not 0 < FLYWHEEL_EVIDENCE_KEY_SHARE <= 1:
    raise MissingSetting("environment variable FLYWHEEL_EVIDENCE_KEY_SHARE must be a share above 0 and at most 1")

# Abuse limits (README, "Abuse limits"). The client address is REMOTE_ADDR; behind N reverse proxies that
# each append to X-Forwarded-For (production's TLS proxy: 1), set FLYWHEEL_TRUSTED_PROXY_COUNT=N. Left at 0,
# a client cannot forge its address, but behind a proxy every client then shares the proxy's address.
FLYWHEEL_TRUSTED_PROXY_COUNT = get_env("FLYWHEEL_TRUSTED_PROXY_COUNT", 0, cast=int)
# API: a token bucket per key, spent by every request (0 turns it off), answering 429 with Retry-After.
FLYWHEEL_API_RATE_PER_S = get_env("FLYWHEEL_API_RATE_PER_S", 50.0, cast=float)
FLYWHEEL_API_BURST = get_env("FLYWHEEL_API_BURST", 200, cast=int)
# API: unknown or revoked keys, a bucket per client address (an IPv6 /64); when it is empty, every request
# from that address gets 429 until it refills. 0 turns it off.
FLYWHEEL_API_AUTH_FAILURES_PER_MIN = get_env("FLYWHEEL_API_AUTH_FAILURES_PER_MIN", 10.0, cast=float)
FLYWHEEL_API_AUTH_FAILURE_BURST = get_env("FLYWHEEL_API_AUTH_FAILURE_BURST", 20, cast=int)
# Logins (the login page and the admin's), by django-axes: after FLYWHEEL_LOGIN_FAILURE_LIMIT failures from
# one address, or for one username, within the cool-off, that address or account is refused (even with the
# right password) until the cool-off has passed since its latest failure. 0 turns it off.
FLYWHEEL_LOGIN_FAILURE_LIMIT = get_env("FLYWHEEL_LOGIN_FAILURE_LIMIT", 10, cast=int)
AXES_ENABLED = FLYWHEEL_LOGIN_FAILURE_LIMIT > 0
AXES_FAILURE_LIMIT = max(1, FLYWHEEL_LOGIN_FAILURE_LIMIT)
AXES_COOLOFF_TIME = timedelta(minutes=max(1, get_env("FLYWHEEL_LOGIN_COOLOFF_MINUTES", 15, cast=int)))
AXES_LOCKOUT_PARAMETERS = ["ip_address", "username"]  # each alone: either one reaching the limit locks
AXES_CLIENT_IP_CALLABLE = "flywheel.accounts.ratelimit.client_address"
AXES_LOCKOUT_CALLABLE = "flywheel.accounts.views.login_locked_out"
# Attempts while locked out are not counted, so the time the lockout page names stays true. A success does
# not reset the count either: else an attacker could clear an address's count by logging in to their own
# account between guesses.
AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT = False
AXES_RESET_ON_SUCCESS = False
FILE_UPLOAD_MAX_MEMORY_SIZE = 5 * 1024 * 1024

# Celery: a filesystem broker by default, so one machine runs a worker with no server.
CELERY_BROKER_URL = get_env("CELERY_BROKER_URL", "filesystem://")
BROKER_DIR = VAR_DIR / "broker"
if CELERY_BROKER_URL.startswith("filesystem://"):
    for sub in ("queue", "processed", "control"):
        (BROKER_DIR / sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(BROKER_DIR / "queue"),
        "data_folder_out": str(BROKER_DIR / "queue"),
        "processed_folder": str(BROKER_DIR / "processed"),
        # kombu's default is "control" relative to the working directory: keep it under var/ too.
        "control_folder": str(BROKER_DIR / "control"),
        "store_processed": False,
    }
    # Messages written aside and renamed into place, so a consumer never reads one half written.
    CELERY_BROKER_TRANSPORT = "flywheel.broker:FilesystemTransport"
CELERY_RESULT_BACKEND = get_env("CELERY_RESULT_BACKEND", None)
CELERY_TASK_ALWAYS_EAGER = get_env("CELERY_TASK_ALWAYS_EAGER", False, cast=bool)
CELERY_TASK_ACKS_LATE = True  # a worker that dies mid-task leaves the message for a retry
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# What runs a model goes to the `gpu` queue: one task at a time per GPU worker. A message there is a turn
# (flywheel.gpu_queue): the worker that takes it runs the waiting work of the project whose turn it is.
CELERY_TASK_ROUTES = {
    "flywheel.gpu_turn": {"queue": "gpu"},
    "flywheel.training.*": {"queue": "gpu"},
    "flywheel.evals.run": {"queue": "gpu"},
    "flywheel.registry.demo_model": {"queue": "gpu"},
    "flywheel.seed.demo_traffic": {"queue": "gpu"},
}
CELERY_IMPORTS = ["flywheel.gpu_queue"]
CELERY_TASK_DEFAULT_QUEUE = "default"
# Work that never reached a worker (a broker down at commit, a lost message, a worker that died) is sent
# again by a sweep that Celery beat runs (flywheel.outbox): `make run` and the compose stack's CPU worker
# embed beat (-B). A row waiting longer than FLYWHEEL_REQUEUE_AFTER_S is sent again.
FLYWHEEL_SWEEP_INTERVAL_S = get_env("FLYWHEEL_SWEEP_INTERVAL_S", 30, cast=float)
FLYWHEEL_REQUEUE_AFTER_S = get_env("FLYWHEEL_REQUEUE_AFTER_S", 60, cast=float)
# An upload's run holds a lease this long, renewed with every chunk; an expired lease may be taken over.
FLYWHEEL_UPLOAD_LEASE_S = get_env("FLYWHEEL_UPLOAD_LEASE_S", 300, cast=float)
# Triage detectors run on a worker after each ingest commits (flywheel.trajectories.triage); off: trajectories
# stay untriaged until a maintainer re-runs triage on the project's Triage page.
FLYWHEEL_TRIAGE = get_env("FLYWHEEL_TRIAGE", True, cast=bool)
# A web process loads, as it starts and in background threads, what its first use would load inside a person's
# request: the leakage guard's sentence model (about 10 s on two busy cores, 90 MB; the first "Run checks" of a
# promotion) and the MLflow client (about 7 s: the first Promote or rollback). Off: each loads on first use.
FLYWHEEL_PRELOAD = get_env("FLYWHEEL_PRELOAD", True, cast=bool)
# Name new clustering suggestions with the llm_judge verifier's OpenAI-compatible endpoint (off: keyword labels).
FLYWHEEL_CLUSTER_NAMING = get_env("FLYWHEEL_CLUSTER_NAMING", False, cast=bool)
# Where the platform and the trainer may send requests (webhooks, vLLM, environment servers, the llm_judge
# endpoint): private, loopback and link-local addresses are refused unless listed here (hostnames, *.suffix
# names, IP addresses, CIDR networks; comma separated), e.g. "vllm.internal,10.0.5.0/24". Public addresses are
# allowed unless FLYWHEEL_OUTBOUND_PUBLIC is false. Checked on the resolved address at send time; redirects
# are never followed (flywheel.outbound).
FLYWHEEL_OUTBOUND_ALLOWLIST = get_list("FLYWHEEL_OUTBOUND_ALLOWLIST", [])
FLYWHEEL_OUTBOUND_PUBLIC = get_env("FLYWHEEL_OUTBOUND_PUBLIC", True, cast=bool)
# Environment servers a maintainer may register (the trainer's `http` environment): URL prefixes, comma
# separated, e.g. "http://envs.internal:8000/,https://gym.example.com/". Empty: none may be registered. A server
# on a private address must also be allowed by FLYWHEEL_OUTBOUND_ALLOWLIST.
FLYWHEEL_ENV_URL_ALLOWLIST = get_list("FLYWHEEL_ENV_URL_ALLOWLIST", [])
# A reviewer's claim on a review-queue item lasts this long; an expired claim may be taken by another.
FLYWHEEL_QUEUE_CLAIM_S = get_env("FLYWHEEL_QUEUE_CLAIM_S", 600, cast=int)
# A running training job's worker writes a heartbeat this often; a job silent for the timeout is failed by the
# reaper (its worker vanished) and can be retried from its last checkpoint.
FLYWHEEL_JOB_HEARTBEAT_S = get_env("FLYWHEEL_JOB_HEARTBEAT_S", 5, cast=float)
FLYWHEEL_JOB_HEARTBEAT_TIMEOUT_S = get_env("FLYWHEEL_JOB_HEARTBEAT_TIMEOUT_S", 120, cast=float)
# A trainer subprocess inherits only what running Python, CUDA, torch, Hugging Face (offline), MLflow and TLS
# need (flywheel.supervise.trainer_env), never the platform's secrets; names listed here pass too (comma
# separated), e.g. "AWS_PROFILE,MY_SCRATCH_DIR".
FLYWHEEL_TRAINER_ENV = get_list("FLYWHEEL_TRAINER_ENV", [])
# The longest a task on the gpu queue (a training job, a measurement, an eval run) may run before it is stopped
# and failed (flywheel.timelimits.gpu): a bound on a run nobody cancels, not a budget. A retried job resumes
# from its last checkpoint.
FLYWHEEL_GPU_TASK_TIME_LIMIT_S = get_env("FLYWHEEL_GPU_TASK_TIME_LIMIT_S", 7 * 24 * 3600, cast=float)
# Bounds on GPU work (README, "Limits on GPU work"). A project may have this many training jobs not yet ended
# (measuring production, waiting for confirmation, queued, running) and this many eval runs queued or running;
# one more is refused with 409 naming the limit. 0 turns a limit off.
FLYWHEEL_MAX_JOBS_PER_PROJECT = get_env("FLYWHEEL_MAX_JOBS_PER_PROJECT", 3, cast=int)
FLYWHEEL_MAX_EVAL_RUNS_PER_PROJECT = get_env("FLYWHEEL_MAX_EVAL_RUNS_PER_PROJECT", 10, cast=int)
# The most optimizer steps one job may take, and the most generations (cases x samples a case) one measurement
# of a suite may take: an eval run, or a job's measurement of production and of its candidate.
FLYWHEEL_MAX_STEPS = get_env("FLYWHEEL_MAX_STEPS", 5000, cast=int)
FLYWHEEL_MAX_EVAL_GENERATIONS = get_env("FLYWHEEL_MAX_EVAL_GENERATIONS", 20000, cast=int)
# How many GPUs this worker reports when it starts (WorkerHeartbeat.gpus); unset: the devices it sees
# (CUDA_VISIBLE_DEVICES, else the NVIDIA driver's list). A job may ask for as many GPUs as the largest report of a
# `gpu` queue worker, and for 1 when none has reported any.
FLYWHEEL_WORKER_GPUS = get_env("FLYWHEEL_WORKER_GPUS", None, cast=int)
# Notifications by e-mail (flywheel.registry.notify) go through Django's mail backend: SMTP when EMAIL_HOST is
# set, else the console (the worker's log). Projects list their recipients on the Models page's settings.
EMAIL_HOST = get_env("EMAIL_HOST", "")
EMAIL_PORT = get_env("EMAIL_PORT", 25, cast=int)
EMAIL_HOST_USER = get_env("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = get_env("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = get_env("EMAIL_USE_TLS", False, cast=bool)
# Seconds an SMTP exchange may wait on the server (Django's default is to wait for ever).
EMAIL_TIMEOUT = get_env("EMAIL_TIMEOUT", 30, cast=int)
EMAIL_BACKEND = ("django.core.mail.backends.smtp.EmailBackend" if EMAIL_HOST
                 else "django.core.mail.backends.console.EmailBackend")
DEFAULT_FROM_EMAIL = get_env("DEFAULT_FROM_EMAIL", "flywheel@localhost")
CELERY_BEAT_SCHEDULE = {
    "outbox-sweep": {
        "task": "flywheel.outbox_sweep",
        "schedule": FLYWHEEL_SWEEP_INTERVAL_S,
        "options": {"expires": FLYWHEEL_SWEEP_INTERVAL_S},  # a sweep not run in time is replaced by the next
    },
    # The project list's "worker last seen": without a beat it was the start's one heartbeat, and a worker
    # that had been working for minutes read as one silent for minutes.
    "worker-heartbeat": {
        "task": "flywheel.accounts.worker_heartbeat",
        "schedule": FLYWHEEL_SWEEP_INTERVAL_S,
        "options": {"expires": FLYWHEEL_SWEEP_INTERVAL_S},
    },
}
# `make run` only (runlocal sets it for its workers): a round of the workplace demo's live traffic this often,
# while a canary or a watch runs there (flywheel.seed.traffic); 0, the default, plays none.
FLYWHEEL_DEMO_TRAFFIC_S = get_env("FLYWHEEL_DEMO_TRAFFIC_S", 0, cast=int)
if FLYWHEEL_DEMO_TRAFFIC_S > 0:
    CELERY_BEAT_SCHEDULE["demo-traffic"] = {
        "task": "flywheel.seed.demo_traffic",
        "schedule": FLYWHEEL_DEMO_TRAFFIC_S,
        # A round the gpu worker could not start in time (a training job holds it) is dropped, not piled up.
        "options": {"expires": FLYWHEEL_DEMO_TRAFFIC_S},
    }
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")

MLFLOW_TRACKING_URI = get_env("MLFLOW_TRACKING_URI", f"sqlite:///{VAR_DIR / 'mlflow.db'}")
MLFLOW_ARTIFACT_ROOT = get_env("MLFLOW_ARTIFACT_ROOT", str(VAR_DIR / "mlartifacts"))
FLYWHEEL_JOBS_DIR = Path(get_env("FLYWHEEL_JOBS_DIR", str(VAR_DIR / "jobs")))
FLYWHEEL_MODELS_DIR = Path(get_env("FLYWHEEL_MODELS_DIR", str(VAR_DIR / "models")))
# A project registers base models from its own folder, FLYWHEEL_MODELS_DIR/<project slug>/, and from the folder
# named here, which every project may use (e.g. "_shared": FLYWHEEL_MODELS_DIR/_shared/; a name no project slug
# can take). Empty: none is shared. Symbolic links are followed before the check, on each worker's disk.
FLYWHEEL_MODELS_SHARED = get_env("FLYWHEEL_MODELS_SHARED", "")
if FLYWHEEL_MODELS_SHARED in (".", "..") or "/" in FLYWHEEL_MODELS_SHARED or "\\" in FLYWHEEL_MODELS_SHARED:
    raise MissingSetting(f"FLYWHEEL_MODELS_SHARED={FLYWHEEL_MODELS_SHARED!r} must be one folder's name "
                         "under FLYWHEEL_MODELS_DIR, such as _shared")
# Registering a base model asks every worker to check its folder and waits this long for their answers.
FLYWHEEL_MODEL_CHECK_TIMEOUT_S = get_env("FLYWHEEL_MODEL_CHECK_TIMEOUT_S", 2.0, cast=float)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": get_env("LOG_LEVEL", "INFO")},
}
