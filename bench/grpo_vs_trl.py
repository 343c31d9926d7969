"""Our GRPO trainer against TRL's GRPOTrainer on the same tiny model, tasks and settings, one after the
other: seconds per step and holdout gain for each, and the speed ratio.

Both run single-turn workplace tasks (one completion per prompt, rewarded by our verifiers through the
environment's final state), G completions for each of P prompts per step, the same token limit, LoRA
config, learning rate (constant), step count and seed; TRL with use_vllm=False, loss_type="grpo",
scale_rewards="group", beta=0. Holdout success is measured the same way for both (our evaluator, sampled,
several samples per prompt). Last line: JSON {ours_s_per_step, trl_s_per_step, speedup, ours_gain, trl_gain,
ours_peak_gib, trl_peak_gib}.

`--device cuda` runs both on the GPU in bfloat16 (our `bf16` autocast over bf16 weights; TRL's `bf16=True` over
the same weights), TRL with use_vllm=False, and prints each side's peak GPU memory
(`torch.cuda.max_memory_allocated` over its training steps) beside its seconds per step. `--size` builds the
model of that size here (`trainer.tiny.SIZES`, warm-started on the device: no download); the default is the
tiny CPU model.

    .venv/bin/python bench/grpo_vs_trl.py [--model DIR] [--steps 30] [--threads 1] [--seed 0]
                                          [--device cpu|cuda] [--size tiny|21m|125m|500m] [--warm-steps 1000]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from trainer.config import GRPOConfig, JobSpec, write_jsonl  # noqa: E402
from trainer.envs import make_env  # noqa: E402
from trainer.envs.workplace import generate_tasks  # noqa: E402
from trainer.evaluation import evaluate_rows  # noqa: E402
from trainer.models import load_model, lora_config  # noqa: E402
from trainer.rollout.hf import HFEngine  # noqa: E402
from trainer.tracking import EventLog  # noqa: E402


def holdout_success(model, tokenizer, rows, args) -> float:
    torch.manual_seed(1234)
    model.eval()
    metrics, _ = evaluate_rows(HFEngine(model, tokenizer), tokenizer, rows, samples_per_prompt=args.eval_samples,
                               temperature=1.0, max_new_tokens=args.max_new_tokens, max_turns=1)
    return metrics["success_rate"]


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    """Peak GPU memory since `reset_peak` (None on CPU: `bench/memory.py` measures the CPU's)."""
    return round(torch.cuda.max_memory_allocated() / 2**30, 3) if device.startswith("cuda") else None


def run_ours(args, cfg: GRPOConfig, train, holdout, work: Path) -> tuple[float, float, float | None]:
    from peft import PeftModel

    from trainer.loop import train_grpo

    job = work / "ours"
    job.mkdir()
    write_jsonl(job / "train.jsonl", train)
    spec = JobSpec(model=str(args.model), job_dir=job, train=job / "train.jsonl", config=cfg, mlflow=False)
    events = EventLog(None)
    reset_peak(args.device)
    train_grpo(spec, events)  # loads the model on the device (bf16 on a GPU), as a job does
    peak = peak_gib(args.device)
    times = [e["step_time"] for e in events.events if e["event"] == "step"]
    base, tok = load_model(args.model, device=args.device)
    model = PeftModel.from_pretrained(base, str(job / "adapters" / "last"))
    after = holdout_success(model, tok, holdout, args)
    del model, base
    return sum(times[1:]) / max(len(times) - 1, 1), after, peak


def run_trl(args, cfg: GRPOConfig, train, holdout, work: Path) -> tuple[float, float, float | None]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    reset_peak(args.device)
    model, tok = load_model(args.model, device=args.device)
    by_id = {t["id"]: t for t in train}

    def reward(prompts, completions, task_id, **_):
        out = []
        for completion, tid in zip(completions, task_id, strict=True):
            env = make_env(by_id[tid])
            env.reset()
            env.step(completion)
            out.append(float(env.score().reward))
        return out

    prompts = [tok.apply_chat_template(t["messages"], tools=t["tools"], add_generation_prompt=True, tokenize=False)
               for t in train]
    data = Dataset.from_dict({"prompt": prompts, "task_id": [t["id"] for t in train]})
    n = cfg.num_prompts_per_step * cfg.num_generations_per_prompt
    trl_args = TRLConfig(
        output_dir=str(work / "trl"), per_device_train_batch_size=n, gradient_accumulation_steps=1,
        num_generations=cfg.num_generations_per_prompt, max_completion_length=cfg.max_new_tokens,
        learning_rate=cfg.learning_rate, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=cfg.max_grad_norm, max_steps=cfg.max_steps, beta=0.0, loss_type="grpo",
        scale_rewards="group", epsilon=cfg.epsilon, num_iterations=1, temperature=cfg.temperature, top_k=0,
        top_p=1.0, use_vllm=False, use_cpu=args.device == "cpu", bf16=args.device.startswith("cuda"),
        report_to="none", save_strategy="no",
        logging_steps=1, seed=cfg.seed, disable_tqdm=True, dataloader_num_workers=0,
    )

    class Timer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.t0)

    timer = Timer()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=trl_args, train_dataset=data,
                          processing_class=tok, peft_config=lora_config(cfg, model), callbacks=[timer])
    trainer.train()
    peak = peak_gib(args.device)
    times = timer.times
    return sum(times[1:]) / max(len(times) - 1, 1), holdout_success(trainer.model, tok, holdout, args), peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a model dir; default: build the tiny model into a temp dir")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--holdout", type=int, default=200)
    p.add_argument("--eval-samples", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda (bf16 on both sides)")
    p.add_argument("--size", help="build a qwen2 model of this size on the device (trainer.tiny.SIZES); "
                                  "default: the tiny CPU model")
    p.add_argument("--warm-steps", type=int, default=1000, help="warm-start steps of the model built here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="grpo-vs-trl-"))
    if args.model is None:
        from trainer.tiny import SIZES, build_tiny

        if args.size:
            args.model = build_tiny(work / args.size, arch="qwen2", device=args.device, steps=args.warm_steps,
                                    **SIZES[args.size])
        else:
            args.model = build_tiny(work / "tiny", steps=args.warm_steps, device=args.device)
    train = generate_tasks(400, seed=args.seed, split="train", difficulty="single")
    holdout = generate_tasks(args.holdout, seed=args.seed + 1, split="holdout", difficulty="single")
    cfg = GRPOConfig(
        num_prompts_per_step=args.prompts_per_step, num_generations_per_prompt=args.generations,
        max_new_tokens=args.max_new_tokens, max_turns=1, learning_rate=args.lr, max_steps=args.steps,
        loss_type="grpo", scale_rewards="group", beta=0.0, eval_on_start=False, eval_interval=args.steps,
        r=16, alpha=32, dropout=0.0, seed=args.seed, train_batch_size=args.prompts_per_step * args.generations,
    )
    base, tok = load_model(args.model, device=args.device)
    before = holdout_success(base, tok, holdout, args)
    del base
    print(f"baseline holdout success (single-turn): {before:.3f}", file=sys.stderr)
    ours_s, ours_after, ours_peak = run_ours(args, cfg, train, holdout, work)
    print(f"ours: {ours_s:.2f} s/step, holdout {before:.3f} -> {ours_after:.3f}, peak {ours_peak} GiB", file=sys.stderr)
    torch.manual_seed(args.seed)
    trl_s, trl_after, trl_peak = run_trl(args, cfg, train, holdout, work)
    print(f"trl:  {trl_s:.2f} s/step, holdout {before:.3f} -> {trl_after:.3f}, peak {trl_peak} GiB", file=sys.stderr)
    meta = json.loads((Path(args.model) / "tiny.json").read_text()) if (Path(args.model) / "tiny.json").exists() else {}
    result = {"device": args.device, "size": args.size or "tiny", "parameters": meta.get("parameters"),
              "ours_s_per_step": round(ours_s, 3), "trl_s_per_step": round(trl_s, 3),
              "ours_peak_gib": ours_peak, "trl_peak_gib": trl_peak,
              "speedup": round(trl_s / ours_s, 2), "ours_gain": round(ours_after - before, 3),
              "trl_gain": round(trl_after - before, 3), "baseline": round(before, 3), "steps": args.steps,
              "holdout_samples": args.holdout * args.eval_samples,
              # Standard error of one gain (a difference of two rates on that many samples each).
              "gain_se": round(math.sqrt(2 * before * (1 - before) / (args.holdout * args.eval_samples)), 3)}
    print(f"ours {ours_s:.2f} s/step vs TRL {trl_s:.2f} s/step: {result['speedup']}x; "
          f"gain ours {result['ours_gain']:+.3f}, TRL {result['trl_gain']:+.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
