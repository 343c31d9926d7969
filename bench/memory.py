"""Peak memory of one GRPO training step at a 152k vocabulary: ours against TRL's GRPOTrainer on the same batch,
on the CPU or (`--device cuda`) on a GPU.

The model is a small Qwen2-architecture one built here (random weights, Qwen2.5's vocabulary of 152,064,
tied embeddings, a few narrow layers), so the LM head dominates as it does for a 0.5B-1.5B model at long
completions. The batch is P prompts x G completions of fixed lengths (random tokens, rewards that differ
within each group), the same for both; LoRA r16 on every projection, loss `grpo`, beta 0, float32.
Each trainer runs in its own process: it builds its model and trainer, then the RSS high-water mark is
reset (/proc/self/clear_refs), one step runs (ours: `trainer.loop.optimize`; TRL: `compute_loss`, backward and
an AdamW step, without generation), and the figure is the high-water mark minus the RSS before the step.
Both are run with and without gradient checkpointing (TRL's GRPOConfig turns it on by default, ours does not).
On a GPU (`--device cuda`) both load the model in bfloat16 and train under bf16 (our autocast, TRL's
`bf16=True`); the figure is `torch.cuda.max_memory_allocated` during the step minus what was allocated before
it, and `*_peak_total_gib` the peak with the model, beside each step's seconds.

    .venv/bin/python bench/memory.py [--prompts 2] [--generations 8] [--prompt-len 256] [--completion-len 128]
                                     [--layers 2] [--hidden 256] [--threads 2] [--device cpu|cuda] [--vocab 152064]

Last line: JSON {vocab, batch_tokens, ours_peak_mb, trl_peak_mb, ...}: ours and TRL each with its own
default checkpointing; `*_gc_*`/`*_no_gc_*` the other setting.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VOCAB = 152064


def build_model(out: Path, args: argparse.Namespace) -> None:
    vocab_size = args.vocab
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=1, pad_token_id=0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    # A word-level tokenizer over the whole vocabulary: the step never decodes, TRL only wants one to exist.
    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")),
                                  pad_token="<pad>", eos_token="<eos>")
    tok.save_pretrained(out)


def make_batch(args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]], list[float]]:
    """P prompts, G completions each (no EOS inside), rewards 0/1 alternating within a group."""
    import random

    rng = random.Random(0)
    prompts, completions, rewards = [], [], []
    for _ in range(args.prompts):
        prompt = [rng.randrange(2, args.vocab) for _ in range(args.prompt_len)]
        for g in range(args.generations):
            prompts.append(prompt)
            completions.append([rng.randrange(2, args.vocab) for _ in range(args.completion_len)])
            rewards.append(float(g % 2))
    return prompts, completions, rewards


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS")) / 1024


def hwm_mb() -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM")) / 1024


def measure(step, device: str = "cpu") -> tuple[float, float, float | None]:
    """(peak MB above the memory in use before the step, seconds, peak GiB in all or None) of step(): the
    process's RSS on the CPU, the allocator's bytes on a GPU."""
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated()
        return (peak - before) / 2**20, seconds, round(peak / 2**30, 3)
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what setup freed goes back, so the step cannot hide in it
    before = rss_mb()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset the high-water mark to the current RSS
    t0 = time.perf_counter()
    step()
    return hwm_mb() - before, time.perf_counter() - t0, None


def worker_ours(args: argparse.Namespace) -> dict:
    from types import SimpleNamespace

    import torch

    from trainer.config import GRPOConfig
    from trainer.loop import optimize
    from trainer.models import attach_lora, load_model, trainable_parameters
    from trainer.rollout.episodes import Episode

    prompts, completions, rewards = make_batch(args)
    n = len(prompts)
    fields = {"gradient_checkpointing": True} if args.gc else {}  # absent before the field existed
    cfg = GRPOConfig(num_prompts_per_step=args.prompts, num_generations_per_prompt=args.generations,
                     max_new_tokens=args.completion_len, max_turns=1, train_batch_size=n, loss_type="grpo",
                     beta=0.0, r=16, alpha=32, **fields)
    base, tok = load_model(args.model, device=args.device)  # bf16 on a GPU; cfg.bf16 autocasts there
    torch.manual_seed(0)  # the same LoRA initialisation in every worker
    model = attach_lora(base, cfg)
    if args.gc:
        from trainer.models import enable_gradient_checkpointing

        enable_gradient_checkpointing(model)
    params = trainable_parameters(model)
    run = SimpleNamespace(cfg=cfg, model=model, tokenizer=tok, params=params, max_completion_length=args.completion_len,
                          optimizer=torch.optim.AdamW(params, lr=1e-5))
    episodes = [Episode(row={}, group=i // args.generations, env=None, token_ids=p + c,
                        mask=[0] * len(p) + [1] * len(c), sampler_logprobs=[0.0] * (len(p) + len(c)),
                        prompt_len=len(p), completion_tokens=len(c), has_sampler_logprobs=False)
                for i, (p, c) in enumerate(zip(prompts, completions, strict=True))]
    out: dict = {}
    peak, secs, total = measure(lambda: out.update(optimize(run, episodes, torch.tensor(rewards))), args.device)
    return {"peak_mb": peak, "seconds": secs, "peak_total_gib": total, "loss": out["loss"], "grad_norm": out["grad_norm"]}


def worker_trl(args: argparse.Namespace) -> dict:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    from trainer.config import GRPOConfig
    from trainer.models import load_model, lora_config

    prompts, completions, rewards = make_batch(args)
    n = len(prompts)
    base, tok = load_model(args.model, device=args.device)
    cuda = args.device.startswith("cuda")
    trl_args = TRLConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-mem-"), per_device_train_batch_size=n, gradient_accumulation_steps=1,
        num_generations=args.generations, max_completion_length=args.completion_len, learning_rate=1e-5,
        beta=0.0, loss_type="grpo", scale_rewards="group", num_iterations=1, use_vllm=False, use_cpu=not cuda,
        bf16=cuda, gradient_checkpointing=bool(args.gc), report_to="none", save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0,
    )
    data = Dataset.from_dict({"prompt": ["t2 t3"] * n})
    torch.manual_seed(0)
    trainer = GRPOTrainer(model=base, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=trl_args,
                          train_dataset=data, processing_class=tok,
                          peft_config=lora_config(GRPOConfig(r=16, alpha=32), base))
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's own loop, which we do not run
    r = torch.tensor(rewards).view(-1, args.generations)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)
    inputs = {
        "prompt_ids": torch.tensor(prompts), "prompt_mask": torch.ones(n, args.prompt_len, dtype=torch.long),
        "completion_ids": torch.tensor(completions),
        "completion_mask": torch.ones(n, args.completion_len, dtype=torch.long),
        "advantages": adv, "num_items_in_batch": torch.tensor(float(n * args.completion_len)),
    }
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in inputs.items()}
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    out: dict = {}

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):  # what Trainer's bf16 wraps it in
            loss = trainer.compute_loss(model, inputs)
        loss.backward()
        out["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        optimizer.step()
        out["loss"] = float(loss)

    peak, secs, total = measure(step, args.device)
    return {"peak_mb": peak, "seconds": secs, "peak_total_gib": total, **out}


def spawn(which: str, gc_on: bool, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", which, "--model", str(args.model), "--prompts", str(args.prompts),
           "--generations", str(args.generations), "--prompt-len", str(args.prompt_len),
           "--completion-len", str(args.completion_len), "--threads", str(args.threads), "--device", args.device,
           "--vocab", str(args.vocab)] + (["--gc"] if gc_on else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{which} worker failed")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    label = f"{which}{' + gradient checkpointing' if gc_on else ''}"
    print(f"{label:34s} peak {result['peak_mb']:8.0f} MB above the loaded model, {result['seconds']:.1f} s, "
          f"loss {result['loss']:+.4f}, grad norm {result['grad_norm']:.4f}", file=sys.stderr)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--completion-len", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu or cuda (bf16 on both sides)")
    p.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size (Qwen2.5's by default)")
    p.add_argument("--quick", action="store_true", help="each trainer with its own default checkpointing only")
    p.add_argument("--model", type=Path, help="a model dir built by this script; default: build one in a temp dir")
    p.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--gc", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    if args.worker:
        result = (worker_ours if args.worker == "ours" else worker_trl)(args)
        print(json.dumps(result))
        return
    if args.model is None:
        args.model = Path(tempfile.mkdtemp(prefix="mem-bench-")) / f"qwen2-{args.vocab}"
        build_model(args.model, args)
    n = args.prompts * args.generations
    tokens = n * (args.prompt_len + args.completion_len)
    print(f"vocab {args.vocab}, {args.prompts} prompts x {args.generations} completions, {args.prompt_len} + "
          f"{args.completion_len} tokens each: {tokens} tokens; full float32 logits of the completions would be "
          f"{n * args.completion_len * args.vocab * 4 / 2**20:.0f} MB a copy", file=sys.stderr)
    # Each with its own default checkpointing (TRL checkpoints, we don't); --quick leaves out the other setting.
    ours, trl_gc = spawn("ours", False, args), spawn("trl", True, args)
    ours_gc = trl = None
    if not args.quick:
        ours_gc, trl = spawn("ours", True, args), spawn("trl", False, args)
    result = {"device": args.device, "vocab": args.vocab, "batch_tokens": tokens,
              "ours_peak_mb": round(ours["peak_mb"]), "trl_peak_mb": round(trl_gc["peak_mb"]),
              "ours_gc_peak_mb": round(ours_gc["peak_mb"]) if ours_gc else None,
              "trl_no_gc_peak_mb": round(trl["peak_mb"]) if trl else None,
              "ours_peak_total_gib": ours["peak_total_gib"], "trl_peak_total_gib": trl_gc["peak_total_gib"],
              "ours_s": round(ours["seconds"], 2), "trl_s": round(trl_gc["seconds"], 2),
              "memory_ratio": round(trl_gc["peak_mb"] / max(ours["peak_mb"], 1e-9), 2)}
    print(f"ours {result['ours_peak_mb']} MB, {result['ours_s']} s vs TRL {result['trl_peak_mb']} MB, {result['trl_s']} s "
          f"(each with its default checkpointing): {result['memory_ratio']}x less; both checkpointing: "
          f"{result['ours_gc_peak_mb']} vs {result['trl_peak_mb']} MB; neither: {result['ours_peak_mb']} vs "
          f"{result['trl_no_gc_peak_mb']} MB")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
