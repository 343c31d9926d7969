"""Labeled failures on real API descriptions: the tools, their argument names and descriptions, and the
users' requests come from the REST operations that the Databricks SDK for Python documents (the
`databricks-sdk` package, Apache-2.0, a dependency of MLflow and so installed with the platform): some
1,400 operations over 40-odd services, each with its own name, argument names and the summary its
maintainers wrote. None of these texts was written by this project, and nothing is fetched.

A failure is an agent given one service's operations as tools, asked in the words of one operation's summary
to do it, and failing it for one of CAUSES. As in public function-calling benchmarks, the cause does not
follow the tool: every cause falls on hundreds of different operations, so a good grouping follows what went
wrong (the signals, the checks, the error) rather than which tool or which argument names were involved.

    failures(n, seed=0) -> [(cause, record)]   records ready for ingestion (`ingest_trajectories`)
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import pkgutil
import random
import re
from dataclasses import dataclass
from typing import Any

_PARAM = re.compile(r":param (\w+):[^\n]*\n?((?:\s{2,}[^\n]*\n?)*)")


@dataclass(frozen=True)
class Operation:
    service: str  # e.g. "jobs"
    name: str  # the tool's name, e.g. "jobs_run_now"
    summary: str  # the first paragraph of the maintainers' docstring
    arguments: tuple[tuple[str, str, bool, str], ...]  # (name, JSON type, required, description)

    def tool(self) -> dict[str, Any]:
        properties = {a: {"type": t, "description": d[:200]} for a, t, _, d in self.arguments}
        required = [a for a, _, req, _ in self.arguments if req]
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.summary[:300],
                "parameters": {"type": "object", "properties": properties, "required": required},
            },
        }


def _json_type(annotation: Any) -> str:
    text = str(annotation).lower()
    for word, kind in (("bool", "boolean"), ("int", "integer"), ("float", "number"), ("list", "array"), ("dict", "object")):
        if word in text:
            return kind
    return "string"


@functools.cache
def operations() -> tuple[Operation, ...]:
    """Every documented operation of the SDK's services that takes arguments, in a fixed order."""
    import databricks.sdk.service as services

    out = []
    for module_info in sorted(pkgutil.iter_modules(services.__path__), key=lambda m: m.name):
        if module_info.name.startswith("_"):
            continue
        module = importlib.import_module(f"databricks.sdk.service.{module_info.name}")
        for class_name, cls in sorted(inspect.getmembers(module, inspect.isclass)):
            if not class_name.endswith("API") or cls.__module__ != module.__name__:
                continue
            prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", class_name.removesuffix("API")).lower()
            for method, fn in sorted(inspect.getmembers(cls, inspect.isfunction)):
                doc = inspect.getdoc(fn) or ""
                kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
                params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self" and p.kind in kinds]
                summary = " ".join(doc.split("\n\n")[0].split())
                if method.startswith("_") or not params or len(summary) < 15:
                    continue
                described = {m.group(1): " ".join(m.group(2).split()) for m in _PARAM.finditer(doc)}
                arguments = tuple(
                    (p.name, _json_type(p.annotation), p.default is inspect.Parameter.empty, described.get(p.name, ""))
                    for p in params[:8]
                )
                out.append(Operation(module_info.name, f"{prefix}_{method}", summary, arguments))
    return tuple(out)


@functools.cache
def _by_service() -> dict[str, list[Operation]]:
    grouped: dict[str, list[Operation]] = {}
    for op in operations():
        grouped.setdefault(op.service, []).append(op)
    return grouped


GREETINGS = ["", "", "", "Hi! ", "Hello, ", "Quick one: ", "Please help. ", "Good morning. "]
ASKS = [
    "{summary}",
    "I need this done: {summary}",
    "Can you do the following? {summary}",
    "{summary} Use {values}.",
    "Task for you ({values}): {summary}",
]
ERRORS = [
    "Error: RESOURCE_DOES_NOT_EXIST: {value} does not exist",
    "Error: PERMISSION_DENIED: the caller has no access to {value}",
    'Error: 400 INVALID_PARAMETER_VALUE: invalid value for "{arg}"',
    "Error: 503 TEMPORARILY_UNAVAILABLE: the service is overloaded, retry later",
    '{{"error_code": "INTERNAL_ERROR", "message": "Internal error while processing {value}"}}',
    "Error: 429 REQUEST_LIMIT_EXCEEDED: too many requests",
]
SORRY = [
    "Sorry, that did not work.",
    "I ran into a problem while doing that.",
    "Apologies, I could not complete the request.",
    "Something went wrong, shall I try again?",
]
DONE = ["Done.", "That is done.", "All set.", "Finished, it went through."]
HALLUCINATED = ["{name}_v2", "{name}s", "{service}_{verb}_all", "{name}_by_name", "bulk_{name}", "{name}_async"]


