"""Verifier throughput: single-call tool_call scores per second on one core, against naive baselines.

    .venv/bin/python bench/verifiers.py [--seconds 1.0]

The cases are workplace single-step requests scored as tool_call specs, with a realistic mix of outputs
(right, wrong argument, wrong tool, unsafe, Hermes-style text, unparseable). Baselines, measured in the
same run on the same cases: the same verifier with cached jsonschema validators but without the fast
schema path; the same verifier with every cache off (spec compiled, validators built and
schemas checked per call), and jsonschema's plain `validate()` of the arguments per call, which does less
than a score does. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jsonschema  # noqa: E402

from trainer.envs.workplace import generate_tasks  # noqa: E402
from trainer.verifiers import caches_disabled, parse_completion, score  # noqa: E402
from trainer.verifiers import schemas as _schemas  # noqa: E402


def make_cases(n_tasks: int = 50) -> list[tuple[dict, list[dict], object]]:
    """(spec, tools, completion) triples, six outputs per request."""
    cases = []
    for task in generate_tasks(n_tasks, seed=0, difficulty="single"):
        fn = task["solution"][0]["tool_calls"][0]["function"]
        args = json.loads(fn["arguments"])
        spec = {
            "type": "tool_call",
            "expected_calls": [{"name": fn["name"], "arguments": args}],
            "unsafe": [{"name": "delete_*"}, {"name": "cancel_*"}],
        }
        wrong = dict(args)
        first = next(iter(wrong))
        wrong[first] = "something else"
        other = next(t["function"]["name"] for t in task["tools"] if t["function"]["name"] != fn["name"])

        def message(name: str, arguments: dict) -> dict:
            return {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c0", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}],
            }

        for completion in (
            message(fn["name"], args),
            message(fn["name"], wrong),
            message(other, {}),
            message("delete_task", {"task_id": "T1"}),
            "<tool_call>" + json.dumps({"name": fn["name"], "arguments": args}) + "</tool_call>",
            '<tool_call>{"name": "' + fn["name"] + '", "arguments": {"title": </tool_call>',
        ):
            cases.append((spec, task["tools"], completion))
    return cases


def rate(fn, cases, seconds: float) -> float:
    """Calls per second of fn over the cases, best of three runs of about `seconds` each."""
    best = 0.0
    for _ in range(3):
        done = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            for case in cases:
                fn(*case)
            done += len(cases)
        best = max(best, done / (time.perf_counter() - start))
    return best


def ours(spec, tools, completion):
    return score(spec, completion, tools=tools)


def uncached(spec, tools, completion):
    with caches_disabled():
        return score(spec, completion, tools=tools)


def without_fast_path(cases, seconds: float) -> float:
    """Ours with cached jsonschema validators but no fast schema path: what the fast path is worth."""
    saved = _schemas._FAST_DRAFTS
    _schemas._FAST_DRAFTS = ()
    _schemas._by_identity.clear()
    _schemas._by_content.clear()
    try:
        for case in cases:
            ours(*case)
        return rate(ours, cases, seconds)
    finally:
        _schemas._FAST_DRAFTS = saved
        _schemas._by_identity.clear()
        _schemas._by_content.clear()


def plain_validate(spec, tools, completion):
    # The naive path: parse, then jsonschema.validate() (which checks the schema and builds a validator
    # every time) on each call's arguments. No matching, no unsafe check, no categorisation.
    parsed = parse_completion(completion)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in parsed.calls:
        if call["name"] in schemas:
            try:
                jsonschema.validate(call["arguments"], schemas[call["name"]])
            except jsonschema.ValidationError:
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="length of each timed run")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core, as the goal is stated
    cases = make_cases()
    for case in cases:  # warm the caches: the steady state is what GRPO and eval runs see
        ours(*case)
    results = {
        "ours": rate(ours, cases, args.seconds),
        "no_fast_path": without_fast_path(cases, args.seconds),
        "uncached": rate(uncached, cases, args.seconds / 4),
        "jsonschema_validate": rate(plain_validate, cases, args.seconds / 4),
    }
    print(f"cases: {len(cases)} single-call tool_call outputs ({len(cases) // 6} requests x 6 kinds), one core")
    print(f"ours (cached)                       {results['ours']:>10,.0f} scores/s   (goal 20,000/s)")
    print(f"cached jsonschema, no fast path     {results['no_fast_path']:>10,.0f} scores/s   x{results['ours'] / results['no_fast_path']:.1f}")
    print(f"same verifier, caches off           {results['uncached']:>10,.0f} scores/s   x{results['ours'] / results['uncached']:.1f}")
    print(f"jsonschema.validate() per call only {results['jsonschema_validate']:>10,.0f} calls/s    x{results['ours'] / results['jsonschema_validate']:.1f}")
    print(
        json.dumps(
            {
                "scores_per_s": round(results["ours"]),
                "no_fast_path_per_s": round(results["no_fast_path"]),
                "uncached_per_s": round(results["uncached"]),
                "jsonschema_validate_per_s": round(results["jsonschema_validate"]),
                "speedup_vs_uncached": round(results["ours"] / results["uncached"], 2),
                "speedup_vs_jsonschema_validate": round(results["ours"] / results["jsonschema_validate"], 2),
                "goal_per_s": 20000,
            }
        )
    )


if __name__ == "__main__":
    main()
