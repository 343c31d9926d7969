"""Our DPO step against TRL's DPOTrainer on the same tiny model, pairs and settings: seconds per step and peak
memory of each, and the ratios.

The pairs are single-call workplace tasks: the reference call chosen, a corrupted call (a wrong argument value
or tool) rejected, as a promoted failure gives them. Both train a new LoRA adapter with the same config, the
sigmoid loss, beta, learning rate (constant), max_grad_norm, P pairs a step in one micro-batch, float32 on CPU,
no gradient checkpointing (TRL's DPOConfig turns it on by default; `--gradient-checkpointing` turns it on for
both), reference = the adapter disabled, recomputed every step (no precomputed reference logprobs). Ours is
`trainer.dpo.dpo_update`, the step a job runs; TRL is `DPOTrainer.train()` on the conversational dataset
(prompt, chosen, rejected, tools), which tokenizes to the same sequences as ours. The order of the pairs
differs (ours draws with replacement from the job's stream, TRL shuffles an epoch); the first step's loss is
log 2 for both. After training, both adapters are measured the same way (`trainer.dpo.preference_metrics`) on
held-out pairs made from holdout tasks: mean margin, its standard error, accuracy.

Each trainer runs in its own process: it loads the model and builds its trainer, then the RSS high-water mark
is reset (/proc/self/clear_refs) and the steps run; peak memory is that high-water mark minus the RSS before
the steps (MB), so it counts the optimizer state, activations, logits and allocator growth of training, not
the loaded model. Seconds per step leave out the first step (warm-up).

    .venv/bin/python bench/dpo_vs_trl.py [--model DIR] [--steps 20] [--pairs-per-step 8] [--threads 1]
                                         [--seed 0] [--gradient-checkpointing]

Last line: JSON {ours_s_per_step, trl_s_per_step, speedup, ours_peak_mb, trl_peak_mb, memory_ratio,
ours_held_out_margin, trl_held_out_margin, held_out_margin_se, ...}.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import hwm_mb, rss_mb  # noqa: E402  (the memory bench's readers of /proc/self/status)

BETA = 0.1


def pair_rows(n: int, seed: int, split: str = "train") -> list[dict]:
    from trainer.envs.workplace import generate_tasks
    from trainer.tiny import noisy_solution

    rng = random.Random(seed)
    rows = []
    for task in generate_tasks(n, seed=seed, split=split, difficulty="single"):
        row = {k: v for k, v in task.items() if k != "solution"}
        row["chosen"], row["rejected"] = task["solution"][0], noisy_solution(task, rng)[0]
        if row["chosen"] != row["rejected"]:
            rows.append(row)
    return rows



def reset_peak() -> float:
    """The RSS now, with the high-water mark reset to it (after freeing what setup left behind)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = rss_mb()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return before


def config(args: argparse.Namespace):
    from trainer.config import GRPOConfig

    return GRPOConfig(loss_type="sigmoid", beta=BETA, learning_rate=args.lr, max_steps=args.steps,
                      num_prompts_per_step=args.pairs_per_step, train_batch_size=2 * args.pairs_per_step,
                      r=16, alpha=32, dropout=0.0, seed=args.seed, gradient_checkpointing=args.gradient_checkpointing)


def held_out(model, tok, cfg, args: argparse.Namespace) -> dict:
    """Preference metrics of the trained adapter on pairs neither trainer saw (the same for both)."""
    from trainer.dpo import encode_pairs, preference_metrics

    pairs, _ = encode_pairs(pair_rows(args.held_out, args.seed + 1, "holdout"), tok, source="held-out pairs")
    return preference_metrics(model, pairs, cfg, pad_id=tok.pad_token_id)


def worker_ours(args: argparse.Namespace) -> dict:
    import torch

    from trainer.dpo import dpo_update, encode_pairs
    from trainer.models import attach_lora, enable_gradient_checkpointing, load_model, trainable_parameters

    cfg = config(args)
    torch.manual_seed(args.seed)
    base, tok = load_model(args.model, device="cpu")
    model = attach_lora(base, cfg)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=0.0)
    pairs, _ = encode_pairs(pair_rows(args.pairs, args.seed), tok, source="pairs")
    rng = random.Random(args.seed)
    before = reset_peak()
    times, losses = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        batch = [pairs[rng.randrange(len(pairs))] for _ in range(cfg.num_prompts_per_step)]
        stats = dpo_update(model, optimizer, params, batch, cfg, pad_id=tok.pad_token_id)
        times.append(time.perf_counter() - t0)
        losses.append(stats["loss"])
    peak = hwm_mb() - before
    return {"peak_mb": peak, "times": times, "losses": losses, "held_out": held_out(model, tok, cfg, args)}


