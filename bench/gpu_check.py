"""The GPU suite (called by bench/gpu_check.sh): every figure of the trainer on a GPU in one run, one JSON line
per part and a summary last. `--tiny` runs the same path on the CPU with a tiny model, in a few minutes (CI).

Parts (`--parts`, in this order):
- `warm_start`: the tiny model's recipe (`build-tiny`, seed 0, 1000 steps) built on this device, and the
  shipped demo model (built on a CPU), each evaluated here on the same holdout tasks and samples: a build on
  the GPU should solve as much as one on the CPU, within the sampling noise (`se`). The shipped model is
  evaluated in bfloat16 (as a job loads it) and in float32, each timed after an untimed warm-up call
  (`eval_s`): bf16 evaluation once took 8.2 s against fp32's 1.9 s here, and on 2 CPU cores the same
  evaluation takes the same decoding steps in both (76) and less time in bf16.
- `learning`: a Qwen2-architecture model warm-started here (`SIZES`: 21M parameters on a GPU), then GRPO with
  the holdout evaluated before and after: holdout success before and after, seconds per step, rollout
  tokens/s, the reward spread, and `no_gradient` when every group's rewards were equal (steps that changed
  nothing: a check that measured nothing).
- `rollout`: the same model's GRPO steps per rollout engine (HF `generate`, HF with `rollout_compile`
  (`hf-compiled`: every shape a job meets compiles once, within these steps); vLLM when `import vllm` works,
  else a line saying it was skipped: a figure here is never a vLLM figure unless its line says
  `"engine": "vllm"`), rollout tokens/s and GPU memory.
- `sampling`: `bench/sampling.py` on the shipped demo model, the learning part's model and a 500M Qwen2 (a
  warm start of a few steps: its tokens/s, not its answers): the LoRA policy sampled unmerged, merged
  (`trainer.models.lora_merged`, the default), compiled (`rollout_compile`: static KV cache, CUDA graphs) and
  through transformers' continuous batching (`continuous`: `generate_batch`'s paged cache, finished rows
  leaving the batch; bench-only so far, 2.5x slower than `merged` on 2 CPU cores), seconds per generate,
  tokens/s, operators per decoding step and the sampler-trainer logprob gap.
- `packing`: `bench/packing.py` on the learning part's model (the demo model in `--tiny`), without and with
  gradient checkpointing: one step's training forward and backward padded, with prefix sharing through the KV
  cache, packed, and packed with sharing (`pack_sequences`, the default); token positions run, seconds, and the
  logprob differences.
- `memory`: `bench/memory.py --device D` (one step at a 152k vocabulary; ours beside TRL).
- `lora_8b`: `bench/memory.py --device D --shape qwen2-7b`: the size teams start at, LoRA on a 7.6B Qwen2
  (Qwen2.5-7B's shape, random bf16 weights built on the GPU, nothing downloaded), gradient checkpointing on
  both sides, 8 prompts x 8 completions of 256 + 256 tokens, rewards that differ within each group: seconds per
  step, peak GPU memory, loss and grad norm (> 0: real gradients), ours beside TRL, and `largest_fit`, the
  longest completions (doubling) that still step at 8 x 8 on this GPU, for ours (the search stops at the first
  out of memory or after a minute, less when the budget is nearly spent; TRL's is not searched, to keep the
  part to about two minutes), and ours again without `pack_sequences` (`ours_unpacked_*`: every prompt G times
  under checkpointing, as before packing; the same loss and gradient). In `--tiny`, the same path at
  `qwen2-7b-tiny` (the shape scaled down), where both sides search to a tiny bound.
- `trl`: `bench/grpo_vs_trl.py --device D --size S` for each of `--sizes` (bf16 on both sides on a GPU, TRL
  with use_vllm=False): seconds per step, holdout gain and peak GPU memory, ours beside TRL.

A part that fails prints its error and the suite goes on; a part that would start after `--budget-s` is
skipped and says so (as is each size of `trl` and each model of `sampling`), and the summary's `rerun` is the
call that runs what was left out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from trainer.cli import demo_config  # noqa: E402
from trainer.config import JobSpec, write_jsonl  # noqa: E402
from trainer.envs.workplace import generate_tasks  # noqa: E402
from trainer.loop import train_grpo  # noqa: E402
from trainer.tiny import SIZES, build_tiny, holdout_success  # noqa: E402
from trainer.tracking import EventLog  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SHIPPED_DEMO_MODEL = REPO / "platform" / "flywheel" / "registry" / "demo_model"
# The size teams train (lora_8b) before the three-size comparison with TRL, the longest part, which checks the
# budget before each size.
PARTS = ("warm_start", "learning", "rollout", "sampling", "packing", "memory", "lora_8b", "trl")
BUDGET_SPENT = "time budget spent"

# Every way of sampling, continuous batching with one manager kept across calls, as an engine would keep it.
SAMPLING_WAYS = ["--ways", "unmerged,merged,compiled,continuous", "--cb-persistent"]

# What each part runs at, on a GPU and in the CPU dry run (--tiny). The GPU's learning model: 8 layers of
# hidden 512 (21M parameters), warm-started for 2000 steps at its width's learning rate (on the CPU a tiny
# Qwen2 of seed 0 solved 0.11 of the holdout after 1000 steps and 0.46 after 2000). The dry run's learning
# model is the shipped demo model (model=None): a 40-step warm start solves nothing, and a dry run whose groups
# all score alike would never reach the loss's gradient.
SETTINGS = {
    "gpu": dict(warm_steps=1000, warm_tasks=2000, eval_tasks=64, eval_samples=4, model="21m", model_steps=2000,
                grpo_steps=30, rollout_steps=6, prompts=8, generations=8, sizes="tiny,125m,500m", trl_steps=10, trl_holdout=100,
                trl_eval_samples=4, memory=[], lora_8b=["--shape", "qwen2-7b", "--steps", "3", "--also-unpacked"],
                sampling=["--prompts", "16", "--samples", "8", "--max-new-tokens", "48", *SAMPLING_WAYS],
                sampling_large="500m",
                packing=["--prompts", "16", "--samples", "8", "--max-new-tokens", "48"]),
    "tiny": dict(warm_steps=40, warm_tasks=300, eval_tasks=8, eval_samples=2, model=None, model_steps=0,
                 grpo_steps=2, rollout_steps=2, prompts=4, generations=4, sizes="tiny", trl_steps=2, trl_holdout=4, trl_eval_samples=1,
                 memory=["--vocab", "2048", "--hidden", "32", "--layers", "1", "--prompts", "1", "--generations", "2",
                         "--prompt-len", "16", "--completion-len", "8", "--threads", "1", "--quick"],
                 lora_8b=["--shape", "qwen2-7b-tiny", "--also-unpacked", "--threads", "1", "--prompts", "2",
                          "--generations", "2", "--prompt-len", "8", "--completion-len", "8", "--steps", "2", "--fit-max-tokens", "160",
                          "--fit-sides", "ours,trl"],
                 sampling=["--prompts", "2", "--samples", "2", "--max-new-tokens", "8", "--repeats", "1",
                           "--threads", "1", *SAMPLING_WAYS], sampling_large=None,
                 packing=["--prompts", "2", "--samples", "3", "--max-new-tokens", "8", "--train-batch-size", "4",
                          "--repeats", "1", "--threads", "1"]),
}


def emit(line: dict) -> dict:
    print(json.dumps(line), flush=True)
    return line


def success_se(p: float, n: int) -> float:
    """Standard error of the difference of two success rates of n samples each."""
    return round(math.sqrt(2 * max(p * (1 - p), 1e-9) / max(n, 1)), 3)


def peak_gib() -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 3) if torch.cuda.is_available() else None


def gpu_used_gib() -> float | None:
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()  # device-wide: includes a vLLM engine in another process
    return round((total - free) / 2**30, 2)


def part_warm_start(ctx: dict) -> dict:
    s, device = ctx["s"], ctx["device"]
    t0 = time.perf_counter()
    built = build_tiny(ctx["work"] / "warm-start", steps=s["warm_steps"], n_tasks=s["warm_tasks"], device=device)
    build_s = time.perf_counter() - t0
    n = s["eval_tasks"] * s["eval_samples"]
    built_success = holdout_success(built, device=device, tasks=s["eval_tasks"], samples=s["eval_samples"])
    shipped, eval_s = {}, {}
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        holdout_success(SHIPPED_DEMO_MODEL, device=device, tasks=2, samples=1, dtype=dtype)  # warm-up, untimed
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        shipped[name] = holdout_success(SHIPPED_DEMO_MODEL, device=device, tasks=s["eval_tasks"],
                                        samples=s["eval_samples"], dtype=dtype)
        eval_s[name] = round(time.perf_counter() - t0, 2)
    # As a job loads it: bfloat16 on a GPU, float32 on a CPU.
    as_loaded = shipped["bfloat16" if device == "cuda" else "float32"]
    return {"built_on": device, "warm_steps": s["warm_steps"], "build_s": round(build_s, 1),
            "built_success": built_success, "shipped_success": as_loaded, "shipped_success_by_dtype": shipped,
            "eval_s": eval_s, "samples": n, "se": success_se((built_success + as_loaded) / 2, n),
            "note": "shipped: the demo model as built on a CPU (seed 0, 1000 steps), evaluated here"}


def learning_model(ctx: dict) -> Path:
    """The learning and rollout parts' model, built once."""
    if "model" not in ctx:
        s = ctx["s"]
        if ctx["args"].model or not s["model"]:
            ctx["model"] = Path(ctx["args"].model or SHIPPED_DEMO_MODEL)
        else:
            ctx["model"] = build_tiny(ctx["work"] / "model", arch="qwen2", device=ctx["device"],
                                      steps=s["model_steps"], **SIZES[s["model"]])
        ctx["meta"] = json.loads((ctx["model"] / "tiny.json").read_text())
    return ctx["model"]


