"""The optional `llm_judge` verifier: an OpenAI-compatible endpoint grades an answer against a rubric.

Off by default. It runs only once enabled, by `configure_llm_judge(endpoint=..., model=...)` or the
environment variables FLYWHEEL_LLM_JUDGE_ENDPOINT and FLYWHEEL_LLM_JUDGE_MODEL (FLYWHEEL_LLM_JUDGE_API_KEY
optional). The endpoint is called through `trainer.outbound`: on a private or loopback address it must be
listed in FLYWHEEL_OUTBOUND_ALLOWLIST. Rewards from a judge are not reproducible the way the other verifiers' are; prefer those.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from trainer import outbound
from trainer.verifiers.base import Score, short

_config: dict[str, Any] = {}


class LLMJudgeDisabled(RuntimeError):
    """Raised when an llm_judge spec is scored while no judge endpoint is configured."""


class JudgeError(RuntimeError):
    """The judge endpoint answered with an error status or something that is not a JSON object."""


@dataclass(frozen=True)
class JudgeSpec:
    rubric: str
    threshold: float
    model: str | None


def configure_llm_judge(*, endpoint: str | None, model: str | None = None, api_key: str | None = None, timeout: float = 30.0) -> None:
    """Enable (endpoint set) or disable (endpoint None) the llm_judge verifier for this process."""
    _config.clear()
    if endpoint:
        _config.update(endpoint=endpoint.rstrip("/"), model=model, api_key=api_key, timeout=timeout)


def _settings() -> dict[str, Any]:
    if _config:
        return _config
    endpoint = os.environ.get("FLYWHEEL_LLM_JUDGE_ENDPOINT")
    if not endpoint:
        raise LLMJudgeDisabled(
            "llm_judge verifiers are off by default: set FLYWHEEL_LLM_JUDGE_ENDPOINT (an OpenAI-compatible base "
            "URL) and FLYWHEEL_LLM_JUDGE_MODEL, or call trainer.verifiers.configure_llm_judge(endpoint=..., model=...)"
        )
    return {
        "endpoint": endpoint.rstrip("/"),
        "model": os.environ.get("FLYWHEEL_LLM_JUDGE_MODEL"),
        "api_key": os.environ.get("FLYWHEEL_LLM_JUDGE_API_KEY"),
        "timeout": float(os.environ.get("FLYWHEEL_LLM_JUDGE_TIMEOUT", "30")),
    }


def judge_chat(settings: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """POST a chat completion to the judge endpoint through the outbound guard (no private address unless
    listed, no redirect, the whole answer within `timeout` seconds); raises JudgeError on any answer but a 2xx
    JSON object."""
    headers = {}
    if settings.get("api_key"):
        headers["Authorization"] = f"Bearer {settings['api_key']}"
    url = settings["endpoint"] + "/chat/completions"
    response = outbound.post_json(url, body, headers=headers, timeout=settings["timeout"])
    shown = outbound.redact_url(url)
    if not response.ok:
        raise JudgeError(f"llm_judge endpoint {shown} answered HTTP {response.status}")
    try:
        reply = response.json()
    except ValueError as exc:
        raise JudgeError(f"llm_judge endpoint {shown} answered something that is not JSON ({exc})") from None
    if not isinstance(reply, dict):
        raise JudgeError(f"llm_judge endpoint {shown} answered JSON that is not an object")
    return reply


def compile_judge(spec: dict, problems: list[str]) -> JudgeSpec:
    for key in sorted(set(spec) - {"type", "rubric", "threshold", "model"}):
        problems.append(f"unknown key {key!r} (expected rubric, threshold, model)")
    rubric = spec.get("rubric")
    if not isinstance(rubric, str) or not rubric.strip():
        problems.append("llm_judge needs \"rubric\": what a good answer does")
        rubric = ""
    threshold = spec.get("threshold", 0.5)
    if not isinstance(threshold, int | float) or isinstance(threshold, bool) or not 0 <= threshold <= 1:
        problems.append("threshold must be a number in [0, 1]")
        threshold = 0.5
    model = spec.get("model")
    if model is not None and not isinstance(model, str):
        problems.append("model must be a string")
        model = None
    return JudgeSpec(rubric, float(threshold), model)


def score_judge(spec: JudgeSpec, answer: str, calls: list[dict], config: dict[str, Any] | None = None) -> Score:
    """Grade `answer` (and the calls made) with the configured judge, or with `config` (endpoint, model,
    api_key, timeout) when given: the platform's online evaluation passes a project's own endpoint."""
    settings = config or _settings()  # raises LLMJudgeDisabled before anything touches a network
    prompt = (
        f"Rubric:\n{spec.rubric}\n\nAnswer:\n{answer}\n\nTool calls:\n{json.dumps(calls)}\n\n"
        'Grade the answer against the rubric. Reply with JSON only: {"score": <0..1>, "reason": "<one sentence>"}'
    )
    body = {
        "model": spec.model or settings.get("model"),
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
    }
    reply = judge_chat(settings, body)
    usage = judge_usage(reply)
    text = reply["choices"][0]["message"]["content"] or ""
    try:
        verdict = json.loads(text.strip().strip("`").removeprefix("json").strip())
        value = float(verdict["score"])
    except (ValueError, KeyError, TypeError):
        return Score(0.0, False, {"judge": {"ok": False, "reason": f"unreadable verdict {short(text)}", **usage}},
                     "wrong_answer")
    value = min(max(value, 0.0), 1.0)
    passed = value >= spec.threshold
    checks = {"judge": {"ok": passed, "score": value, "reason": short(verdict.get("reason", ""), 200), **usage}}
    return Score(value, passed, checks, None if passed else "wrong_answer")


def judge_usage(reply: dict[str, Any]) -> dict[str, int]:
    """The tokens the judge's answer says it spent (OpenAI's `usage`: prompt and completion tokens), as
    {"input_tokens", "output_tokens"}; {} when it says nothing readable (what the platform counts as judge spend)."""
    usage = reply.get("usage")
    if not isinstance(usage, dict):
        return {}
    pair = [usage.get("prompt_tokens"), usage.get("completion_tokens")]
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= 10**9 for x in pair):
        return {}
    return {"input_tokens": pair[0], "output_tokens": pair[1]}
