"""Ways of sampling a LoRA policy with transformers `generate`, side by side in one process on one device, in
float32 and bfloat16:
- `unmerged`: the adapter's layers run beside the base (what `HFEngine` did in bfloat16 before);
- `merged`: the adapter merged into the base for the call (`trainer.models.lora_merged`, what it does now);
- `compiled`: merged, decoding with a static KV cache and a compiled forward (`rollout_compile`: CUDA graphs
  on a GPU; its compilation is paid in the untimed first call and reported as `first_call_s`).

Per dtype and way: seconds per `generate` of P prompts x G samples (the faster of `--repeats`, after one
untimed call), decoding steps and completion tokens per second, the aten operators per decoding step
(torch.profiler: on a GPU each is at least one kernel launch, which is what a small model's decoding costs
there), and how far the sampler's logprobs are from the trainer's (the mean and the largest |difference| on
the sampled tokens, against `token_logprobs` of the unmerged policy in float32 autocast as the loss sees it;
the loop's importance weight corrects for it). The adapter is the trainer's default LoRA (r16, every
projection) with B drawn at `--lora-std`, so that it changes the model as a trained one does.

    .venv/bin/python bench/sampling.py [--device cpu|cuda] [--model DIR] [--prompts 16] [--samples 8]
                                       [--max-new-tokens 48] [--ways unmerged,merged,compiled] [--threads 1]

Last line: JSON {device, rows: [{dtype, way, s_per_generate, tokens_per_s, ops_per_step, ...}],
speedup_<dtype>_<way>: seconds of `unmerged` over the way's}.
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

from trainer.batching import collate, token_logprobs  # noqa: E402
from trainer.config import GRPOConfig  # noqa: E402
from trainer.envs.workplace import generate_tasks  # noqa: E402
from trainer.evaluation import make_env_for  # noqa: E402
from trainer.models import attach_lora, load_model  # noqa: E402
from trainer.rollout.episodes import run_episodes, start_episodes  # noqa: E402
from trainer.rollout.hf import HFEngine  # noqa: E402

SHIPPED_DEMO_MODEL = REPO / "platform" / "flywheel" / "registry" / "demo_model"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def policy(args: argparse.Namespace, dtype: torch.dtype):
    torch.manual_seed(0)
    base, tok = load_model(args.model, device=args.device, dtype=dtype)
    model = attach_lora(base, GRPOConfig())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, args.lora_std)
    return model, tok


def measure(args: argparse.Namespace, dtype: torch.dtype, way: str, rows: list[dict]) -> dict:
    model, tok = policy(args, dtype)
    engine = HFEngine(model, tok, merge_lora=way != "unmerged", compile=way == "compiled")
    prompts = [list(ep.token_ids) for ep in start_episodes(rows, 1, tok, make_env_for)]
    batch = [p for p in prompts for _ in range(args.samples)]

    def once() -> tuple[float, list]:
        torch.manual_seed(1)
        sync(args.device)
        t0 = time.perf_counter()
        out = engine.generate(batch, max_new_tokens=args.max_new_tokens, temperature=1.0)
        sync(args.device)
        return time.perf_counter() - t0, out

    first = once()[0]  # allocations, kernels' first launch, compilation
    seconds, out = min((once() for _ in range(args.repeats)), key=lambda r: r[0])
    steps = max(len(g.token_ids) for g in out)
    tokens = sum(len(g.token_ids) for g in out)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        once()
    ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    # Sampler against trainer: the same prompts and samples (the same shape, so nothing compiles again), one
    # turn each, as the rollout sampled it.
    episodes = start_episodes(rows, args.samples, tok, make_env_for)
    torch.manual_seed(2)
    run_episodes(engine, tok, episodes, max_new_tokens=args.max_new_tokens, temperature=1.0, max_turns=1,
                 max_seq_len=2048)
    data = collate(episodes, tok.pad_token_id)
    with torch.no_grad(), torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16,
                                         enabled=dtype == torch.bfloat16 and args.device.startswith("cuda")):
        logp, _ = token_logprobs(model, data, temperature=1.0)
    mask = data.loss_mask.bool()
    gap = (logp.float().cpu() - data.sampler_logprobs)[mask].abs()
    return {"dtype": str(dtype).removeprefix("torch."), "way": way, "first_call_s": round(first, 2),
            "s_per_generate": round(seconds, 4),
            "decode_steps": steps, "tokens_per_s": round(tokens / seconds, 1), "ops_per_step": round(ops / steps),
            "logprob_gap_mean": round(float(gap.mean()), 5), "logprob_gap_max": round(float(gap.max()), 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", type=Path, default=SHIPPED_DEMO_MODEL)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lora-std", type=float, default=0.02)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--ways", default="unmerged,merged,compiled")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = generate_tasks(args.prompts, seed=1, split="holdout", difficulty="single")
    out = []
    ways = args.ways.split(",")
    for name in args.dtypes.split(","):
        for way in ways:
            row = measure(args, getattr(torch, name), way, rows)
            out.append(row)
            print(f"{row['dtype']:8s} {way:8s} {row['s_per_generate']:.3f} s/generate (first {row['first_call_s']} s), "
                  f"{row['tokens_per_s']:.0f} tokens/s, {row['ops_per_step']} ops/step, sampler-trainer |dlogp| "
                  f"mean {row['logprob_gap_mean']} max {row['logprob_gap_max']}", file=sys.stderr)
    result: dict = {"device": args.device, "model": args.model.name, "batch": args.prompts * args.samples, "rows": out}
    for name in args.dtypes.split(","):
        by_way = {r["way"]: r for r in out if r["dtype"] == name}
        for way in ways:
            if way != "unmerged" and "unmerged" in by_way:
                result[f"speedup_{name}_{way}"] = round(by_way["unmerged"]["s_per_generate"]
                                                        / by_way[way]["s_per_generate"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
