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

`--shape qwen2-7b` measures the size teams train with LoRA on one GPU instead: Qwen2.5-7B's architecture
(hidden 3584, 28 layers, 28 query and 4 key-value heads, vocabulary 152,064, untied embeddings; 7.6B
parameters), random weights built by each worker straight on the device from the saved config.json, bfloat16
on a GPU, seeded so ours and TRL train the same weights (`same_weights` checks it); nothing is downloaded and
15 GB of weights are never written. Both sides: LoRA r16 on the trainer's default modules, gradient
checkpointing on, 8 prompts x 8 completions of 256 + 256 tokens, rewards 0/1 within each group (real
gradients: `*_grad_norm` > 0; learning is not the point), `--steps` steps on the same batch: `*_s_per_step` is
the mean of the steps after the first, `*_peak_total_gib` (GPU) and `*_peak_mb` (above the built model: GPU
allocator or CPU RSS) the peak over all of them. Then, for the sides in `--fit-sides`, `largest_fit`: the
completion length doubles, one step each, until a step runs out of GPU memory (`stopped_by: "oom"`), the batch
would pass `--fit-max-tokens`, or the next step would end after `--fit-time-s` of searching; it names the
largest prompts x completions x tokens that stepped. Ours packs its rows (`pack_sequences`, the default: each
prompt once per packed unit, which prefix sharing cannot do under checkpointing otherwise); `--also-unpacked`
adds ours without packing (`ours_unpacked_*`, every prompt G times; the same loss and gradient).
`--shape qwen2-7b-tiny` is the same structure scaled down (2 layers of hidden 112, 7 query heads to 1 key-value
head, vocabulary 2048): the CPU dry run of that path.

    .venv/bin/python bench/memory.py --shape qwen2-7b --device cuda [--steps 3] [--fit-time-s 60]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VOCAB = 152064

# Named shapes (Qwen2Config fields), built from their config in each worker. qwen2-7b is Qwen2.5-7B's
# architecture; -tiny keeps its structure (untied head, 7:1 grouped-query attention, MLP 5.3x the hidden) at a
# size the CPU steps in milliseconds.
SHAPES = {
    "qwen2-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, vocab_size=VOCAB),
    "qwen2-7b-tiny": dict(hidden_size=112, intermediate_size=592, num_hidden_layers=2, num_attention_heads=7,
                          num_key_value_heads=1, vocab_size=2048),
}
# Per shape: prompts, generations, prompt and completion length, steps, --fit-max-tokens (0: no search).
DEFAULTS = {"custom": (2, 8, 256, 128, 1, 0)}
DEFAULTS.update(dict.fromkeys(SHAPES, (8, 8, 256, 256, 3, 2**20)))


def save_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    # A word-level tokenizer over the whole vocabulary: the step never decodes, TRL only wants one to exist.
    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")),
                                  pad_token="<pad>", eos_token="<eos>")
    tok.save_pretrained(out)


def build_model(out: Path, args: argparse.Namespace) -> None:
    vocab_size = args.vocab
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=1, pad_token_id=0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    save_tokenizer(out, vocab_size)


def shape_config(shape: str):
    from transformers import Qwen2Config

    return Qwen2Config(**SHAPES[shape], tie_word_embeddings=False, max_position_embeddings=32768, rms_norm_eps=1e-6,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6}, eos_token_id=1, pad_token_id=0)


def build_shape(out: Path, shape: str) -> int:
    """config.json and the tokenizer only (the workers build the weights on their device); the parameter count,
    from a model on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = shape_config(shape)
    config.save_pretrained(out)
    save_tokenizer(out, config.vocab_size)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def load_base(args: argparse.Namespace):
    """The worker's base model and tokenizer: loaded from the folder (custom), or built from its config on the
    device with seed 0 (a named shape): the same weights in every worker, bfloat16 on a GPU as load_model's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.models import load_model, load_tokenizer

    if args.shape == "custom":
        return load_model(args.model, device=args.device)
    tok = load_tokenizer(args.model)
    config = AutoConfig.from_pretrained(args.model, local_files_only=True)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def fingerprint(model) -> float:
    """A sum over the embeddings and the head: equal in two workers when they built the same weights."""
    import torch

    with torch.no_grad():
        heads = {id(m.weight): m.weight for m in (model.get_input_embeddings(), model.get_output_embeddings())}
        return float(sum(w.sum(dtype=torch.float32) for w in heads.values()))


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


