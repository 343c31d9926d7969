"""Registry worlds the tests share: a project's base model in production and adapters after it."""

from __future__ import annotations

from pathlib import Path

from flywheel.registry import services
from flywheel.registry.models import GateDecision, ModelVersion


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
