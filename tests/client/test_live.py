"""Live metrics through the client against the live test server: a version's figures over a window, and the
strings mapped to versions (listed, mapped, unmapped), with the scope each needs."""

from __future__ import annotations

import pytest
from flywheel_client import ApiError, Flywheel

from flywheel.registry import live, services


def record(i: int, model: str, outcome: str) -> dict:
    return {"external_id": f"c-{i}", "model_version": model, "outcome": outcome,
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def test_a_script_reads_a_versions_live_metrics_and_maps_a_string(live_server, project, user, make_api_key, tmp_path):
    base = tmp_path / "tiny"
    base.mkdir()
    (base / "config.json").write_text("{}")
    services.base_model_register(project=project, name="tiny", path=str(base), user=user)
    read = make_api_key(project, scopes=["ingest", "read"])
    promote = make_api_key(project, scopes=["promote"])
    with Flywheel(live_server.url, read) as fw:
        fw.ingest([record(i, f"{project.slug}-v1", "failure" if i < 1 else "success") for i in range(4)]
                  + [record(10 + i, "my-finetune", "failure") for i in range(2)])
        live.rollup_refresh()  # what the sweep's worker does
        metrics = fw.live(1, window="7d")
        assert (metrics.version, metrics.window, metrics.metrics["trajectories"]) == (1, "7d", 4)
        assert metrics.failure_rate == 0.25 and len(metrics.series["t"]) == 169
        names, unmapped = fw.version_names()
        assert names == [] and unmapped == [{"name": "my-finetune", "trajectories": 2}]
        with pytest.raises(ApiError) as refused:
            fw.map_version_name("my-finetune", 1)
        assert refused.value.status_code == 403
        with pytest.raises(ApiError) as bad:
            fw.live(1, window="2w")
        assert bad.value.status_code == 400
    with Flywheel(live_server.url, promote) as admin:
        mapped = admin.map_version_name("my-finetune", 1)
        assert (mapped.name, mapped.version) == ("my-finetune", 1)
    with Flywheel(live_server.url, read) as fw:
        assert fw.live(1, window="24h").metrics["trajectories"] == 6
    with Flywheel(live_server.url, promote) as admin:
        admin.unmap_version_name("my-finetune")
    with Flywheel(live_server.url, read) as fw:
        assert fw.live(1).metrics["failures"] == 1
        assert fw.live(1).cost["token_cost_per_1k"] is None  # no usage carried
        with pytest.raises(ApiError):
            fw.set_price(1, input_per_m=1.0)
    with Flywheel(live_server.url, promote) as admin:
        price = admin.set_price(1, input_per_m=0.5, output_per_m=2.0, on="base")
        assert (price["price_input_per_m"], price["price_output_per_m"], price["price_source"]) == (0.5, 2.0, "base")
        with pytest.raises(ApiError) as bad:
            admin.set_price(1, output_per_m=-1.0)
        assert bad.value.status_code == 422
