"""bench/gpu_check.sh --tiny: the GPU suite's whole path on the CPU, as a maintainer's GPU box runs it (the
same script, parts and JSON lines, with a tiny model). CI has no GPU, so this is what keeps the GPU run from
breaking unseen: every part prints its line with the figures a GPU run reports, and the learning part's steps
have a real gradient."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The keys each part's line carries (beside "part", "device" and "part_s").
KEYS = {
    "warm_start": {"built_on", "warm_steps", "build_s", "built_success", "shipped_success", "samples", "se",
                   "shipped_success_by_dtype", "eval_s"},
    "learning": {"model", "parameters", "holdout_before", "holdout_after", "gain", "se", "steps", "step_time_s",
                 "rollout_tokens_per_s", "reward_std", "frac_zero_variance_groups", "grad_norm", "peak_gib"},
    "rollout": {"engine"},
    "sampling": {"model", "batch", "rows", "speedup_float32_merged", "speedup_bfloat16_merged",
                 "speedup_bfloat16_compiled"},
    "packing": {"model", "rows_per_step", "tokens", "gc", "micro_batches", "rows"},
    "trl": {"size", "ours_s_per_step", "trl_s_per_step", "speedup", "ours_gain", "trl_gain", "ours_peak_gib",
            "trl_peak_gib", "gain_se"},
    "memory": {"device", "vocab", "ours_peak_mb", "trl_peak_mb", "ours_s", "trl_s", "ours_peak_total_gib",
               "trl_peak_total_gib", "memory_ratio"},
    "lora_8b": {"shape", "parameters", "weights_gib", "prompts", "completions", "prompt_len", "completion_len",
                "batch_tokens", "steps", "ours_s_per_step", "trl_s_per_step", "ours_peak_mb", "trl_peak_mb",
                "ours_peak_total_gib", "trl_peak_total_gib", "ours_loss", "trl_loss", "ours_grad_norm", "trl_grad_norm",
                "same_weights", "largest_fit", "trl_largest_fit", "ours_unpacked_s_per_step", "ours_unpacked_peak_mb",
                "ours_unpacked_grad_norm"},
}
FIT = {"prompts", "completions", "prompt_len", "completion_len", "batch_tokens", "step_s", "stopped_by"}


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
    assert list(by_part) == ["warm_start", "learning", "rollout", "sampling", "packing", "memory", "lora_8b", "trl",
                            "summary"]
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
    assert engines["hf"]["rollout_tokens_per_s"] > 0 and engines["hf-compiled"]["rollout_tokens_per_s"] > 0
    if importlib.util.find_spec("vllm") is None:
        # No vLLM here: its line says it was skipped, never a figure that could pass for a vLLM one.
        assert "skipped" in engines["vllm"] and "rollout_tokens_per_s" not in engines["vllm"]
    assert set(by_part["warm_start"][0]["eval_s"]) == {"float32", "bfloat16"}
    # Sampling: every way ran in both dtypes; a merged adapter runs fewer operators a decoding step than an
    # unmerged one, a compiled forward fewer still (counted, not timed), and each sampled the policy.
    rows = {(r["dtype"], r["way"]): r for r in by_part["sampling"][0]["rows"]}
    assert set(rows) == {(d, w) for d in ("float32", "bfloat16")
                         for w in ("unmerged", "merged", "compiled", "continuous")}
    # Continuous batching samples too, with the sampler logprobs the loss needs (exact in float32).
    for dtype in ("float32", "bfloat16"):
        assert "unavailable" not in rows[dtype, "continuous"] and rows[dtype, "continuous"]["logprobs_match"]
    assert rows["float32", "continuous"]["logprob_gap_max"] < 1e-3
    for dtype in ("float32", "bfloat16"):
        ops = [rows[dtype, way]["ops_per_step"] for way in ("unmerged", "merged", "compiled")]
        assert ops[0] > ops[1] > ops[2], (dtype, ops)
        assert all(rows[dtype, way]["logprob_gap_max"] < 0.5 for way in ("unmerged", "merged", "compiled"))
    # Packing: every layout ran, without and with gradient checkpointing (where prefix sharing needs packing),
    # ran fewer positions than padding, and gave the padded forward's logprobs.
    assert [line["gc"] for line in by_part["packing"]] == [False, True]
    for line in by_part["packing"]:
        layouts = {r["layout"]: r for r in line["rows"]}
        assert set(layouts) == ({"padded", "packed", "packed_shared"} | (set() if line["gc"] else {"shared"}))
        assert layouts["packed_shared"]["positions"] < layouts["padded"]["positions"]
        assert all(r["max_logprob_diff"] < 1e-4 and r["s_fwd_bwd"] > 0 for r in line["rows"])
    assert by_part["trl"][0]["ours_s_per_step"] > 0 and by_part["trl"][0]["trl_s_per_step"] > 0
    assert by_part["memory"][0]["ours_peak_mb"] > 0 and by_part["memory"][0]["trl_peak_mb"] > 0
    # The 7B path at its scaled-down shape: both sides step with real gradients, from the same weights (same
    # LoRA initialisation too, so the same gradient), and the largest-fit search runs to its tiny bound.
    lora = by_part["lora_8b"][0]
    assert lora["shape"] == "qwen2-7b-tiny" and lora["steps"] == 2 and lora["parameters"] > 0
    assert lora["ours_grad_norm"] > 0 and lora["trl_grad_norm"] > 0
    assert lora["same_weights"] is True and abs(lora["ours_grad_norm"] - lora["trl_grad_norm"]) < 1e-3
    assert lora["ours_s_per_step"] > 0 and lora["trl_s_per_step"] > 0
    assert lora["ours_unpacked_s_per_step"] > 0
    assert abs(lora["ours_unpacked_grad_norm"] - lora["ours_grad_norm"]) < 1e-3  # packing changes no gradient
    assert lora["ours_peak_mb"] > 0 and lora["trl_peak_mb"] > 0 and lora["ours_peak_total_gib"] is None
    for fit in (lora["largest_fit"], lora["trl_largest_fit"]):
        assert FIT <= fit.keys() and fit["stopped_by"] == "max_tokens"
        assert fit["completion_len"] > lora["completion_len"] and fit["batch_tokens"] > lora["batch_tokens"]
    summary = lines[-1]
    assert summary["ok"] is True and summary["tiny"] is True and summary["no_gradient"] is False
    assert summary["parts"] == dict.fromkeys(KEYS, "ok") and summary["rerun"] is None


def test_what_the_time_budget_leaves_out_is_named_with_the_call_that_runs_it(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(
        [str(REPO / "platform"), str(REPO), str(REPO / "client"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--tiny", "--parts", "memory,trl",
                           "--budget-s", "0"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [line["part"] for line in lines] == ["memory", "trl", "summary"]
    assert all(line["skipped"].startswith("time budget spent") for line in lines[:2])
    summary = lines[-1]
    assert summary["ok"] is False and summary["parts"] == {"memory": "skipped", "trl": "skipped"}
    assert summary["rerun"] == "bench/gpu_check.sh --wheels DIR --parts memory,trl"


def _bench(name: str):
    """bench/<name>.py as a module (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_largest_fit_search_stops_at_the_first_out_of_memory_or_at_its_bounds():
    # A CPU never runs out of GPU memory, so the dry run cannot reach this branch: a step that raises the error
    # torch raises on a GPU stands in for it.
    import torch

    memory = _bench("memory")
    args = argparse.Namespace(prompts=8, generations=8, prompt_len=256, completion_len=256, device="cpu",
                              fit_max_tokens=2**20, fit_time_s=60, steps=2)
    tried, zeroed = [], []

    def prepare(length):
        def step():
            tried.append(length)
            if length >= 4096:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return step

    fit = memory.largest_fit(args, prepare, lambda: zeroed.append(True), 0.01, 1.0)
    assert tried == [512, 1024, 2048, 4096] and zeroed == [True]
    assert fit["stopped_by"] == "oom" and fit["stopped_at_completion_len"] == 4096
    assert fit["completion_len"] == 2048 and fit["batch_tokens"] == 64 * (256 + 2048)
    tried.clear()
    args.fit_max_tokens = 64 * (256 + 1024)
    fit = memory.largest_fit(args, prepare, lambda: None, 0.01, 1.0)
    assert tried == [512, 1024] and fit["stopped_by"] == "max_tokens" and fit["completion_len"] == 1024
    tried.clear()
    args.fit_time_s = 1.0  # the next step is estimated at 7.5 s: it is not started
    fit = memory.largest_fit(args, prepare, lambda: None, 5.0, 1.0)
    assert tried == [] and fit["stopped_by"] == "time" and fit["completion_len"] == 256
    # Out of memory in the measured steps is the side's result, not a crash of the part.
    out = memory.run_steps(args, lambda length: prepare(8192), {}, lambda: zeroed.append(True))
    assert out == {"oom": "CUDA out of memory. Tried to allocate 20.00 GiB"}


def test_a_script_past_its_timeout_is_killed_with_the_processes_it_started(tmp_path):
    """memory.py runs each trainer in a worker process that holds the GPU: a timeout must take it down too."""
    import pytest

    gpu_check = _bench("gpu_check")
    pid_file = tmp_path / "child.pid"
    script = tmp_path / "spawns.py"
    script.write_text("import subprocess, sys, time\n"
                      "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],\n"
                      "                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
                      f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
                      "time.sleep(120)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        gpu_check.run_script([str(script)], timeout=3)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; only its parent (gone too) would reap it
