"""GPU check (called by bench/gpu_check.sh): a ~0.5B Qwen2-architecture model built locally from a config
(random init, no download), a few GRPO steps with HF generate and, when `import vllm` works, with vLLM.
Prints rollout tokens/s, step time and GPU memory per engine; last line JSON.

The model is random, so the verifier reward would be 0 everywhere; the check pays a small length reward
instead so that advantages, gradients and optimizer steps are real work. It measures speed, not learning.
`--tiny` shrinks everything so the CPU-capable parts can be dry-run anywhere.
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
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from trainer.config import GRPOConfig, JobSpec, write_jsonl  # noqa: E402
from trainer.envs import replay  # noqa: E402
from trainer.envs.workplace import generate_tasks  # noqa: E402
from trainer.loop import train_grpo  # noqa: E402
from trainer.tiny import _render, train_tokenizer  # noqa: E402
from trainer.tracking import EventLog  # noqa: E402

QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1_000_000.0,
                 max_position_embeddings=4096)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=2048, tie_word_embeddings=True, max_position_embeddings=1024)


def build_model(out: Path, tiny: bool) -> int:
    tasks = generate_tasks(200, seed=0, split="train")
    tok = train_tokenizer([_render(replay(t, t["solution"])[0], t["tools"]) for t in tasks])
    cfg = Qwen2Config(**(TINY if tiny else QWEN2_05B), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16 if torch.cuda.is_available() and not tiny else torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


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
        max_new_tokens=args.max_new_tokens, max_turns=args.max_turns, learning_rate=1e-5, max_steps=args.steps,
        eval_on_start=False, eval_interval=args.steps, rollout_engine=engine, r=16, alpha=32,
        train_batch_size=args.micro_batch, vllm_gpu_memory_utilization=args.vllm_memory,
        max_seq_len=1024,
    )
    spec = JobSpec(model=str(model_dir), job_dir=job, train=job / "train.jsonl", config=cfg, mlflow=False)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    events = EventLog(None)
    t0 = time.perf_counter()
    train_grpo(spec, events, reward_fn=lambda ep: min(ep.completion_tokens, 64) / 64)
    steps = [e for e in events.events if e["event"] == "step"]
    later = steps[1:] or steps  # the first step pays for compilation and allocator warm-up
    result = {
        "engine": engine, "steps": len(steps), "wall_s": round(time.perf_counter() - t0, 1),
        "rollout_tokens_per_s": round(sum(s["tokens_per_s"] for s in later) / len(later), 1),
        "step_time_s": round(sum(s["step_time"] for s in later) / len(later), 3),
        "rollout_time_s": round(sum(s["rollout_time"] for s in later) / len(later), 3),
        "train_time_s": round(sum(s["train_time"] for s in later) / len(later), 3),
    }
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
    p.add_argument("--max-turns", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--vllm-memory", type=float, default=0.35)
    p.add_argument("--engines", default="hf,vllm")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    t0 = time.perf_counter()
    n_params = build_model(work / "model", args.tiny)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(json.dumps({"model": "qwen2-tiny" if args.tiny else "qwen2-0.5b", "parameters": n_params,
                      "device": device, "build_s": round(time.perf_counter() - t0, 1)}), flush=True)
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
