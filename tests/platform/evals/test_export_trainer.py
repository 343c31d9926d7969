"""A version's export works unchanged with the trainer: `python -m trainer score` judges the original
outputs failed and the references passed, exactly as promotion's checks did, and `python -m trainer
evaluate --suite FILE` runs the file on the tiny model (the suite's shared, cached `tiny_model`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.urls import reverse

from flywheel.evals import promotion

pytestmark = pytest.mark.django_db
REPO = Path(__file__).resolve().parents[3]


def _trainer(*args: str) -> tuple[int, list[dict], str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run([sys.executable, "-m", "trainer", *args], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env=env)
    return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines() if line.strip()], proc.stderr


def test_exported_version_runs_unchanged_in_the_trainer(client_for, user, project, ingest, refund_record, suite,
                                                        corrected, tmp_path, tiny_model):
    calls_case, calls_check = promotion.trajectory_promote(
        trajectory=ingest(refund_record("x-1")), data=corrected, target=suite, user=user)
    answer = ingest(refund_record("x-2", order="Q-2", request="Refund 50.00 on Q-2 and tell me when done",
                                  answer="I cannot do that."))
    answer_case, answer_check = promotion.trajectory_promote(
        trajectory=answer, target=suite, user=user,
        data={"message_index": 6, "expect": "answer", "answer_match": "regex", "expected_answer": "(?i)refunded",
              "reference_answer": "Refunded 50.00."})
    download = client_for(user).get(reverse("suite_export", args=[project.slug, suite.pk, 2]))
    suite_file = tmp_path / "regression.jsonl"
    suite_file.write_bytes(download.content)

    originals, references = tmp_path / "originals.jsonl", tmp_path / "references.jsonl"
    checks = {calls_case.row_id: calls_check, answer_case.row_id: answer_check}
    originals.write_text("".join(json.dumps({"id": k, "completion": c.original}) + "\n" for k, c in checks.items()))
    references.write_text("".join(json.dumps({"id": k, "completion": c.reference}) + "\n" for k, c in checks.items()))
    code, rows, stderr = _trainer("score", str(suite_file), str(originals))
    assert code == 0, stderr[-2000:]
    assert {r["id"]: (r["passed"], r["failure"]) for r in rows} == {
        calls_case.row_id: (False, "wrong_arguments"), answer_case.row_id: (False, "wrong_answer")}
    code, rows, stderr = _trainer("score", str(suite_file), str(references))
    assert code == 0 and all(r["passed"] for r in rows), rows

    code, events, stderr = _trainer("evaluate", "--model", str(tiny_model), "--suite", str(suite_file),
                                    "--samples", "2", "--max-new-tokens", "16", "--threads", "1")
    assert code == 0, stderr[-3000:]
    cases = [e["case"] for e in events if e["event"] == "eval"]
    assert [c["id"] for c in cases] == [calls_case.row_id, answer_case.row_id]
    assert all(c["n"] == 2 for c in cases)
    assert events[-1]["event"] == "done" and events[-1]["metrics"]["n"] == 4
