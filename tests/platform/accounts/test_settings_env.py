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