def _value(rng: random.Random, name: str, kind: str) -> Any:
    if kind == "integer":
        return rng.randint(1, 500)
    if kind == "number":
        return round(rng.uniform(1, 100), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [f"{name}-{rng.randint(1, 99)}"]
    if kind == "object":
        return {"key": f"{name}-{rng.randint(1, 99)}"}
    return f"{name.removesuffix('_id')}-{rng.randint(100, 9999)}"


def _wrong(kind: str) -> Any:
    """A value of the wrong JSON type for `kind`."""
    return {"string": 12345, "integer": "twelve", "number": "a lot", "boolean": "maybe", "array": "all of them", "object": "none"}[kind]


class _Trajectory:
    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.n = 0

    def call(self, name: str, arguments: dict[str, Any] | str, result: str | None) -> None:
        self.n += 1
        raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
        call = {"id": f"call_{self.n}", "type": "function", "function": {"name": name, "arguments": raw}}
        self.messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        if result is not None:
            self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})

    def say(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


def _loop(t: _Trajectory, r: random.Random, op: Operation, args: dict[str, Any]) -> None:
    result = json.dumps({"status": r.choice(["PENDING", "RUNNING", "IN_PROGRESS", "QUEUED"])})
    for _ in range(r.choice([3, 3, 4, 5])):
        t.call(op.name, args, result)
    t.say(r.choice(["It is still in progress.", "Still pending, it seems.", "No change yet."]))


def _wrong_arguments(t: _Trajectory, r: random.Random, op: Operation, args: dict[str, Any]) -> None:
    wrong = dict(args)
    required = [a for a, _, req, _ in op.arguments if req]
    if required and r.random() < 0.5:
        del wrong[r.choice(required)]
    else:
        name, kind, _, _ = r.choice(op.arguments)
        wrong[name] = _wrong(kind)
    t.call(op.name, wrong, r.choice(['Error: 400 INVALID_PARAMETER_VALUE: the request is malformed', "Error: bad request"]))
    t.say(r.choice(SORRY))


def _hallucinated_api(t: _Trajectory, r: random.Random, op: Operation, args: dict[str, Any]) -> None:
    verb = op.name.rsplit("_", 1)[-1]
    name = r.choice(HALLUCINATED).format(name=op.name, service=op.service, verb=verb)
    t.call(name, args, f"Error: unknown tool {name}")
    t.say(r.choice(SORRY))


def _tool_error(t: _Trajectory, r: random.Random, op: Operation, args: dict[str, Any]) -> None:
    arg, value = r.choice(list(args.items())) if args else ("name", "it")
    t.call(op.name, args, r.choice(ERRORS).format(arg=arg, value=value))
    t.say(r.choice(SORRY))


def _invalid_json(t: _Trajectory, r: random.Random, op: Operation, args: dict[str, Any]) -> None:
    raw = json.dumps(args)
    broken = r.choice([raw[:-1], raw.replace('"', "'"), raw[:-1] + ",}", raw.replace('": ', ": ", 1).replace('"', "", 1)])
    t.call(op.name, broken, "Error: could not parse the arguments")
    t.say(r.choice(SORRY))


CAUSES = {
    "loop": _loop,
    "wrong_arguments": _wrong_arguments,
    "hallucinated_api": _hallucinated_api,
    "tool_error": _tool_error,
    "invalid_json": _invalid_json,
}


def failure(cause: str, i: int, *, seed: int = 0, prefix: str = "api") -> dict[str, Any]:
    """One failing trajectory of `cause` on a randomly drawn operation, deterministic in (cause, i, seed)."""
    rng = random.Random(f"api:{seed}:{cause}:{i}")
    op = rng.choice(operations())
    tools = _by_service()[op.service]
    if len(tools) > 24:  # an agent gets a slice of a large service, the operation among them
        tools = [op, *rng.sample([o for o in tools if o is not op], 23)]
    args = {a: _value(rng, a, kind) for a, kind, req, _ in op.arguments if req or rng.random() < 0.3}
    values = ", ".join(f"{k}={v}" for k, v in list(args.items())[:2]) or "the defaults"
    t = _Trajectory()
    t.messages.append({"role": "user", "content": rng.choice(GREETINGS) + rng.choice(ASKS).format(summary=op.summary[:300], values=values)})
    CAUSES[cause](t, rng, op, args)
    return {
        "external_id": f"{prefix}-{cause}-{i}",
        "agent": "workspace-operator",
        "model_version": rng.choice(["v3", "v4"]),
        "messages": [{"role": "system", "content": f"You operate the {op.service} service through its API."}, *t.messages],
        "tools": [o.tool() for o in tools],
        "outcome": "failure",
    }


def failures(n: int, *, seed: int = 0, prefix: str = "api") -> list[tuple[str, dict[str, Any]]]:
    """`n` failures spread evenly over CAUSES, interleaved: [(cause, record)]."""
    names = list(CAUSES)
    return [(names[i % len(names)], failure(names[i % len(names)], i // len(names), seed=seed, prefix=prefix)) for i in range(n)]
