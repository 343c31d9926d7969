"""Every request the platform sends to a URL someone typed (webhooks, vLLM, environment servers, the llm_judge
endpoint) goes through here: only to destinations the operator's settings allow.

FLYWHEEL_OUTBOUND_ALLOWLIST lists hostnames, `*.suffix` names, IP addresses and CIDR networks that may be
private, loopback or link-local; any other such address is refused, and public ones unless
FLYWHEEL_OUTBOUND_PUBLIC is false. The check that counts is at send time, on the resolved address, with the
connection pinned to the address checked (DNS rebinding) and no redirect followed: `trainer.outbound` does
it, so the platform and the trainer (a subprocess fed these settings through its environment) share one
implementation. `check_url_field` is the earlier check a form or a model runs at save time.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError

from trainer import outbound as guard
from trainer.outbound import OutboundError, OutboundRefused, Response

__all__ = ["OutboundError", "OutboundRefused", "Response", "check_url_field", "policy", "post",
           "post_json", "subprocess_env"]


def policy() -> guard.Policy:
    """The operator's policy, read from the settings at each call (tests and reloads change them)."""
    return guard.Policy.parse(getattr(settings, "FLYWHEEL_OUTBOUND_ALLOWLIST", []) or [],
                              public=getattr(settings, "FLYWHEEL_OUTBOUND_PUBLIC", True))


def post(url: str, *, body: bytes, headers: dict[str, str] | None = None, timeout: float = 10.0,
         max_bytes: int = 1 << 16) -> Response:
    """POST `body` where the policy allows; the answer whatever its status. Raises OutboundRefused (not
    allowed, or a redirect), OutboundError (no such host) or OSError (refused, timed out)."""
    return guard.request(url, body=body, headers=headers, timeout=timeout, policy=policy(), max_bytes=max_bytes)


def post_json(url: str, payload: Any, *, headers: dict[str, str] | None = None, timeout: float = 10.0) -> Response:
    return guard.post_json(url, payload, headers=headers, timeout=timeout, policy=policy())


def check_url_field(url: str, field: str) -> None:
    """At save time: a URL whose host is, or resolves to, an address the policy refuses is a field error.

    A host that does not resolve now is let through (it may be up by the time anything is sent); the
    send-time check refuses it then if it must."""
    if not url:
        return
    try:
        guard.check_url(url, policy())
    except OutboundRefused as exc:
        raise ValidationError({field: f"{exc} (ask the operator to list it, or use another address)"}) from None
    except OutboundError as exc:
        if "does not resolve" not in str(exc):
            raise ValidationError({field: str(exc)}) from None


def subprocess_env() -> dict[str, str]:
    """The policy as the environment of a trainer subprocess (`trainer.outbound.env_policy` reads it back)."""
    return {guard.ALLOWLIST_VAR: ",".join(getattr(settings, "FLYWHEEL_OUTBOUND_ALLOWLIST", []) or []),
            guard.PUBLIC_VAR: "true" if getattr(settings, "FLYWHEEL_OUTBOUND_PUBLIC", True) else "false"}
