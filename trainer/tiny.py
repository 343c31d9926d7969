"""`build-tiny OUT`: the CPU model for tests and the demo, built here with no download.

A byte-level BPE tokenizer trained on the workplace task corpus, a chat template that renders tools and
messages compactly, a ~1M-parameter Llama, and a short SFT warm start on the tasks' solutions with label
noise (some solutions get a wrong argument or tool), so the sampled policy sometimes succeeds and
sometimes not: something for GRPO to improve. Saved with `save_pretrained` and loaded back through
`trainer.models.load_model`, the path a real model takes.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jinja2
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from trainer.envs.workplace.world import DATES, TIMES
from trainer.models import load_model
from trainer.sft import build_examples, sft_steps

PAD, EOS = "<|pad|>", "<|end|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|tools|>"]
CALL_TOKENS = ["<tool_call>", "</tool_call>"]  # plain (not special) tokens: they decode into the text

# Tools by name only (a tiny model learns their arguments from the examples), then one block per message; an assistant turn is its text then its calls in
# the `<tool_call>{json}</tool_call>` form `trainer.verifiers.parse_completion` reads. Each block ends in
# <|end|>, the EOS, so a turn stops where the template would close it.
CHAT_TEMPLATE = (
    "{%- if tools -%}<|tools|>"
    "{%- for t in tools -%}{%- set f = t.function if t.function is defined else t -%}"
    "{{ f.name }}{{ ' ' if not loop.last else '' }}"
    "{%- endfor -%}<|end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}<|assistant|>{{ m.content if m.content else '' }}"
    "{%- for c in (m.tool_calls or []) -%}{%- set f = c.function if c.function is defined else c -%}"
    '<tool_call>{"name": "{{ f.name }}", "arguments": '
    "{{ f.arguments if f.arguments is string else (f.arguments | tojson) }}}</tool_call>"
    "{%- endfor -%}<|end|>"
    "{%- else -%}<|{{ m.role }}|>{{ m.content if m.content is string else (m.content | tojson) }}<|end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)

# Words and digit runs are whole pre-tokens without their leading space, so a name in the request and
# the same name in a call's JSON are the same token: copying is then an identity a tiny model learns fast.
PRE_TOKENIZE = r"[A-Za-z0-9_]+|[^A-Za-z0-9_]+"


def _render(messages: list[dict], tools: list[dict] | None) -> str:
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(CHAT_TEMPLATE).render(messages=messages, tools=tools, add_generation_prompt=False)


def train_tokenizer(texts: list[str], vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, EOS, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS,
                                   additional_special_tokens=ROLE_TOKENS)
    fast.add_tokens(CALL_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _alternatives(key: str, value: Any, world: dict[str, Any], rng: random.Random) -> list[Any]:
    """Plausible wrong values for an argument: other people, ids, dates, titles of the same company."""
    people = [p["name"].split()[0] for p in world["people"]]
    if isinstance(value, list):
        return [[rng.choice(people) for _ in value]]
    if key in ("task_id", "event_id", "email_id", "project_id"):
        pool = {"task_id": "tasks", "event_id": "events", "email_id": "emails", "project_id": "projects"}[key]
        return [r["id"] for r in world[pool]]
    if key in ("assignee", "to"):
        return people
    if key in ("due", "date"):
        return list(DATES)
    if key in ("title", "subject"):
        return [t["title"] for t in world["tasks"]] + [e["title"] for e in world["events"]]
    if key == "project":
        return [p["name"] for p in world["projects"]]
    if key == "time":
        return list(TIMES)
    if key == "status":
        return ["open", "in_progress", "done"]
    return []


def noisy_solution(task: dict[str, Any], rng: random.Random) -> list[dict[str, Any]]:
    """The task's solution with one call corrupted: a wrong argument value, or a wrong offered tool."""
    solution = copy.deepcopy(task["solution"])
    calls = [m for m in solution if m.get("tool_calls")]
    if not calls:
        return solution
    call = rng.choice(calls)["tool_calls"][0]["function"]
    args = json.loads(call["arguments"])
    world = task["env"]["initial_state"]
    if args and rng.random() < 0.8:
        key = rng.choice(sorted(args))
        options = [v for v in _alternatives(key, args[key], world, rng) if v != args[key]]
        if options:
            args[key] = rng.choice(options)
    else:
        names = [t["function"]["name"] for t in task["tools"] if t["function"]["name"] != call["name"]]
        call["name"] = rng.choice(names)
    call["arguments"] = json.dumps(args)
    return solution


# Sizes of the model of this kind that the GPU suite builds (`bench/gpu_check.py`, `bench/grpo_vs_trl.py --size`).
# Parameters with the 1k-token workplace vocabulary: about 10 x hidden^2 a layer.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden=128, layers=2, heads=2),  # the CPU model, 0.43M
    "21m": dict(hidden=512, layers=8, heads=8),
    "125m": dict(hidden=1024, layers=12, heads=16),
    "500m": dict(hidden=2048, layers=12, heads=16),
}
BASE_LR, BASE_HIDDEN = 3e-3, 128


