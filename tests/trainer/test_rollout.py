"""Rollouts: sampler logprobs equal the trainer's, and multi-turn episodes train only on model tokens."""

from __future__ import annotations

import json
import math
import shutil

import torch

from trainer.batching import collate, token_logprobs
from trainer.config import GRPOConfig
from trainer.envs import DEFAULT_MAX_TURNS
from trainer.envs.workplace import TOOLS
from trainer.evaluation import make_env_for
from trainer.models import attach_lora, load_model
from trainer.rollout import Generation, make_engine
from trainer.rollout.episodes import run_episodes, start_episodes
from trainer.rollout.hf import HFEngine


class ScriptedEngine:
    """Answers each episode with the next turn of its task's solution, as the tiny template renders it."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer = tokenizer
        self.turns = turns
        self.calls = 0

    def sync(self, model, version):
        pass

    def generate(self, prompts, *, max_new_tokens, temperature):
        text = self.turns[self.calls]
        self.calls += 1
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return [Generation(ids, [-0.5] * len(ids), True) for _ in prompts]


def _solution_texts(task: dict) -> list[str]:
    out = []
    for m in task["solution"]:
        text = m.get("content") or ""
        for c in m.get("tool_calls") or []:
            args = json.loads(c["function"]["arguments"])
            text += '<tool_call>' + json.dumps({"name": c["function"]["name"], "arguments": args}) + '</tool_call>'
        out.append(text)
    return out


def test_multi_turn_episode_masks_observations(tiny_model, workplace_tasks):
    _, tok = load_model(tiny_model, device="cpu")
    task = workplace_tasks["train"][0]
    turns = _solution_texts(task)
    eps = start_episodes([task], 2, tok, make_env_for)
    run_episodes(ScriptedEngine(tok, turns), tok, eps, max_new_tokens=64, temperature=1.0, max_turns=None,
                 max_seq_len=1024)
    ep = eps[0]
    assert ep.reward == 1.0 and ep.score.passed, ep.score
    assert ep.turns == len(turns) == 2  # the call, then the final answer after the observation
    model_text = tok.decode([t for t, m in zip(ep.token_ids, ep.mask, strict=True) if m])
    context_text = tok.decode([t for t, m in zip(ep.token_ids[ep.prompt_len:], ep.mask[ep.prompt_len:],
                                                 strict=True) if not m])
    assert "<tool_call>" in model_text and '"ok"' not in model_text  # observations are never trained on
    assert '"ok"' in context_text and "<|tool|>" in context_text
    assert ep.completion_tokens == sum(ep.mask)
    # The incremental sequence is exactly what the template renders for the whole conversation.
    rendered = tok.apply_chat_template(ep.messages, tools=task["tools"], tokenize=False)
    assert tok.decode(ep.token_ids) == rendered


# A Qwen2.5-style ChatML template: tools in the system turn, calls as `<tool_call>\n{json}\n</tool_call>`,
# consecutive tool results in one user turn, and every turn closed by `<|im_end|>\n`.
CHATML_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}{%- for t in tools %}{{- '\\n' }}{{- t | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'assistant' and not m.tool_calls) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if m.content %}{{- '\\n' + m.content }}{%- endif %}"
    "{%- for c in m.tool_calls %}{{- '\\n<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' }}"
    "{%- if c.function.arguments is string %}{{- c.function.arguments }}"
    "{%- else %}{{- c.function.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_multi_turn_tokens_match_a_chatml_rendering(tiny_model, workplace_tasks):
    """With ChatML, the sampled turn stops at <|im_end|> but the template puts a newline after it: the
    episode's tokens must still be exactly the tokens of the rendered conversation (what serving sees)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHATML_TEMPLATE
    task = workplace_tasks["train"][0]
    turns = []
    for m in task["solution"]:  # each turn as this template renders it, so a faithful model would sample it
        calls = [f'\n<tool_call>\n{{"name": "{c["function"]["name"]}", "arguments": '
                 f'{json.dumps(json.loads(c["function"]["arguments"]), ensure_ascii=False)}}}\n</tool_call>'
                 for c in m.get("tool_calls") or []]
        turns.append("".join(calls)[1:] if calls else m["content"])
    eps = start_episodes([task], 1, tok, make_env_for)
    run_episodes(ScriptedEngine(tok, turns), tok, eps, max_new_tokens=64, temperature=1.0, max_turns=None,
                 max_seq_len=2048)
    ep = eps[0]
    assert ep.score.passed and ep.turns == len(turns) == 2, ep.score
    rendered = tok.apply_chat_template(ep.messages, tools=task["tools"], tokenize=False)
    full = tok(rendered, add_special_tokens=False)["input_ids"]
    # The episode ends on the sampled <|im_end|>; the rendering closes that last turn with "\n" only.
    assert ep.token_ids == full[: len(ep.token_ids)]
    assert tok.decode(full[len(ep.token_ids):]) == "\n"
    # Each model turn starts right after the rendering of the conversation so far plus the generation prompt.
    starts = [i for i in range(ep.prompt_len, len(ep.mask)) if ep.mask[i] and not ep.mask[i - 1]]
    assistant_at = [i for i, m in enumerate(ep.messages) if m["role"] == "assistant"]
    assert len(starts) == len(assistant_at) == 2
    for start, k in zip(starts, assistant_at, strict=True):
        context = tok.apply_chat_template(ep.messages[:k], tools=task["tools"], add_generation_prompt=True,
                                          tokenize=False)
        assert ep.token_ids[:start] == tok(context, add_special_tokens=False)["input_ids"]


