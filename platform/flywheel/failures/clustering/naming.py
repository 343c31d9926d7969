"""Optional names for new clusters, from an OpenAI-compatible endpoint: the one the llm_judge verifier is
configured with (FLYWHEEL_LLM_JUDGE_ENDPOINT / _MODEL / _API_KEY / _TIMEOUT, or configure_llm_judge).

Off by default (FLYWHEEL_CLUSTER_NAMING); nothing needs it. When on, each new group's c-TF-IDF label and a few
representatives are sent, and the answer, one short line, becomes the label. Any failure (endpoint down,
a bad answer) keeps the c-TF-IDF label: naming never fails a run. Agent text goes to that endpoint, so it
is the operator's choice to turn this on."""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings

from trainer.verifiers.llm_judge import LLMJudgeDisabled, _settings, judge_chat

logger = logging.getLogger(__name__)

MAX_NAME = 120


def naming_enabled() -> bool:
    return bool(getattr(settings, "FLYWHEEL_CLUSTER_NAMING", False))


def _ask(config: dict[str, Any], prompt: str) -> str:
    body = {"model": config.get("model"), "messages": [{"role": "user", "content": prompt}], "temperature": 0}
    reply = judge_chat(config, body)  # through the outbound guard, as the verifier's calls
    return str(reply["choices"][0]["message"]["content"])


def cluster_name(*, label: str, examples: list[dict[str, Any]]) -> str | None:
    """A short name for a group of failures, or None (naming off, not configured, or it failed)."""
    if not naming_enabled():
        return None
    try:
        config = _settings()
    except LLMJudgeDisabled as exc:
        logger.warning("cluster naming is on but no endpoint is configured: %s", exc)
        return None
    shown = "\n".join(f"- request: {e.get('request')}\n  failing step: {e.get('step')}\n  result: {e.get('result')}" for e in examples[:5])
    prompt = (
        "These agent failures were grouped together. Name the failure they share in at most eight words, "
        f"as a reviewer would name a failure mode. Keywords: {label}\nExamples:\n{shown}\n"
        "Reply with the name only."
    )
    try:
        name = " ".join(_ask(config, prompt).split()).strip(" \"'.")
    except Exception as exc:  # the endpoint is a boundary we do not own: any failure keeps the label
        logger.warning("cluster naming failed (%s: %s); keeping the keyword label", type(exc).__name__, exc)
        return None
    return name[:MAX_NAME] or None