def at_length(args: argparse.Namespace, completion_len: int) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "completion_len": completion_len})


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS")) / 1024


def hwm_mb() -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM")) / 1024


def measure(step, device: str = "cpu", steps: int = 1) -> tuple[float, list[float], float | None]:
    """(peak MB above the memory in use before the first step, each step's seconds, peak GiB in all or None) of
    `steps` calls of step(): the process's RSS on the CPU, the allocator's bytes on a GPU."""
    gc.collect()
    seconds = []
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated()
        return (peak - before) / 2**20, seconds, round(peak / 2**30, 3)
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what setup freed goes back, so the step cannot hide in it
    before = rss_mb()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset the high-water mark to the current RSS
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - t0)
    return hwm_mb() - before, seconds, None


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def largest_fit(args: argparse.Namespace, prepare, zero_grad, step_s: float, peak_mb: float) -> dict:
    """Double the completion length, one step each, from twice the measured one: the largest prompts x
    completions x tokens that stepped, and why the search stopped (`oom`: the next length ran out of GPU memory;
    `max_tokens`: it would pass --fit-max-tokens; `time`: its step, estimated from the last one's seconds per
    token, would end after --fit-time-s of searching). A step whose memory, extrapolated linearly in tokens from
    the last one's, would pass the GPU's is tried while any search time is left, however long the estimate: it
    is expected to run out of memory partway through its forward, and an `oom` settles the question that `time`
    leaves open. A CPU never reports `oom`."""
    import torch

    cuda = args.device.startswith("cuda")
    device_gib = torch.cuda.mem_get_info()[1] / 2**30 if cuda else math.inf

    def shape(length: int) -> dict:
        return {"prompts": args.prompts, "completions": args.generations, "prompt_len": args.prompt_len,
                "completion_len": length, "batch_tokens": args.prompts * args.generations * (args.prompt_len + length)}

    best, above_mb = {**shape(args.completion_len), "step_s": round(step_s, 2)}, peak_mb
    length, spent, stopped = 2 * args.completion_len, 0.0, None
    while stopped is None:
        tokens = shape(length)["batch_tokens"]
        grow = tokens / best["batch_tokens"]
        base_gib = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
        beyond = base_gib + above_mb * grow / 1024 > device_gib
        if tokens > args.fit_max_tokens:
            stopped = "max_tokens"
        elif spent >= args.fit_time_s or (not beyond and spent + max(best["step_s"], 0.01) * grow > args.fit_time_s):
            stopped = "time"
        else:
            t0 = time.perf_counter()
            step = prepare(length)
            free_memory(args.device)
            before = torch.cuda.memory_allocated() if cuda else 0
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            try:
                step()
                if cuda:
                    torch.cuda.synchronize()
            except torch.OutOfMemoryError:
                stopped = "oom"
            seconds = time.perf_counter() - t0
            spent += seconds
            del step
            if stopped is None:
                peak = torch.cuda.max_memory_allocated() if cuda else 0
                best = {**shape(length), "step_s": round(seconds, 2),
                        "peak_total_gib": round(peak / 2**30, 3) if cuda else None}
                above_mb = (peak - before) / 2**20 if cuda else 0.0
                length *= 2
            else:  # the failed step's tensors went with its frames; its partial gradients go here
                zero_grad()
                free_memory(args.device)
    return {**best, "stopped_by": stopped, "stopped_at_completion_len": length, "search_s": round(spent, 1)}