def test_hf_sampler_logprobs_match_trainer(tiny_model, workplace_tasks):
    torch.manual_seed(0)
    base, tok = load_model(tiny_model, device="cpu")
    model = attach_lora(base, GRPOConfig(r=4, alpha=8))
    with torch.no_grad():  # a non-zero adapter, so merging for generation actually changes the weights
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    engine = HFEngine(model, tok)
    eps = start_episodes(workplace_tasks["holdout"][:3], 2, tok, make_env_for)
    run_episodes(engine, tok, eps, max_new_tokens=24, temperature=0.7, max_turns=None, max_seq_len=1024)
    batch = collate(eps, tok.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature=0.7)
    mask = batch.loss_mask.bool()
    diff = (logp - batch.sampler_logprobs)[mask].abs()
    assert mask.sum() > 20
    assert diff.max() < 1e-3, diff.max()


def _policy(path, seed=0, dtype=None):
    """The model at `path` with a non-zero LoRA adapter (merging it for generation changes the weights)."""
    torch.manual_seed(seed)
    base, tok = load_model(path, device="cpu", dtype=dtype)
    model = attach_lora(base, GRPOConfig(r=4, alpha=8))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model, tok


def test_hf_samples_from_our_config_not_the_models(tiny_model, workplace_tasks, tmp_path):
    """A model whose generation_config.json brings sampling defaults of its own (as released models do):
    none of them may reach sampling, or the sampler's distribution is not the one the loss assumes."""
    rows = workplace_tasks["holdout"][:4]
    model, tok = _policy(tiny_model)
    prompt = tok.apply_chat_template(rows[0]["messages"], tools=rows[0]["tools"], add_generation_prompt=True,
                                     tokenize=False)
    with torch.no_grad():
        logits = model(**tok(prompt, add_special_tokens=False, return_tensors="pt")).logits[0, -1]
    first, second = logits.topk(2).indices.tolist()  # the turn's likeliest opening tokens
    assert logits.softmax(-1)[first] > 0.3
    local = tmp_path / "model"
    shutil.copytree(tiny_model, local)
    gen = json.loads((local / "generation_config.json").read_text())
    gen.update(do_sample=True, temperature=0.3, top_k=3, top_p=0.5, min_p=0.2, typical_p=0.5,
               repetition_penalty=1.5, no_repeat_ngram_size=2, min_new_tokens=12, suppress_tokens=[first],
               bad_words_ids=[[second]])
    (local / "generation_config.json").write_text(json.dumps(gen))
    model, tok = _policy(local)
    assert model.generation_config.suppress_tokens == [first]  # the model really carries them

    torch.manual_seed(1)
    eps = start_episodes(rows, 4, tok, make_env_for)
    run_episodes(HFEngine(model, tok), tok, eps, max_new_tokens=24, temperature=1.0, max_turns=1, max_seq_len=1024)
    batch = collate(eps, tok.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature=1.0)
    mask = batch.loss_mask.bool()
    diff = (logp - batch.sampler_logprobs)[mask].abs()
    assert mask.sum() > 50
    assert diff.max() < 1e-3, diff.max()  # the sampler's distribution is the trainer's
    sampled = [ep.token_ids[ep.prompt_len] for ep in eps]
    assert sampled.count(first) > len(sampled) // 2  # suppressed by the model's config, not by ours
    with torch.no_grad():
        full = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].log_softmax(-1)
    # min_p=0.2 (a warper transformers applies after any processor of ours) would never let these through.
    below_min_p = (logp < full.max(-1).values + math.log(0.2)) & mask
    assert below_min_p.sum() >= 1  # 6 of 320 tokens on seed 1; exactly 0 whenever min_p reaches sampling
    assert model.generation_config.suppress_tokens == [first]  # and the model's own config is left as it was


