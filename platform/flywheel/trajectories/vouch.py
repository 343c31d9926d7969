"""Live evidence the platform vouches for: which version really answered a trajectory.

The reference router (flywheel.router) signs every answer it routes by the split with a token: HMAC-SHA256, under
the project's evidence key, over the version, the time and a request id of its own (the format is the router's:
`router.evidence_sign`). The agent's trajectory carries the token back in `metadata.flywheel_evidence`
(`flywheel_client.wrap` copies it from the answer; an OTLP span carries it as the attribute `flywheel.evidence`).
Ingestion (`ingest_trajectories`, so the REST API, JSONL uploads, OTLP and the command alike) checks it here and
records on the trajectory whether it is vouched for, or why not (`Trajectory.vouch`):

- `malformed`: not a token; `bad_mac`: not signed under the project's evidence key (nor one of SECRET_KEY_FALLBACKS');
- `other_version`: signed for another version than the one the trajectory's model_version names;
- `replayed`: its request id already vouched for another trajectory (another external_id), or the trajectory it
  vouched for is sent again by another key or user;
- `expired` / `future`: first sent more than FLYWHEEL_EVIDENCE_TTL_HOURS after the answer, or dated ahead of the
  platform's clock by more than CLOCK_SKEW_S.

A trajectory that is not vouched for is stored all the same: only the canary's and the watch's automatic actions
leave it out (flywheel.registry.evidence). A replay of a vouched trajectory by the key that sent it (the wrapper
sending the agent's reported outcome later) stays vouched, however late.

The evidence key is derived from SECRET_KEY by HKDF, one per project, as flywheel.sealed derives its own; the
router reads it with a key of scope `route` (`GET /api/v1/serving/evidence-key`). Rotating SECRET_KEY rotates it:
tokens signed under a key in SECRET_KEY_FALLBACKS still verify."""

from __future__ import annotations

import base64
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings

from flywheel.accounts.models import Project
from flywheel.router import evidence_parse
from flywheel.trajectories.models import Trajectory, Vouch

METADATA_KEY = "flywheel_evidence"  # where a trajectory carries its token
CLOCK_SKEW_S = 300  # how far ahead of the platform's clock a router's may run


# --- the key -------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _derive(secret: str, project_id: int) -> bytes:
    # A key of its own for this purpose and project: nothing else derived from SECRET_KEY shares it, and one
    # project's router cannot vouch for another project's traffic.
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=b"flywheel.evidence",
                info=b"v1:project:%d" % project_id).derive(secret.encode())


def evidence_keys(project_id: int) -> list[bytes]:
    """The keys a token of the project may be signed with: SECRET_KEY's first, then the fallbacks'."""
    return [_derive(s, project_id) for s in (settings.SECRET_KEY, *getattr(settings, "SECRET_KEY_FALLBACKS", []))]


def evidence_key_text(project: Project) -> str:
    """The project's current evidence key as the router reads it (base64url)."""
    return base64.urlsafe_b64encode(evidence_keys(project.pk)[0]).rstrip(b"=").decode()


# --- which version a name names ----------------------------------------------------------------------------
# The registry maps model_version strings to versions and sits above this app: it registers its resolver here.

_resolver: Callable[[Project, list[str]], dict[str, int]] | None = None


def version_resolver_set(resolver: Callable[[Project, list[str]], dict[str, int]]) -> None:
    """`resolver(project, names)` -> {name: version number} for the names that name a version."""
    global _resolver
    _resolver = resolver


# --- the check ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    """What a record claims: its external_id, the model_version it names and its token (anything; None: none)."""

    external_id: str
    model_version: str
    token: Any


def token_of(metadata: Any) -> Any:
    return metadata.get(METADATA_KEY) if isinstance(metadata, dict) else None


def vouch_claims(*, project: Project, claims: Iterable[Claim], ingested_by: str,
                 now: datetime) -> dict[str, tuple[str, str]]:
    """{external_id: (vouch, request id)} for the claims that carry a token, in the order given (a later record
    reusing an earlier one's request id for another external_id is the replay). The request id is kept for
    every token signed under the project's key, vouched or not, so that its replays are found."""
    claims = [c for c in claims if c.token is not None]
    if not claims:
        return {}
    keys = evidence_keys(project.pk)
    parsed = {}
    for claim in claims:
        evidence = evidence_parse(claim.token)
        parsed[claim.external_id] = (evidence, evidence is not None and any(evidence.signed_by(k) for k in keys))
    signed = {eid: e for eid, (e, ok) in parsed.items() if ok}
    names = sorted({c.model_version for c in claims if c.external_id in signed})
    versions = _resolver(project, names) if (_resolver is not None and names) else {}
    # Who already holds each request id: {request id: [(external_id, vouch, ingested_by)]}.
    holders: dict[str, list[tuple[str, str, str]]] = {}
    request_ids = sorted({e.request_id for e in signed.values()})
    for start in range(0, len(request_ids), 500):
        rows = (Trajectory.objects.filter(project=project, vouch_request__in=request_ids[start:start + 500])
                .exclude(vouch_request="").values_list("vouch_request", "external_id", "vouch", "ingested_by"))
        for request_id, external_id, vouch, by in rows:
            holders.setdefault(request_id, []).append((external_id, vouch, by))
    ttl_s = settings.FLYWHEEL_EVIDENCE_TTL_HOURS * 3600
    clock = now.timestamp()
    out: dict[str, tuple[str, str]] = {}
    for claim in claims:
        evidence, ok = parsed[claim.external_id]
        if evidence is None:
            out[claim.external_id] = (Vouch.MALFORMED, "")
            continue
        if not ok:
            out[claim.external_id] = (Vouch.BAD_MAC, "")
            continue
        held = holders.setdefault(evidence.request_id, [])
        mine = [h for h in held if h[0] == claim.external_id]
        others = [h for h in held if h[0] != claim.external_id]
        if versions.get(claim.model_version) != evidence.version:
            status = Vouch.OTHER_VERSION
        elif any(v == Vouch.VOUCHED for _, v, _ in mine):
            # Sent again (an outcome reported later): still vouched, however late, if the same sender sends it.
            status = Vouch.VOUCHED if all(by == ingested_by for _, v, by in mine if v == Vouch.VOUCHED) \
                else Vouch.REPLAYED
        elif others:
            status = Vouch.REPLAYED
        elif evidence.at > clock + CLOCK_SKEW_S:
            status = Vouch.FUTURE
        elif clock - evidence.at > ttl_s:
            status = Vouch.EXPIRED
        else:
            status = Vouch.VOUCHED
        out[claim.external_id] = (status, evidence.request_id)
        if not mine:
            held.append((claim.external_id, status, ingested_by))
    return out
