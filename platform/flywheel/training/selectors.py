"""Reads of training jobs for the pages: the list, and the jobs a comparison names."""

from __future__ import annotations

from collections.abc import Iterable

from django.core.exceptions import ValidationError
from django.db.models import OuterRef, Subquery
from django.http import Http404

from flywheel.accounts.models import Project
from flywheel.registry.models import GateDecision
from flywheel.training.models import TrainingJob

LIST_SIZE = 100


def job_list(*, project: Project, limit: int = LIST_SIZE) -> list[TrainingJob]:
    """The project's newest jobs with what a row shows, in one query."""
    # The gate's last verdict on each job, beside its status: a job that succeeded may still have been refused.
    verdict = GateDecision.objects.filter(job=OuterRef("pk")).order_by("-decided_at", "-id")
    return list(TrainingJob.objects.filter(project=project)
                .annotate(gate_passed=Subquery(verdict.values("passed")[:1]),
                          gate_error=Subquery(verdict.values("error")[:1]),
                          gate_decision_id=Subquery(verdict.values("pk")[:1]))
                .select_related("task_set_version__task_set", "created_by")[:limit])


def compared_jobs(*, project: Project, raw_ids: Iterable[str]) -> list[TrainingJob]:
    """The jobs `?ids=…` names, in that order, for `comparison.compare_jobs`. An id that is not a number is
    a ValidationError on `ids`; a job that is not in `project` (another project's, or none) is a 404, as
    every page answers for what its user may not see."""
    ids: list[int] = []
    for raw in raw_ids:
        for part in str(raw).split(","):
            part = part.strip()
            if not part:
                continue
            if not (part.isascii() and part.isdigit()):
                raise ValidationError({"ids": f"{part[:20]!r} is not a job number."})
            ids.append(int(part))
    found = {job.pk: job for job in TrainingJob.objects.filter(project=project, pk__in=ids)}
    missing = [pk for pk in ids if pk not in found]
    if missing:
        raise Http404(f"No job {missing[0]} in this project.")
    return [found[pk] for pk in dict.fromkeys(ids)]