def run_steps(args: argparse.Namespace, prepare, out: dict, zero_grad) -> dict:
    """The measured steps at the batch's shape, then (--fit-max-tokens) the search for the largest that fits. A
    GPU out of memory in the measured steps is a result (`oom`), not a failure."""
    import torch

    step = prepare(args.completion_len)
    try:
        peak, seconds, total = measure(step, args.device, args.steps)
    except torch.OutOfMemoryError as exc:
        oom = str(exc).splitlines()[0]
    else:
        oom = None
    del step
    if oom is not None:
        zero_grad()
        free_memory(args.device)
        return {"oom": oom}
    later = seconds[1:] or seconds  # the first step pays for the allocator's and kernels' warm-up
    result = {"peak_mb": peak, "seconds": sum(later) / len(later), "step_seconds": [round(s, 3) for s in seconds],
              "peak_total_gib": total, "loss": out["loss"], "grad_norm": out["grad_norm"]}
    if args.fit_max_tokens > 0:
        result["largest_fit"] = largest_fit(args, prepare, zero_grad, result["seconds"], peak)
    return result


def worker_ours(args: argparse.Namespace) -> dict:
    from types import SimpleNamespace

    import torch

    from trainer.config import GRPOConfig
    from trainer.loop import optimize
    from trainer.models import attach_lora, trainable_parameters
    from trainer.rollout.episodes import Episode

    n = args.prompts * args.generations
    fields = {"gradient_checkpointing": True} if args.gc else {}  # absent before the field existed
    if args.unpacked:
        fields["pack_sequences"] = False
    cfg = GRPOConfig(num_prompts_per_step=args.prompts, num_generations_per_prompt=args.generations,
                     max_new_tokens=args.completion_len, max_turns=1, train_batch_size=n, loss_type="grpo",
                     beta=0.0, r=16, alpha=32, **fields)
    base, tok = load_base(args)  # bf16 on a GPU; cfg.bf16 autocasts there
    weights = fingerprint(base)
    torch.manual_seed(0)  # the same LoRA initialisation in every worker
    model = attach_lora(base, cfg)
    if args.gc:
        from trainer.models import enable_gradient_checkpointing

        enable_gradient_checkpointing(model)
    params = trainable_parameters(model)
    run = SimpleNamespace(cfg=cfg, model=model, tokenizer=tok, params=params, max_completion_length=args.completion_len,
                          optimizer=torch.optim.AdamW(params, lr=1e-5))
    out: dict = {}

    def prepare(length: int):
        prompts, completions, rewards = make_batch(at_length(args, length))
        episodes = [Episode(row={}, group=i // args.generations, env=None, token_ids=p + c,
                            mask=[0] * len(p) + [1] * len(c), sampler_logprobs=[0.0] * (len(p) + len(c)),
                            prompt_len=len(p), completion_tokens=len(c), has_sampler_logprobs=False)
                    for i, (p, c) in enumerate(zip(prompts, completions, strict=True))]
        r = torch.tensor(rewards)

        def step() -> None:
            run.max_completion_length = length
            out.update(optimize(run, episodes, r))

        return step

    return {**run_steps(args, prepare, out, lambda: run.optimizer.zero_grad(set_to_none=True)), "weights": weights}