def worker_trl(args: argparse.Namespace) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from trainer.models import load_model, lora_config

    cfg = config(args)
    torch.manual_seed(args.seed)
    model, tok = load_model(args.model, device="cpu")
    rows = pair_rows(args.pairs, args.seed)
    data = Dataset.from_list([{"prompt": r["messages"], "chosen": [r["chosen"]], "rejected": [r["rejected"]],
                               "tools": json.dumps(r["tools"])} for r in rows])
    trl_args = DPOConfig(
        output_dir=str(Path(tempfile.mkdtemp(prefix="dpo-trl-"))), per_device_train_batch_size=args.pairs_per_step,
        gradient_accumulation_steps=1, learning_rate=cfg.learning_rate, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=cfg.max_grad_norm, max_steps=args.steps, beta=BETA, loss_type=["sigmoid"],
        max_length=cfg.max_seq_len, precompute_ref_log_probs=False, gradient_checkpointing=cfg.gradient_checkpointing,
        use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1, seed=args.seed,
        disable_tqdm=True, dataloader_num_workers=0,
    )

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, *a, **k) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k) -> None:
            self.times.append(time.perf_counter() - self.t0)

    timer = Timer()
    trainer = DPOTrainer(model=model, args=trl_args, train_dataset=data, processing_class=tok,
                         peft_config=lora_config(cfg, model), callbacks=[timer])
    before = reset_peak()
    trainer.train()
    peak = hwm_mb() - before
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"peak_mb": peak, "times": timer.times, "losses": losses,
            "held_out": held_out(trainer.model, tok, cfg, args)}


def spawn(which: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", which, "--model", str(args.model), "--steps", str(args.steps),
           "--pairs-per-step", str(args.pairs_per_step), "--pairs", str(args.pairs), "--held-out", str(args.held_out), "--lr", str(args.lr),
           "--threads", str(args.threads), "--seed", str(args.seed)]
    cmd += ["--gradient-checkpointing"] if args.gradient_checkpointing else []
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{which} worker failed")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    times = result["times"]
    result["s_per_step"] = sum(times[1:]) / max(len(times) - 1, 1)
    print(f"{which:5s} {result['s_per_step']:.3f} s/step, peak {result['peak_mb']:.0f} MB above the loaded model, "
          f"loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f} over {len(times)} steps, held-out margin "
          f"{result['held_out']['margin']:.3f} (SE {result['held_out']['margin_se']:.3f}), accuracy "
          f"{result['held_out']['accuracy']:.2f}", file=sys.stderr)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a model dir; default: build the tiny model into a temp dir")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--pairs-per-step", type=int, default=8)
    p.add_argument("--pairs", type=int, default=400, help="workplace tasks the pairs are made from")
    p.add_argument("--held-out", type=int, default=100, help="holdout tasks the held-out pairs are made from")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gradient-checkpointing", action="store_true", help="on for both (TRL's default, not ours)")
    p.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    if args.worker:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        out = sys.stdout
        sys.stdout = sys.stderr  # library chatter must not reach the line the parent parses
        result = (worker_ours if args.worker == "ours" else worker_trl)(args)
        out.write(json.dumps(result) + "\n")
        return
    if args.model is None:
        from trainer.tiny import build_tiny

        args.model = build_tiny(Path(tempfile.mkdtemp(prefix="dpo-vs-trl-")) / "tiny")
    ours, trl = spawn("ours", args), spawn("trl", args)
    result = {
        "ours_s_per_step": round(ours["s_per_step"], 4), "trl_s_per_step": round(trl["s_per_step"], 4),
        "speedup": round(trl["s_per_step"] / ours["s_per_step"], 2),
        "ours_peak_mb": round(ours["peak_mb"]), "trl_peak_mb": round(trl["peak_mb"]),
        "memory_ratio": round(trl["peak_mb"] / max(ours["peak_mb"], 1.0), 2),
        "ours_loss_first": round(ours["losses"][0], 4), "trl_loss_first": round(trl["losses"][0], 4),
        "ours_loss_last": round(ours["losses"][-1], 4), "trl_loss_last": round(trl["losses"][-1], 4),
        "ours_held_out_margin": round(ours["held_out"]["margin"], 4),
        "trl_held_out_margin": round(trl["held_out"]["margin"], 4),
        "held_out_margin_se": round(max(ours["held_out"]["margin_se"], trl["held_out"]["margin_se"]), 4),
        "ours_held_out_accuracy": round(ours["held_out"]["accuracy"], 3),
        "trl_held_out_accuracy": round(trl["held_out"]["accuracy"], 3), "held_out_pairs": ours["held_out"]["pairs"],
        "log2": round(math.log(2), 4), "steps": args.steps, "pairs_per_step": args.pairs_per_step,
        "gradient_checkpointing": args.gradient_checkpointing, "threads": args.threads,
        "memory": "RSS high-water mark above the RSS before the steps (/proc/self/clear_refs), MB",
    }
    print(f"ours {result['ours_s_per_step']:.3f} s/step vs TRL {result['trl_s_per_step']:.3f} s/step: "
          f"{result['speedup']}x; peak ours {result['ours_peak_mb']} MB vs TRL {result['trl_peak_mb']} MB "
          f"({result['memory_ratio']}x)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