def grpo_job(ctx: dict, name: str, engine: str, holdout: bool, steps: int | None = None) -> tuple[dict, list[dict]]:
    s = ctx["s"]
    job = ctx["work"] / name
    job.mkdir()
    write_jsonl(job / "train.jsonl", generate_tasks(200, seed=0, split="train", difficulty="single"))
    if holdout:
        write_jsonl(job / "holdout.jsonl", generate_tasks(s["eval_tasks"], seed=1, split="holdout", difficulty="single"))
    # The demo's recipe (lr 1e-3, the one the learning test measures on the CPU), at this part's batch and steps.
    cfg = demo_config(steps or s["grpo_steps"], seed=0)
    cfg.num_prompts_per_step, cfg.num_generations_per_prompt = s["prompts"], s["generations"]
    cfg.train_batch_size = s["prompts"] * s["generations"]
    cfg.eval_on_start, cfg.eval_samples_per_prompt = holdout, s["eval_samples"]
    # `hf-compiled`: the hf engine with rollout_compile (static KV cache, compiled forward).
    cfg.rollout_engine, cfg.vllm_gpu_memory_utilization = engine.removesuffix("-compiled"), ctx["args"].vllm_memory
    cfg.rollout_compile = engine == "hf-compiled"
    spec = JobSpec(model=str(learning_model(ctx)), job_dir=job, train=job / "train.jsonl",
                   holdout=(job / "holdout.jsonl") if holdout else None, config=cfg, mlflow=False)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    events = EventLog(None)
    done = train_grpo(spec, events)
    steps = [e for e in events.events if e["event"] == "step"]
    return done, steps