def worker_trl(args: argparse.Namespace) -> dict:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    from trainer.config import GRPOConfig
    from trainer.models import lora_config

    n = args.prompts * args.generations
    base, tok = load_base(args)
    weights = fingerprint(base)
    cuda = args.device.startswith("cuda")
    trl_args = TRLConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-mem-"), per_device_train_batch_size=n, gradient_accumulation_steps=1,
        num_generations=args.generations, max_completion_length=args.completion_len, learning_rate=1e-5,
        beta=0.0, loss_type="grpo", scale_rewards="group", num_iterations=1, use_vllm=False, use_cpu=not cuda,
        bf16=cuda, gradient_checkpointing=bool(args.gc), report_to="none", save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=0,  # TRL seeds torch with it before making the adapter: ours is made at 0
    )
    data = Dataset.from_dict({"prompt": ["t2 t3"] * n})
    torch.manual_seed(0)
    trainer = GRPOTrainer(model=base, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=trl_args,
                          train_dataset=data, processing_class=tok,
                          peft_config=lora_config(GRPOConfig(r=16, alpha=32), base))
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's own loop, which we do not run
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    out: dict = {}

    def prepare(length: int):
        prompts, completions, rewards = make_batch(at_length(args, length))
        r = torch.tensor(rewards).view(-1, args.generations)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)
        inputs = {
            "prompt_ids": torch.tensor(prompts), "prompt_mask": torch.ones(n, args.prompt_len, dtype=torch.long),
            "completion_ids": torch.tensor(completions), "completion_mask": torch.ones(n, length, dtype=torch.long),
            "advantages": adv, "num_items_in_batch": torch.tensor(float(n * length)),
        }
        inputs = {k: v.to(device) for k, v in inputs.items()}

        def step() -> None:
            trainer.max_completion_length = length
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):  # what Trainer's bf16 wraps it in
                loss = trainer.compute_loss(model, inputs)
            loss.backward()
            out["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
            optimizer.step()
            out["loss"] = float(loss)

        return step

    return {**run_steps(args, prepare, out, lambda: optimizer.zero_grad(set_to_none=True)), "weights": weights}


def spawn(which: str, gc_on: bool, args: argparse.Namespace, fit: bool = False, unpacked: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--worker", which, "--model", str(args.model), "--prompts", str(args.prompts),
           "--generations", str(args.generations), "--prompt-len", str(args.prompt_len),
           "--completion-len", str(args.completion_len), "--threads", str(args.threads), "--device", args.device,
           "--vocab", str(args.vocab), "--shape", args.shape, "--steps", str(args.steps),
           "--fit-max-tokens", str(args.fit_max_tokens if fit else 0), "--fit-time-s", str(args.fit_time_s)]
    cmd += (["--gc"] if gc_on else []) + (["--unpacked"] if unpacked else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{which} worker failed")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    label = f"{which}{' + gradient checkpointing' if gc_on else ''}{' without packing' if unpacked else ''}"
    if "oom" in result:
        print(f"{label:46s} out of GPU memory: {result['oom']}", file=sys.stderr)
        if args.shape == "custom":  # its figures are all of one step: nothing to report without it
            raise SystemExit(f"{which} worker ran out of GPU memory")
        return result
    print(f"{label:46s} peak {result['peak_mb']:8.0f} MB above the loaded model, {result['seconds']:.1f} s"
          f"{' a step' if args.steps > 1 else ''}, loss {result['loss']:+.4f}, grad norm {result['grad_norm']:.4f}"
          + (f"; largest fit {result['largest_fit']}" if "largest_fit" in result else ""), file=sys.stderr)
    return result


def main_shape(args: argparse.Namespace) -> None:
    """A named shape: ours and TRL, both with LoRA and gradient checkpointing, `--steps` steps each."""
    cuda = args.device.startswith("cuda")
    if args.model is None:
        args.model = Path(tempfile.mkdtemp(prefix="mem-bench-")) / args.shape
    parameters = build_shape(args.model, args.shape)
    n = args.prompts * args.generations
    tokens = n * (args.prompt_len + args.completion_len)
    sides = set(args.fit_sides.split(",")) if args.fit_max_tokens > 0 else set()
    weights_gib = round(parameters * (2 if cuda else 4) / 2**30, 2)
    print(f"{args.shape}: {parameters:,} parameters ({weights_gib:.1f} GiB of "
          f"weights), {args.prompts} prompts x {args.generations} completions, {args.prompt_len} + "
          f"{args.completion_len} tokens each: {tokens} tokens a step, {args.steps} steps", file=sys.stderr)
    ours, trl = spawn("ours", True, args, fit="ours" in sides), spawn("trl", True, args, fit="trl" in sides)
    unpacked = spawn("ours", True, args, unpacked=True) if args.also_unpacked else None

    def fig(side: dict, key: str, digits: int):
        return round(side[key], digits) if side.get(key) is not None else None

    result = {"device": args.device, "shape": args.shape, "parameters": parameters,
              "weights_gib": weights_gib, "dtype": "bfloat16" if cuda else "float32",
              "vocab": args.vocab, "lora_r": 16, "gradient_checkpointing": True, "prompts": args.prompts,
              "completions": args.generations, "prompt_len": args.prompt_len, "completion_len": args.completion_len,
              "batch_tokens": tokens, "steps": args.steps,
              "ours_s_per_step": fig(ours, "seconds", 3), "trl_s_per_step": fig(trl, "seconds", 3),
              "ours_step_seconds": ours.get("step_seconds"), "trl_step_seconds": trl.get("step_seconds"),
              "ours_peak_total_gib": ours.get("peak_total_gib"), "trl_peak_total_gib": trl.get("peak_total_gib"),
              "ours_peak_mb": fig(ours, "peak_mb", 0), "trl_peak_mb": fig(trl, "peak_mb", 0),
              "ours_loss": fig(ours, "loss", 5), "trl_loss": fig(trl, "loss", 5),
              "ours_grad_norm": fig(ours, "grad_norm", 5), "trl_grad_norm": fig(trl, "grad_norm", 5),
              "same_weights": ours["weights"] == trl["weights"] if "weights" in ours and "weights" in trl else None,
              "largest_fit": ours.get("largest_fit"), "trl_largest_fit": trl.get("largest_fit"),
              "fit_sides": sorted(sides)}
    if result["ours_s_per_step"] and result["trl_s_per_step"]:
        result["speedup"] = round(result["trl_s_per_step"] / result["ours_s_per_step"], 2)
    if unpacked is not None:  # without pack_sequences: the same loss and gradient, every prompt G times
        result |= {"ours_unpacked_s_per_step": fig(unpacked, "seconds", 3),
                   "ours_unpacked_peak_mb": fig(unpacked, "peak_mb", 0),
                   "ours_unpacked_peak_total_gib": unpacked.get("peak_total_gib"),
                   "ours_unpacked_loss": fig(unpacked, "loss", 5),
                   "ours_unpacked_grad_norm": fig(unpacked, "grad_norm", 5)}
    for name, side in (("ours", ours), ("trl", trl), ("ours_unpacked", unpacked or {})):
        if "oom" in side:
            result[f"{name}_oom"] = side["oom"]
    print(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["custom", *SHAPES], default="custom",
                   help="custom: the small model of --layers/--hidden/--vocab; a named one: see above")
    p.add_argument("--prompts", type=int, help="default 2 (custom), 8 (named shapes)")
    p.add_argument("--generations", type=int, help="default 8")
    p.add_argument("--prompt-len", type=int, help="default 256")
    p.add_argument("--completion-len", type=int, help="default 128 (custom), 256 (named shapes)")
    p.add_argument("--steps", type=int, help="steps measured; default 1 (custom), 3 (named shapes)")
    p.add_argument("--fit-max-tokens", type=int,
                   help="the largest-fit search's bound on a step's tokens; 0: no search (custom's default)")
    p.add_argument("--fit-time-s", type=float, default=60, help="the largest-fit search's time bound, per side")
    p.add_argument("--fit-sides", default="ours", help="which sides search for the largest fit: ours, trl or ours,trl")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu or cuda (bf16 on both sides)")
    p.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size (Qwen2.5's by default; a named shape "
                   "fixes its own)")
    p.add_argument("--quick", action="store_true", help="each trainer with its own default checkpointing only")
    p.add_argument("--model", type=Path, help="a model dir built by this script; default: build one in a temp dir")
    p.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--gc", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--also-unpacked", action="store_true", help="a named shape: also ours without pack_sequences "
                   "(no prefix sharing under gradient checkpointing), as ours_unpacked_*")
    p.add_argument("--unpacked", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    for key, value in zip(("prompts", "generations", "prompt_len", "completion_len", "steps", "fit_max_tokens"),
                          DEFAULTS[args.shape], strict=True):
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.shape != "custom":
        args.vocab = SHAPES[args.shape]["vocab_size"]

    import torch

    torch.set_num_threads(args.threads)
    if args.worker:
        result = (worker_ours if args.worker == "ours" else worker_trl)(args)
        print(json.dumps(result))
        return
    if args.shape != "custom":
        main_shape(args)
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
