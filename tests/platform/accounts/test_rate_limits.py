"""Abuse limits: API token buckets per key and per address (429 with Retry-After), login lockouts by
django-axes per address and per account, and the buckets' atomicity under concurrent spenders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from datetime import timedelta

import pytest
from axes.models import AccessAttempt
from django.contrib.auth import get_user_model
from django.db import connection, connections
from django.test import Client
from django.urls import reverse

from flywheel.accounts import ratelimit
from flywheel.accounts.models import RateBucket

LIST = "/api/v1/trajectories"
OTLP = "/api/v1/otlp/v1/traces"
PASSWORD = "the-right-password"


class Clock:
    """The rate limiter's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 1_900_000_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(ratelimit, "clock", fake)
    return fake


def api_get(key: str | None, *, address: str = "127.0.0.1", **headers: str):
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return Client().get(LIST, headers=headers, REMOTE_ADDR=address)


# --- API: a bucket per key ---------------------------------------------------------------------------------


def test_a_burst_beyond_the_bucket_gets_429_with_retry_after_and_the_bucket_refills(
    settings, clock, project, make_api_key
):
    settings.FLYWHEEL_API_RATE_PER_S = 0.5  # a token every 2 s
    settings.FLYWHEEL_API_BURST = 3
    key = make_api_key(project)
    other = make_api_key(project, name="other")

    assert [api_get(key).status_code for _ in range(3)] == [200, 200, 200]
    refused = api_get(key)
    assert refused.status_code == 429
    assert refused["Retry-After"] == "2"
    detail = refused.json()["detail"]
    assert "FLYWHEEL_API_RATE_PER_S" in detail and "FLYWHEEL_API_BURST" in detail and "0.5 a second" in detail
    # Another key of the same project has its own bucket.
    assert api_get(other).status_code == 200

    clock.advance(1)  # half a token: still refused, and the wait shrinks
    again = api_get(key)
    assert again.status_code == 429 and again["Retry-After"] == "1"
    clock.advance(1)
    assert api_get(key).status_code == 200
    assert api_get(key).status_code == 429
    clock.advance(60)  # refills up to the burst, not beyond
    assert [api_get(key).status_code for _ in range(4)] == [200, 200, 200, 429]


def test_a_refused_request_spends_nothing(settings, clock, project, make_api_key):
    settings.FLYWHEEL_API_RATE_PER_S = 1
    settings.FLYWHEEL_API_BURST = 1
    key = make_api_key(project)
    assert api_get(key).status_code == 200
    for _ in range(5):
        assert api_get(key).status_code == 429
    clock.advance(1)
    assert api_get(key).status_code == 200


def test_the_otlp_endpoint_answers_429_as_a_google_rpc_status_with_retry_after(
    settings, clock, project, make_api_key
):
    settings.FLYWHEEL_API_RATE_PER_S = 0.25
    settings.FLYWHEEL_API_BURST = 1
    key = make_api_key(project)
    client = Client()
    headers = {"Authorization": f"Bearer {key}"}
    assert client.post(OTLP, "{}", content_type="application/json", headers=headers).status_code == 200
    refused = client.post(OTLP, "{}", content_type="application/json", headers=headers)
    assert refused.status_code == 429
    assert refused["Retry-After"] == "4"
    status = json.loads(refused.content)
    assert status["code"] == 8  # RESOURCE_EXHAUSTED
    assert "FLYWHEEL_API_RATE_PER_S" in status["message"]


def test_rate_zero_turns_the_key_limit_off(settings, clock, project, make_api_key):
    settings.FLYWHEEL_API_RATE_PER_S = 0
    settings.FLYWHEEL_API_BURST = 1
    key = make_api_key(project)
    assert {api_get(key).status_code for _ in range(5)} == {200}
    assert not RateBucket.objects.exists()


# --- API: failed keys per client address -------------------------------------------------------------------


