"""The platform's side of the trainer's stdout contract: `supervise` hands on each event as a typed
`trainer.events.Event`, and lines that break the contract are refused (logged) without stopping the run."""

from __future__ import annotations

import logging
import sys

from flywheel.supervise import supervise
from trainer import events

CHILD = r"""
import sys
print('{"event": "step", "step": 1, "loss": 0.5}')
print("a library's chatter on stdout")
print('{"event": "progress", "pct": 50}')
print('[1, 2]')
print('')
print('{"event": "eval", "step": 1, "split": "holdout", "metrics": {"pass_rate": 0.5}}')
sys.stdout.write('{"event": "done", "metrics": {"pass_rate": 0.5}}')  # no newline at the end
"""


def test_supervise_passes_typed_events_and_refuses_the_rest(tmp_path, caplog):
    seen: list[events.Event] = []
    with caplog.at_level(logging.INFO, logger="flywheel.supervise"):
        status, cancelled = supervise([sys.executable, "-c", CHILD], cwd=tmp_path, env={},
                                      stderr_path=tmp_path / "stderr.log", on_event=seen.append,
                                      on_start=lambda pid: None, on_tick=lambda: False)
    assert (status, cancelled) == (0, False)
    assert [(e.kind, e.step) for e in seen] == [("step", 1), ("eval", 1), ("done", None)]
    assert seen[-1].data == {"metrics": {"pass_rate": 0.5}}
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 3
    assert "not JSON" in refused[0] and "unknown event kind 'progress'" in refused[1] and "list" in refused[2]