def test_hf_top_k_top_p_logprobs_are_the_truncated_distribution(tiny_model, workplace_tasks):
    """With top_k/top_p the sampler draws from the truncated, renormalised distribution and records its
    logprobs; the loss corrects with min(pi_train / pi_sampler, C), which must then be <= 1."""
    model, tok = _policy(tiny_model)
    top_k, top_p, temperature = 4, 0.7, 1.2
    engine = make_engine(GRPOConfig(top_k=top_k, top_p=top_p), model, tok)
    torch.manual_seed(2)
    eps = start_episodes(workplace_tasks["holdout"][:4], 4, tok, make_env_for)
    run_episodes(engine, tok, eps, max_new_tokens=24, temperature=temperature, max_turns=1, max_seq_len=1024)
    batch = collate(eps, tok.pad_token_id)
    with torch.no_grad():
        trainer_logp, _ = token_logprobs(model, batch, temperature=temperature)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1] / temperature
    full = logits.log_softmax(-1)
    rows, cols = batch.loss_mask.nonzero(as_tuple=True)
    assert len(rows) > 50
    truncated = 0
    for i, t in zip(rows.tolist(), cols.tolist(), strict=True):
        token = int(batch.input_ids[i, t + 1])
        lp, order = full[i, t].sort(descending=True)
        kept = lp[:top_k].exp() / lp[:top_k].exp().sum()  # top-k, renormalised, then the nucleus of that
        n = int(((kept.cumsum(0) - kept) < top_p).sum())
        assert token in order[:n].tolist()
        expected = lp[(order == token).nonzero()[0, 0]] - lp[:n].logsumexp(0)
        assert abs(float(batch.sampler_logprobs[i, t]) - float(expected)) < 1e-3
        assert float(trainer_logp[i, t]) <= float(batch.sampler_logprobs[i, t]) + 1e-4  # IS weight <= 1
        truncated += n < full.shape[-1]
    assert truncated == len(rows)


class _CallForever:
    """Every turn lists the tasks: an episode runs until something other than the model ends it."""

    def __init__(self, tokenizer):
        text = '<tool_call>' + json.dumps({"name": "list_tasks", "arguments": {}}) + '</tool_call>'
        self.ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def sync(self, model, version):
        pass

    def generate(self, prompts, *, max_new_tokens, temperature):
        return [Generation(list(self.ids), [-0.5] * len(self.ids), True) for _ in prompts]


