"""The HTTP environment: an episode played against an environment server (the shape of NeMo Gym's
resources servers), so a team's own tools and checks can train a policy without living in this process.

Row: `{"id", "messages", "tools", "env": {"type": "http", "url": "http://host:port", "timeout_s"?: 30,
"retries"?: 2, "max_concurrency"?: 8, "max_turns"?: 6, ...anything the server reads}}`. The protocol, JSON
in and out, every call a POST:

    {url}/reset   {"task": <the row>}
               -> {"session_id": "...", "messages"?: [opening messages; default the row's], "tools"?: [...]}
    {url}/step    {"session_id", "turn": 0, 1, ..., "message": <the assistant message, OpenAI format>}
               -> {"observations": [tool (or user) messages], "done": bool, "reward"?: number}
    {url}/verify  {"session_id"}
               -> {"reward": number, "passed"?: bool (default reward >= 1), "checks"?: {...},
                   "failure"?: a failure category or null, "components"?: {name: number}}

The assistant message is sent parsed (calls with ids and JSON-string arguments, as the transcript holds
them); unparseable output is sent as its text. A request that fails to connect, times out, or gets HTTP 429
or 5xx is retried (`retries` times, backing off); `turn` lets a server answer a repeated /step from its
record instead of applying it twice. Requests go through `trainer.outbound`: a server on a private or
loopback address must be listed in FLYWHEEL_OUTBOUND_ALLOWLIST, and redirects are not followed. Any other failure, or an answer that breaks the protocol, raises
`EnvServerError` naming the task, the URL and the call. At most `max_concurrency` requests are in flight to
one URL (the first row seen for a URL sets it); the episode runner steps episodes of such environments
concurrently. `/reset` must answer the same opening messages for every session of one row: GRPO compares
the samples of one prompt.
"""

from __future__ import annotations

import copy
import http.client
import json
import math
import threading
import time
from typing import Any

from trainer import outbound
from trainer.envs.base import StepResult, max_turns, parse_turn
from trainer.verifiers import FAILURES, Score

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_RETRIES = 2
DEFAULT_MAX_CONCURRENCY = 8
MAX_RESPONSE_BYTES = 16 << 20
BACKOFF_S = 0.2  # first retry's wait; doubles per attempt, at most 5 s
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})

_slots: dict[str, threading.BoundedSemaphore] = {}
_slots_lock = threading.Lock()


class EnvServerError(RuntimeError):
    """An environment server failed or broke the protocol; the message names the task, URL and call."""


