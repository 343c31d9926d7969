"""The platform's side of the trainer's stdout contract: `supervise` hands on each event as a typed
`trainer.events.Event`, and lines that break the contract are refused (logged) without stopping the run; and
the environment a trainer gets (`trainer_env`): what it needs to run, none of the worker's secrets."""

from __future__ import annotations

import logging
import os
import sys

from flywheel.supervise import supervise, trainer_env
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


WORKER_SECRETS = {"SECRET_KEY": "worker-secret-key-not-for-the-trainer", "EMAIL_HOST_PASSWORD": "mail-password",
                  "CELERY_BROKER_URL": "redis://:broker-pass@redis:6379/0", "HF_TOKEN": "hf_not_needed_offline"}


def test_a_trainer_gets_what_it_needs_to_run_and_none_of_the_workers_secrets(monkeypatch, settings):
    for name, value in {**WORKER_SECRETS, "CUDA_VISIBLE_DEVICES": "0,1", "HF_HUB_OFFLINE": "1",
                        "MLFLOW_TRACKING_TOKEN": "mlflow-token", "OMP_NUM_THREADS": "4", "LC_ALL": "C.UTF-8",
                        "NCCL_DEBUG": "INFO", "SCRATCH_DIR": "/scratch"}.items():
        monkeypatch.setenv(name, value)
    settings.FLYWHEEL_TRAINER_ENV = ["SCRATCH_DIR"]
    env = trainer_env(MLFLOW_TRACKING_URI="http://mlflow:5000")
    assert not set(WORKER_SECRETS) & set(env)
    assert env["PATH"] == os.environ["PATH"] and env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert env["HF_HUB_OFFLINE"] == "1" and env["MLFLOW_TRACKING_TOKEN"] == "mlflow-token"
    assert env["OMP_NUM_THREADS"] == "4" and env["LC_ALL"] == "C.UTF-8" and env["NCCL_DEBUG"] == "INFO"
    assert env["SCRATCH_DIR"] == "/scratch"  # the operator's own addition
    assert env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000" and env["FLYWHEEL_ENV_ENTRY_POINTS"] == "0"
    assert env["FLYWHEEL_OUTBOUND_ALLOWLIST"] == ",".join(settings.FLYWHEEL_OUTBOUND_ALLOWLIST)
    if "DATABASE_URL" in os.environ:
        assert "DATABASE_URL" not in env