def test_a_workplace_row_without_max_turns_gets_the_default_turns(tiny_model, workplace_tasks):
    """One resolver, one default: the runner used to cut such a row after one turn while its environment
    allowed six."""
    _, tok = load_model(tiny_model, device="cpu")
    task = workplace_tasks["train"][0]
    task = {**task, "tools": list(TOOLS.values()),
            "env": {k: v for k, v in task["env"].items() if k != "max_turns"}}
    eps = start_episodes([task], 1, tok, make_env_for)
    run_episodes(_CallForever(tok), tok, eps, max_new_tokens=64, temperature=1.0, max_turns=None, max_seq_len=4096)
    assert eps[0].turns == DEFAULT_MAX_TURNS and not eps[0].truncated
    eps = start_episodes([task], 1, tok, make_env_for)
    run_episodes(_CallForever(tok), tok, eps, max_new_tokens=64, temperature=1.0, max_turns=2, max_seq_len=4096)
    assert eps[0].turns == 2  # the config's max_turns caps it


def test_sampling_merges_the_adapter_and_gives_the_base_back_bit_for_bit_in_every_dtype(tiny_model):
    from trainer.models import lora_merged

    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    for dtype in (torch.float32, torch.bfloat16):
        model, tok = _policy(tiny_model, dtype=dtype)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            unmerged = model(input_ids=ids).logits.float()
            with model.disable_adapter():
                plain = model(input_ids=ids).logits.float()
            with lora_merged(model) as merged:
                inside = model(input_ids=ids).logits.float()
                calls = sum(1 for n, _ in model.named_modules() if n.endswith("lora_A.default"))
        assert merged is True and calls > 0
        # Inside: the policy (base + adapter) from merged weights; the adapter makes a difference, and merging
        # rounds it to the dtype once (bfloat16 holds about 3 digits).
        tol = 1e-4 if dtype == torch.float32 else 0.1
        assert (inside - unmerged).abs().max() < tol, (dtype, (inside - unmerged).abs().max())
        assert (unmerged - plain).abs().max() > 3 * (inside - unmerged).abs().max()
        # After: every weight is the one before, bit for bit, and the adapter is on and trainable again.
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), dtype
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits.float(), unmerged)
        assert any(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)
        # The engine samples through it: generate leaves the weights as they were.
        HFEngine(model, tok).generate([[1, 5, 9]] * 4, max_new_tokens=6, temperature=1.0)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), dtype
    # Adapters turned off: nothing to merge, the base runs as it is.
    with model.disable_adapter(), lora_merged(model) as merged:
        assert merged is False


def test_a_compiled_engine_samples_the_policy_and_returns_only_the_rows_asked(tiny_model, workplace_tasks):
    """`rollout_compile`: static cache, compiled forward, batch padded to a power of two and prompts to a
    multiple of 64 tokens; what comes back is one generation per prompt asked, with the policy's logprobs."""
    from trainer.rollout.hf import compiled_shape

    assert compiled_shape(3, 70) == (4, 128) and compiled_shape(4, 64) == (4, 64) and compiled_shape(1, 1) == (1, 64)
    model, tok = _policy(tiny_model)
    engine = make_engine(GRPOConfig(r=4, alpha=8, rollout_compile=True), model, tok)
    assert engine.compile is True
    eps = start_episodes(workplace_tasks["holdout"][:3], 1, tok, make_env_for)  # 3 rows: run as 4
    torch.manual_seed(0)
    run_episodes(engine, tok, eps, max_new_tokens=24, temperature=0.7, max_turns=1, max_seq_len=1024)
    assert all(ep.completion_tokens > 0 for ep in eps)
    batch = collate(eps, tok.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature=0.7)
    mask = batch.loss_mask.bool()
    assert mask.sum() > 10
    assert (logp - batch.sampler_logprobs)[mask].abs().max() < 1e-3