def test_bad_keys_from_one_address_get_429_while_a_good_key_from_another_address_works(
    settings, clock, project, make_api_key
):
    settings.FLYWHEEL_API_AUTH_FAILURES_PER_MIN = 6  # a token every 10 s
    settings.FLYWHEEL_API_AUTH_FAILURE_BURST = 3
    good = make_api_key(project)
    attacker, bystander = "203.0.113.9", "198.51.100.7"

    assert [api_get(f"fw_bad_{i}", address=attacker).status_code for i in range(3)] == [401, 401, 401]
    refused = api_get("fw_bad_4", address=attacker)
    assert refused.status_code == 429
    assert refused["Retry-After"] == "10"
    assert "FLYWHEEL_API_AUTH_FAILURES_PER_MIN" in refused.json()["detail"]
    # Refused before the key is looked up: a good key from that address waits too...
    assert api_get(good, address=attacker).status_code == 429
    # ... while other addresses are not affected.
    assert api_get(good, address=bystander).status_code == 200
    assert api_get("fw_bad_5", address=bystander).status_code == 401
    # Requests without any key are not key failures.
    assert api_get(None, address=bystander).status_code == 401

    clock.advance(10)
    assert api_get(good, address=attacker).status_code == 200  # good keys cost the address nothing
    assert api_get("fw_bad_6", address=attacker).status_code == 401
    assert api_get("fw_bad_7", address=attacker).status_code == 429


def test_ipv6_failures_count_per_64_prefix(db, settings, clock):
    settings.FLYWHEEL_API_AUTH_FAILURES_PER_MIN = 1
    settings.FLYWHEEL_API_AUTH_FAILURE_BURST = 2
    assert api_get("fw_x", address="2001:db8:1:2::1").status_code == 401
    assert api_get("fw_x", address="2001:db8:1:2:ffff::9").status_code == 401
    assert api_get("fw_x", address="2001:db8:1:2::77").status_code == 429
    assert api_get("fw_x", address="2001:db8:1:3::1").status_code == 401  # another /64


def test_x_forwarded_for_counts_only_behind_the_configured_proxies(db, settings, clock):
    settings.FLYWHEEL_API_AUTH_FAILURES_PER_MIN = 1
    settings.FLYWHEEL_API_AUTH_FAILURE_BURST = 1
    # No trusted proxy (the default): a forged X-Forwarded-For changes nothing.
    assert api_get("fw_x", address="10.0.0.1", **{"X-Forwarded-For": "1.1.1.1"}).status_code == 401
    assert api_get("fw_x", address="10.0.0.1", **{"X-Forwarded-For": "2.2.2.2"}).status_code == 429
    # Behind one proxy (10.9.9.9), the client is the last entry, whatever the client put before it.
    settings.FLYWHEEL_TRUSTED_PROXY_COUNT = 1
    via_proxy = {"address": "10.9.9.9"}
    assert api_get("fw_x", **via_proxy, **{"X-Forwarded-For": "6.6.6.6, 3.3.3.3"}).status_code == 401
    assert api_get("fw_x", **via_proxy, **{"X-Forwarded-For": "7.7.7.7, 3.3.3.3"}).status_code == 429
    assert api_get("fw_x", **via_proxy, **{"X-Forwarded-For": "4.4.4.4"}).status_code == 401
    # A header the proxy did not write (too short, or not an address): the socket's address is used.
    assert api_get("fw_x", **via_proxy, **{"X-Forwarded-For": "not-an-ip"}).status_code == 401
    assert api_get("fw_x", **via_proxy).status_code == 429


def test_idle_buckets_are_pruned_once_they_would_be_full(db, clock):
    ratelimit.rate_bucket_take(name="addr:192.0.2.1", rate=0.1, burst=5)
    clock.advance(40)
    ratelimit.rate_bucket_take(name="addr:192.0.2.2", rate=0.1, burst=5)
    clock.advance(20)  # the first bucket is full again (50 s after its take); the second is not
    assert ratelimit.rate_buckets_prune(prefix="addr:", rate=0.1, burst=5) == 1
    assert list(RateBucket.objects.values_list("name", flat=True)) == ["addr:192.0.2.2"]


