"""`python -m trainer latency`: per-case generation time of production (A) and a candidate (B) on the tiny model,
one request at a time, one loaded base model. Timings depend on the machine: only their sanity is asserted."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.trainer.test_cli import run_cli
from trainer.config import read_jsonl, write_jsonl


@pytest.fixture(scope="module")
def adapter(make_lora_policy, tmp_path_factory) -> Path:
    model, _ = make_lora_policy()
    path = tmp_path_factory.mktemp("latency") / "adapter"
    model.save_pretrained(path)
    return path


def test_latency_command_times_both_models_on_each_case(tiny_model, job_dir, adapter):
    out = job_dir / "latency.jsonl"
    code, events, stderr = run_cli("latency", "--model", str(tiny_model), "--suite", str(job_dir / "holdout.jsonl"),
                                   "--adapter-a", "", "--adapter-b", str(adapter), "--cases", "4",
                                   "--max-new-tokens", "24", "--seed", "3", "--out", str(out), "--threads", "1")
    assert code == 0, stderr[-3000:]
    rows = [e["case"] for e in events if e["event"] == "latency"]
    done = events[-1]
    assert done["event"] == "done" and done["results"] == str(out) and done["cases"] == 4
    assert read_jsonl(out) == rows
    suite_ids = [r["id"] for r in read_jsonl(job_dir / "holdout.jsonl")]
    ids = [r["id"] for r in rows]
    assert len(set(ids)) == 4 and ids == [i for i in suite_ids if i in ids]  # chosen by the seed, suite order
    for row in rows:
        for side in ("a", "b"):
            assert row[f"latency_ms_{side}"] > 0 and 1 <= row[f"tokens_{side}"] <= 24
            assert len(row[f"requests_ms_{side}"]) == 2  # A, B, B, A: two requests each
            assert row[f"latency_ms_{side}"] == min(row[f"requests_ms_{side}"])
    # Another seed picks other cases; the same seed the same ones.
    code, again, _ = run_cli("latency", "--model", str(tiny_model), "--suite", str(job_dir / "holdout.jsonl"),
                             "--adapter-b", str(adapter), "--cases", "4", "--max-new-tokens", "4", "--seed", "3",
                             "--threads", "1")
    assert code == 0 and [e["case"]["id"] for e in again if e["event"] == "latency"] == ids


def test_the_same_adapter_on_both_sides_runs_at_the_same_rate(tiny_model, adapter, workplace_tasks):
    from trainer.latency import measure_latency

    torch.set_num_threads(1)
    rows = measure_latency(tiny_model, workplace_tasks["holdout"][:12], adapter_a=str(adapter),
                           adapter_b=str(adapter), cases=12, max_new_tokens=24)
    assert len(rows) == 12
    # Greedy, the same weights: the very same tokens on both sides.
    assert [r["tokens_a"] for r in rows] == [r["tokens_b"] for r in rows]
    ratios = [math.log((r["latency_ms_b"] / r["tokens_b"]) / (r["latency_ms_a"] / r["tokens_a"])) for r in rows]
    mean = math.exp(sum(ratios) / len(ratios))
    print(f"\nsame adapter on both sides: geometric mean ratio of ms per token {mean:.3f} over {len(rows)} cases")
    assert 0.67 < mean < 1.5


def test_each_side_generates_with_its_own_weights(tiny_model, adapter):
    from trainer.latency import TwoModels
    from trainer.models import load_model

    base, _ = load_model(tiny_model)
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        models = TwoModels(tiny_model, None, str(adapter))
        with models.use("a"):  # production without an adapter: the base model
            a = models.model(input_ids=ids).logits
        with models.use("b"):  # the candidate's adapter, merged for the request
            b = models.model(input_ids=ids).logits
        with models.use("a"):  # unmerged again: the base is the base
            a_again = models.model(input_ids=ids).logits
    assert torch.allclose(a, plain, atol=1e-5) and torch.allclose(a_again, plain, atol=1e-5)
    assert not torch.allclose(b, plain, atol=1e-3)
    # Production with the same adapter as the candidate: the very same weights on both sides.
    with torch.no_grad():
        both = TwoModels(tiny_model, str(adapter), str(adapter))
        with both.use("a"):
            a = both.model(input_ids=ids).logits
        with both.use("b"):
            b2 = both.model(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-4) and torch.allclose(b2, b, atol=1e-4)


def test_a_suite_without_cases_or_a_missing_adapter_is_an_error(tiny_model, job_dir, tmp_path, adapter):
    write_jsonl(tmp_path / "empty.jsonl", [])
    code, events, _ = run_cli("latency", "--model", str(tiny_model), "--suite", str(tmp_path / "empty.jsonl"),
                              "--adapter-b", str(adapter))
    assert code == 1 and events[-1]["event"] == "error" and "no cases" in events[-1]["message"]
    code, events, _ = run_cli("latency", "--model", str(tiny_model), "--suite", str(job_dir / "holdout.jsonl"),
                              "--adapter-b", str(tmp_path / "nowhere"))
    assert code == 1 and events[-1]["event"] == "error"
    assert events[-1]["message"].startswith("latency failed: ")
