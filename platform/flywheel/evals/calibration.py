"""Verifier calibration: does a verifier agree with the outcomes reviewers labeled?

The field's advice is to run 50-100 outputs through a reward before trusting it. A verifier (a case's, a
task's, or one written in the form) scores each labeled trajectory; the verifier "passes" a trajectory when
it passes one of its assistant turns (a case's verifier is about one turn, and a trajectory holds that turn
somewhere), with the trajectory's own declared tools. Passing is compared with the reviewer's label
(success / failure): a confusion matrix, precision and recall of "passes" against "success", and Cohen's
kappa, from scikit-learn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from flywheel.accounts.models import Project
from flywheel.trajectories.models import Outcome, Trajectory
from trainer.verifiers import SpecError, score, validate_spec

MIN_LABELED = 50  # under this the page warns: too few labels to trust the figures
MAX_TRAJECTORIES = 2000


@dataclass
class Disagreement:
    trajectory_id: int
    label: str  # the reviewer's outcome
    passed: bool  # the verifier's verdict
    failure: str | None
    turn: int | None  # the assistant message that passed, or the last one scored


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


def _verdict(spec: dict, trajectory: Trajectory) -> tuple[bool, str | None, int | None]:
    messages = trajectory.messages if isinstance(trajectory.messages, list) else []
    tools = trajectory.tools if isinstance(trajectory.tools, list) and trajectory.tools else None
    last_failure, last_turn = None, None
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "assistant":
            s = score(spec, m, tools=tools)
            if s.passed:
                return True, None, i
            last_failure, last_turn = s.failure, i
    return False, last_failure or "missing_call", last_turn


def verifier_calibrate(*, project: Project, verifier: dict, agent: str = "",
                       limit: int = MAX_TRAJECTORIES) -> Calibration:
    """Score the project's labeled trajectories (newest first, at most `limit`) with `verifier`."""
    result = Calibration()
    result.spec_errors = validate_spec(verifier)
    if result.spec_errors:
        return result
    qs = Trajectory.objects.filter(project=project, reviewed_outcome__in=[Outcome.SUCCESS, Outcome.FAILURE])
    if agent:
        qs = qs.filter(agent=agent)
    labels, verdicts = [], []
    for t in qs.order_by("-id").only("id", "messages", "tools", "reviewed_outcome")[:limit]:
        try:
            passed, failure, turn = _verdict(verifier, t)
        except SpecError as exc:  # validated above; kept so that a page never fails on one odd spec
            result.spec_errors = exc.problems
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
    from flywheel.environments.models import Task
    from flywheel.evals.models import EvalCase

    out = [(f"case:{c.pk}", f"{c.row_id} · {c.suite.name} · {c.verifier.get('type', '?')}")
           for c in EvalCase.objects.filter(suite__project=project).select_related("suite").order_by("-pk")[:200]]
    out += [(f"task:{t.pk}", f"{t.row_id} · {t.task_set.name} · {t.verifier.get('type', '?')}")
            for t in Task.objects.filter(task_set__project=project).select_related("task_set").order_by("-pk")[:200]]
    return out


def verifier_from_source(*, project: Project, source: str, text: str, errors: dict[str, str]) -> dict | None:
    """The verifier to calibrate: written JSON wins over a chosen case or task. Problems go into `errors`."""
    from flywheel.environments.models import Task
    from flywheel.evals.models import EvalCase

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
    kind, _, pk = source.partition(":")
    if not source:
        return None
    item = None
    number = int(pk) if pk.isascii() and pk.isdigit() and len(pk) <= 18 else None
    if number is not None and kind == "case":
        item = EvalCase.objects.filter(suite__project=project, pk=number).first()
    elif number is not None and kind == "task":
        item = Task.objects.filter(task_set__project=project, pk=number).first()
    if item is None:
        errors["source"] = "no such case or task in this project"
        return None
    return item.verifier
