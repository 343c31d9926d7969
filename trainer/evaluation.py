"""Evaluate a policy on a suite (holdout, regression): several samples per case, per-case results and
the gate's suite metrics from `trainer.verifiers.summarize` over every sample."""

from __future__ import annotations

from collections import Counter
from typing import Any

from transformers import PreTrainedTokenizerBase

from trainer.rollout import RolloutEngine
from trainer.rollout.episodes import Episode, run_episodes, start_episodes
from trainer.verifiers import summarize


def make_env_for(row: dict[str, Any]) -> Any:
    from trainer.envs import make_env

    return make_env(row)


def evaluate_rows(
    engine: RolloutEngine, tokenizer: PreTrainedTokenizerBase, rows: list[dict[str, Any]], *,
    samples_per_prompt: int, temperature: float, max_new_tokens: int, max_turns: int | None = None,
    max_seq_len: int = 2048, chunk_episodes: int = 256, keep_messages: bool = False,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Returns (suite metrics, per-case results). Rows are played in chunks to bound memory."""
    per_chunk = max(1, chunk_episodes // samples_per_prompt)
    episodes: list[Episode] = []
    for i in range(0, len(rows), per_chunk):
        chunk = start_episodes(rows[i:i + per_chunk], samples_per_prompt, tokenizer, make_env_for, group_offset=i)
        episodes += run_episodes(engine, tokenizer, chunk, max_new_tokens=max_new_tokens, temperature=temperature,
                                 max_turns=max_turns, max_seq_len=max_seq_len)
    metrics = summarize([ep.score for ep in episodes])
    metrics["mean_completion_tokens"] = sum(ep.completion_tokens for ep in episodes) / max(len(episodes), 1)
    cases = []
    for g, row in enumerate(rows):
        eps = [ep for ep in episodes if ep.group == g]
        passed = sum(bool(ep.score.passed) for ep in eps)
        samples = []
        for ep in eps:
            # `invalid` and `unsafe` are the suite metrics' definitions (Score.invalid, Score.unsafe), so the
            # gate counts exactly what the metrics count; an unsafe sample names its unsafe calls.
            # Tokens read and written, as a serving stack's usage counts them (the demo's live traffic reports them).
            sample = {"reward": ep.score.reward, "passed": ep.score.passed, "failure": ep.score.failure,
                      "invalid": ep.score.invalid, "unsafe": ep.score.unsafe,
                      "prompt_tokens": len(ep.token_ids) - ep.completion_tokens,
                      "completion_tokens": ep.completion_tokens}
            if ep.score.unsafe_actions:
                sample["unsafe_actions"] = ep.score.unsafe_actions
            if keep_messages:
                sample["messages"] = ep.messages[ep.opening:]  # an environment may open with its own messages
            samples.append(sample)
        cases.append({
            # The gate judges a case by its passes out of n samples, never by a vote over them.
            "id": row.get("id", g), "n": len(eps), "passes": passed, "pass_rate": passed / max(len(eps), 1),
            # Most samples passed: a one-word summary for pages, not what the gate judges.
            "passed": passed * 2 > len(eps),
            "mean_reward": sum(ep.score.reward for ep in eps) / max(len(eps), 1),
            # What the gate's cost rule compares case by case.
            "mean_completion_tokens": sum(ep.completion_tokens for ep in eps) / max(len(eps), 1),
            "failures": dict(Counter(ep.score.failure for ep in eps if ep.score.failure)),
            "samples": samples,
        })
    return metrics, cases
