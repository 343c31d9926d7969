"""Drive a rollout engine through environments: one episode per (task, sample), all turns batched.

The token sequence of an episode is built incrementally, never re-rendered: the prompt, then each turn's
sampled ids exactly as sampled (trained on, mask 1), then what the template renders after the turn's end
token, the tool observations and the next generation prompt (context only, mask 0). That keeps the
trainer's logprobs on the very tokens sampled, and the context the one the served model sees.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from trainer.envs.base import max_turns as turn_limit
from trainer.rollout import PromptTooLong, RolloutEngine

# Threads stepping environments that wait on I/O (`env.concurrent`, e.g. an environment server); each
# environment bounds its own requests in flight (the http environment's max_concurrency per server).
MAX_ENV_THREADS = 64


@dataclass
class Episode:
    row: dict[str, Any]
    group: int  # index of the prompt in the step: episodes of one group share a row
    env: Any
    token_ids: list[int]
    mask: list[int]  # 1 where the model produced the token
    sampler_logprobs: list[float]  # aligned with token_ids; 0 where mask is 0
    prompt_len: int
    messages: list[dict[str, Any]] = field(default_factory=list)
    opening: int = 0  # how many of `messages` the environment opened with (its reset, not the policy's turns)
    completion_tokens: int = 0
    turns: int = 0
    truncated: bool = False  # a turn hit max_new_tokens or the episode hit max_seq_len
    done: bool = False
    has_sampler_logprobs: bool = True
    score: Any = None
    reward: float = 0.0


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None,
           generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False
    )


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def observation_ids(tokenizer: PreTrainedTokenizerBase, history: list[dict], new: list[dict],
                    tools: list[dict] | None, end_id: int | None = None) -> list[int]:
    """Tokens of the tool messages and the next generation prompt: the rendered conversation's suffix
    past what the history (ending with the assistant turn) already renders to.

    `end_id` is the token the sampled turn stopped on. A template may close a turn with more than that
    token (ChatML renders `<|im_end|>\n`): the sampled ids stop at `<|im_end|>`, so what the template puts
    after it belongs to this suffix too, or the model would see `<|im_end|><|im_start|>` in training and
    `<|im_end|>\n<|im_start|>` when served.
    """
    before = render(tokenizer, history, tools, generation_prompt=False)
    after = render(tokenizer, history + new, tools, generation_prompt=True)
    if not after.startswith(before):
        # A template that rewrites earlier turns (some strip reasoning): take the longest common prefix.
        i = 0
        while i < min(len(before), len(after)) and before[i] == after[i]:
            i += 1
        return encode(tokenizer, after[i:])
    cut = len(before)
    end = tokenizer.decode([end_id]) if end_id is not None else ""
    at = before.rfind(end) if end else -1
    # Only a whitespace tail: anything else means that token did not close the last turn in the rendering.
    if at >= 0 and not before[at + len(end):].strip():
        cut = at + len(end)
    return encode(tokenizer, after[cut:])


def each_env(items: list[Any], env_of: Callable[[Any], Any], fn: Callable[[Any], Any]) -> list[Any]:
    """`fn` over `items`, in order; the items whose environment waits on I/O (`env.concurrent`) run in
    threads, the others here. The first exception (an environment server's error naming its task) is
    raised once every call has returned."""
    io = [i for i, item in enumerate(items) if getattr(env_of(item), "concurrent", False)]
    if len(io) < 2:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(len(io), MAX_ENV_THREADS), thread_name_prefix="env") as pool:
        futures = {i: pool.submit(fn, items[i]) for i in io}
        local = {i: fn(item) for i, item in enumerate(items) if i not in futures}
        return [futures[i].result() if i in futures else local[i] for i in range(len(items))]


def start_episodes(rows: list[dict], n: int, tokenizer: PreTrainedTokenizerBase,
                   make_env: Callable[[dict], Any], group_offset: int = 0) -> list[Episode]:
    pairs = [(g, row, make_env(row)) for g, row in enumerate(rows) for _ in range(n)]
    openings = each_env(pairs, lambda p: p[2], lambda p: p[2].reset())
    episodes = []
    prompt_cache: dict[int, tuple[list[dict], list[int]]] = {}
    for (g, row, env), messages in zip(pairs, openings, strict=True):
        if g not in prompt_cache:  # the same row renders to the same prompt for all its samples
            prompt_cache[g] = (messages, encode(tokenizer, render(tokenizer, messages, env.tools,
                                                                  generation_prompt=True)))
        elif messages != prompt_cache[g][0]:
            # GRPO compares the samples of one prompt; an environment that opens differently each time
            # would make the group's advantages meaningless.
            raise ValueError(f"task {row.get('id')!r}: the environment opened two episodes of the same task "
                             "with different messages (reset must answer the same opening for one task)")
        ids = list(prompt_cache[g][1])
        episodes.append(Episode(
            row=row, group=group_offset + g, env=env, token_ids=ids, mask=[0] * len(ids),
            sampler_logprobs=[0.0] * len(ids), prompt_len=len(ids), messages=list(messages),
            opening=len(messages),
        ))
    return episodes


def run_episodes(
    engine: RolloutEngine, tokenizer: PreTrainedTokenizerBase, episodes: list[Episode], *,
    max_new_tokens: int, temperature: float, max_turns: int | None, max_seq_len: int,
) -> list[Episode]:
    """Play every episode to the end, batching the active ones turn by turn, then score them.

    An episode ends when its environment says so, at its turn limit (`trainer.envs.max_turns` of its row,
    lowered to `max_turns` when given), or when its tokens would pass `max_seq_len`."""
    eos_id = tokenizer.eos_token_id
    while True:
        active = [ep for ep in episodes if not ep.done]
        if not active:
            break
        try:
            gens = engine.generate([ep.token_ids for ep in active], max_new_tokens=max_new_tokens,
                                   temperature=temperature)
        except PromptTooLong as exc:  # the engine knows the limit, only we know whose prompt it is
            raise ValueError(f"task {active[exc.index].row.get('id')!r}: {exc}") from exc
        texts = [tokenizer.decode([t for t in gen.token_ids if t != eos_id], skip_special_tokens=True)
                 for gen in gens]
        results = each_env(list(zip(active, texts, strict=True)), lambda p: p[0].env,
                           lambda p: p[0].env.step(p[1]))
        for ep, gen, result in zip(active, gens, results, strict=True):
            ep.token_ids.extend(gen.token_ids)
            ep.mask.extend([1] * len(gen.token_ids))
            if gen.logprobs is None:
                ep.has_sampler_logprobs = False
                ep.sampler_logprobs.extend([0.0] * len(gen.token_ids))
            else:
                ep.sampler_logprobs.extend(gen.logprobs)
            ep.completion_tokens += len(gen.token_ids)
            ep.turns += 1
            if not gen.finished:
                ep.truncated = True
            history = ep.messages
            assistant = [m for m in result.messages if m.get("role") == "assistant"]
            observations = [m for m in result.messages if m.get("role") != "assistant"]
            ep.messages = history + result.messages
            if result.done or ep.turns >= turn_limit(ep.row, max_turns) or not observations:
                ep.done = True
                continue
            if not gen.finished:  # close the cut turn so the next context is well formed (not trained on)
                ep.token_ids.append(eos_id)
                ep.mask.append(0)
                ep.sampler_logprobs.append(0.0)
            obs = observation_ids(tokenizer, history + assistant, observations, ep.env.tools,
                                  end_id=ep.token_ids[-1])
            if len(ep.token_ids) + len(obs) + max_new_tokens > max_seq_len:
                ep.done = ep.truncated = True
                continue
            ep.token_ids.extend(obs)
            ep.mask.extend([0] * len(obs))
            ep.sampler_logprobs.extend([0.0] * len(obs))
    for ep, score in zip(episodes, each_env(episodes, lambda ep: ep.env, lambda ep: ep.env.score()), strict=True):
        ep.score = score
        ep.reward = float(score.reward)
    return episodes
