"""Layouts of GRPO's training forward and backward, side by side on one step's real episodes, one process, one
device:
- `padded`: every row in full, right-padded to its micro-batch's longest (`share_prompt_prefix` off, or
  gradient checkpointing on, before packing);
- `shared`: each distinct prompt once, its continuations attending to its KV cache, padded to their longest
  (`share_prompt_prefix` without `pack_sequences`: the default before packing, and the baseline here);
- `packed`: rows laid end to end in rows as wide as the longest, each attending to itself only
  (`pack_sequences` without sharing);
- `packed_shared`: units of one prompt and the continuations that fit after it in the costed width, laid end to
  end (`pack_sequences` with `share_prompt_prefix`, the default; also under gradient checkpointing, where
  `shared` cannot run).

The episodes are one step of the demo's recipe by default (16 prompts x 8 samples of the workplace tasks,
48 new tokens a turn, the task's turns, micro-batches of 64 ordered as the loop orders them) sampled from the
shipped demo model with a LoRA adapter drawn at `--lora-std`. Per layout: the token positions the decoder runs
(padding included) and the widths of the rows they run in, seconds for the step's forwards and backwards (the fastest of `--repeats`, after one untimed
pass), and the largest |logprob difference| from `padded`.

    .venv/bin/python bench/packing.py [--device cpu|cuda] [--model DIR] [--prompts 16] [--samples 8]
                                      [--max-new-tokens 48] [--train-batch-size 64] [--gc] [--threads 1]

Last line: JSON {device, rows: [{layout, positions, widths, s_fwd_bwd, max_logprob_diff}], speedup_<layout>: seconds
of the baseline (`shared`, or `padded` with --gc) over the layout's}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.sampling import policy, policy_arguments, sync  # noqa: E402
from trainer.batching import Batch, collate, pack_costs, pack_layout, pack_width, token_logprobs  # noqa: E402
from trainer.envs.workplace import generate_tasks  # noqa: E402
from trainer.evaluation import make_env_for  # noqa: E402
from trainer.models import enable_gradient_checkpointing  # noqa: E402
from trainer.rollout.episodes import run_episodes, start_episodes  # noqa: E402
from trainer.rollout.hf import HFEngine  # noqa: E402

LAYOUTS = {"padded": (False, False), "shared": (True, False), "packed": (False, True), "packed_shared": (True, True)}


def positions(model, batch: Batch, layout: str) -> tuple[int, int]:
    """Token positions the decoder runs for one micro-batch in `layout`, padding included, and its rows' width."""
    lens = batch.attention_mask.sum(dim=1)
    share, pack = LAYOUTS[layout]
    if pack:
        bins, width = pack_layout(batch, share, pack_width(batch, share, pack_costs(model.get_base_model())))
        return len(bins) * width, width
    if share:
        distinct = batch.prompts.unique()
        return (len(distinct) * int(batch.prompt_lens.max()) + len(batch) * int((lens - batch.prompt_lens).max()),
                int(lens.max()))
    return len(batch) * int(lens.max()), int(lens.max())


def micro_batches(episodes: list, pad_id: int, size: int) -> list[Batch]:
    """The step's micro-batches as `trainer.loop.optimize` makes them: a group's rows together, by length."""
    batch = collate(episodes, pad_id)
    order = sorted(range(len(episodes)), key=lambda i: (int(batch.prompts[i]), len(episodes[i].token_ids)))
    return [batch.select(order[i:i + size]) for i in range(0, len(order), size)]


def fwd_bwd(model, mbs: list[Batch], layout: str, device: str) -> tuple[float, list[torch.Tensor]]:
    share, pack = LAYOUTS[layout]
    model.zero_grad(set_to_none=True)
    sync(device)
    t0 = time.perf_counter()
    out = []
    for mb in mbs:
        logp, _ = token_logprobs(model, mb, 1.0, entropy=True, share_prefix=share, pack=pack)
        (logp * mb.loss_mask.to(logp.device)).sum().backward()
        out.append(logp.detach().float().cpu())
    sync(device)
    return time.perf_counter() - t0, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    policy_arguments(p)
    p.add_argument("--train-batch-size", type=int, default=64)
    p.add_argument("--gc", action="store_true", help="gradient checkpointing (no `shared` layout then)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    # A job's weights on a GPU are bfloat16, its forwards autocast (trainer.loop._precision).
    model, tok = policy(args, torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    rows = generate_tasks(args.prompts, seed=0, split="train", difficulty="single")
    episodes = start_episodes(rows, args.samples, tok, make_env_for)
    torch.manual_seed(1)
    run_episodes(HFEngine(model, tok), tok, episodes, max_new_tokens=args.max_new_tokens, temperature=1.0,
                 max_turns=None, max_seq_len=2048)
    mbs = micro_batches(episodes, tok.pad_token_id, args.train_batch_size)
    lens = [len(ep.token_ids) for ep in episodes]
    model.train()
    layouts = list(LAYOUTS)
    if args.gc:
        enable_gradient_checkpointing(model)
        layouts.remove("shared")
    out, reference = [], None
    for layout in layouts:
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if args.device.startswith("cuda") else None
        with autocast or torch.autocast("cpu", enabled=False):
            fwd_bwd(model, mbs, layout, args.device)
            seconds, logps = min((fwd_bwd(model, mbs, layout, args.device) for _ in range(args.repeats)),
                                 key=lambda r: r[0])
        if reference is None:
            reference = logps
        diff = max(float(((a - b) * mb.loss_mask).abs().max()) for a, b, mb in zip(logps, reference, mbs, strict=True))
        sizes = [positions(model, mb, layout) for mb in mbs]
        row = {"layout": layout, "positions": sum(n for n, _ in sizes), "widths": [w for _, w in sizes],
               "s_fwd_bwd": round(seconds, 4), "max_logprob_diff": round(diff, 6)}
        out.append(row)
        print(f"{layout:14s} {row['positions']:7d} positions (rows {row['widths']} wide)  {seconds:.3f} s  "
              f"|dlogp| max {diff:.1e}",
              file=sys.stderr)
    baseline = "padded" if args.gc else "shared"
    base = next(r for r in out if r["layout"] == baseline)
    result = {"device": args.device, "model": args.model.name, "rows_per_step": len(episodes),
              "tokens": sum(lens), "row_length": {"min": min(lens), "max": max(lens)}, "gc": args.gc,
              "micro_batches": len(mbs), "rows": out}
    for r in out:
        if r is not base:
            result[f"speedup_{r['layout']}"] = round(base["s_fwd_bwd"] / r["s_fwd_bwd"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