# --- the buckets' atomicity --------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_concurrent_takes_never_spend_more_than_the_bucket_holds(clock):
    """Threads with their own database connections spend one bucket at once. With a read-then-write the
    takes interleave and more are granted than the bucket held; the single upsert grants exactly `burst`,
    also while the first takes race to create the row."""
    threads, takes_each, burst = 8, 20, 40
    barrier = threading.Barrier(threads)
    granted: list[int] = []

    def spend() -> None:
        try:
            barrier.wait()
            mine = 0
            for _ in range(takes_each):
                # No refill: the clock stands still (and the rate is tiny besides).
                mine += ratelimit.rate_bucket_take(name="key:contended", rate=1e-9, burst=burst).granted
            granted.append(mine)
        finally:
            connections.close_all()

    workers = [threading.Thread(target=spend) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(granted) == threads, f"a thread failed ({connection.vendor})"
    assert sum(granted) == burst
    assert RateBucket.objects.get(name="key:contended").tokens == pytest.approx(0.0, abs=1e-6)


# --- logins ------------------------------------------------------------------------------------------------


@pytest.fixture
def login_limits(settings):
    settings.AXES_FAILURE_LIMIT = 3
    settings.AXES_COOLOFF_TIME = timedelta(minutes=15)
    return settings


def login(username: str, password: str, *, address: str, url: str | None = None):
    return Client().post(
        url or reverse("login"), {"username": username, "password": password}, REMOTE_ADDR=address
    )


def assert_locked_out(response) -> int:
    assert response.status_code == 429
    page = response.content.decode()
    assert "Too many login attempts" in page and "Try again in" in page
    retry_after = int(response["Retry-After"])
    assert 14 * 60 < retry_after <= 15 * 60 + 1
    assert response["Content-Security-Policy"]  # a page of ours, not a bare library answer
    return retry_after


def test_an_address_is_locked_out_after_the_limit_even_with_the_right_password(login_limits, make_user):
    make_user("alice", password=PASSWORD)
    for name in ("nobody1", "nobody2"):
        assert login(name, "guess", address="203.0.113.5").status_code == 200  # the form again
    assert_locked_out(login("nobody3", "guess", address="203.0.113.5"))  # the limit-th failure locks
    assert_locked_out(login("alice", PASSWORD, address="203.0.113.5"))
    # Alice's account is not locked: she logs in from elsewhere.
    assert login("alice", PASSWORD, address="198.51.100.1").status_code == 302


def test_an_account_is_locked_out_after_the_limit_from_any_address(login_limits, make_user):
    make_user("bob", password=PASSWORD)
    make_user("carol", password=PASSWORD)
    for i in range(2):
        assert login("bob", "guess", address=f"203.0.113.{10 + i}").status_code == 200
    assert_locked_out(login("bob", "guess", address="203.0.113.12"))
    assert_locked_out(login("bob", PASSWORD, address="198.51.100.2"))
    # The address itself is not locked: another account logs in from it.
    assert login("carol", PASSWORD, address="198.51.100.2").status_code == 302


def test_the_lockout_ends_after_the_cool_off(login_limits, make_user):
    make_user("dave", password=PASSWORD)
    for _ in range(3):
        login("dave", "guess", address="203.0.113.20")
    retry_after = assert_locked_out(login("dave", PASSWORD, address="203.0.113.20"))
    # The page says the truth: the time passes (axes counts by the attempts' stored times): not quite long enough...
    AccessAttempt.objects.update(
        attempt_time=AccessAttempt.objects.get().attempt_time - timedelta(seconds=retry_after - 5)
    )
    assert login("dave", PASSWORD, address="203.0.113.20").status_code == 429
    # ... then the time the page named has passed.
    AccessAttempt.objects.update(attempt_time=AccessAttempt.objects.get().attempt_time - timedelta(seconds=5))
    assert login("dave", PASSWORD, address="203.0.113.20").status_code == 302


def test_the_lockout_page_names_when_the_earliest_counted_attempts_expire(login_limits, make_user):
    make_user("erin", password=PASSWORD)
    login_limits.AXES_FAILURE_LIMIT = 5
    for i in range(4):  # four rows, one failure each...
        assert login("erin", "guess", address=f"203.0.113.{30 + i}").status_code == 200
    login_limits.AXES_FAILURE_LIMIT = 3
    now_rows = list(AccessAttempt.objects.order_by("ip_address"))
    base = now_rows[0].attempt_time
    for minutes_ago, row in zip((14, 12, 1, 0), now_rows, strict=True):
        AccessAttempt.objects.filter(pk=row.pk).update(attempt_time=base - timedelta(minutes=minutes_ago))
    # ...4 failures counted, limit 3: locked until the two oldest stop counting (12 min ago + 15 min).
    response = login("erin", PASSWORD, address="198.51.100.3")
    assert response.status_code == 429
    assert 2 * 60 < int(response["Retry-After"]) <= 3 * 60 + 1


def test_the_admin_login_is_limited_too(login_limits, make_user):
    make_user("root", password=PASSWORD, is_staff=True, is_superuser=True)
    admin_login = reverse("admin:login")
    for _ in range(2):
        assert login("root", "guess", address="203.0.113.40", url=admin_login).status_code == 200
    assert_locked_out(login("root", "guess", address="203.0.113.40", url=admin_login))
    assert_locked_out(login("root", PASSWORD, address="203.0.113.41", url=admin_login))
    # One count for both doors: the account is locked on the login page as well.
    assert_locked_out(login("root", PASSWORD, address="203.0.113.42"))


def test_a_forged_x_forwarded_for_does_not_escape_the_address_lockout(login_limits, make_user):
    make_user("frank", password=PASSWORD)
    statuses = [
        Client().post(
            reverse("login"), {"username": f"x{i}", "password": "guess"},
            REMOTE_ADDR="203.0.113.50", HTTP_X_FORWARDED_FOR=f"10.0.0.{i}",
        ).status_code
        for i in range(3)
    ]  # fmt: skip
    assert statuses == [200, 200, 429]
    response = Client().post(
        reverse("login"), {"username": "frank", "password": PASSWORD},
        REMOTE_ADDR="203.0.113.50", HTTP_X_FORWARDED_FOR="10.0.0.99",
    )  # fmt: skip
    assert_locked_out(response)


def test_logins_below_the_limit_and_force_login_are_untouched(login_limits, make_user, client_for):
    user = make_user("gina", password=PASSWORD)
    assert login("gina", "typo", address="203.0.113.60").status_code == 200
    assert login("gina", PASSWORD, address="203.0.113.60").status_code == 302
    assert client_for(user).get("/").status_code == 200
    assert get_user_model().objects.filter(username="gina").exists()


# --- settings ----------------------------------------------------------------------------------------------


def test_the_limits_come_from_the_environment():
    code = (
        "from django.conf import settings as s; import json; print(json.dumps([s.FLYWHEEL_API_RATE_PER_S, "
        "s.FLYWHEEL_API_BURST, s.FLYWHEEL_API_AUTH_FAILURES_PER_MIN, s.FLYWHEEL_API_AUTH_FAILURE_BURST, "
        "s.FLYWHEEL_TRUSTED_PROXY_COUNT, s.AXES_ENABLED, s.AXES_FAILURE_LIMIT, s.AXES_COOLOFF_TIME.total_seconds()]))"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "flywheel.settings",
        "FLYWHEEL_API_RATE_PER_S": "2.5",
        "FLYWHEEL_API_BURST": "7",
        "FLYWHEEL_API_AUTH_FAILURES_PER_MIN": "3",
        "FLYWHEEL_API_AUTH_FAILURE_BURST": "4",
        "FLYWHEEL_TRUSTED_PROXY_COUNT": "1",
        "FLYWHEEL_LOGIN_FAILURE_LIMIT": "6",
        "FLYWHEEL_LOGIN_COOLOFF_MINUTES": "30",
    }
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == [2.5, 7, 3.0, 4, 1, True, 6, 1800.0]
    off = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "FLYWHEEL_LOGIN_FAILURE_LIMIT": "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert json.loads(off.stdout.splitlines()[-1])[5] is False