def step_figures(steps: list[dict]) -> dict:
    later = steps[1:] or steps  # the first step pays for compilation and allocator warm-up

    def mean(key: str, rows: list[dict], digits: int = 3) -> float:
        return round(sum(r.get(key, 0.0) for r in rows) / max(len(rows), 1), digits)

    out = {"steps": len(steps), "step_time_s": mean("step_time", later), "rollout_time_s": mean("rollout_time", later),
           "train_time_s": mean("train_time", later), "rollout_tokens_per_s": mean("tokens_per_s", later, 1),
           "reward_std": mean("reward_std", steps), "frac_zero_variance_groups": mean("frac_zero_variance_groups", steps),
           "grad_norm": round(max((r.get("grad_norm", 0.0) for r in steps), default=0.0), 4),
           "completion_length": mean("completion_length", steps, 1)}
    if out["grad_norm"] == 0:
        out["no_gradient"] = "every step had equal rewards in every group: the timings are not of real updates"
    return out


def part_learning(ctx: dict) -> dict:
    t0 = time.perf_counter()
    learning_model(ctx)
    build_s = time.perf_counter() - t0
    done, steps = grpo_job(ctx, "learning", "hf", holdout=True)
    before, after = done["holdout_before"], done["holdout_after"]
    n = before.get("n") or ctx["s"]["eval_tasks"] * ctx["s"]["eval_samples"]
    meta = ctx["meta"]
    return {"model": f"{meta['arch']}-{meta['layers']}x{meta['hidden']}", "parameters": meta["parameters"],
            "warm_start_lr": meta.get("lr"), "build_s": round(build_s, 1),
            "holdout_before": round(before["success_rate"], 3), "holdout_after": round(after["success_rate"], 3),
            "gain": round(after["success_rate"] - before["success_rate"], 3),
            "se": success_se(before["success_rate"], n), **step_figures(steps), "peak_gib": peak_gib()}


