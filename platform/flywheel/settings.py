"""Django settings. Everything configurable comes from the environment through `flywheel.env`;
the defaults make `make run` work on one machine with nothing set (SQLite, a filesystem broker,
MLflow on a local SQLite store)."""

from __future__ import annotations

from pathlib import Path

import dj_database_url

from flywheel.env import get_env, get_list

BASE_DIR = Path(__file__).resolve().parent.parent.parent  # the repository root
VAR_DIR = Path(get_env("FLYWHEEL_VAR_DIR", str(BASE_DIR / "var")))
VAR_DIR.mkdir(parents=True, exist_ok=True)

# Production (docker-compose) sets FLYWHEEL_ENV=production: then SECRET_KEY is required and DEBUG is off.
PRODUCTION = get_env("FLYWHEEL_ENV", "development") == "production"
DEBUG = get_env("DEBUG", not PRODUCTION, cast=bool)
SECRET_KEY = get_env("SECRET_KEY") if PRODUCTION else get_env("SECRET_KEY", "dev-insecure-key-not-for-production")
ALLOWED_HOSTS = get_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = get_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_htmx",
    "ninja",  # serves the API docs page's Swagger UI from its own static files, not a CDN
    "flywheel.accounts",
    "flywheel.trajectories",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "flywheel.accounts.middleware.ContentSecurityPolicyMiddleware",
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
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # WAL lets the web server and the worker share the file without "database is locked".
    DATABASES["default"].setdefault("OPTIONS", {})["init_command"] = (
        "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; PRAGMA busy_timeout=5000;"
    )
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
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
# A JSONL file uploaded in the UI is held in memory and in one database row while it is ingested.
FLYWHEEL_MAX_UPLOAD_BYTES = get_env("FLYWHEEL_MAX_UPLOAD_BYTES", 5 * FLYWHEEL_MAX_REQUEST_BYTES, cast=int)
DATA_UPLOAD_MAX_MEMORY_SIZE = FLYWHEEL_MAX_REQUEST_BYTES + 1024 * 1024
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
CELERY_RESULT_BACKEND = get_env("CELERY_RESULT_BACKEND", None)
CELERY_TASK_ALWAYS_EAGER = get_env("CELERY_TASK_ALWAYS_EAGER", False, cast=bool)
CELERY_TASK_ACKS_LATE = True  # a worker that dies mid-task leaves the message for a retry
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ROUTES = {"flywheel.training.*": {"queue": "gpu"}}
CELERY_TASK_DEFAULT_QUEUE = "default"

MLFLOW_TRACKING_URI = get_env("MLFLOW_TRACKING_URI", f"sqlite:///{VAR_DIR / 'mlflow.db'}")
MLFLOW_ARTIFACT_ROOT = get_env("MLFLOW_ARTIFACT_ROOT", str(VAR_DIR / "mlartifacts"))
FLYWHEEL_JOBS_DIR = Path(get_env("FLYWHEEL_JOBS_DIR", str(VAR_DIR / "jobs")))
FLYWHEEL_MODELS_DIR = Path(get_env("FLYWHEEL_MODELS_DIR", str(VAR_DIR / "models")))

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": get_env("LOG_LEVEL", "INFO")},
}
