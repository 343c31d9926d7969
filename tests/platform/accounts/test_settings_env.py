"""Settings come from the environment through one reader, which fails loudly on a missing or bad value."""

import os
import subprocess
import sys

import pytest

from flywheel.env import MissingSetting, get_env, get_list


def test_a_missing_required_setting_names_the_variable(monkeypatch):
    monkeypatch.delenv("FLYWHEEL_TEST_REQUIRED", raising=False)
    with pytest.raises(MissingSetting, match="FLYWHEEL_TEST_REQUIRED is required"):
        get_env("FLYWHEEL_TEST_REQUIRED")


def test_an_empty_value_counts_as_unset(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_TEST_X", "")
    assert get_env("FLYWHEEL_TEST_X", "fallback") == "fallback"
    with pytest.raises(MissingSetting):
        get_env("FLYWHEEL_TEST_X")


@pytest.mark.parametrize(("raw", "value"), [("1", True), ("true", True), ("On", True), ("0", False), ("no", False)])
def test_booleans(monkeypatch, raw, value):
    monkeypatch.setenv("FLYWHEEL_TEST_BOOL", raw)
    assert get_env("FLYWHEEL_TEST_BOOL", False, cast=bool) is value


@pytest.mark.parametrize(("raw", "cast"), [("maybe", bool), ("12x", int)])
def test_a_bad_value_names_the_variable_and_the_value(monkeypatch, raw, cast):
    monkeypatch.setenv("FLYWHEEL_TEST_BAD", raw)
    with pytest.raises(MissingSetting, match=f"FLYWHEEL_TEST_BAD='{raw}' is invalid"):
        get_env("FLYWHEEL_TEST_BAD", cast=cast)


def test_lists(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_TEST_LIST", " a.example, b.example ,,")
    assert get_list("FLYWHEEL_TEST_LIST", []) == ["a.example", "b.example"]
    monkeypatch.delenv("FLYWHEEL_TEST_LIST")
    assert get_list("FLYWHEEL_TEST_LIST", ["x"]) == ["x"]


def _load_settings(**env):
    base = {k: v for k, v in os.environ.items() if k not in {"SECRET_KEY", "FLYWHEEL_ENV", "DEBUG"}}
    return subprocess.run(
        [sys.executable, "-c", "from django.conf import settings; print(settings.DEBUG, settings.DATABASES['default']['ENGINE'])"],
        capture_output=True, text=True, env={**base, "DJANGO_SETTINGS_MODULE": "flywheel.settings", **env},
        timeout=120, check=False,
    )  # fmt: skip


def test_production_without_a_secret_key_refuses_to_start():
    result = _load_settings(FLYWHEEL_ENV="production")
    assert result.returncode != 0
    assert "environment variable SECRET_KEY is required" in result.stderr


def test_production_with_a_secret_key_runs_without_debug():
    result = _load_settings(FLYWHEEL_ENV="production", SECRET_KEY="s" * 50, DATABASE_URL="postgres://u@db:5432/fw")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "django.db.backends.postgresql"]


def test_with_nothing_set_development_runs_on_sqlite():
    result = _load_settings(DATABASE_URL="")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "django.db.backends.sqlite3"]


def _run_in_settings(code: str, **env):
    base = {k: v for k, v in os.environ.items() if k not in {"SECRET_KEY", "FLYWHEEL_ENV", "DEBUG", "SECURE_HSTS_SECONDS"}}
    return subprocess.run(
        [sys.executable, "-c", "import django; django.setup(); from django.conf import settings\n" + code],
        capture_output=True, text=True, env={**base, "DJANGO_SETTINGS_MODULE": "flywheel.settings", **env},
        timeout=120, check=False,
    )  # fmt: skip


_SECURITY = (
    "print(getattr(settings, 'SECURE_PROXY_SSL_HEADER', None), settings.SESSION_COOKIE_SECURE, "
    "settings.CSRF_COOKIE_SECURE, settings.SECURE_HSTS_SECONDS, settings.SECURE_CONTENT_TYPE_NOSNIFF, "
    "settings.WHITENOISE_USE_FINDERS, sep='|')"
)
PRODUCTION = {"FLYWHEEL_ENV": "production", "SECRET_KEY": "s" * 50}


def test_production_trusts_the_tls_proxy_and_sends_cookies_over_https_only():
    result = _run_in_settings(_SECURITY, **PRODUCTION)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().split("|") == [
        "('HTTP_X_FORWARDED_PROTO', 'https')", "True", "True", str(365 * 24 * 3600), "True", "False"
    ]  # fmt: skip


def test_production_hsts_comes_from_the_environment():
    result = _run_in_settings(_SECURITY, SECURE_HSTS_SECONDS="600", **PRODUCTION)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().split("|")[3] == "600"
    bad = _run_in_settings(_SECURITY, SECURE_HSTS_SECONDS="a year", **PRODUCTION)
    assert bad.returncode != 0
    assert "SECURE_HSTS_SECONDS='a year' is invalid" in bad.stderr


def test_development_keeps_plain_http_cookies_and_serves_static_from_the_finders():
    result = _run_in_settings(_SECURITY)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().split("|") == ["None", "False", "False", "0", "True", "True"]


def test_production_serves_the_collected_static_files(tmp_path):
    """As the image does: collectstatic into FLYWHEEL_STATIC_ROOT, then whitenoise serves from there only."""
    code = (
        "from django.core.management import call_command\n"
        "from django.test import Client\n"
        "call_command('collectstatic', '--noinput', verbosity=0)\n"
        "client = Client()\n"
        "ok = client.get('/static/flywheel/app.css')\n"
        "print(ok.status_code, ok['Content-Type'].split(';')[0], ok.get('X-Content-Type-Options'))\n"
    )
    static_root = tmp_path / "collected"
    result = _run_in_settings(code, FLYWHEEL_STATIC_ROOT=str(static_root), DATABASE_URL="", **PRODUCTION)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["200", "text/css", "nosniff"]
    assert (static_root / "flywheel" / "app.css").is_file()

    # Nothing collected: nothing served, so a stale or missing collectstatic shows at once.
    empty = _run_in_settings(
        "from django.test import Client\nprint(Client().get('/static/flywheel/app.css').status_code)",
        FLYWHEEL_STATIC_ROOT=str(tmp_path / "empty"), DATABASE_URL="", **PRODUCTION,
    )  # fmt: skip
    assert empty.returncode == 0, empty.stderr
    assert empty.stdout.split() == ["404"]


def test_the_upload_limit_defaults_to_five_requests_and_comes_from_the_environment():
    code = "print(settings.FLYWHEEL_MAX_REQUEST_BYTES, settings.FLYWHEEL_MAX_UPLOAD_BYTES)"
    default = _run_in_settings(code, FLYWHEEL_MAX_REQUEST_BYTES="1000", FLYWHEEL_MAX_UPLOAD_BYTES="")
    assert default.returncode == 0, default.stderr
    assert default.stdout.split() == ["1000", "5000"]
    chosen = _run_in_settings(code, FLYWHEEL_MAX_UPLOAD_BYTES="123456")
    assert chosen.returncode == 0, chosen.stderr
    assert chosen.stdout.split()[1] == "123456"
