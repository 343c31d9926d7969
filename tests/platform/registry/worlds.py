"""Registry worlds the tests share: a project's base model in production and adapters after it, and evidence
tokens as the reference router signs them."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from flywheel.registry import services
from flywheel.registry.models import GateDecision, ModelVersion
from flywheel.router import evidence_sign
from flywheel.trajectories.vouch import evidence_keys


def versions_with_adapters(project, user, folder: Path, *, adapters: int = 1,
                           gated: bool = True) -> tuple[ModelVersion, ...]:
    """v1 in production (the base model alone, a folder under `folder`), then `adapters` versions with an adapter
    of their own (distinct bytes, so distinct hashes), each passed the gate against v1 when `gated`."""
    base = folder / "tiny"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "llama"}')
    v1 = services.base_model_register(project=project, name="tiny", path=str(base), user=user)
    out = [v1]
    for number in range(2, 2 + adapters):
        adapter = folder / f"adapter-{number}"
        adapter.mkdir()
        (adapter / "adapter_config.json").write_text('{"r": 8}')
        (adapter / "adapter_model.safetensors").write_bytes(bytes([number]) * 100)
        version = services.model_version_create(project=project, base=v1.base, adapter_path=str(adapter), user=user)
        if gated:
            GateDecision.objects.create(project=project, candidate=version, production=v1, passed=True)
        out.append(version)
    return tuple(out)


def evidence_token(project, version_number: int, *, at: float | None = None, request_id: str | None = None,
                   key: bytes | None = None) -> str:
    """The token the reference router puts on an answer of `version_number`, under the project's evidence key
    (or `key`), now (or `at`), for a request of its own (or `request_id`)."""
    return evidence_sign(key or evidence_keys(project.pk)[0], version=version_number,
                         at=int(time.time() if at is None else at), request_id=request_id or uuid.uuid4().hex)
