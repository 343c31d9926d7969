"""`Flywheel(url, key)`: the platform's API as typed methods, for scripts, CI and agents.

The key decides the project, as on the API: no method names a project. Task sets and eval suites are named by
their id and a version number, as the API does, so a script never needs a database id it cannot see."""

from __future__ import annotations

import gzip
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TextIO
from urllib.parse import urlsplit

from flywheel_client import __version__
from flywheel_client._http import Transport
from flywheel_client.errors import ApiError, FlywheelError, IncompatibleServer
from flywheel_client.types import (
    JOB_FINISHED,
    AliasMove,
    CanaryStart,
    Clustering,
    Collection,
    CollectionVersion,
    FieldError,
    GateDecision,
    IngestedRecord,
    IngestResult,
    LiveCheck,
    LiveMetrics,
    ModelVersion,
    Production,
    Promotion,
    Rejection,
    ServerVersion,
    Status,
    TrainingJob,
    VersionName,
)

API = "/api/v1"
API_MAJOR = "1"  # the major version of the API this client speaks
# Defaults under the server's (FLYWHEEL_MAX_BATCH_RECORDS 5000, FLYWHEEL_MAX_REQUEST_BYTES 20 MiB); a server that
# says its own limits in /api/v1/version is taken at its word, and a 413 splits the batch in two.
BATCH_RECORDS = 1000
BATCH_BYTES = 8 * 1024 * 1024
GZIP_OVER_BYTES = 64 * 1024


def server_url(url: str | None) -> str:
    """`url`, else FLYWHEEL_URL, checked at once: an address without http:// or https:// would otherwise be
    sent as a protocol of its own name ("localhost:8031" reads as the scheme "localhost") and retried in vain."""
    source = "url=" if url else "FLYWHEEL_URL"
    url = url or os.environ.get("FLYWHEEL_URL")
    if not url:
        raise FlywheelError("No server: pass url= or set FLYWHEEL_URL (e.g. https://flywheel.example.com).")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        hint = url.strip().split("://", 1)[-1].lstrip("/")
        raise FlywheelError(f"{source} {url!r} is not an http:// or https:// address of a server: "
                            f"write it in full, e.g. http://{hint or 'localhost:8000'}")
    return url.strip().rstrip("/")