def part_rollout(ctx: dict) -> list[dict]:
    lines = []
    for engine in ctx["args"].engines.split(","):
        if engine == "vllm":
            try:
                import vllm  # noqa: F401
            except Exception as exc:  # noqa: BLE001 (any import failure means: no vLLM here)
                lines.append({"engine": "vllm", "skipped": f"import vllm failed: {exc}; the vLLM engine stays "
                              "verified against its stand-in only"})
                continue
        try:
            # Throughput, not learning: a few steps (the first, warm-up, is left out of the means).
            _, steps = grpo_job(ctx, f"rollout-{engine}", engine, holdout=False, steps=ctx["s"]["rollout_steps"])
            lines.append({"engine": engine, **step_figures(steps), "trainer_peak_gib": peak_gib(),
                          "device_used_gib": gpu_used_gib()})
        except Exception as exc:  # noqa: BLE001 (report and go on to the next engine)
            lines.append({"engine": engine, "error": f"{type(exc).__name__}: {exc}"})
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return lines


def part_sampling(ctx: dict) -> list[dict]:
    """bench/sampling.py per model, each in its own process: the demo model in both dtypes, the larger ones in
    bfloat16 (what a job samples them in on a GPU)."""
    s = ctx["s"]
    models = [("demo", SHIPPED_DEMO_MODEL, "float32,bfloat16")]
    if not ctx["tiny"]:
        models.append(("learning", learning_model(ctx), "bfloat16"))
        if s["sampling_large"]:
            large = ctx["work"] / f"sampling-{s['sampling_large']}"
            if not (large / "tiny.json").exists():  # throughput only: a few steps, so it speaks the tokenizer
                build_tiny(large, arch="qwen2", device=ctx["device"], steps=20, n_tasks=300,
                           **SIZES[s["sampling_large"]])
            models.append((s["sampling_large"], large, "bfloat16"))
    lines = []
    for name, path, dtypes in models:
        if ctx["left"]() <= 0:
            lines.append({"model": name, "skipped": BUDGET_SPENT})
            continue
        argv = ["bench/sampling.py", "--device", ctx["device"], "--model", str(path), "--dtypes", dtypes, *s["sampling"]]
        try:
            out = run_script(argv, timeout=max(ctx["left"](), 120))
            out.pop("device", None)  # the line's device is the GPU's name
            lines.append({**out, "model": name})
        except Exception as exc:  # noqa: BLE001 (report and go on to the next model)
            lines.append({"model": name, "error": f"{type(exc).__name__}: {exc}"})
    return lines


def part_packing(ctx: dict) -> list[dict]:
    """bench/packing.py on the learning part's model, without and with gradient checkpointing."""
    path = learning_model(ctx)
    lines = []
    for gc in ([], ["--gc"]):
        if ctx["left"]() <= 0:
            lines.append({"gc": bool(gc), "skipped": BUDGET_SPENT})
            continue
        out = run_script(["bench/packing.py", "--device", ctx["device"], "--model", str(path), *ctx["s"]["packing"],
                          *gc], timeout=max(ctx["left"](), 120))
        out.pop("device", None)
        lines.append(out)
    return lines