def default_lr(hidden: int) -> float:
    """The warm start's peak learning rate: 3e-3 up to the tiny model's width, then falling as 1/width (Adam's
    update to a d x d matrix moves its outputs about d times as much; GPT-3 trained 125M at 6e-4). The 21M and
    127M builds that solved nothing on a GPU ran at 3e-3, but they were also read back with the wrong tokenizer
    (`trainer.models.load_tokenizer`), so this rule is the usual one, not yet a measured fix."""
    return BASE_LR * min(1.0, BASE_HIDDEN / hidden)


@contextlib.contextmanager
def full_precision() -> Iterator[None]:
    """float32 tensors by default, float32 matmuls as float32 (no TF32, which transformers' Trainer switches on
    for the whole process on a GPU with `tf32=True`) and no autocast: the warm start computes the same thing
    on every device, whatever the process set before."""
    precision, dtype = torch.get_float32_matmul_precision(), torch.get_default_dtype()
    torch.set_float32_matmul_precision("highest")
    torch.set_default_dtype(torch.float32)
    try:
        with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
            yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.set_default_dtype(dtype)


def build_tiny(out: str | Path, *, n_tasks: int = 2000, steps: int = 1000, noise: float = 0.35, seed: int = 0,
               hidden: int = 128, layers: int = 2, heads: int = 2, batch_size: int = 16, lr: float | None = None,
               warmup: int | None = None, difficulty: str | None = "single", arch: str = "llama",
               device: str = "cpu", log: Any = None) -> Path:
    """Build, warm-start and save the tiny model; returns its directory (a normal HF model folder).

    `arch="qwen2"` builds the same model as a Qwen2 (what the GPU check serves with vLLM); hidden, layers
    and heads make it larger (`lr` then defaults to `default_lr(hidden)`), and `device` trains it on a GPU.
    Nothing in the recipe depends on the device but where the arithmetic runs: the weights are initialised by
    the CPU's generator and moved, the batches are drawn by a Python `random.Random(seed)`, the warm start
    runs in float32 (`full_precision`), and what is saved is the model that was trained."""
    from trainer.envs.workplace import generate_tasks

    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    tasks = generate_tasks(n_tasks, seed=seed, split="train", difficulty=difficulty)
    rows = []
    for task in tasks:
        row = dict(task)
        if rng.random() < noise:
            row["solution"], row["trust_solution"] = noisy_solution(task, rng), True
        rows.append(row)

    from trainer.envs import replay

    texts = [_render(replay(t, t["solution"])[0], t["tools"]) for t in tasks[:300]]
    tokenizer = train_tokenizer(texts)
    examples = build_examples(rows, tokenizer)
    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    config = config_class(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    lr = default_lr(hidden) if lr is None else lr
    warmup = (20 if hidden <= BASE_HIDDEN else max(20, steps // 20)) if warmup is None else warmup

    def on_step(step: int, stats: dict[str, float]) -> None:
        if log and (step % 100 == 0 or step == steps):
            log({"event": "step", "step": step, "loss": round(stats["loss"], 4),
                 "seconds": round(time.perf_counter() - t0, 1)})

    with full_precision():
        # Initialised by the CPU's generator and then moved: the same starting weights whatever the device.
        model = model_class(config).to(device)
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
        sft_steps(model, optimizer, params, examples, pad_id=tokenizer.pad_token_id, steps=range(1, steps + 1),
                  batch_size=batch_size, lr=lr, total=steps, rng=rng, warmup=warmup, on_step=on_step)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    meta = {"arch": arch, "hidden": hidden, "layers": layers, "heads": heads, "lr": lr, "warmup": warmup,
            "device": str(device),
            "n_tasks": n_tasks, "steps": steps, "noise": noise, "seed": seed, "examples": len(examples),
            "parameters": sum(p.numel() for p in params), "seconds": round(time.perf_counter() - t0, 1)}
    (out / "tiny.json").write_text(json.dumps(meta, indent=1))
    # Prove it loads back through the real-model path, with the tokenization it was trained on: a model read
    # with another tokenizer (transformers' Qwen2Tokenizer on a qwen2 folder) solved almost nothing.
    _, loaded = load_model(out, device="cpu")
    for text in texts[:20]:
        if loaded.encode(text, add_special_tokens=False) != tokenizer.encode(text, add_special_tokens=False):
            raise RuntimeError(f"{out}: the saved tokenizer loads back as {type(loaded).__name__}, which tokenizes "
                               "the training text differently from the tokenizer the model was trained with")
    return out


def holdout_success(model_dir: str | Path, *, device: str = "cpu", tasks: int = 64, samples: int = 4, seed: int = 0,
                    max_new_tokens: int = 64, dtype: torch.dtype | None = None) -> float:
    """Sampled (T=1) success of a model folder on `tasks` single-call workplace holdout tasks, `samples` each, loaded
    as a job loads it on `device` (bfloat16 on a GPU; `dtype` another): the figure a warm start is judged by."""
    from trainer.envs.workplace import generate_tasks
    from trainer.evaluation import evaluate_rows
    from trainer.rollout.hf import HFEngine

    model, tokenizer = load_model(model_dir, device=device, dtype=dtype)
    model.eval()
    torch.manual_seed(seed)
    rows = generate_tasks(tasks, seed=seed, split="holdout", difficulty="single")
    metrics, _ = evaluate_rows(HFEngine(model, tokenizer), tokenizer, rows, samples_per_prompt=samples,
                               temperature=1.0, max_new_tokens=max_new_tokens)
    return round(metrics["success_rate"], 4)
