"""bench/gpu_check.sh --tiny: the GPU suite's whole path on the CPU, as a maintainer's GPU box runs it (the
same script, parts and JSON lines, with a tiny model). CI has no GPU, so this is what keeps the GPU run from
breaking unseen: every part prints its line with the figures a GPU run reports, and the learning part's steps
have a real gradient."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The keys each part's line carries (beside "part", "device" and "part_s").
KEYS = {
    "warm_start": {"built_on", "warm_steps", "build_s", "built_success", "shipped_success", "samples", "se"},
    "learning": {"model", "parameters", "holdout_before", "holdout_after", "gain", "se", "steps", "step_time_s",
                 "rollout_tokens_per_s", "reward_std", "frac_zero_variance_groups", "grad_norm", "peak_gib"},
    "rollout": {"engine"},
    "trl": {"size", "ours_s_per_step", "trl_s_per_step", "speedup", "ours_gain", "trl_gain", "ours_peak_gib",
            "trl_peak_gib", "gain_se"},
    "memory": {"device", "vocab", "ours_peak_mb", "trl_peak_mb", "ours_s", "trl_s", "ours_peak_total_gib",
               "trl_peak_total_gib", "memory_ratio"},
}


def test_the_tiny_dry_run_prints_every_part_and_a_summary(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(
        [str(REPO / "platform"), str(REPO), str(REPO / "client"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--tiny"], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    by_part: dict[str, list[dict]] = {}
    for line in lines:
        by_part.setdefault(line["part"], []).append(line)
    assert list(by_part) == ["warm_start", "learning", "rollout", "trl", "memory", "summary"]
    assert lines[-1]["part"] == "summary"
    for part, keys in KEYS.items():
        for line in by_part[part]:
            assert "error" not in line, line
            assert keys <= line.keys(), (part, keys - line.keys())
            assert line["device"] == "cpu"
    # The dry run's learning model solves some tasks, so its groups differ and the loss has a gradient.
    learning = by_part["learning"][0]
    assert "no_gradient" not in learning and learning["grad_norm"] > 0
    assert 0 <= learning["holdout_before"] <= 1 and 0 <= learning["holdout_after"] <= 1
    assert learning["peak_gib"] is None  # GPU memory only on a GPU
    engines = {line["engine"]: line for line in by_part["rollout"]}
    assert engines["hf"]["rollout_tokens_per_s"] > 0
    if importlib.util.find_spec("vllm") is None:
        # No vLLM here: its line says it was skipped, never a figure that could pass for a vLLM one.
        assert "skipped" in engines["vllm"] and "rollout_tokens_per_s" not in engines["vllm"]
    assert by_part["trl"][0]["ours_s_per_step"] > 0 and by_part["trl"][0]["trl_s_per_step"] > 0
    assert by_part["memory"][0]["ours_peak_mb"] > 0 and by_part["memory"][0]["trl_peak_mb"] > 0
    summary = lines[-1]
    assert summary["ok"] is True and summary["tiny"] is True and summary["no_gradient"] is False
    assert summary["parts"] == dict.fromkeys(KEYS, "ok")
