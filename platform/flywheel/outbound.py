"""Every request the platform sends to a URL someone typed (webhooks, vLLM, environment servers, the llm_judge
endpoint) goes through here: only to destinations the operator's settings allow.

FLYWHEEL_OUTBOUND_ALLOWLIST lists hostnames, `*.suffix` names, IP addresses and CIDR networks that may be
private, loopback or link-local; any other such address is refused, and public ones unless
FLYWHEEL_OUTBOUND_PUBLIC is false. The check that counts is at send time, on the resolved address, with the
connection pinned to the address checked (DNS rebinding) and no redirect followed: `trainer.outbound` does
it, so the platform and the trainer (a subprocess fed these settings through its environment) share one
implementation, with one overall deadline per request. `check_url_field` is the earlier check a form or a
model runs at save time: it also refuses a URL with credentials in it (they belong in the secret fields).

A secret given with a URL (the judge's API key, the webhook's signing secret) is bound to that URL's origin
(`origin`): a new URL on another origin needs the secret given again, so a changed address never receives a
secret meant for the old one. Any URL written into an error, a delivery log or an exception's text goes
through `redact` or `redact_url` first (no user, password, query or fragment).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.core.exceptions import ValidationError

from trainer import outbound as guard
from trainer.outbound import OutboundError, OutboundRefused, Response, redact, redact_url

__all__ = ["OutboundError", "OutboundRefused", "Response", "check_url_field", "origin", "policy", "post",
           "post_json", "redact", "redact_url", "secret_rebind_error", "subprocess_env"]


def policy() -> guard.Policy:
    """The operator's policy, read from the settings at each call (tests and reloads change them)."""
    return guard.Policy.parse(getattr(settings, "FLYWHEEL_OUTBOUND_ALLOWLIST", []) or [],
                              public=getattr(settings, "FLYWHEEL_OUTBOUND_PUBLIC", True))


def post(url: str, *, body: bytes, headers: dict[str, str] | None = None, timeout: float = 10.0,
         max_bytes: int = 1 << 16) -> Response:
    """POST `body` where the policy allows; the answer whatever its status, all of it within `timeout`
    seconds. Raises OutboundRefused (not allowed, or a redirect), OutboundError (no such host, credentials in
    the URL) or OSError (refused; TimeoutError past the deadline)."""
    return guard.request(url, body=body, headers=headers, timeout=timeout, policy=policy(), max_bytes=max_bytes)


def post_json(url: str, payload: Any, *, headers: dict[str, str] | None = None, timeout: float = 10.0) -> Response:
    return guard.post_json(url, payload, headers=headers, timeout=timeout, policy=policy())


def check_url_field(url: str, field: str) -> None:
    """At save time: a URL with a user name or password in it, or whose host is, or resolves to, an address the
    policy refuses, is a field error.

    A host that does not resolve now is let through (it may be up by the time anything is sent); the
    send-time check refuses it then if it must."""
    if not url:
        return
    check_no_credentials(url, field)
    try:
        guard.check_url(url, policy())
    except OutboundRefused as exc:
        raise ValidationError({field: f"{exc} (ask the operator to list it, or use another address)"}) from None
    except OutboundError as exc:
        if "does not resolve" not in str(exc):
            raise ValidationError({field: str(exc)}) from None


def check_no_credentials(url: str, field: str) -> None:
    """A URL with a user name or password in it (`https://user:pass@host/`) is a field error: whoever can see
    the URL (a viewer of an error, a log) would see them. Credentials go in the secret fields."""
    try:
        netloc = urlsplit(url).netloc
    except ValueError:
        return  # malformed: the field's own check says so
    if "@" in netloc:
        raise ValidationError({field: "Remove the user name and password from the URL (user:password@host): "
                                      "put credentials in the secret fields, which are never shown back."})


def origin(url: str) -> tuple[str, str, int] | None:
    """The (scheme, host, port) a secret given with `url` is bound to, the default port filled in; None for
    no URL or a malformed one."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return None
    if not parts.scheme or not parts.hostname:
        return None
    return parts.scheme.lower(), parts.hostname.lower().rstrip("."), port or {"https": 443, "http": 80}.get(
        parts.scheme.lower(), 0)


def secret_rebind_error(*, old_url: str, new_url: str, secret_set: bool, secret_given: bool,
                        what: str, clear_hint: str) -> str | None:
    """Why a stored secret cannot stay when its URL moves to another origin (None when it may): it was given
    for the old origin only, so it must be given again (or cleared) with the new URL."""
    if not secret_set or secret_given or not new_url or origin(old_url) == origin(new_url):
        return None
    return (f"The stored {what} was given for {_origin_text(old_url)}, not for {_origin_text(new_url)}: give it "
            f"again for the new address, or {clear_hint}.")


def _origin_text(url: str) -> str:
    found = origin(url)
    if found is None:
        return "no address"
    scheme, host, port = found
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"


def subprocess_env() -> dict[str, str]:
    """The policy as the environment of a trainer subprocess (`trainer.outbound.env_policy` reads it back)."""
    return {guard.ALLOWLIST_VAR: ",".join(getattr(settings, "FLYWHEEL_OUTBOUND_ALLOWLIST", []) or []),
            guard.PUBLIC_VAR: "true" if getattr(settings, "FLYWHEEL_OUTBOUND_PUBLIC", True) else "false"}