def run_script(argv: list[str], timeout: float) -> dict:
    """A bench script in its own process (its GPU memory is its own); its last stdout line is its JSON. Past
    `timeout` its whole process group is killed: memory.py's workers, which hold the GPU, with it."""
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} exited {proc.returncode}: {stderr.strip()[-800:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def part_trl(ctx: dict) -> list[dict]:
    s, args = ctx["s"], ctx["args"]
    lines = []
    for size in (args.sizes or s["sizes"]).split(","):
        if ctx["left"]() <= 0:
            lines.append({"size": size, "skipped": BUDGET_SPENT})
            continue
        argv = ["bench/grpo_vs_trl.py", "--device", ctx["device"], "--steps", str(s["trl_steps"]),
                "--holdout", str(s["trl_holdout"]), "--eval-samples", str(s["trl_eval_samples"])]
        if ctx["tiny"]:
            argv += ["--model", str(learning_model(ctx)), "--prompts-per-step", "4", "--generations", "4",
                     "--max-new-tokens", "16"]
        else:
            argv += ["--size", size, "--warm-steps", str(s["warm_steps"])]
        try:
            lines.append({"size": size, **run_script(argv, timeout=max(ctx["left"](), 60))})
        except Exception as exc:  # noqa: BLE001 (report and go on to the next size)
            lines.append({"size": size, "error": f"{type(exc).__name__}: {exc}"})
    return lines


def part_memory(ctx: dict) -> dict:
    return run_script(["bench/memory.py", "--device", ctx["device"], *ctx["s"]["memory"]],
                      timeout=max(ctx["left"](), 60))


def part_lora_8b(ctx: dict) -> dict:
    argv = ["bench/memory.py", "--device", ctx["device"], *ctx["s"]["lora_8b"]]
    if not ctx["tiny"]:
        # The largest-fit search gets a minute, less when the suite's budget is nearly spent (the two workers'
        # start, build and measured steps take about as long again).
        argv += ["--fit-time-s", str(round(min(60, max(ctx["left"]() - 90, 10))))]
    # At least four minutes once started: the two workers' builds and steps of a 7.6B model need that much.
    out = run_script(argv, timeout=max(ctx["left"](), 240))
    out.pop("device", None)  # the line's device is the GPU's name
    return out


RUNNERS = {"warm_start": part_warm_start, "learning": part_learning, "rollout": part_rollout,
           "sampling": part_sampling, "packing": part_packing, "trl": part_trl,
           "memory": part_memory, "lora_8b": part_lora_8b}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: a dry run of the same path")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--sizes", help="the trl part's model sizes (trainer.tiny.SIZES); default tiny,125m,500m")
    p.add_argument("--engines", default="hf,hf-compiled,vllm",
                   help="the rollout part's engines (hf-compiled: hf with rollout_compile)")
    p.add_argument("--model", help="the learning and rollout parts' model folder instead of building one")
    p.add_argument("--vllm-memory", type=float, default=0.35)
    p.add_argument("--budget-s", type=float, default=450, help="start no part after this many seconds")
    args = p.parse_args()
    tiny = args.tiny
    device = "cuda" if torch.cuda.is_available() and not tiny else "cpu"
    if tiny:
        torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    t0 = time.perf_counter()
    ctx = {"args": args, "tiny": tiny, "device": device, "work": work, "s": SETTINGS["tiny" if tiny else "gpu"],
           "left": lambda: args.budget_s - (time.perf_counter() - t0)}
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    status: dict[str, str] = {}
    lines: dict[str, list[dict]] = {}
    for part in args.parts.split(","):
        if part not in RUNNERS:
            raise SystemExit(f"gpu_check: unknown part {part!r}; parts are {', '.join(PARTS)}")
        if ctx["left"]() <= 0:
            emit({"part": part, "skipped": f"{BUDGET_SPENT} ({args.budget_s:.0f} s)"})
            status[part] = "skipped"
            continue
        started = time.perf_counter()
        try:
            out = RUNNERS[part](ctx)
        except Exception as exc:  # noqa: BLE001 (report and go on to the next part)
            out = {"error": f"{type(exc).__name__}: {exc}"}
        rows = out if isinstance(out, list) else [out]
        lines[part] = [emit({"part": part, "device": name, **row, "part_s": round(time.perf_counter() - started, 1)})
                       for row in rows]
        status[part] = ("error" if any("error" in r for r in rows)
                        else "partial" if any(r.get("skipped") == BUDGET_SPENT for r in rows) else "ok")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    learning = (lines.get("learning") or [{}])[0]
    # What the budget left out, as the next call to make (a machine lent for minutes may not run all in one).
    left_out = [part for part, state in status.items() if state in ("skipped", "partial")]
    emit({"part": "summary", "device": name, "tiny": tiny, "parts": status,
          "ok": all(v == "ok" for v in status.values()),
          "rerun": f"bench/gpu_check.sh --wheels DIR --parts {','.join(left_out)}" if left_out else None,
          "no_gradient": "no_gradient" in learning if learning else None,
          "learning_gain": learning.get("gain"), "learning_se": learning.get("se"),
          "wall_s": round(time.perf_counter() - t0, 1)})
    sys.stdout.flush()


if __name__ == "__main__":
    main()