class Flywheel:
    """A client of one Flywheel server, with one project API key.

    `url` and `key` default to FLYWHEEL_URL and FLYWHEEL_API_KEY. The server's API version is checked on the
    first call: a server of another major version is refused with IncompatibleServer."""

    def __init__(self, url: str | None = None, key: str | None = None, *, timeout: float = 30.0,
                 max_retries: int = 5, max_wait_s: float = 60.0, batch_records: int | None = None,
                 batch_bytes: int | None = None, **transport_options: Any) -> None:
        self.url = server_url(url)
        self.key = key if key is not None else os.environ.get("FLYWHEEL_API_KEY")
        self._http = Transport(self.url, self.key, timeout=timeout, max_retries=max_retries, max_wait_s=max_wait_s,
                               **transport_options)
        self._batch_records = batch_records
        self._batch_bytes = batch_bytes
        self._server: ServerVersion | None = None

    # --- plumbing -------------------------------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Flywheel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **options: Any) -> Any:
        self.server_version()
        response = self._http.request(method, API + path, **options)
        return response.json() if response.content else None

    def server_version(self) -> ServerVersion:
        """The server's API version (checked once per client; IncompatibleServer on another major version).

        Read from `GET /api/v1/version`; a server without it is read from its OpenAPI schema's info.version."""
        if self._server is not None:
            return self._server
        response = self._http.request("GET", API + "/version", ok=(404,))
        if response.status_code == 404:
            schema = self._http.request("GET", API + "/openapi.json", ok=(404,))
            if schema.status_code == 404:
                raise IncompatibleServer(f"{self.url} has no Flywheel API at {API}/ (neither {API}/version nor "
                                         f"{API}/openapi.json): check FLYWHEEL_URL.")
            info = self._json_object(schema).get("info") or {}
            data = {"api_version": str(info.get("version", "")), "platform_version": None}
        else:
            data = self._json_object(response)
        server = ServerVersion.from_dict(data)
        major = str(server.api_version).split(".")[0]
        if major != API_MAJOR:
            raise IncompatibleServer(
                f"{self.url} speaks version {server.api_version or '(none)'} of the Flywheel API; "
                f"flywheel-client {__version__} speaks version {API_MAJOR}. Install the client that matches "
                f"the server (platform {server.platform_version or 'unknown'}).")
        self._server = server
        return server

    def _json_object(self, response: Any) -> dict[str, Any]:
        try:
            data = response.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise IncompatibleServer(f"{self.url}{response.request.url.path} is not the Flywheel API (its answer is "
                                     "not a JSON object): check FLYWHEEL_URL.")
        return data

    def _limit(self, name: str, default: int) -> int:
        raw = self.server_version().raw
        value = raw.get(name, (raw.get("limits") or {}).get(name))
        return int(value) if isinstance(value, int) and value > 0 else default

    # --- trajectories ---------------------------------------------------------------------------------------------

    def ingest(self, records: Iterable[Mapping[str, Any]]) -> IngestResult:
        """Send trajectories (the platform's contract: external_id, messages, tools, outcome, ...), in as many
        requests as the server's limits ask for. Each record's fate is in the answer; a rejected record's
        `index` is its position in `records`. Replaying an external_id updates its trajectory."""
        max_records = min(self._batch_records or BATCH_RECORDS, self._limit("max_batch_records", 5000))
        max_bytes = min(self._batch_bytes or BATCH_BYTES, self._limit("max_request_bytes", 20 * 1024 * 1024) // 2)
        total = IngestResult()
        batch: list[tuple[int, bytes]] = []
        size = 0
        for index, record in enumerate(records):
            line = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
            if batch and (len(batch) >= max_records or size + len(line) > max_bytes):
                self._send_batch(batch, total)
                batch, size = [], 0
            batch.append((index, line))
            size += len(line)
        if batch:
            self._send_batch(batch, total)
        total.rejected.sort(key=lambda r: r.index)
        total.records.sort(key=lambda r: r.index)
        return total

    def _send_batch(self, batch: list[tuple[int, bytes]], total: IngestResult) -> None:
        body = b"".join(line for _, line in batch)
        headers = {"Content-Type": "application/x-ndjson"}
        if len(body) > GZIP_OVER_BYTES:
            body = gzip.compress(body, compresslevel=5)
            headers["Content-Encoding"] = "gzip"
        try:
            # Replaying a batch is safe: an external_id already stored is updated, never duplicated.
            data = self._call("POST", "/trajectories", content=body, headers=headers, ok=(422,))
        except ApiError as exc:
            if exc.status_code != 413:
                raise
            if len(batch) > 1:
                half = len(batch) // 2
                self._send_batch(batch[:half], total)
                self._send_batch(batch[half:], total)
                return
            index = batch[0][0]
            total.rejected.append(Rejection(index=index, external_id=_external_id(batch[0][1]),
                                            errors=[FieldError(message=str(exc.detail))]))
            return
        # The server numbers the lines of this request from 0; give each back its place in the caller's records.
        positions = [index for index, _ in batch]
        total.accepted += data.get("accepted", 0)
        total.created += data.get("created", 0)
        total.updated += data.get("updated", 0)
        for rejected in data.get("rejected", []):
            rejection = Rejection.from_dict(rejected)
            rejection.index = positions[rejection.index]
            total.rejected.append(rejection)
        for record in data.get("records", []):
            ingested = IngestedRecord.from_dict(record)
            ingested.index = positions[ingested.index]
            total.records.append(ingested)

    def _pages(self, path: str, params: Mapping[str, Any] | None = None) -> Iterator[dict[str, Any]]:
        """Every item of a list endpoint: a plain JSON array, or pages of `items` followed by `next_cursor`."""
        query = {k: v for k, v in (params or {}).items() if v is not None}
        while True:
            page = self._call("GET", path, params=query)
            if isinstance(page, list):
                yield from page
                return
            yield from page["items"]
            if not page.get("next_cursor"):
                return
            query["cursor"] = page["next_cursor"]

    def trajectories(self, **filters: Any) -> Iterator[dict[str, Any]]:
        """Every trajectory matching the filters of `GET /api/v1/trajectories` (outcome, agent, external_id,
        signal, q, ...), newest first, page after page."""
        return self._pages("/trajectories", filters)

    def trajectory(self, trajectory_id: int) -> dict[str, Any]:
        return self._call("GET", f"/trajectories/{trajectory_id}")

    # --- clustering -----------------------------------------------------------------------------------------------

    def start_clustering(self, **run_filter: Any) -> Clustering:
        """Start clustering the project's failures (days, limit, outcome, unassigned, agent, signal)."""
        created = self._call("POST", "/clusterings", json=run_filter, idempotent=False)
        return self.clustering(created["id"])

    def clustering(self, clustering_id: int) -> Clustering:
        """A clustering run; once `status` is `done`, its suggestions are `clusters`."""
        return Clustering.from_dict(self._call("GET", f"/clusterings/{clustering_id}"))

    def wait_clustering(self, clustering_id: int, *, timeout: float | None = None, poll_s: float = 1.0) -> Clustering:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            run = self.clustering(clustering_id)
            if run.status in ("done", "failed"):
                return run
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"Clustering {clustering_id} is still {run.status} after {timeout:.0f}s.")
            time.sleep(poll_s)

    def decide(self, suggestion_id: int, action: str, **fields: Any) -> dict[str, Any]:
        """Accept, merge (failure_mode_id=...), split or dismiss a suggestion, as a reviewer does on the page."""
        return self._call("POST", f"/clusterings/suggestions/{suggestion_id}/decision",
                          json={"action": action, **fields}, idempotent=False)

    # --- task sets and eval suites --------------------------------------------------------------------------------

    def task_sets(self) -> list[Collection]:
        return [Collection.from_dict(c) for c in self._pages("/task-sets")]

    def task_set_versions(self, task_set_id: int) -> list[CollectionVersion]:
        """Newest first."""
        return [CollectionVersion.from_dict(v) for v in self._pages(f"/task-sets/{task_set_id}/versions")]

    def create_task_set(self, name: str, description: str = "") -> Collection:
        return Collection.from_dict(self._call("POST", "/task-sets", json={"name": name, "description": description},
                                               idempotent=False))

    def eval_suites(self) -> list[Collection]:
        return [Collection.from_dict(c) for c in self._pages("/eval-suites")]

    def eval_suite_versions(self, suite_id: int) -> list[CollectionVersion]:
        """Newest first."""
        return [CollectionVersion.from_dict(v) for v in self._pages(f"/eval-suites/{suite_id}/versions")]

    def create_eval_suite(self, name: str, kind: str = "regression", description: str = "") -> Collection:
        return Collection.from_dict(self._call("POST", "/eval-suites", json={
            "name": name, "kind": kind, "description": description}, idempotent=False))

    def promote_to_task_set(self, task_set_id: int, *, trajectory_id: int | None = None,
                            external_id: str | None = None, **fields: Any) -> Promotion:
        """Turn a trajectory (by id, or by the external_id the agent gave it) into a task; `fields` are those of
        the API (message_index, expect, expected_calls, env_type, dry_run, ...). A refusal raises ApiError (422)
        whose `body` holds the field errors and both verifier checks."""
        return self._promote(f"/task-sets/{task_set_id}", trajectory_id, external_id, fields)

    def promote_to_eval_suite(self, suite_id: int, *, trajectory_id: int | None = None,
                              external_id: str | None = None, **fields: Any) -> Promotion:
        """As `promote_to_task_set`, into an eval suite (a regression or holdout case)."""
        return self._promote(f"/eval-suites/{suite_id}", trajectory_id, external_id, fields)

    def _promote(self, collection: str, trajectory_id: int | None, external_id: str | None,
                 fields: dict[str, Any]) -> Promotion:
        if (trajectory_id is None) == (external_id is None):
            raise ValueError("Name the trajectory by trajectory_id or by external_id (one of them).")
        who = {"trajectory_id": trajectory_id} if trajectory_id is not None else {"external_id": external_id}
        return Promotion.from_dict(self._call("POST", f"{collection}/promotions", json={**fields, **who},
                                              idempotent=False))

    # --- training -------------------------------------------------------------------------------------------------

    def _latest(self, versions: list[CollectionVersion], what: str) -> int:
        if not versions:
            raise FlywheelError(f"{what} has no version yet: promote a trajectory into it first.")
        return versions[0].number

    def start_training(self, task_set: int, task_set_version: int | None = None, *, holdout: int | None = None,
                       holdout_version: int | None = None, regression: int | None = None,
                       regression_version: int | None = None, config: Mapping[str, Any] | None = None,
                       algorithm: str = "grpo", confirm: bool = True) -> TrainingJob:
        """Start a training job on a task set's version (its latest when not given), judged on the holdout and
        regression suites' versions (their latest when not given). `config` holds GRPOConfig fields; the
        server names each wrong one (ApiError 422). With `confirm` (the default) training starts as soon as
        production is measured."""
        body: dict[str, Any] = {
            "task_set": task_set,
            "task_set_version": task_set_version or self._latest(self.task_set_versions(task_set),
                                                                 f"Task set {task_set}"),
            "algorithm": algorithm, "config": dict(config or {}), "confirm": confirm,
        }
        for name, suite, number in (("holdout", holdout, holdout_version),
                                    ("regression", regression, regression_version)):
            if suite is not None:
                body[name] = suite
                body[f"{name}_version"] = number or self._latest(self.eval_suite_versions(suite), f"Eval suite {suite}")
        created = self._call("POST", "/training-jobs", json=body, idempotent=False)
        return self.training_job(created["id"])

    def training_job(self, job_id: int) -> TrainingJob:
        return TrainingJob.from_dict(self._call("GET", f"/training-jobs/{job_id}"))

    def training_jobs(self, status: str | None = None) -> list[TrainingJob]:
        """The project's jobs, newest first (those in `status` only, when given)."""
        return [TrainingJob.from_dict(j) for j in self._pages("/training-jobs", {"status": status})]

    def cancel(self, job_id: int) -> TrainingJob:
        self._call("POST", f"/training-jobs/{job_id}/cancel", json={}, idempotent=False)
        return self.training_job(job_id)

    def curves(self, job_id: int) -> dict[str, Any]:
        """The job's curves: train metrics per step and holdout metrics per evaluation."""
        return self._call("GET", f"/training-jobs/{job_id}/curves")

    def wait(self, job_id: int, *, timeout: float | None = None, poll_s: float = 2.0,
             progress: bool | TextIO | None = None, until: Iterable[str] = JOB_FINISHED) -> TrainingJob:
        """Poll the job until its status is one of `until` (succeeded, failed or cancelled; add `ready` for a job
        started without `confirm`), and return it. `progress`: a line redrawn on stderr when it is a terminal
        (True: always; a file: there). TimeoutError after `timeout` seconds; the job goes on."""
        stop = frozenset(until)
        out = _progress_stream(progress)
        deadline = None if timeout is None else time.monotonic() + timeout
        line = _ProgressLine(out) if out is not None else None
        while True:
            job = self.training_job(job_id)
            if line is not None:
                line.draw(job, last=job.status in stop)
            if job.status in stop:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"Training job {job_id} is still {job.status} after {timeout:.0f}s.")
            time.sleep(poll_s)

    # --- the gate and the registry --------------------------------------------------------------------------------

    def gate_report(self, *, job_id: int | None = None, version: int | None = None) -> GateDecision | None:
        """The gate's decision on a job's candidate, or the latest on a model version; None before there is one."""
        if (job_id is None) == (version is None):
            raise ValueError("Name job_id or version (one of them).")
        return self.training_job(job_id).gate if job_id is not None else self.model_version(version).gate

    def model_version(self, number: int) -> ModelVersion:
        return ModelVersion.from_dict(self._call("GET", f"/model-versions/{number}"))

    def live(self, version: int, window: str = "24h") -> LiveMetrics:
        """A version's live metrics on production traffic over `window`: 1h, 24h, 7d or 30d."""
        return LiveMetrics.from_dict(self._call("GET", f"/model-versions/{version}/live", params={"window": window}))

    def version_names(self) -> tuple[list[VersionName], list[dict[str, Any]]]:
        """The model_version strings mapped to versions, and the recent strings that name none (with counts)."""
        answer = self._call("GET", "/version-names")
        return [VersionName.from_dict(n) for n in answer["names"]], answer["unmapped"]

    def map_version_name(self, name: str, version: int) -> VersionName:
        """Count the traffic carrying `name` as `model_version` for `version` (needs `promote`)."""
        return VersionName.from_dict(self._call("POST", "/version-names", json={"name": name, "version": version}))

    def set_price(self, version: int, *, input_per_m: float | None = None, output_per_m: float | None = None,
                  on: str = "version") -> dict[str, Any]:
        """Set a version's price per 1M input and output tokens (`on="base"`: its base model's, which every
        version of that base without its own uses); None leaves a price as it is. Needs `promote`."""
        body: dict[str, Any] = {"on": on}
        if input_per_m is not None:
            body["price_input_per_m"] = input_per_m
        if output_per_m is not None:
            body["price_output_per_m"] = output_per_m
        return self._call("PUT", f"/model-versions/{version}/price", json=body)

    def unmap_version_name(self, name: str) -> None:
        self._call("DELETE", "/version-names", params={"name": name})

    def promote(self, version: int, reason: str = "") -> AliasMove:
        """Move `production` to a version that passed the gate (ApiError 409 with the failing rules otherwise)."""
        return AliasMove.from_dict(self._call("POST", f"/model-versions/{version}/promote", json={"reason": reason},
                                              idempotent=False))

    def rollback(self, reason: str = "", to_version: int | None = None) -> AliasMove:
        """Move `production` back to the version it replaced, or to `to_version` (one that served before)."""
        body: dict[str, Any] = {"reason": reason}
        if to_version is not None:
            body["to_version"] = to_version
        return AliasMove.from_dict(self._call("POST", "/models/production/rollback", json=body, idempotent=False))

    def canary(self, version: int, *, weight: float | None = None, reason: str = "") -> CanaryStart:
        """Serve `version` (it must have passed the gate against production) to a share of traffic beside
        production: `weight` (default: the project's canary weight, 10%). The canary decision then watches it."""
        body: dict[str, Any] = {"reason": reason}
        if weight is not None:
            body["weight"] = weight
        return CanaryStart.from_dict(self._call("POST", f"/model-versions/{version}/canary", json=body,
                                                idempotent=False))

    def canary_promote(self, reason: str = "") -> AliasMove:
        """Move the canary's version to all of the traffic (production), as a person deciding."""
        return AliasMove.from_dict(self._call("POST", "/canary/promote", json={"reason": reason}, idempotent=False))

    def canary_rollback(self, reason: str = "") -> AliasMove:
        """End the canary: production takes all of the traffic again."""
        return AliasMove.from_dict(self._call("POST", "/canary/rollback", json={"reason": reason}, idempotent=False))

    def live_checks(self, limit: int = 50) -> list[LiveCheck]:
        """Canary decisions and watches after promotions, newest first, each with its last look's evidence."""
        return [LiveCheck.from_dict(c) for c in self._call("GET", "/live-checks", params={"limit": limit})]

    def live_rules(self) -> dict[str, Any]:
        return self._call("GET", "/live-rules")

    def set_live_rules(self, **rules: Any) -> dict[str, Any]:
        """Set some of the canary's and the watch's rules (canary_weight, canary_min_per_arm, canary_max_hours,
        canary_auto, canary_tolerance, watch_hours, watch_trajectories, watch_rollback, watch_holdback,
        notify_emails); needs `promote`."""
        return self._call("PUT", "/live-rules", json=rules)

    def serving(self) -> dict[str, Any]:
        """What serves now: production's version and adapter name, and the canary's with its weight."""
        return self._call("GET", "/serving")

    def production(self) -> Production | None:
        """What serves now; None while the project has no model."""
        try:
            return Production.from_dict(self._call("GET", "/models/production"))
        except ApiError as exc:
            if exc.status_code == 404:
                return None
            raise

    def history(self) -> list[AliasMove]:
        """Every move of `production` and `candidate`, newest first."""
        return [AliasMove.from_dict(m) for m in self._pages("/models/history")]

    def status(self) -> Status:
        """Production first, then the current candidate, the latest moves and the jobs not finished."""
        production = self.production()
        history = self.history()
        candidate = next((m.to_version for m in history if m.alias == "candidate"), None)
        try:
            jobs = [j for j in self.training_jobs() if not j.finished]
        except ApiError as exc:  # a server without the job list still has a status
            if exc.status_code not in (404, 405):
                raise
            jobs = []
        return Status(production=production, candidate=candidate, history=history[:5], jobs=jobs)


def _external_id(line: bytes) -> str | None:
    try:
        value = json.loads(line).get("external_id")
    except (ValueError, AttributeError):
        return None
    return None if value is None else str(value)


def _progress_stream(progress: bool | TextIO | None) -> TextIO | None:
    if progress is None:
        return sys.stderr if sys.stderr.isatty() else None
    if progress is True:
        return sys.stderr
    return progress or None


class _ProgressLine:
    """One line redrawn in place (`\\r`) on a terminal; elsewhere a line whenever the status changes."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = getattr(out, "isatty", lambda: False)()
        self.last = ""
        self.status = ""

    def draw(self, job: TrainingJob, *, last: bool) -> None:
        width = 24
        done = int(round(width * max(0.0, min(1.0, job.progress or 0.0))))
        line = (f"job {job.id} {job.status:<10} [{'#' * done}{'.' * (width - done)}] "
                f"{100 * (job.progress or 0):3.0f}%  step {job.step}/{job.max_steps or '?'}")
        if self.tty:
            self.out.write("\r" + line.ljust(len(self.last)) + ("\n" if last else ""))
        elif job.status != self.status:
            self.out.write(line + "\n")
        self.out.flush()
        self.last, self.status = line, job.status
