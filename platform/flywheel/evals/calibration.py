"""Verifier calibration: does a verifier agree with the outcomes reviewers labeled?

The field's advice is to run 50-100 outputs through a reward before trusting it. A verifier (a case's, a
task's, or one written in the form) scores one turn of each labeled trajectory, the turn it is about:
- a case's or task's verifier, the turn it was promoted at (its message index; the assistant turn at that
  index of each trajectory, or the nearest one before it), in the case's environment: a replay case replays
  each trajectory's own recorded calls from that turn on, a workplace case starts from its initial state;
- a written verifier, the turn promotion would start from (`promotion.default_message_index`: a flagged turn,
  else the last turn that made calls), single-turn.
Scoring goes through the trainer's environment for that row (`promotion.score_episode`), as training and
eval runs score it: the trajectory's assistant turns from there on are the episode's turns, with the
trajectory's own declared tools. Never "any turn passes": that would lean every verdict toward "pass".
Passing is compared with the reviewer's label (success / failure): a confusion matrix, precision and recall
of "passes" against "success", and Cohen's kappa, from scikit-learn.

A verifier calibration runs on a worker (`calibration_start`, then the task's `calibration_run_process`),
under its time limit and one at a time per project: it runs the trainer's verifiers on agent data (tool
schemas, patterns) for up to MAX_TRAJECTORIES trajectories, which has no place in a web request. The page
and the API start one and then read its row (`VerifierCalibration`): progress, then figures or why it failed.

Triage's detectors are calibrated the same way (`detector_calibrate`): a detector "says failure" on a
trajectory when it left a signal there; its precision is the share of the labeled trajectories it flagged
that reviewers call failures, its recall the share of the failures it flagged, each with its 95% Wilson
interval. Read from the stored signals, so the figures are those of the triage the queue shows (a re-run
brings them up to the current policy).

Which labels make such a figure mean something: labels the detectors never saw, written by a person. An
outcome a tool_call verifier recorded (the workplace demo's plays) is the same check the call-reading
detectors run, so their agreement with it holds by construction; a detector revised after looking at its
precision on a set is measured in-sample there. `detector_reference` measures the detectors against a set
labeled by hand before they ran on it (`tests/platform/trajectories/data/triage_reference.jsonl`): per
signal, against the person's judgement that the signal applies, and "any signal" against the outcome.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Count, F, Q, Value
from django.db.models.functions import Coalesce, NullIf
from django.utils import timezone

from flywheel import outbox, runs, timelimits
from flywheel.accounts.models import Project
from flywheel.evals import promotion
from flywheel.evals import rows as row_shape
from flywheel.evals.calibration_models import CALIBRATION_ACTIVE, CalibrationStatus, VerifierCalibration
from flywheel.evals.kinds import train_side
from flywheel.evals.models import EnvType
from flywheel.registry.sequential import wilson
from flywheel.supervise import Refused
from flywheel.trajectories.models import Outcome, SignalKind, Trajectory, TriageSignal
from trainer.verifiers import SpecError, validate_spec

logger = logging.getLogger(__name__)

MIN_LABELED = 50  # under this the page warns: too few labels to trust the figures
MAX_TRAJECTORIES = 2000
PROGRESS_EVERY = 25  # trajectories scored between two writes of a calibration's progress (its heartbeat)


@dataclass
class Disagreement:
    trajectory_id: int
    label: str  # the reviewer's outcome
    passed: bool  # the verifier's verdict
    failure: str | None
    turn: int | None  # the assistant message scored


@dataclass
class Calibration:
    n: int = 0
    # matrix[label][verdict]: label in (success, failure), verdict in (pass, fail)
    matrix: dict[str, dict[str, int]] = field(default_factory=lambda: {"success": {"pass": 0, "fail": 0},
                                                                       "failure": {"pass": 0, "fail": 0}})
    precision: float = 0.0
    recall: float = 0.0
    kappa: float = 0.0
    accuracy: float = 0.0
    disagreements: list[Disagreement] = field(default_factory=list)
    spec_errors: list[str] = field(default_factory=list)

    @property
    def too_few(self) -> bool:
        return self.n < MIN_LABELED

    def to_dict(self) -> dict[str, Any]:
        """The figures as a calibration row keeps them (and the API shows them)."""
        out = asdict(self)
        del out["spec_errors"]
        return {**out, "too_few": self.too_few}


@dataclass(frozen=True)
class Scoring:
    """Where a verifier is applied: the turn it is about and the environment it runs in."""

    message_index: int | None = None  # None: each trajectory's default turn
    env: dict[str, Any] | None = None  # the case's env block; None: single-turn

    @classmethod
    def of(cls, item: Any) -> Scoring:
        """A case's or task's: the turn it was promoted at (a row written without one: the turn after its
        context) and its environment."""
        index = item.message_index if item.message_index is not None else len(item.messages or [])
        return cls(index, item.env if isinstance(item.env, dict) else None)


def _is_assistant(message: Any) -> bool:
    return isinstance(message, dict) and message.get("role") == "assistant"


def _row(spec: dict, trajectory: Trajectory, turn: int, scoring: Scoring) -> dict[str, Any]:
    """The row the verifier would have if it had been promoted from this trajectory at `turn`."""
    messages = trajectory.messages
    env = scoring.env
    if env is not None and env.get("type") == EnvType.REPLAY:
        # The case's recordings answer the case's trajectory; this one is answered from its own.
        env = {**env, "recorded": promotion.replay_recordings(messages, turn)}
    tools = trajectory.tools if isinstance(trajectory.tools, list) else []
    row = row_shape.build_row(row_id=f"calibration-{trajectory.pk}", messages=messages[:turn], tools=tools,
                              verifier=spec, env=env, trajectory_id=trajectory.pk, failure_mode_id=None)
    if not tools:
        del row["tools"]  # none declared: skip the declared-tool check rather than fail every call
    return row


def _verdict(spec: dict, trajectory: Trajectory, scoring: Scoring) -> tuple[bool, str | None, int | None]:
    """(passes, failure, the turn scored) for one trajectory."""
    messages = trajectory.messages if isinstance(trajectory.messages, list) else []
    turn = promotion.default_message_index(trajectory, scoring.message_index)
    if turn is None:
        return False, "missing_call", None
    turns = [m for m in messages[turn:] if _is_assistant(m)]
    result = promotion.score_episode(_row(spec, trajectory, turn, scoring), turns)
    return result.passed, None if result.passed else result.failure, turn


def verifier_calibrate(*, project: Project, verifier: dict, agent: str = "", source: str = "",
                       limit: int = MAX_TRAJECTORIES,
                       progress: Callable[[int, int], None] | None = None) -> Calibration:
    """Score the project's labeled trajectories (newest first, at most `limit`) with `verifier`, at the turn
    and in the environment of `source` (`case:ID` or `task:ID`) when `verifier` is that case's or task's, else
    as a written verifier (see the module's docstring). `progress(done, total)` is told every PROGRESS_EVERY."""
    result = Calibration()
    result.spec_errors = validate_spec(verifier)
    if result.spec_errors:
        return result
    item = _source_item(project, source) if source else None
    scoring = Scoring.of(item) if item is not None and item.verifier == verifier else Scoring()
    qs = Trajectory.objects.filter(project=project, reviewed_outcome__in=[Outcome.SUCCESS, Outcome.FAILURE])
    if agent:
        qs = qs.filter(agent=agent)
    labels, verdicts = [], []
    trajectories = qs.order_by("-id").only("id", "messages", "tools", "reviewed_outcome").prefetch_related("signals")
    total = min(qs.count(), limit) if progress is not None else 0
    for done, t in enumerate(trajectories[:limit]):
        if progress is not None and done % PROGRESS_EVERY == 0:
            progress(done, total)
        try:
            passed, failure, turn = _verdict(verifier, t, scoring)
        except SpecError as exc:  # the trainer refuses the row (the spec was validated above): say why
            result.spec_errors = exc.problems
            return result
        except ValueError as exc:  # the trainer refuses the row: a state verifier outside its world, an env it lacks
            result.spec_errors = [str(exc)]
            return result
        label = t.reviewed_outcome
        result.matrix[label]["pass" if passed else "fail"] += 1
        labels.append(label == Outcome.SUCCESS)
        verdicts.append(passed)
        if passed != (label == Outcome.SUCCESS):
            result.disagreements.append(Disagreement(t.pk, label, passed, failure, turn))
    result.n = len(labels)
    if result.n:
        result.precision, result.recall, result.kappa, result.accuracy = agreement(labels, verdicts)
    return result


def agreement(labels: list[bool], verdicts: list[bool]) -> tuple[float, float, float, float]:
    """(precision, recall, Cohen's kappa, accuracy) of verdicts against labels, positive = True."""
    from sklearn.metrics import accuracy_score, cohen_kappa_score, precision_score, recall_score

    kappa = cohen_kappa_score(labels, verdicts) if len(set(labels) | set(verdicts)) > 1 else 1.0
    # Kappa is undefined (nan) when both raters use one class only and agree: perfect agreement.
    if kappa != kappa:
        kappa = 1.0 if labels == verdicts else 0.0
    return (float(precision_score(labels, verdicts, zero_division=0)),
            float(recall_score(labels, verdicts, zero_division=0)), float(kappa),
            float(accuracy_score(labels, verdicts)))


def verifier_sources(*, project: Project) -> list[tuple[str, str]]:
    """What the page offers to calibrate: every case's and task's verifier, as (value, label)."""
    from flywheel.evals.models import EvalCase

    tasks = train_side().item.objects
    out = [(f"case:{c.pk}", f"{c.row_id} · {c.suite.name} · {c.verifier.get('type', '?')}")
           for c in EvalCase.objects.filter(suite__project=project).select_related("suite").order_by("-pk")[:200]]
    out += [(f"task:{t.pk}", f"{t.row_id} · {t.task_set.name} · {t.verifier.get('type', '?')}")
            for t in tasks.filter(task_set__project=project).select_related("task_set").order_by("-pk")[:200]]
    return out


def verifier_from_source(*, project: Project, source: str, text: str, errors: dict[str, str]) -> dict | None:
    """The verifier to calibrate: written JSON wins over a chosen case or task. Problems go into `errors`."""
    if text.strip():
        try:
            spec = json.loads(text)
        except (ValueError, RecursionError) as exc:
            errors["verifier"] = f"not valid JSON: {exc}"
            return None
        if not isinstance(spec, dict):
            errors["verifier"] = "a verifier spec is a JSON object, e.g. {\"type\": \"tool_call\", ...}"
            return None
        problems = validate_spec(spec)
        if problems:
            errors["verifier"] = "; ".join(problems)
            return None
        return spec
    if not source:
        return None
    item = _source_item(project, source)
    if item is None:
        errors["source"] = "no such case or task in this project"
        return None
    return item.verifier


# --- calibrations on a worker ----------------------------------------------------------------------------


class CalibrationRefused(Refused):
    """Another calibration of the project is on its way."""


def calibration_request(*, project: Project, source: str, text: str, agent: str, errors: dict[str, str],
                        user: Any = None) -> VerifierCalibration | None:
    """What the page and the API do: the verifier of `text` (written JSON) or of `source`, checked, then a
    calibration of it started. Problems with the request go into `errors` (field -> why) and return None;
    CalibrationRefused when another calibration of the project is on its way."""
    if len(source) > VerifierCalibration._meta.get_field("source").max_length:
        errors["source"] = "not a case or task of this project (case:ID or task:ID)"
        return None
    if len(agent) > VerifierCalibration._meta.get_field("agent").max_length:
        errors["agent"] = "an agent's name has at most 200 characters"
        return None
    spec = verifier_from_source(project=project, source=source, text=text, errors=errors)
    if spec is None and not errors:
        errors["verifier"] = "give a verifier spec, or a source (case:ID or task:ID)"
    if errors:
        return None
    return calibration_start(project=project, verifier=spec, source=source, agent=agent, user=user)


def calibration_start(*, project: Project, verifier: dict, source: str = "", agent: str = "",
                      user: Any = None) -> VerifierCalibration:
    """Queue a calibration of `verifier` (checked by the caller) for a worker. One at a time per project: while
    one is on its way, asking for the same one again finds it, and asking for another is refused."""
    from flywheel.evals.tasks import calibration_task  # tasks import this module

    try:
        with transaction.atomic():
            run = VerifierCalibration.objects.create(project=project, requested_by=user, verifier=verifier,
                                                     source=source, agent=agent, queued_at=timezone.now())
            outbox.send_on_commit(calibration_task, run.pk)
    except IntegrityError:
        active = VerifierCalibration.objects.filter(project=project, status__in=CALIBRATION_ACTIVE).first()
        if active is None:  # it ended in between: ask again
            return calibration_start(project=project, verifier=verifier, source=source, agent=agent, user=user)
        if (active.verifier, active.source, active.agent) == (verifier, source, agent):
            return active
        raise CalibrationRefused(f"Calibration #{active.pk} of this project is on its way; calibrate again once it "
                                 "has finished.") from None
    return run


def calibration_run_process(*, run_id: int) -> VerifierCalibration | None:
    """The worker's side: claim the calibration, score, and store the figures or why it failed (a verifier the
    trainer refuses on a row, the time limit). A duplicate message finds it no longer queued."""
    claimed = runs.run_claim(VerifierCalibration, run_id, done=0, total=0)
    run = VerifierCalibration.objects.select_related("project").filter(pk=run_id).first()
    if not claimed or run is None:
        return run

    def progress(done: int, total: int) -> None:
        VerifierCalibration.objects.filter(pk=run_id).update(done=done, total=total, heartbeat_at=timezone.now())

    try:
        result = verifier_calibrate(project=run.project, verifier=run.verifier, agent=run.agent, source=run.source,
                                    progress=progress)
    except Exception as exc:
        logger.exception("calibration %s failed", run_id)
        fields = {"status": CalibrationStatus.FAILED, "error": timelimits.stopped_reason(exc)[:2000]}
    else:
        if result.spec_errors:
            fields = {"status": CalibrationStatus.FAILED, "error": "verifier: " + "; ".join(result.spec_errors)[:2000]}
        else:
            fields = {"status": CalibrationStatus.DONE, "result": result.to_dict(), "done": result.n,
                      "total": result.n}
    VerifierCalibration.objects.filter(pk=run_id, status=CalibrationStatus.RUNNING).update(
        finished_at=timezone.now(), **fields)
    return VerifierCalibration.objects.get(pk=run_id)


def calibration_sweep() -> int:
    """The outbox sweep: fail calibrations whose worker stopped beating, send again those no worker took."""
    from flywheel.evals.tasks import calibration_task

    return runs.run_sweep(VerifierCalibration, task=calibration_task)


def _source_item(project: Project, source: str) -> Any:
    """The case (`case:ID`) or task (`task:ID`) of the project that `source` names, or None."""
    from flywheel.evals.models import EvalCase

    tasks = train_side().item.objects
    kind, _, pk = source.partition(":")
    number = int(pk) if pk.isascii() and pk.isdigit() and len(pk) <= 18 else None
    if number is not None and kind == "case":
        return EvalCase.objects.filter(suite__project=project, pk=number).first()
    if number is not None and kind == "task":
        return tasks.filter(task_set__project=project, pk=number).first()
    return None


# --- triage detectors ------------------------------------------------------------------------------------

# Which labels a detector is measured against: reviewers' only, or reviewers' where given and else the
# outcome the agent (or the environment that played it) recorded.
DETECTOR_LABELS = {"reviewed": "reviewers' labels",
                   "outcome": "reviewers' labels, else the recorded outcome"}
ANY_SIGNAL = "any"  # the row of "any detector fired": what puts an unreviewed success in the review queue


@dataclass(frozen=True)
class DetectorRow:
    kind: str  # a SignalKind value, or ANY_SIGNAL
    label: str
    on_failures: int  # labeled failures it flagged (true positives)
    on_successes: int  # labeled successes it flagged (false positives)
    failures: int  # labeled failures in all

    @property
    def flagged(self) -> int:
        return self.on_failures + self.on_successes

    @property
    def precision(self) -> float | None:
        """Of the labeled trajectories it flagged, the share that are failures; None when it flagged none."""
        return self.on_failures / self.flagged if self.flagged else None

    @property
    def recall(self) -> float | None:
        """Of the labeled failures, the share it flagged; None without failures."""
        return self.on_failures / self.failures if self.failures else None

    @property
    def precision_interval(self) -> tuple[float, float] | None:
        """The 95% Wilson interval of the precision: on a handful of flagged trajectories it is wide."""
        return wilson(self.on_failures, self.flagged)

    @property
    def recall_interval(self) -> tuple[float, float] | None:
        return wilson(self.on_failures, self.failures)


@dataclass
class DetectorCalibration:
    labels: str  # a key of DETECTOR_LABELS, or "reference" (`detector_reference`)
    n: int = 0  # labeled trajectories (success or failure)
    failures: int = 0
    untriaged: int = 0  # of the labeled, not triaged yet: counted as flagged by nothing
    rows: list[DetectorRow] = field(default_factory=list)

    @property
    def successes(self) -> int:
        return self.n - self.failures

    @property
    def too_few(self) -> bool:
        return self.n < MIN_LABELED


def _label(labels: str, prefix: str = "") -> Any:
    """The label of a trajectory (reached through `prefix`) as an expression: its reviewer's outcome, or with
    "outcome" the reviewer's where given and else the recorded one (selectors.EFFECTIVE_OUTCOME's rule)."""
    reviewed = F(f"{prefix}reviewed_outcome")
    return reviewed if labels == "reviewed" else Coalesce(NullIf(reviewed, Value("")), F(f"{prefix}outcome"))


def detector_calibrate(*, project: Project, agent: str = "", labels: str = "reviewed") -> DetectorCalibration:
    """Precision and recall of each triage detector (and of "any signal") against the labels `labels` names
    (a key of DETECTOR_LABELS), over every labeled trajectory of the project (of `agent` when given). Two
    grouped queries, whatever the number of trajectories."""
    if labels not in DETECTOR_LABELS:
        raise ValueError(f"labels must be one of {sorted(DETECTOR_LABELS)}, not {labels!r}")
    labeled = Trajectory.objects.filter(project=project).annotate(label=_label(labels)).filter(
        label__in=[Outcome.SUCCESS, Outcome.FAILURE])
    if agent:
        labeled = labeled.filter(agent=agent)
    totals = labeled.order_by().aggregate(
        n=Count("id"), failures=Count("id", filter=Q(label=Outcome.FAILURE)),
        untriaged=Count("id", filter=Q(triage_version=0)), any_failures=Count(
            "id", filter=Q(label=Outcome.FAILURE, triage_severity__gt=0)),
        any_successes=Count("id", filter=Q(label=Outcome.SUCCESS, triage_severity__gt=0)))
    result = DetectorCalibration(labels=labels, n=totals["n"], failures=totals["failures"],
                                 untriaged=totals["untriaged"])
    # Per kind and label, each trajectory once however many signals of that kind it has.
    counts: dict[tuple[str, str], int] = {}
    grouped = (TriageSignal.objects.filter(project=project, trajectory__in=labeled.values("id"))
               .annotate(label=_label(labels, "trajectory__")).values("kind", "label")
               .annotate(n=Count("trajectory_id", distinct=True)).order_by())
    for row in grouped:
        counts[(row["kind"], row["label"])] = row["n"]
    for kind, text in SignalKind.choices:
        result.rows.append(DetectorRow(kind, text, counts.get((kind, Outcome.FAILURE), 0),
                                       counts.get((kind, Outcome.SUCCESS), 0), result.failures))
    result.rows.append(DetectorRow(ANY_SIGNAL, "Any signal (flagged by triage)", totals["any_failures"],
                                   totals["any_successes"], result.failures))
    return result



REFERENCE_OUTCOMES = (Outcome.SUCCESS, Outcome.FAILURE)


def _reference_judgement(record: Any, number: int) -> tuple[str, set[str], dict[str, Any]]:
    """(outcome, signals, trajectory) of one labeled record; ValueError naming the record and field."""
    kinds = set(SignalKind.values)
    name = record.get("id", f"#{number}") if isinstance(record, dict) else f"#{number}"
    judgement = record.get("judgement") if isinstance(record, dict) else None
    trajectory = record.get("trajectory") if isinstance(record, dict) else None
    if not isinstance(judgement, dict):
        raise ValueError(f"reference record {name}: judgement must be an object")
    if judgement.get("outcome") not in REFERENCE_OUTCOMES:
        raise ValueError(f"reference record {name}: judgement.outcome must be success or failure")
    signals = judgement.get("signals")
    if not isinstance(signals, list) or not set(signals) <= kinds:
        raise ValueError(f"reference record {name}: judgement.signals must be a list of {', '.join(sorted(kinds))}")
    if not isinstance(trajectory, dict) or not isinstance(trajectory.get("messages"), list):
        raise ValueError(f"reference record {name}: trajectory.messages must be a list")
    return judgement["outcome"], set(signals), trajectory


def detector_reference(records: list[dict[str, Any]], *, unsafe_rules: list[dict[str, Any]] | None = None
                       ) -> DetectorCalibration:
    """Each detector against a person's judgement on a labeled set (records of {id, judgement: {outcome,
    signals}, trajectory: {messages, tools?, feedback?, human_intervention?}}), the detectors run on it here
    under `unsafe_rules` (the default policy's when None). Per signal kind, "positive" is the person's
    judgement that the signal applies: `on_failures` counts the trajectories the detector flagged where it
    applies, `on_successes` those it flagged where it does not, `failures` those where it applies. The "any
    signal" row is against the outcome, as the queue uses it."""
    from flywheel.trajectories.triage import detect
    from flywheel.trajectories.triage_policy import DEFAULT_UNSAFE_RULES, rules_spec

    spec = rules_spec(DEFAULT_UNSAFE_RULES if unsafe_rules is None else unsafe_rules)
    judged = [_reference_judgement(record, number) for number, record in enumerate(records, 1)]
    hits = {kind: [0, 0, 0] for kind in SignalKind.values}  # flagged where it applies, where not, applies
    any_hits = [0, 0]
    for outcome, signals, trajectory in judged:
        found = {signal.kind for signal in detect(
            messages=trajectory["messages"], tools=trajectory.get("tools"), unsafe_spec=spec,
            feedback=trajectory.get("feedback"), human_intervention=trajectory.get("human_intervention"))}
        for kind, counts in hits.items():
            counts[0] += kind in found and kind in signals
            counts[1] += kind in found and kind not in signals
            counts[2] += kind in signals
        if found:
            any_hits[outcome != Outcome.FAILURE] += 1
    failures = sum(outcome == Outcome.FAILURE for outcome, _, _ in judged)
    result = DetectorCalibration(labels="reference", n=len(judged), failures=failures)
    for kind, text in SignalKind.choices:
        result.rows.append(DetectorRow(kind, text, *hits[kind]))
    result.rows.append(DetectorRow(ANY_SIGNAL, "Any signal (flagged by triage)", any_hits[0], any_hits[1], failures))
    return result
