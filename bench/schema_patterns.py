"""Hostile patterns in a tool's parameters schema: jsonschema's own keywords (Python's re) against the
validators trainer.verifiers builds (RE2), on `^(a+)+$` and an argument name of N a's and a "!".

    .venv/bin/python bench/schema_patterns.py [--n 16 18 20 22]

Both sides validate the same instance against the same schema in the same run; the baseline is jsonschema's
Draft 2020-12 validator with an empty registry (nothing fetched either way). Python's re doubles its time with
each character (issue 22 measured 0.29 s at N=22 and 5.19 s at N=26); RE2 stays flat, shown up to N=30 and
N=10,000 on our side only. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jsonschema  # noqa: E402
import referencing  # noqa: E402

from trainer.verifiers.jsonschemas import schema_validator  # noqa: E402

PATTERN = "^(a+)+$"
SCHEMAS = {
    "patternProperties": {"type": "object", "patternProperties": {PATTERN: {"type": "string"}}},
    "additionalProperties": {"type": "object", "patternProperties": {PATTERN: {}}, "additionalProperties": False},
    "unevaluatedProperties": {"type": "object", "patternProperties": {PATTERN: {}}, "unevaluatedProperties": False},
}


def seconds(validator: object, n: int) -> float:
    instance = {"a" * n + "!": "x"}
    start = time.perf_counter()
    list(validator.iter_errors(instance))  # type: ignore[attr-defined]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[16, 18, 20, 22])
    args = parser.parse_args()
    out: dict[str, dict[str, float]] = {}
    for name, schema in SCHEMAS.items():
        stock = jsonschema.Draft202012Validator(schema, registry=referencing.Registry())
        ours = schema_validator(schema)
        for n in args.n:
            re_s, re2_s = seconds(stock, n), seconds(ours, n)
            out[f"{name} N={n}"] = {"re_s": round(re_s, 4), "re2_s": round(re2_s, 6)}
            print(f"{name:22s} N={n:<6d} re {re_s:8.3f} s   RE2 {re2_s * 1e3:7.3f} ms   x{re_s / max(re2_s, 1e-9):,.0f}")
        for n in (30, 10_000):
            re2_s = seconds(ours, n)
            out[f"{name} N={n}"] = {"re2_s": round(re2_s, 6)}
            print(f"{name:22s} N={n:<6d} re   (not run)   RE2 {re2_s * 1e3:7.3f} ms")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
