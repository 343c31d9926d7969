"""Abuse limits: token buckets for the API, the client's address, and when a login lockout ends.

The API spends one token per request from its key's bucket (FLYWHEEL_API_RATE_PER_S, FLYWHEEL_API_BURST) and
one token per unknown key from the client address's bucket (FLYWHEEL_API_AUTH_FAILURES_PER_MIN,
FLYWHEEL_API_AUTH_FAILURE_BURST); an empty bucket answers 429 with Retry-After. Logins are limited by
django-axes (settings.py), which asks `client_address` for the address and `login_lockout_end` tells the
lockout page when to come back.

Buckets live in one table (`RateBucket`) and each take is ONE statement, an upsert that refills, spends and
says whether it could, so that every web server process (gunicorn runs several) spends from the same
bucket, on PostgreSQL and on SQLite, with no other service. Time comes from the application's clock (`clock`), not the database's: one
expression serves both databases, tests can move time, and a host whose clock lags only refills nothing
(the elapsed time is floored at 0 and `updated_at` never goes back)."""

from __future__ import annotations

import ipaddress
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from axes.helpers import get_cool_off
from axes.models import AccessAttempt
from django.conf import settings
from django.db import connection
from django.http import HttpRequest
from ninja.errors import HttpError

from flywheel.accounts.models import RateBucket

# Seconds since the epoch. Tests replace it to move time without sleeping.
clock: Callable[[], float] = time.time

KEY_PREFIX = "key:"  # one bucket per API key, by its id
ADDRESS_PREFIX = "addr:"  # one bucket per client address that sent unknown keys
PRUNE_EVERY_S = 60.0
# time.monotonic() of this process's last prune: a cheap DELETE, but it need not run on every request.
_last_prune = -math.inf


@dataclass(frozen=True)
class Take:
    granted: bool
    tokens: float  # left in the bucket after this take (what there was, when refused)
    retry_after: int  # whole seconds until the tokens asked for are there again; 0 when granted


class RateLimited(HttpError):
    """429 with a Retry-After header. The API's error handler copies `headers` onto the answer, which is
    a `{"detail": ...}` or, on the OTLP endpoint, a google.rpc.Status RESOURCE_EXHAUSTED."""

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(429, message)
        self.retry_after = retry_after
        self.headers = {"Retry-After": str(retry_after)}


def _sql_functions() -> tuple[str, str]:
    # The only vendor difference: PostgreSQL's LEAST/GREATEST are SQLite's two-argument MIN/MAX.
    return ("MIN", "MAX") if connection.vendor == "sqlite" else ("LEAST", "GREATEST")


def _retry_after(tokens: float, cost: float, rate: float) -> int:
    if tokens >= cost:
        return 0
    return max(1, math.ceil((cost - tokens) / rate))


def rate_bucket_take(*, name: str, rate: float, burst: float, cost: float = 1.0) -> Take:
    """Spend `cost` tokens from bucket `name` (refilled at `rate` a second, holding at most `burst`) if it
    has them; refuse, spending nothing, if not. One atomic statement: concurrent takes never overspend."""
    least, greatest = _sql_functions()
    table = connection.ops.quote_name(RateBucket._meta.db_table)
    refilled = (
        f"{least}(%(burst)s, {table}.tokens + {greatest}(0.0, %(now)s - {table}.updated_at) * %(rate)s)"
    )
    # Both databases evaluate every SET expression on the row as it was, so `granted` and `tokens` agree.
    sql = (
        f"INSERT INTO {table} (name, tokens, updated_at, granted) "
        f"VALUES (%(name)s, %(initial)s, %(now)s, %(first)s) "
        f"ON CONFLICT (name) DO UPDATE SET "
        f"tokens = CASE WHEN {refilled} >= %(cost)s THEN {refilled} - %(cost)s ELSE {refilled} END, "
        f"granted = ({refilled} >= %(cost)s), "
        f"updated_at = {greatest}({table}.updated_at, %(now)s) "
        f"RETURNING tokens, granted"
    )
    params = {
        "name": name,
        "rate": float(rate),
        "burst": float(burst),
        "cost": float(cost),
        "now": clock(),
        "initial": float(burst - cost if burst >= cost else burst),  # a new bucket starts full
        "first": burst >= cost,
    }
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        tokens, granted = cursor.fetchone()
    granted = bool(granted)
    return Take(
        granted=granted, tokens=tokens, retry_after=0 if granted else _retry_after(tokens, cost, rate)
    )