def _slot(url: str, limit: int) -> threading.BoundedSemaphore:
    with _slots_lock:
        if url not in _slots:
            _slots[url] = threading.BoundedSemaphore(limit)
        return _slots[url]


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class HttpEnv:
    """One episode against an environment server (a session from /reset to /verify)."""

    concurrent = True  # waits on the network: the episode runner steps these in threads

    def __init__(self, task: dict[str, Any]):
        self.task = task
        self.tools: list[dict] = task.get("tools") or []
        env = task.get("env") or {}
        where = f"task {task.get('id')!r}: env"
        url = env.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"{where}.url must be an http:// or https:// URL, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout_s = float(self._setting(env, "timeout_s", DEFAULT_TIMEOUT_S, where, minimum=0.001))
        self.retries = int(self._setting(env, "retries", DEFAULT_RETRIES, where, minimum=0, integer=True))
        limit = int(self._setting(env, "max_concurrency", DEFAULT_MAX_CONCURRENCY, where, minimum=1, integer=True))
        self._limit = _slot(self.url, limit)
        self.max_turns: int = max_turns(task)
        self.session_id: Any = None
        self.turn = 0
        self.done = False
        self.step_rewards: list[float] = []

    @staticmethod
    def _setting(env: dict, key: str, default: float, where: str, *, minimum: float, integer: bool = False) -> float:
        value = env.get(key, default)
        ok = _number(value) and value >= minimum and (not integer or float(value).is_integer())
        if not ok:
            kind = "an integer" if integer else "a number"
            raise ValueError(f"{where}.{key} must be {kind} >= {minimum:g}, got {value!r}")
        return value

    # --- protocol ----------------------------------------------------------------------------------
    def reset(self) -> list[dict]:
        answer = self._post("/reset", {"task": self.task})
        sid = answer.get("session_id")
        if not isinstance(sid, str | int) or isinstance(sid, bool) or sid == "":
            raise self._error("/reset", f"the answer has no \"session_id\" (got {_short(sid)})")
        self.session_id, self.turn, self.done, self.step_rewards = sid, 0, False, []
        if "tools" in answer:
            if not isinstance(answer["tools"], list):
                raise self._error("/reset", "\"tools\" must be a list of tool schemas")
            self.tools = answer["tools"]
        messages = answer.get("messages", self.task.get("messages") or [])
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise self._error("/reset", "\"messages\" must be a list of chat messages")
        return copy.deepcopy(messages)

    def step(self, completion: str | dict) -> StepResult:
        if self.done:
            raise RuntimeError(f"task {self.task.get('id')}: step() after the episode ended; call reset()")
        _, message = parse_turn(completion, self.turn)
        answer = self._post("/step", {"session_id": self.session_id, "turn": self.turn, "message": message})
        self.turn += 1
        observations = answer.get("observations", [])
        if not isinstance(observations, list) or not all(isinstance(m, dict) and "role" in m for m in observations):
            raise self._error("/step", "\"observations\" must be a list of chat messages")
        done = answer.get("done", False)
        if not isinstance(done, bool):
            raise self._error("/step", f"\"done\" must be true or false, got {_short(done)}")
        if "reward" in answer and answer["reward"] is not None:
            if not _number(answer["reward"]):
                raise self._error("/step", f"\"reward\" must be a number, got {_short(answer['reward'])}")
            self.step_rewards.append(float(answer["reward"]))
        self.done = done or self.turn >= self.max_turns
        return StepResult([message, *observations], self.done)

    def score(self) -> Score:
        answer = self._post("/verify", {"session_id": self.session_id})
        reward = answer.get("reward")
        if not _number(reward):
            raise self._error("/verify", f"\"reward\" must be a number, got {_short(reward)}")
        passed = answer.get("passed", reward >= 1.0)
        if not isinstance(passed, bool):
            raise self._error("/verify", f"\"passed\" must be true or false, got {_short(passed)}")
        failure = answer.get("failure")
        if failure is not None and failure not in FAILURES:
            raise self._error("/verify", f"\"failure\" must be null or one of {list(FAILURES)}, got {_short(failure)}")
        checks = answer.get("checks") or {}
        if not isinstance(checks, dict):
            raise self._error("/verify", "\"checks\" must be an object")
        components = answer.get("components") or {}
        if not isinstance(components, dict) or not all(_number(v) for v in components.values()):
            raise self._error("/verify", "\"components\" must be an object of name -> number")
        episode = checks.get("episode") if isinstance(checks.get("episode"), dict) else {}
        episode = {**episode, "turns": self.turn, "server": outbound.redact_url(self.url)}
        if self.step_rewards:
            episode["step_rewards"] = self.step_rewards
        checks = {**checks, "episode": episode}
        return Score(float(reward), passed, checks, None if passed else failure,
                     {str(k): float(v) for k, v in components.items()})

    # --- transport ---------------------------------------------------------------------------------
    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body, ensure_ascii=False, default=str).encode()
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(BACKOFF_S * 2 ** (attempt - 1), 5.0))
            try:
                with self._limit:
                    response = outbound.request(self.url + path, body=data, timeout=self.timeout_s,
                                                headers={"Content-Type": "application/json"},
                                                max_bytes=MAX_RESPONSE_BYTES)
            except outbound.OutboundError as exc:  # an address not allowed, a redirect: retrying changes nothing
                raise self._error(path, f"not sent: {exc}") from None
            except TimeoutError:
                last = f"timed out after {self.timeout_s:g} s"
                continue
            except (http.client.HTTPException, OSError) as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            raw = response.body
            if not response.ok:
                last = f"HTTP {response.status}{_detail(raw)}"
                if response.status in RETRY_STATUS:
                    continue
                raise self._error(path, f"answered {last}")
            if len(raw) > MAX_RESPONSE_BYTES:
                raise self._error(path, f"the answer is larger than {MAX_RESPONSE_BYTES} bytes")
            try:
                answer = json.loads(raw)
            except ValueError as exc:
                raise self._error(path, f"the answer is not JSON ({exc})") from None
            if not isinstance(answer, dict):
                raise self._error(path, "the answer must be a JSON object")
            return answer
        attempts = self.retries + 1
        raise self._error(path, f"failed after {attempts} attempt{'s' if attempts > 1 else ''}: {last}")

    def _error(self, path: str, what: str) -> EnvServerError:
        return EnvServerError(outbound.redact(f"task {self.task.get('id')!r}: environment server {self.url}: "
                                              f"POST {path} {what}"))


def _detail(raw: bytes) -> str:
    text = raw[:500].decode("utf-8", "replace").strip()
    return f" ({_short(text, 200)})" if text else ""


def _short(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."
