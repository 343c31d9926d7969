"""Typed answers of the Flywheel API: plain dataclasses built from the JSON the server sends.

Every answer keeps the whole JSON object in `raw`, so a field the server added after this client was written is
still there to read; fields this client knows are typed attributes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

T = TypeVar("T", bound="Answer")

# A job in one of these states changes no more.
JOB_FINISHED = frozenset({"succeeded", "failed", "cancelled"})


@dataclass
class Answer:
    """Base of every answer: `from_dict` takes the fields it knows and keeps the rest in `raw`.

    `nested` names the fields that hold answers of their own (a list of them, or one): their type."""

    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    nested: ClassVar[dict[str, type[Answer]]] = {}

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        known = {f.name for f in dataclasses.fields(cls)} - {"raw"}
        values = {name: cls._convert(name, data[name]) for name in known if name in data}
        return cls(raw=data, **values)

    @classmethod
    def _convert(cls, name: str, value: Any) -> Any:
        kind = cls.nested.get(name)
        if kind is None or value is None:
            return value
        if isinstance(value, list):
            return [kind.from_dict(v) for v in value]
        return kind.from_dict(value)


@dataclass
class FieldError(Answer):
    field: str = ""
    message: str = ""

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


@dataclass
class Rejection(Answer):
    """A record the server refused: `index` is its position in what was sent (the file's line for JSONL)."""

    index: int = 0
    external_id: str | int | None = None
    errors: list[FieldError] = field(default_factory=list)

    @classmethod
    def _convert(cls, name: str, value: Any) -> Any:
        if name == "errors":
            return [FieldError.from_dict(e) if isinstance(e, dict) else FieldError(message=str(e)) for e in value]
        return value

    def __str__(self) -> str:
        who = f"record {self.index}" + (f" ({self.external_id})" if self.external_id is not None else "")
        return f"{who}: " + "; ".join(map(str, self.errors))


@dataclass
class IngestedRecord(Answer):
    index: int = 0
    external_id: str | None = None
    id: int | None = None


@dataclass
class IngestResult(Answer):
    """What became of each record of one `ingest` call, however many requests it took."""

    accepted: int = 0
    created: int = 0
    updated: int = 0
    rejected: list[Rejection] = field(default_factory=list)
    records: list[IngestedRecord] = field(default_factory=list)

    nested: ClassVar[dict[str, type[Answer]]] = {"rejected": Rejection, "records": IngestedRecord}

    @property
    def ok(self) -> bool:
        return not self.rejected


@dataclass
class Collection(Answer):
    """A task set (`kind` None) or an eval suite (`holdout` or `regression`)."""

    id: int = 0
    name: str = ""
    kind: str | None = None
    description: str = ""
    size: int = 0
    last_version: int | None = None
    created_at: str | None = None


@dataclass
class CollectionVersion(Answer):
    """A frozen version of a task set or an eval suite: its `number` is what a training job names."""

    number: int = 0
    content_hash: str = ""
    size: int = 0
    note: str = ""
    created_at: str | None = None
    frozen_at: str | None = None
    export_url: str = ""


@dataclass
class Promotion(Answer):
    """A trajectory promoted into a task set or an eval suite (`saved`), or a dry run's checks."""

    saved: bool = False
    item: dict[str, Any] | None = None
    version: CollectionVersion | None = None
    checks: dict[str, Any] = field(default_factory=dict)
    row: dict[str, Any] | None = None

    nested: ClassVar[dict[str, type[Answer]]] = {"version": CollectionVersion}


@dataclass
class Cluster(Answer):
    id: int = 0
    size: int = 0
    label: str = ""
    trajectory_ids: list[int] = field(default_factory=list)
    representative_ids: list[int] = field(default_factory=list)
    signals: dict[str, int] = field(default_factory=dict)
    terms: list[str] = field(default_factory=list)
    suggested_category: str = ""
    target_mode_id: int | None = None
    decision: str = "pending"
    failure_mode_id: int | None = None


@dataclass
class Clustering(Answer):
    """A clustering run and, once `status` is `done`, its suggestions (`clusters`)."""

    id: int = 0
    status: str = ""
    stage: str = ""
    progress: int = 0
    total: int = 0
    error: str = ""
    clusters: list[Cluster] = field(default_factory=list)

    nested: ClassVar[dict[str, type[Answer]]] = {"clusters": Cluster}


@dataclass
class GateDecision(Answer):
    """The gate's verdict on a candidate: each rule with both sides' values and why it passed or not."""

    id: int = 0
    passed: bool = False
    rules: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""

    @property
    def failing(self) -> list[dict[str, Any]]:
        return [rule for rule in self.rules if not rule.get("passed")]

    def summary(self) -> str:
        if self.error:
            return f"the gate could not judge: {self.error}"
        lines = ["passed" if self.passed else "refused"]
        for rule in self.rules:
            mark = "ok  " if rule.get("passed") else "FAIL"
            lines.append(f"  {mark} {rule.get('name')}: production {rule.get('production')}, "
                         f"candidate {rule.get('candidate')}" + (f" ({rule['detail']})" if rule.get("detail") else ""))
        return "\n".join(lines)


@dataclass
class TrainingJob(Answer):
    """A training job: its state and progress, the versions it trains and is judged on, and, once it
    succeeded, its candidate model version and the gate's decision."""

    id: int = 0
    status: str = ""
    algorithm: str = ""
    task_set: int | None = None
    task_set_version: int | None = None
    holdout: int | None = None
    holdout_version: int | None = None
    regression: int | None = None
    regression_version: int | None = None
    base_version: int | None = None
    step: int = 0
    max_steps: int = 0
    progress: float = 0.0
    error: str = ""
    failed_step: int | None = None
    candidate_version: int | None = None
    gate: GateDecision | None = None
    last_metrics: dict[str, Any] | None = None
    created_at: str | None = None
    finished_at: str | None = None
    # The device time it held: device (gpu or cpu), devices, wall_seconds, device_hours, gpu_hours.
    usage: dict[str, Any] = field(default_factory=dict)

    nested: ClassVar[dict[str, type[Answer]]] = {"gate": GateDecision}

    @property
    def finished(self) -> bool:
        return self.status in JOB_FINISHED


@dataclass
class ModelVersion(Answer):
    version: int = 0
    base_model: str = ""
    adapter_path: str | None = None
    adapter_sha256: str | None = None
    lineage: dict[str, Any] = field(default_factory=dict)
    aliases: list[str] = field(default_factory=list)
    gate: GateDecision | None = None
    created_at: str | None = None

    nested: ClassVar[dict[str, type[Answer]]] = {"gate": GateDecision}


@dataclass
class LiveMetrics(Answer):
    """A version's live metrics on production traffic over a window (`GET /model-versions/{n}/live`).

    `metrics`: trajectories, failures, failure_rate, triaged, tokens_per_trajectory, latency_ms_per_trajectory
    (and whatever other live measures add); `signals`: each triage signal's count and rate; `series`: per hour
    (per day for 30d), `t` in Unix seconds; `cost`: per 1,000 requests, tokens' cost at the version's price
    (`token_cost_per_1k`, None without a price) and GPU-seconds (`gpu_seconds_per_1k`)."""

    version: int = 0
    window: str = ""
    names: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    cost: dict[str, Any] = field(default_factory=dict)
    signals: list[dict[str, Any]] = field(default_factory=list)
    series: dict[str, Any] = field(default_factory=dict)

    @property
    def failure_rate(self) -> float | None:
        return self.metrics.get("failure_rate")


@dataclass
class VersionName(Answer):
    """A model_version string mapped to a version."""

    name: str = ""
    version: int = 0
    created_at: str | None = None
    created_by: str | None = None


@dataclass
class Production(Answer):
    """What the `production` alias points at."""

    project: str = ""
    version: int = 0
    base_model: str = ""
    adapter_path: str | None = None
    adapter_sha256: str | None = None
    since: str | None = None
    reason: str = ""


@dataclass
class AliasMove(Answer):
    """One move of an alias (a promotion, a rollback): who, when, from, to and why."""

    alias: str = ""
    kind: str = ""
    from_version: int | None = None
    to_version: int = 0
    user: str | None = None
    actor: str = ""  # the rule that moved it when no person did: gate, canary or watch
    evidence: dict[str, Any] = field(default_factory=dict)
    weight: float | None = None  # a canary's share of traffic after the move
    reason: str = ""
    at: str | None = None


@dataclass
class LiveCheck(Answer):
    """A canary decision or a watch after a promotion: its status and the evidence of its last look."""

    id: int = 0
    kind: str = ""  # canary | watch
    status: str = ""  # running, promoted, rolled_back, flagged, passed, expired, ended
    subject_version: int = 0
    baseline_version: int = 0
    started_at: str | None = None
    ends_at: str | None = None
    rules: dict[str, Any] = field(default_factory=dict)
    evidence: dict[str, Any] = field(default_factory=dict)
    looks: int = 0
    decided_at: str | None = None
    decided_by: str | None = None

    def summary(self) -> str:
        look = self.evidence.get("look") or {}
        why = look.get("reason") or self.evidence.get("reason") or ""
        return (f"{self.kind} of version {self.subject_version} against {self.baseline_version}: {self.status}"
                + (f" ({why})" if why else ""))


@dataclass
class CanaryStart(Answer):
    move: AliasMove | None = None
    check: LiveCheck | None = None
    nested: ClassVar[dict[str, type[Answer]]] = {"move": AliasMove, "check": LiveCheck}


@dataclass
class ServerVersion(Answer):
    api_version: str = ""
    platform_version: str | None = None


@dataclass
class Status(Answer):
    """`Flywheel.status()`: production first, then the candidate, recent moves and active jobs."""

    production: Production | None = None
    candidate: int | None = None
    history: list[AliasMove] = field(default_factory=list)
    jobs: list[TrainingJob] = field(default_factory=list)