def rate_bucket_peek(*, name: str, rate: float, burst: float, cost: float = 1.0) -> Take:
    """Whether bucket `name` holds `cost` tokens now, spending nothing (one read by primary key)."""
    # Raw SQL: every API request with a key makes this read, and the ORM would triple its cost.
    table = connection.ops.quote_name(RateBucket._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT tokens, updated_at FROM {table} WHERE name = %s", [name])
        row = cursor.fetchone()
    if row is None:
        return Take(granted=True, tokens=float(burst), retry_after=0)
    tokens = min(burst, row[0] + max(0.0, clock() - row[1]) * rate)
    return Take(granted=tokens >= cost, tokens=tokens, retry_after=_retry_after(tokens, cost, rate))


def rate_buckets_prune(*, prefix: str, rate: float, burst: float) -> int:
    """Delete the buckets of `prefix` idle for `burst / rate` seconds, full again whatever they held. A
    missing row is a full bucket, so this changes no answer. A take racing the delete either lands first
    (the row is then recent and the delete re-checks it) or inserts a fresh full bucket."""
    horizon = clock() - burst / rate
    deleted, _ = RateBucket.objects.filter(name__startswith=prefix, updated_at__lt=horizon).delete()
    return deleted


def _maybe_prune() -> None:
    global _last_prune
    now = time.monotonic()
    if now - _last_prune < PRUNE_EVERY_S:
        return
    _last_prune = now
    if settings.FLYWHEEL_API_RATE_PER_S > 0:
        rate_buckets_prune(prefix=KEY_PREFIX, rate=settings.FLYWHEEL_API_RATE_PER_S, burst=_key_burst())
    if settings.FLYWHEEL_API_AUTH_FAILURES_PER_MIN > 0:
        rate_buckets_prune(prefix=ADDRESS_PREFIX, rate=_failure_rate(), burst=_failure_burst())


# --- the client's address -------------------------------------------------------------------------------


def client_address(request: HttpRequest) -> str:
    """The client's IP address: REMOTE_ADDR, or, behind FLYWHEEL_TRUSTED_PROXY_COUNT proxies, the address
    the outermost of them saw, which is that many entries from the right of X-Forwarded-For (each proxy
    appends the address it received the request from; entries further left are the client's to forge).
    Anything that is not an IP address falls back to REMOTE_ADDR. django-axes uses it too."""
    remote = request.META.get("REMOTE_ADDR") or "0.0.0.0"
    count = settings.FLYWHEEL_TRUSTED_PROXY_COUNT
    if count <= 0:
        return remote
    forwarded = [part.strip() for part in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")]
    forwarded = [part for part in forwarded if part]
    if len(forwarded) < count:
        return remote  # the request did not come through every proxy: trust only the socket
    candidate = forwarded[-count]
    try:
        return str(ipaddress.ip_address(candidate))
    except ValueError:
        return remote


def _address_bucket(address: str) -> str:
    # An IPv6 client usually holds a whole /64: count its failures together, or it could rotate through them.
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return f"{ADDRESS_PREFIX}{address}"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return f"{ADDRESS_PREFIX}{ip.ipv4_mapped}"
        return f"{ADDRESS_PREFIX}{ipaddress.ip_network(f'{ip}/64', strict=False)}"
    return f"{ADDRESS_PREFIX}{ip}"


# --- the API's limits -------------------------------------------------------------------------------------


def _key_burst() -> float:
    return max(1.0, float(settings.FLYWHEEL_API_BURST))


def _failure_rate() -> float:
    return settings.FLYWHEEL_API_AUTH_FAILURES_PER_MIN / 60.0


def _failure_burst() -> float:
    return max(1.0, float(settings.FLYWHEEL_API_AUTH_FAILURE_BURST))


def _failures_refused(address: str, take: Take) -> RateLimited:
    return RateLimited(
        f"Too many requests with unknown or revoked API keys from {address}: the limit is "
        f"{settings.FLYWHEEL_API_AUTH_FAILURES_PER_MIN:g} a minute, {_failure_burst():g} at once "
        f"(FLYWHEEL_API_AUTH_FAILURES_PER_MIN, FLYWHEEL_API_AUTH_FAILURE_BURST). "
        f"Retry after {take.retry_after} s.",
        retry_after=take.retry_after,
    )


def api_address_check(*, address: str) -> None:
    """Raise RateLimited when `address` has used up its failed-key allowance, before any key is looked up."""
    if settings.FLYWHEEL_API_AUTH_FAILURES_PER_MIN <= 0:
        return
    take = rate_bucket_peek(name=_address_bucket(address), rate=_failure_rate(), burst=_failure_burst())
    if not take.granted:
        raise _failures_refused(address, take)


def api_address_failed(*, address: str) -> None:
    """Count an unknown or revoked key from `address`; raise RateLimited when there was no allowance left
    (a failure that raced others past the check above)."""
    if settings.FLYWHEEL_API_AUTH_FAILURES_PER_MIN <= 0:
        return
    _maybe_prune()
    take = rate_bucket_take(name=_address_bucket(address), rate=_failure_rate(), burst=_failure_burst())
    if not take.granted:
        raise _failures_refused(address, take)


def api_key_throttle(*, api_key_id: int) -> None:
    """Spend one request from the key's bucket; raise RateLimited when it is empty."""
    rate = settings.FLYWHEEL_API_RATE_PER_S
    if rate <= 0:
        return
    _maybe_prune()
    take = rate_bucket_take(name=f"{KEY_PREFIX}{api_key_id}", rate=rate, burst=_key_burst())
    if not take.granted:
        raise RateLimited(
            f"Too many requests with this API key: the limit is {rate:g} a second, {_key_burst():g} at once "
            f"(FLYWHEEL_API_RATE_PER_S, FLYWHEEL_API_BURST). Retry after {take.retry_after} s.",
            retry_after=take.retry_after,
        )


# --- logins (django-axes) ---------------------------------------------------------------------------------


def login_lockout_end(*, address: str | None, username: str | None, now: datetime) -> datetime | None:
    """When the login lockout of `address` or of `username` ends, or None if neither is locked out.

    Mirrors how django-axes counts (AXES_LOCKOUT_PARAMETERS ["ip_address", "username"]): the failures of
    the attempt rows whose latest failure lies within the cool-off, per address and per username; a row
    stops counting once its latest failure is older than the cool-off, the oldest first."""
    cool_off = get_cool_off()
    if not cool_off:
        return None
    limit = settings.AXES_FAILURE_LIMIT
    ends = []
    for field, value in (("ip_address", address), ("username", username)):
        if not value:
            continue
        rows = (
            AccessAttempt.objects.filter(**{field: value}, attempt_time__gte=now - cool_off)
            .order_by("attempt_time")
            .values_list("attempt_time", "failures_since_start")
        )
        counted = [(attempt_time, failures) for attempt_time, failures in rows]
        remaining = sum(failures for _, failures in counted)
        end = None
        for attempt_time, failures in counted:
            if remaining < limit:
                break
            end = attempt_time + cool_off
            remaining -= failures
        if end is not None:
            ends.append(end)
    return max(ends) if ends else None
