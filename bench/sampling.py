"""Ways of sampling a LoRA policy with transformers `generate`, side by side in one process on one device, in
float32 and bfloat16:
- `unmerged`: the adapter's layers run beside the base (what `HFEngine` did in bfloat16 before);
- `merged`: the adapter merged into the base for the call (`trainer.models.lora_merged`, what it does now);
- `compiled`: merged, decoding with a static KV cache and a compiled forward (`rollout_compile`: CUDA graphs
  on a GPU; its compilation is paid in the untimed first call and reported as `first_call_s`);
- `continuous`: merged, sampling through transformers' continuous batching (`generate_batch`: a paged KV cache,
  requests scheduled in and out of the batch by a background thread, `--cb-requests` at most per forward),
  with the sampler's logprobs it returns (`return_logprobs`). Where it cannot run, or its logprobs are not the
  trainer's, its line says so instead of figures.

Per dtype and way: seconds per `generate` of P prompts x G samples (the faster of `--repeats`, after one
untimed call), decoding steps and completion tokens per second, the aten operators per decoding step
(torch.profiler, every thread: on a GPU each is at least one kernel launch, which is what a small model's
decoding costs there; `forwards` counts the model's forward passes, which continuous batching runs more of
than the longest completion), and how far the sampler's logprobs are from the trainer's (the mean and the
largest |difference| on the sampled tokens, against `token_logprobs` of the unmerged policy in float32 autocast
as the loss sees it; the loop's importance weight corrects for it). The adapter is the trainer's default LoRA
(r16, every projection) with B drawn at `--lora-std`, so that it changes the model as a trained one does.

    .venv/bin/python bench/sampling.py [--device cpu|cuda] [--model DIR] [--prompts 16] [--samples 8]
                                       [--max-new-tokens 48] [--ways unmerged,merged,compiled,continuous]
                                       [--threads 1] [--cb-requests 32] [--cb-page-size 32] [--cb-persistent]

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
from trainer.models import attach_lora, load_model, lora_merged  # noqa: E402
from trainer.rollout import Generation  # noqa: E402
from trainer.rollout.episodes import run_episodes, start_episodes  # noqa: E402
from trainer.rollout.hf import HFEngine  # noqa: E402

SHIPPED_DEMO_MODEL = REPO / "platform" / "flywheel" / "registry" / "demo_model"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Unavailable(RuntimeError):
    """A way that cannot sample here, or not with the sampler logprobs the loss needs: its line says why."""


# The largest sampler-vs-trainer |logprob| gap a way may show and still count as giving the trainer's logprobs
# (the merged way's is ~0 in float32, ~1e-2..1e-1 in bfloat16, where the merged weights are rounded).
LOGPROB_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.5, "float16": 0.5}


class ContinuousEngine:
    """The rollout engine interface over transformers' continuous batching (`generate_batch`), for the bench.

    The LoRA adapter is merged for the call as `HFEngine` merges it. The distribution is ours alone: the
    `GenerationConfig` given to `generate_batch` is used as is (the model's generation_config.json is not merged
    in, unlike `generate`), so with temperature 1, top_k 0 and top_p 1 no logits processor runs, and the logprob
    it returns, log(softmax(fp32 logits))[token], is the one of the full distribution the token was drawn from.
    `--cb-persistent` keeps one manager across calls (its configuration, temperature included, is the first
    call's). On a CPU the attention is `sdpa` over one flat sequence of every scheduled request with a
    block-diagonal mask (the paged decode fast path needs flash attention on CUDA/XPU), so a forward reads the KV
    of the whole batch.
    """

    def __init__(self, model, tokenizer, *, requests_per_batch: int, page_size: int, top_k: int = 0,
                 top_p: float = 1.0, persistent: bool = False) -> None:
        self.model = model
        # persistent: keep one manager and its thread started across calls instead of `generate_batch`'s own per
        # call, whose stop alone costs two gc.collect() and up to 0.1 s of the loop's idle wait.
        self.persistent = persistent
        self.manager = None
        self.requests_per_batch = requests_per_batch
        self.page_size = page_size
        self.top_k = top_k
        self.top_p = top_p
        eos = model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
        self.eos_ids = sorted({*eos, tokenizer.eos_token_id} - {None})
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def sync(self, model, version: int) -> None:
        self.model = model

    def _configs(self, prompts: list[list[int]], max_new_tokens: int, temperature: float):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        gen_config = GenerationConfig(
            do_sample=temperature > 0, temperature=temperature if temperature > 0 else 1.0, top_k=self.top_k,
            top_p=self.top_p, max_new_tokens=max_new_tokens, eos_token_id=self.eos_ids, pad_token_id=self.pad_id,
        )
        # The KV cache sized for the batch, not from 60% of the host's memory (the default on a CPU), which would
        # also size the (max_batch_tokens, cache tokens) attention mask allocated and filled at every call.
        per_request = -(-(max(len(p) for p in prompts) + max_new_tokens) // self.page_size) + 1
        requests = min(self.requests_per_batch, len(prompts))
        cb_config = ContinuousBatchingConfig(
            page_size=self.page_size, num_blocks=2 * requests * per_request,
            max_batch_tokens=max(requests * self.page_size, 1024), max_requests_per_batch=requests,
            return_logprobs=True, seed=int(torch.randint(2**31 - 1, ())),  # reproducible under torch.manual_seed
        )  # CUDA graphs, compile and async batching left to transformers: all off on a CPU
        return gen_config, cb_config

    # Not inference_mode (HFEngine's): tensors the manager makes in this thread are updated in place by its
    # background thread, which is outside inference mode (thread-local), and that raises.
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float) -> list[Generation]:
        if not prompts:
            return []
        gen_config, cb_config = self._configs(prompts, max_new_tokens, temperature)
        inner = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        was_training = self.model.training
        try:
            with lora_merged(self.model):
                if not self.persistent:
                    results = list(inner.generate_batch(
                        prompts, generation_config=gen_config, continuous_batching_config=cb_config,
                        max_new_tokens=max_new_tokens, progress_bar=False).values())
                else:  # one manager and thread for every call, sized (and configured) by the first
                    if self.manager is None:
                        self.manager = inner.init_continuous_batching(generation_config=gen_config,
                                                                      continuous_batching_config=cb_config)
                        self.manager.start()
                    results = self._through_manager(prompts, max_new_tokens)
        finally:  # the manager leaves the model in eval mode
            self.model.train(was_training)
        if len(results) != len(prompts):  # generate_batch logs a failed or lost request, it does not raise
            raise Unavailable(f"generate_batch answered {len(results)} of {len(prompts)} requests")
        eos = set(self.eos_ids)
        gens = []
        for r in results:
            if r.error is not None:
                raise Unavailable(f"generate_batch failed a request: {r.error}")
            if len(r.logprobs) != len(r.generated_tokens):
                raise Unavailable(f"generate_batch returned {len(r.logprobs)} logprobs for "
                                  f"{len(r.generated_tokens)} tokens")
            ids = list(r.generated_tokens)
            gens.append(Generation(token_ids=ids, logprobs=[float(x) for x in r.logprobs],
                                   finished=bool(ids) and ids[-1] in eos))
        return gens

    def _through_manager(self, prompts: list[list[int]], max_new_tokens: int) -> list:
        ids = self.manager.add_requests(prompts, max_new_tokens=max_new_tokens)
        done: dict = {}
        while len(done) < len(ids):
            r = self.manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                done[r.request_id] = r
            elif r is None and not self.manager.is_running():
                break
        return [done[i] for i in ids if i in done]

    def close(self) -> None:
        if self.manager is not None:
            self.manager.stop(block=True)
            self.manager.destroy()
            self.manager = None


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
    if way != "continuous":
        engine = HFEngine(model, tok, merge_lora=way != "unmerged", compile=way == "compiled")
        return measure_engine(args, dtype, way, rows, model, tok, engine)
    engine = ContinuousEngine(model, tok, requests_per_batch=args.cb_requests, page_size=args.cb_page_size,
                              persistent=args.cb_persistent)
    try:
        return measure_engine(args, dtype, way, rows, model, tok, engine)
    finally:
        engine.close()  # a started manager's thread would keep the process alive


def measure_engine(args: argparse.Namespace, dtype: torch.dtype, way: str, rows: list[dict], model, tok,
                   engine) -> dict:
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
    # Every thread: continuous batching runs the model in a background thread.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
                                ) as prof:
        once()
    ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    forwards = sum(e.count for e in prof.key_averages() if e.key == "aten::embedding")  # one per forward
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
    name = str(dtype).removeprefix("torch.")
    extra = {"cb_requests": args.cb_requests, "cb_persistent": args.cb_persistent} if way == "continuous" else {}
    return {"dtype": name, "way": way, **extra, "first_call_s": round(first, 2),
            "s_per_generate": round(seconds, 4),
            "decode_steps": steps, "forwards": forwards, "tokens_per_s": round(tokens / seconds, 1),
            "ops_per_step": round(ops / steps), "logprob_gap_mean": round(float(gap.mean()), 5),
            "logprob_gap_max": round(float(gap.max()), 4),
            "logprobs_match": bool(gap.max() <= LOGPROB_TOLERANCE.get(name, 0.5))}


def measure_or_reason(args: argparse.Namespace, dtype: torch.dtype, way: str, rows: list[dict]) -> dict:
    """`measure`, except that a `continuous` way that cannot run here is a row saying why (the others raise)."""
    if way != "continuous":
        return measure(args, dtype, way, rows)
    try:
        import transformers.generation.continuous_batching  # noqa: F401
    except ImportError as exc:
        reason = f"this transformers has no continuous batching ({exc})"
    else:
        try:
            return measure(args, dtype, way, rows)
        except Exception as exc:  # noqa: BLE001 (whatever stops it, the other ways still run)
            reason = f"{type(exc).__name__}: {exc}"
    return {"dtype": str(dtype).removeprefix("torch."), "way": way, "unavailable": reason}


def policy_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `policy` and of the demo-step batch it samples (shared with bench/packing.py)."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", type=Path, default=SHIPPED_DEMO_MODEL)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lora-std", type=float, default=0.02)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    policy_arguments(p)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--ways", default="unmerged,merged,compiled")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cb-requests", type=int, default=32, help="continuous: most requests in one forward")
    p.add_argument("--cb-page-size", type=int, default=32, help="continuous: tokens per KV cache page")
    p.add_argument("--cb-persistent", action="store_true",
                   help="continuous: one manager (and thread) for every call instead of one per generate_batch")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = generate_tasks(args.prompts, seed=1, split="holdout", difficulty="single")
    out = []
    ways = args.ways.split(",")
    for name in args.dtypes.split(","):
        for way in ways:
            row = measure_or_reason(args, getattr(torch, name), way, rows)
            out.append(row)
            label = f"{way} (persistent)" if row.get("cb_persistent") else way
            if "unavailable" in row:
                print(f"{row['dtype']:8s} {label:8s} CANNOT SAMPLE HERE: {row['unavailable']}", file=sys.stderr)
                continue
            gap = (f"sampler-trainer |dlogp| mean {row['logprob_gap_mean']} max {row['logprob_gap_max']}"
                   if row["logprobs_match"] else
                   f"SAMPLER LOGPROBS ARE NOT THE TRAINER'S: |dlogp| max {row['logprob_gap_max']} > "
                   f"{LOGPROB_TOLERANCE.get(row['dtype'], 0.5)}")
            print(f"{row['dtype']:8s} {label:8s} {row['s_per_generate']:.3f} s/generate "
                  f"(first {row['first_call_s']} s), {row['tokens_per_s']:.0f} tokens/s, "
                  f"{row['forwards']} forwards for {row['decode_steps']} steps, "
                  f"{row['ops_per_step']} ops/step, {gap}", file=sys.stderr)
    result: dict = {"device": args.device, "model": args.model.name, "batch": args.prompts * args.samples, "rows": out}
    for name in args.dtypes.split(","):
        by_way = {r["way"]: r for r in out if r["dtype"] == name and "unavailable" not in r}
        for way in ways:
            if way != "unmerged" and "unmerged" in by_way and way in by_way:
                result[f"speedup_{name}_{way}"] = round(by_way["unmerged"]["s_per_generate"]
                                                        / by_way[way]["s_per_generate"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
