"""Progress reporting: JSON-lines events on stdout for the platform, and MLflow runs for people.

Events are one JSON object a line, `{"event": "step"|"eval"|"checkpoint"|"done"|"error"|..., ...}`, as
`trainer.events` writes and the platform reads them (one contract, one list of kinds). The CLI
moves everything else that writes to stdout (libraries, C extensions) onto stderr, so stdout stays
parseable line by line. MLflow is best effort: a tracking failure is reported, never kills a run.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from pathlib import Path
from typing import Any, TextIO

from trainer import events


class EventLog:
    """Writes events as JSON lines; keeps them in memory too (tests, the demo's summary)."""

    def __init__(self, stream: TextIO | None = None, keep: bool = True) -> None:
        self.stream = stream
        self.keep = keep
        self.events: list[dict[str, Any]] = []

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = events.record(event, **fields)  # an unknown kind raises: the platform would refuse it
        if self.keep:
            self.events.append(record)
        if self.stream is not None:
            self.stream.write(json.dumps(record) + "\n")
            self.stream.flush()
        return record


def claim_stdout() -> TextIO:
    """Return a private handle on the real stdout and point fd 1 (and sys.stdout) at stderr."""
    sys.stdout.flush()
    events_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(events_fd, "w", buffering=1)


def error_message(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def log_traceback() -> None:
    traceback.print_exc(file=sys.stderr)


def default_tracking_uri(job_dir: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(job_dir / 'mlflow.db').resolve()}"


class Tracker:
    """One MLflow run per job (resumed by id when the job is retried). Disabled -> every call is a no-op."""

    def __init__(self, *, enabled: bool, job_dir: Path, tracking_uri: str | None = None,
                 experiment_name: str = "flywheel", run_name: str | None = None,
                 run_id: str | None = None) -> None:
        self.enabled = enabled
        self.error: str | None = None
        self.run_id: str | None = None
        if not enabled:
            return
        try:
            import mlflow

            self.mlflow = mlflow
            uri = tracking_uri or default_tracking_uri(job_dir)
            mlflow.set_tracking_uri(uri)
            experiment = mlflow.get_experiment_by_name(experiment_name)
            if experiment is None:
                local = uri.startswith(("sqlite:", "file:")) or "://" not in uri
                # A local store would put artifacts in ./mlruns of whatever cwd; keep them in the job dir.
                location = (job_dir / "mlartifacts").resolve().as_uri() if local else None
                experiment_id = mlflow.create_experiment(experiment_name, artifact_location=location)
            else:
                experiment_id = experiment.experiment_id
            run = mlflow.start_run(run_id=run_id, experiment_id=None if run_id else experiment_id,
                                   run_name=run_name)
            self.run_id = run.info.run_id
        except Exception as exc:  # noqa: BLE001 (tracking must never take a run down)
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.error = f"mlflow: {error_message(exc)}"
        print(self.error, file=sys.stderr)
        self.enabled = False

    def log_params(self, params: dict[str, Any]) -> None:
        if not self.enabled:
            return
        try:
            flat = {k: json.dumps(v) if isinstance(v, list | dict) else v for k, v in params.items()}
            self.mlflow.log_params({k: str(v)[:500] for k, v in flat.items()})
        except Exception as exc:  # noqa: BLE001
            # Params are immutable in MLflow: a resumed run re-logging them may fail; that is fine.
            print(f"mlflow params: {error_message(exc)}", file=sys.stderr)

    def log_metrics(self, metrics: dict[str, Any], step: int, prefix: str = "") -> None:
        if not self.enabled:
            return
        numeric = {
            f"{prefix}{k}": float(v) for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(float(v))
        }
        try:
            self.mlflow.log_metrics(numeric, step=step)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def log_artifacts(self, path: Path, artifact_path: str) -> None:
        if not self.enabled:
            return
        try:
            self.mlflow.log_artifacts(str(path), artifact_path=artifact_path)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def end(self, status: str = "FINISHED") -> None:
        if not self.enabled:
            return
        try:
            self.mlflow.end_run(status=status)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
