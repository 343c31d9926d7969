"""GPU check (called by bench/gpu_check.sh): a Qwen2-architecture model built here with `build-tiny` (the
tiny model's tokenizer and SFT warm start at a larger size, trained on the GPU; no download), then a few GRPO
steps with HF generate and, when `import vllm` works, with vLLM. Prints rollout tokens/s, step time and GPU
memory per engine; last line JSON.

The warm start teaches the model to call the workplace tools and to end its turn (emit EOS), so the
verifier's rewards vary within groups and the gradients are real: each engine's line reports the reward
spread, the share of groups with nothing to learn and the gradient norm, and says `no_gradient` when every
step had a zero gradient (a check that measured nothing). `--tiny` shrinks everything so the same code path
can be dry-run on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from trainer.config import GRPOConfig, JobSpec, write_jsonl  # noqa: E402
from trainer.envs.workplace import generate_tasks  # noqa: E402
from trainer.loop import train_grpo  # noqa: E402
from trainer.tiny import build_tiny  # noqa: E402
from trainer.tracking import EventLog  # noqa: E402

# The GPU model: 8 layers of hidden 512 (about 26M parameters with the 1k-token workplace vocabulary),
# warm-started for 1000 steps; --tiny: the CPU test model's size with a short warm start (a dry run).
SIZES = {"gpu": dict(hidden=512, layers=8, heads=8, steps=1000), "tiny": dict(hidden=64, layers=2, heads=2, steps=60)}


def build_model(out: Path, tiny: bool) -> dict:
    size = SIZES["tiny" if tiny else "gpu"]
    device = "cuda" if torch.cuda.is_available() and not tiny else "cpu"
    build_tiny(out, arch="qwen2", device=device, **size)
    return json.loads((out / "tiny.json").read_text())


def gpu_used_gib() -> float | None:
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()  # device-wide: includes a vLLM engine in another process
    return round((total - free) / 2**30, 2)


def run_engine(engine: str, model_dir: Path, work: Path, args) -> dict:
    job = work / f"job-{engine}"
    job.mkdir()
    write_jsonl(job / "train.jsonl", generate_tasks(200, seed=0, split="train", difficulty="single"))
    cfg = GRPOConfig(
        num_prompts_per_step=args.prompts, num_generations_per_prompt=args.generations,
        max_new_tokens=args.max_new_tokens, max_turns=args.max_turns, learning_rate=1e-4, max_steps=args.steps,
        eval_on_start=False, eval_interval=args.steps, rollout_engine=engine, r=16, alpha=32,
        train_batch_size=args.micro_batch, vllm_gpu_memory_utilization=args.vllm_memory,
        max_seq_len=1024,
    )
    spec = JobSpec(model=str(model_dir), job_dir=job, train=job / "train.jsonl", config=cfg, mlflow=False)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    events = EventLog(None)
    t0 = time.perf_counter()
    train_grpo(spec, events)  # the verifier's reward: the warm-started model sometimes solves a task
    steps = [e for e in events.events if e["event"] == "step"]
    later = steps[1:] or steps  # the first step pays for compilation and allocator warm-up
    result = {
        "engine": engine, "steps": len(steps), "wall_s": round(time.perf_counter() - t0, 1),
        "rollout_tokens_per_s": round(sum(s["tokens_per_s"] for s in later) / len(later), 1),
        "step_time_s": round(sum(s["step_time"] for s in later) / len(later), 3),
        "rollout_time_s": round(sum(s["rollout_time"] for s in later) / len(later), 3),
        "train_time_s": round(sum(s["train_time"] for s in later) / len(later), 3),
        "reward_std": round(sum(s["reward_std"] for s in steps) / len(steps), 3),
        "frac_zero_variance_groups": round(sum(s["frac_zero_variance_groups"] for s in steps) / len(steps), 3),
        "grad_norm": round(max(s.get("grad_norm", 0.0) for s in steps), 4),
        "completion_length": round(sum(s.get("completion_length", 0.0) for s in steps) / len(steps), 1),
    }
    if result["grad_norm"] == 0:
        result["no_gradient"] = "every step had equal rewards in every group: the timings are not of real updates"
    if torch.cuda.is_available():
        result["trainer_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        result["device_used_gib"] = gpu_used_gib()
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tiny", action="store_true", help="a tiny model: dry-run on CPU")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-turns", type=int, default=None, help="default: the task's own (call, then answer)")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--vllm-memory", type=float, default=0.35)
    p.add_argument("--engines", default="hf,vllm")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    t0 = time.perf_counter()
    meta = build_model(work / "model", args.tiny)
    n_params = meta["parameters"]
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(json.dumps({"model": f"qwen2-{meta['layers']}x{meta['hidden']}", "parameters": n_params,
                      "sft_steps": meta["steps"], "device": device, "build_s": round(time.perf_counter() - t0, 1)}),
          flush=True)
    results = []
    for engine in args.engines.split(","):
        if engine == "vllm":
            try:
                import vllm  # noqa: F401
            except Exception as exc:  # noqa: BLE001 (any import failure means: no vLLM here)
                print(json.dumps({"engine": "vllm", "skipped": f"import vllm failed: {exc}"}), flush=True)
                continue
        try:
            results.append(run_engine(engine, work / "model", work, args))
        except Exception as exc:  # noqa: BLE001 (report and go on to the next engine)
            print(json.dumps({"engine": engine, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(json.dumps({"event": "done", "device": device, "parameters": n_params, "engines": results}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
