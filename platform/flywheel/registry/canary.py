"""Canary rollout and the watch after a full promotion: a version serves a share of live traffic beside
production until a sequential test on that traffic decides, and a newly promoted production is watched
against the version it replaced. Every move goes through the registry's one move (`services.alias_move`,
`model_promote`, `model_rollback`, `alias_end`), so a rule's rollback is the same atomic move as a person's.

Each running check is looked at by a worker every sweep (`live_check_sweep` hands `live_check_look` the running
checks, and the flagged ones, whose figures stay current while they wait for a person). A look counts each
arm's trajectories in its window (a bounded query on the trajectories whose `model_version` names the arm's
version), then `sequential.look` (mSPRT, always valid however often it is looked at; its error rates are in
flywheel.registry.sequential and tests/platform/registry/test_sequential.py). What a look decides:

- canary: worse (failure or unsafe-action rate, p <= 0.05) → rolled back if the project acts by itself
  (`canary_auto`), else flagged for a person; each arm has `canary_min_per_arm` trajectories and nothing is
  worse → promoted to production (auto) or flagged ready; `canary_max_hours` passed first → removed,
  expired. A person may promote or roll back the canary at any time.
- watch: worse → production rolled back to the version it replaced (`watch_rollback`), else flagged; the
  watch passes at its end (`watch_hours`) or once production served `watch_trajectories` (when above 0).

An automatic action (a rollback, a promotion) also needs the same verdict from the evidence the platform vouched
for (flywheel.registry.evidence: trajectories the router vouched for, one sender's share capped, and for the
canary a split that agrees with its weight); a verdict on other traffic alone flags the check for a person.

Every automatic action, and every flag, is a notification (flywheel.registry.notify)."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import ValidationError
from django.core.validators import validate_email
from django.db import transaction
from django.db.models import Count, Exists, Max, OuterRef, Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from flywheel import fields, outbox
from flywheel.accounts.models import Project
from flywheel.accounts.services import project_lock
from flywheel.registry import evidence as live_evidence
from flywheel.registry import sequential
from flywheel.registry.live import names_of
from flywheel.registry.models import (
    Alias,
    AliasAssignment,
    AliasEvent,
    AliasEventKind,
    LiveCheck,
    LiveCheckKind,
    LiveCheckStatus,
    ModelVersion,
    RegistrySettings,
)
from flywheel.registry.notify import notify

logger = logging.getLogger(__name__)


# --- which trajectories belong to a version -----------------------------------------------------------------
# A version's traffic is what carries one of its names (`live.names_of`: its adapter name `<slug>-v<n>`, and
# the names a maintainer mapped to it), the same resolution live metrics use.


def arm_counts(*, project: Project, names: list[str], after_id: int | None = None,
               window: tuple[datetime, datetime] | None = None, vouched: bool = False) -> dict[str, int]:
    """`{n, failures, unsafe}` of the trajectories named `names`: those that arrived after trajectory
    `after_id` (the arms of a running check: an index range on (project, model_version, id)), or whose time
    (started_at, else arrival) falls in `window` [from, to) (the watch's fixed baseline, counted once).
    `vouched`: only what may act by itself (`evidence.trusted_rows`), with its `vouched` and `senders` too.

    `known`: trajectories whose effective outcome (a reviewer's over the agent's) is success or failure, the
    failure rate's denominator (an unknown outcome is not a success); `triaged`: trajectories triage has run
    on, the unsafe-action rate's (an unsafe action is a triage signal `unsafe_action`)."""
    from flywheel.trajectories.models import Outcome, SignalKind, Trajectory, TriageSignal

    rows = Trajectory.objects.filter(project=project, model_version__in=names)
    if after_id is not None:
        rows = rows.filter(pk__gt=after_id)
    if window is not None:
        rows = rows.annotate(at=Coalesce("started_at", "created_at")).filter(at__gte=window[0], at__lt=window[1])
    failed = Q(reviewed_outcome=Outcome.FAILURE) | Q(reviewed_outcome="", outcome=Outcome.FAILURE)
    known = (Q(reviewed_outcome__in=[Outcome.FAILURE, Outcome.SUCCESS])
             | Q(reviewed_outcome="", outcome__in=[Outcome.FAILURE, Outcome.SUCCESS]))
    unsafe = Exists(TriageSignal.objects.filter(trajectory=OuterRef("pk"), kind=SignalKind.UNSAFE_ACTION))
    trust: dict[str, int] = {}
    if vouched:
        rows, trust = live_evidence.trusted_rows(rows)
    counts = rows.aggregate(n=Count("id"), known=Count("id", filter=known), failures=Count("id", filter=failed),
                            triaged=Count("id", filter=Q(triaged_at__isnull=False)),
                            unsafe=Count("id", filter=Q(unsafe)))
    return {key: counts[key] or 0 for key in ("n", "known", "failures", "triaged", "unsafe")} | trust


def _last_trajectory_id(project: Project) -> int:
    from flywheel.trajectories.models import Trajectory

    return Trajectory.objects.filter(project=project).aggregate(m=Max("id"))["m"] or 0


# --- the rules ----------------------------------------------------------------------------------------------

LIVE_RULE_FIELDS = ("canary_weight", "canary_min_per_arm", "canary_max_hours", "canary_auto", "canary_tolerance",
                    "watch_hours", "watch_trajectories", "watch_rollback", "watch_holdback", "notify_emails")
# Shares a field holds: (lowest, highest, whether each end is left out, the example in its message). A canary's
# weight is what `_weight_error` allows a canary started with its own.
_SHARES = {"canary_weight": (0.0, 1.0, (True, True), "0.1 (10% of traffic)"),
           "canary_tolerance": (0.0, 0.5, (True, False), "0.05 (five points)"),
           "watch_holdback": (0.0, 0.5, (False, False), "0.05 (5% of traffic; 0 turns the holdback off)")}
_LIMITS = {"canary_min_per_arm": (1, 1_000_000), "canary_max_hours": (1, 24 * 90), "watch_hours": (0, 24 * 90),
           "watch_trajectories": (0, 10_000_000)}
_BOOLEANS = ("canary_auto", "watch_rollback")


def _weight_error(weight: float) -> str | None:
    if not 0 < weight < 1 or weight != weight:
        return f"A share of traffic between 0 and 1 (0.1 = 10%), not {weight:g}."
    return None


def live_rules_set(*, project: Project, data: dict[str, Any]) -> RegistrySettings:
    """Set the canary's and the watch's rules and the addresses notifications go to. `data` holds text (a
    form's) or values (the API's); a field left out or blank keeps its value. Each wrong value is an error on
    its field, and nothing is saved then."""
    with transaction.atomic():
        config, _ = RegistrySettings.objects.select_for_update().get_or_create(project=project)
        errors: dict[str, str] = {}
        for name in LIVE_RULE_FIELDS:
            if name not in data or data[name] is None:
                continue
            raw = data[name]
            text = raw if isinstance(raw, str) else str(raw)
            if name == "notify_emails":
                lines = [line.strip() for line in text.replace(",", "\n").splitlines() if line.strip()]
                bad = []
                for line in lines:
                    try:
                        validate_email(line)
                    except ValidationError:
                        bad.append(line)
                if bad:
                    errors[name] = f"Not an e-mail address: {', '.join(bad[:3])}."
                elif len(lines) > 50:
                    errors[name] = "At most 50 addresses."
                else:
                    config.notify_emails = "\n".join(lines)
                continue
            if name in _BOOLEANS:
                value = fields.flag(data, name, errors)
            elif name in _SHARES:
                low, high, (low_open, high_open), example = _SHARES[name]
                value = fields.number(data, name, errors, low=low, high=high, low_open=low_open,
                                      high_open=high_open, example=example)
            else:
                low, high = _LIMITS[name]
                value = fields.whole(data, name, errors, low=low, high=high)
            if value is not None:
                setattr(config, name, value)
        if errors:
            raise ValidationError(errors)
        config.save()
    return config


def live_rules_of(config: RegistrySettings) -> dict[str, Any]:
    return {name: getattr(config, name) for name in LIVE_RULE_FIELDS}


def _config(project: Project) -> RegistrySettings:
    return RegistrySettings.objects.filter(project=project).first() or RegistrySettings(project=project)


# --- starting ----------------------------------------------------------------------------------------------


def canary_start(*, project: Project, version: ModelVersion, user=None, weight: float | None = None,
                 reason: str = "") -> LiveCheck:
    """Serve `version` to a share of traffic (`weight`, default the project's canary_weight) beside production
    and start its decision. Only a version that may be promoted (`services.promotable_check`: it passed the
    gate against the production serving now), never production itself, and one canary at a time: a second is
    refused until the first is promoted or rolled back."""
    from flywheel.registry import services

    config = _config(project)
    weight = config.canary_weight if weight is None else float(weight)
    problem = _weight_error(weight)
    if problem:
        raise ValidationError({"weight": problem})
    if version.project_id != project.pk:
        raise services.RegistryError("That version belongs to another project.")
    with transaction.atomic():
        project_lock(project=project)
        production = services.promotable_check(project=project, version=version)
        if production is None:
            raise services.RegistryError("Nothing is in production yet: a canary is compared with production.")
        if production.version_id == version.pk:
            raise services.RegistryError(f"v{version.number} is production already.")
        current = AliasAssignment.objects.filter(project=project, alias=Alias.CANARY).select_related("version").first()
        if current is not None:
            raise services.RegistryError(
                f"v{current.version.number} is the canary now: promote it or roll it back before starting another.")
        # A check left running without its canary (ended behind its back) must not block the new one.
        LiveCheck.objects.filter(project=project, kind=LiveCheckKind.CANARY, status=LiveCheckStatus.RUNNING).update(
            status=LiveCheckStatus.ENDED, decided_at=timezone.now())
        event = services.alias_move(
            project=project, alias=Alias.CANARY, version=version, user=user, kind=AliasEventKind.PROMOTE,
            weight=weight, reason=reason or f"Canary beside production v{production.version.number}.",
        )
        rules = {"weight": weight, "min_per_arm": config.canary_min_per_arm, "max_hours": config.canary_max_hours,
                 "auto": config.canary_auto, "tolerance": config.canary_tolerance}
        return LiveCheck.objects.create(
            project=project, kind=LiveCheckKind.CANARY, subject=version, baseline=production.version,
            started_at=event.at, ends_at=event.at + timedelta(hours=config.canary_max_hours), rules=rules,
            evidence={"window": {"after_id": _last_trajectory_id(project)}}, event=event,
        )


def _watch_start(*, event: AliasEvent) -> LiveCheck | None:
    """The watch of a version just promoted to production, against the one it replaced; none when the watch
    is off (watch_hours 0) or nothing served before."""
    if event.from_version_id is None or event.from_version_id == event.to_version_id:
        return None
    config = _config(event.project)
    if config.watch_hours <= 0:
        return None
    hours = timedelta(hours=config.watch_hours)
    rules = {"hours": config.watch_hours, "trajectories": config.watch_trajectories,
             "rollback": config.watch_rollback, "holdback": config.watch_holdback}
    return LiveCheck.objects.create(
        project=event.project, kind=LiveCheckKind.WATCH, subject=event.to_version, baseline=event.from_version,
        started_at=event.at, baseline_from=event.at - hours, ends_at=event.at + hours, rules=rules,
        evidence={"window": {"after_id": _last_trajectory_id(event.project)}}, event=event,
    )


def after_production_move(*, event: AliasEvent) -> None:
    """What a move of production does to the live checks, in the move's transaction (services calls it):
    a running watch ends (production moved again, or a person rolled it back); a canary of the version now in
    production ends as promoted, any other canary ends (it was compared with a production that no longer
    serves); a promotion starts the new production's watch."""
    from flywheel.registry import services

    project = event.project
    now = timezone.now()
    note = {"moved": {"event": event.pk, "kind": event.kind, "to_version": event.to_version.number,
                      "actor": event.actor, "at": event.at.isoformat()}}
    watches = LiveCheck.objects.filter(project=project, kind=LiveCheckKind.WATCH).filter(
        Q(status=LiveCheckStatus.RUNNING) | Q(status=LiveCheckStatus.FLAGGED))
    for check in watches:
        # A flagged watch that a person answers with a rollback is rolled back; any other move ends it.
        acted = check.status == LiveCheckStatus.FLAGGED and event.kind == AliasEventKind.ROLLBACK
        check.status = LiveCheckStatus.ROLLED_BACK if acted else LiveCheckStatus.ENDED
        check.decided_at, check.decided_by = now, event.user
        if acted:
            check.event = event
        check.evidence = {**check.evidence, **note}
        check.save(update_fields=["status", "decided_at", "decided_by", "evidence", "event"])
    canary = AliasAssignment.objects.filter(project=project, alias=Alias.CANARY).select_related("version").first()
    if canary is not None:
        promoted = canary.version_id == event.to_version_id
        reason = (f"v{canary.version.number} is production now: the canary ended." if promoted else
                  f"Production moved to v{event.to_version.number}: the canary was compared with another version.")
        end = services.alias_end(project=project, alias=Alias.CANARY, user=event.user, reason=reason,
                                 actor=event.actor, evidence=event.evidence)
        for check in LiveCheck.objects.filter(project=project, kind=LiveCheckKind.CANARY,
                                              subject=canary.version).filter(
                Q(status=LiveCheckStatus.RUNNING) | Q(status=LiveCheckStatus.FLAGGED)):
            check.status = LiveCheckStatus.PROMOTED if promoted else LiveCheckStatus.ENDED
            check.decided_at, check.decided_by = now, event.user
            check.event = event if promoted else end
            check.evidence = {**check.evidence, **note}
            check.save(update_fields=["status", "decided_at", "decided_by", "event", "evidence"])
    if event.kind == AliasEventKind.PROMOTE:
        _watch_start(event=event)


# --- a person's decision -------------------------------------------------------------------------------------


def _canary_check(project: Project, version: ModelVersion) -> LiveCheck | None:
    return (LiveCheck.objects.filter(project=project, kind=LiveCheckKind.CANARY, subject=version)
            .filter(Q(status=LiveCheckStatus.RUNNING) | Q(status=LiveCheckStatus.FLAGGED)).first())


def canary_promote(*, project: Project, user=None, reason: str = "", actor: str = "",
                   evidence: dict[str, Any] | None = None) -> AliasEvent:
    """Send all traffic to the canary: its version becomes production by `model_promote` (the gate's rule
    checked again), and the canary alias ends in the same transaction."""
    from flywheel.registry import services

    with transaction.atomic():
        project_lock(project=project)
        current = AliasAssignment.objects.filter(project=project, alias=Alias.CANARY).select_related("version").first()
        if current is None:
            raise services.RegistryError("No canary is serving.")
        check = _canary_check(project, current.version)
        evidence = evidence if evidence is not None else ({"look": check.evidence.get("look")} if check else {})
        return services.model_promote(project=project, version=current.version, user=user, actor=actor,
                                      evidence=evidence,
                                      reason=reason or f"Canary v{current.version.number} promoted to all traffic.")


def canary_rollback(*, project: Project, user=None, reason: str = "", actor: str = "",
                    evidence: dict[str, Any] | None = None,
                    status: str = LiveCheckStatus.ROLLED_BACK) -> AliasEvent:
    """Take the canary out of serving (the canary alias ends; production keeps all traffic) and close its
    check as rolled back (or `status`, e.g. expired)."""
    from flywheel.registry import services

    with transaction.atomic():
        project_lock(project=project)
        current = AliasAssignment.objects.filter(project=project, alias=Alias.CANARY).select_related("version").first()
        if current is None:
            raise services.RegistryError("No canary is serving.")
        check = _canary_check(project, current.version)
        if evidence is None:
            evidence = {"look": check.evidence.get("look")} if check else {}
        event = services.alias_end(project=project, alias=Alias.CANARY, user=user, actor=actor, evidence=evidence,
                                   reason=reason or f"Canary v{current.version.number} rolled back.")
        if check is not None:
            check.status = status
            check.decided_at, check.decided_by, check.event = timezone.now(), user, event
            check.save(update_fields=["status", "decided_at", "decided_by", "event"])
    return event


# --- the looks ----------------------------------------------------------------------------------------------


# Checks a look is for: running ones, and flagged ones, which wait for a person but keep their figures current
# (and a canary flagged ready that turns worse is flagged again, as worse).
LOOKED_AT = (LiveCheckStatus.RUNNING, LiveCheckStatus.FLAGGED)


def live_check_sweep() -> int:
    """The sweep (outbox.SWEEPS): hand each running or flagged check to a worker for a look. Cheap: one indexed
    query."""
    from flywheel.registry.tasks import live_check_task

    sent = 0
    for pk in LiveCheck.objects.filter(status__in=LOOKED_AT).values_list("id", flat=True)[:500]:
        try:
            outbox.send(live_check_task, pk)
        except outbox.BrokerUnavailable:
            break
        sent += 1
    return sent


TRAIL_MAX = 300  # looks kept for the check's page (the newest; a look that saw nothing new adds none)


def _evidence(check: LiveCheck, look: sequential.Look, now: datetime, **extra: Any) -> dict[str, Any]:
    """The evidence a look leaves: its counts, rates, p-values and verdict, the check's window, and a trail
    of the looks that saw new traffic ([at, subject n, baseline n, failure p, unsafe p])."""
    trail = list(check.evidence.get("trail", []))
    point = [now.isoformat(), look.subject["n"], look.baseline["n"], round(look.failure.p, 6), round(look.unsafe.p, 6)]
    if not trail or trail[-1][1:] != point[1:]:
        trail = (trail + [point])[-TRAIL_MAX:]
    return {**{k: v for k, v in check.evidence.items() if k in ("window", "baseline_fixed", "trusted")},
            "look": look.to_dict(), "at": now.isoformat(), "looks": check.looks + 1, "trail": trail, **extra}


def live_check_look(*, check_id: int, now: datetime | None = None) -> str:
    """One look at a running check, and what it decides; answers the check's status after it. Safe to run
    twice at once: the project's lock is held, and a check no longer running is left alone."""
    now = now or timezone.now()
    check = LiveCheck.objects.select_related("project", "subject", "baseline").filter(pk=check_id).first()
    if check is None:
        return "gone"
    with transaction.atomic():
        project_lock(project=check.project)
        check = (LiveCheck.objects.select_for_update(of=("self",)).select_related("project", "subject", "baseline")
                 .filter(pk=check_id, status__in=LOOKED_AT).first())
        if check is None:
            return "not running"
        if check.kind == LiveCheckKind.CANARY:
            return _canary_look(check, now)
        return _watch_look(check, now)


def _payload(check: LiveCheck, evidence: dict[str, Any]) -> dict[str, Any]:
    return {"check": check.pk, "kind": check.kind, "subject_version": check.subject.number,
            "baseline_version": check.baseline.number, "status": check.status, "evidence": evidence}


def _still_serving(check: LiveCheck, alias: str, now: datetime) -> bool:
    """Whether `alias` still points at the check's version; when it does not, the check has ended (a person or
    another move took the version off), and is saved so."""
    current = AliasAssignment.objects.filter(project=check.project, alias=alias).values_list("version_id", flat=True)
    if current.first() == check.subject_id:
        return True
    check.status, check.decided_at = LiveCheckStatus.ENDED, now
    check.save(update_fields=["status", "decided_at"])
    return False


def _after_id(check: LiveCheck) -> int:
    """The check's window starts after this trajectory id (taken when it started)."""
    return int(check.evidence.get("window", {}).get("after_id", 0))


def _look(check: LiveCheck, subject: dict[str, int], baseline: dict[str, int], *, min_per_arm: int,
          previous: dict[str, Any] | None = None) -> sequential.Look:
    """The sequential tests on the two arms' counts, carrying the check's previous look on (or `previous`)."""
    return sequential.look(subject_n=subject["n"], subject_failures=subject["failures"],
                           subject_unsafe=subject["unsafe"], subject_known=subject.get("known"),
                           subject_triaged=subject.get("triaged"), baseline_n=baseline["n"],
                           baseline_failures=baseline["failures"], baseline_unsafe=baseline["unsafe"],
                           baseline_known=baseline.get("known"), baseline_triaged=baseline.get("triaged"),
                           min_per_arm=min_per_arm, tolerance=float(check.rules.get("tolerance",
                                                                                    sequential.TOLERANCE)),
                           previous=check.evidence.get("look") if previous is None else previous)


# --- what may act by itself (flywheel.registry.evidence) ----------------------------------------------------


def _served_beside(check: LiveCheck, kind: str) -> list[tuple[datetime, datetime | None, float]]:
    """(from, until or None while served, weight) of each arm of `kind`'s checks served while `check` ran: the
    holdbacks beside a canary (kind watch), the canaries beside a watch's holdback (kind canary)."""
    arms = []
    for other in LiveCheck.objects.filter(project=check.project, kind=kind).exclude(pk=check.pk).filter(
            Q(decided_at__isnull=True) | Q(decided_at__gt=check.started_at) | Q(status__in=LOOKED_AT)):
        weight = float((other.rules or {}).get("holdback" if kind == LiveCheckKind.WATCH else "weight") or 0)
        if weight > 0:
            arms.append((other.started_at, None if other.status in LOOKED_AT else other.decided_at, weight))
    return arms


def _trusted(check: LiveCheck, now: datetime, *, after_id: int, min_per_arm: int, weight: float | None = None,
             baseline_window: tuple[datetime, datetime] | None = None) -> live_evidence.Trust:
    """The look on the vouched evidence alone (its p-values carried over from its own last look), kept in the
    check's evidence as `trusted`; with `weight` (the canary's, or a watch's holdback, the baseline's) the split
    check, its share corrected for the other arms served beside (`_served_beside`), told once when it turns."""
    project, before = check.project, check.evidence.get("trusted") or {}
    subject = arm_counts(project=project, names=names_of(project=project, version=check.subject),
                         after_id=after_id, vouched=True)
    if baseline_window is None:
        baseline = arm_counts(project=project, names=names_of(project=project, version=check.baseline),
                              after_id=after_id, vouched=True)
    else:  # the watch without a holdback: the replaced version's hours before the move, recounted
        baseline = arm_counts(project=project, names=names_of(project=project, version=check.baseline),
                              window=baseline_window, vouched=True)
    look = _look(check, subject, baseline, min_per_arm=min_per_arm, previous=before.get("look") or {})
    canary = check.kind == LiveCheckKind.CANARY
    split = None
    if weight is not None:
        weighted, other = (check.subject, check.baseline) if canary else (check.baseline, check.subject)
        periods = live_evidence.split_periods(
            started_at=check.started_at, now=now, weight=weight,
            others=_served_beside(check, LiveCheckKind.WATCH if canary else LiveCheckKind.CANARY))
        counts = live_evidence.split_counts(
            project=project, canary_names=names_of(project=project, version=weighted),
            production_names=names_of(project=project, version=other), after_id=after_id, periods=periods)
        split = {**live_evidence.split_check(counts, previous=before.get("split")), "on": f"v{weighted.number}"}
    trust = live_evidence.Trust(look=look, subject=subject, baseline=baseline, split=split,
                                baseline_fixed=baseline_window is not None)
    check.evidence = {**check.evidence, "trusted": trust.to_dict()}
    if trust.imbalanced and not (before.get("split") or {}).get("imbalanced"):
        text = trust.acts("ready" if canary else "worse", subject=f"v{check.subject.number}",
                          baseline=f"v{check.baseline.number}", min_per_arm=min_per_arm)[1]
        notify(project=project, event_type=f"{check.kind}.imbalanced", text=text[:1].upper() + text[1:] + ".",
               subject=(f"Canary v{check.subject.number}" if canary else
                        f"Watch of v{check.subject.number} (holdback v{check.baseline.number})")
               + ": the split is not the weight; it will not act by itself",
               payload=_payload(check, {"trusted": trust.to_dict()}))
    return trust


def _canary_look(check: LiveCheck, now: datetime) -> str:
    from flywheel.registry import services

    project, rules = check.project, check.rules
    if not _still_serving(check, Alias.CANARY, now):
        return check.status
    after_id = _after_id(check)
    subject = arm_counts(project=project, names=names_of(project=project, version=check.subject), after_id=after_id)
    baseline = arm_counts(project=project, names=names_of(project=project, version=check.baseline),
                          after_id=after_id)
    min_per_arm = int(rules.get("min_per_arm", 1000))
    look = _look(check, subject, baseline, min_per_arm=min_per_arm)
    auto = bool(rules.get("auto"))
    v, b = f"v{check.subject.number}", f"v{check.baseline.number}"
    flagged, was = check.status == LiveCheckStatus.FLAGGED, check.evidence.get("verdict")
    # An automatic action needs the verdict on vouched evidence too (flywheel.registry.evidence).
    trust = _trusted(check, now, after_id=after_id, min_per_arm=min_per_arm, weight=float(rules.get("weight") or 0.1))
    held_before = bool(check.evidence.get("held"))
    worse = trust.look if trust.look.worse else look
    acts_worse, held_worse = trust.acts("worse", subject=v, baseline=b, min_per_arm=min_per_arm) if auto \
        else (False, "")
    # A check flagged worse because its vouched evidence did not show it yet acts once that evidence does.
    if worse.worse and not (flagged and was == "worse" and not (acts_worse and held_before)):
        evidence = _evidence(check, look, now, verdict="worse", **({"held": held_worse} if held_worse else {}))
        if acts_worse:
            _save_look(check, evidence)
            canary_rollback(project=project, actor="canary", evidence=_brief(evidence),
                            reason=f"Rolled back by the canary decision: {worse.reason()}.")
            check.refresh_from_db()
            _tell(check, "canary.rolled_back", f"Canary {v} rolled back: worse than {b}", worse.reason(), evidence)
        else:
            _save_look(check, evidence, status=LiveCheckStatus.FLAGGED, now=now)
            _tell(check, "canary.worse", f"Canary {v} is worse than {b}: decide on the Models page",
                  worse.reason() + (f"; not rolled back by itself: {held_worse}" if held_worse else ""), evidence)
    elif flagged:
        # It waits for a person: the figures move on, the verdict they were told stays (no second notice).
        kept = {k: check.evidence[k] for k in ("refused", "held") if k in check.evidence}
        _save_look(check, _evidence(check, look, now, verdict=was, **kept))
    elif (look.ready and auto and trust.any_vouched and not trust.imbalanced and now < check.ends_at
          and not (ready := trust.acts("ready", subject=v, baseline=b, min_per_arm=min_per_arm))[0]):
        # The router vouches for this traffic: the vouched evidence decides once it has its minimum (past the
        # check's end, a person does).
        _save_look(check, _evidence(check, look, now, verdict="watching", held=ready[1]))
    elif look.ready:
        acts_ready, held = trust.acts("ready", subject=v, baseline=b, min_per_arm=min_per_arm) if auto \
            else (False, "")
        evidence = _evidence(check, look, now, verdict="ready", **({"held": held} if held else {}))
        refused = ""
        if acts_ready:
            _save_look(check, evidence)
            try:
                with transaction.atomic():
                    canary_promote(project=project, actor="canary", evidence=_brief(evidence),
                                   reason=f"Promoted by the canary decision: {look.reason()}.")
            except services.MlflowUnavailable:
                raise  # nothing changed: the next sweep looks again
            except services.RegistryError as exc:  # e.g. its gate decision went stale: a person decides
                refused = str(exc)
            else:
                check.refresh_from_db()
                _tell(check, "canary.promoted", f"Canary {v} promoted to production", look.reason(), evidence)
        if refused:
            evidence = {**evidence, "refused": refused}
            check.looks -= 1  # the same look, saved again with why it was not promoted
            _save_look(check, evidence, status=LiveCheckStatus.FLAGGED, now=now)
            _tell(check, "canary.ready", f"Canary {v} is ready but was not promoted: decide on the Models page",
                  f"{look.reason()}; {refused}", evidence)
        elif not acts_ready:
            _save_look(check, evidence, status=LiveCheckStatus.FLAGGED, now=now)
            _tell(check, "canary.ready", f"Canary {v} is ready to promote: decide on the Models page",
                  look.reason() + (f"; not promoted by itself: {held}" if held else ""), evidence)
    elif now >= check.ends_at:
        if look.enough:
            bound = "not bounded" if look.upper is None else f"bounded at {look.upper:.1%} points"
            why = (f"ended after {rules.get('max_hours')} h without showing it is no worse: its failure rate's "
                   f"increase was {bound}, above the tolerance of {look.tolerance:.0%}")
        else:
            why = (f"ended after {rules.get('max_hours')} h without enough traffic: {subject['known']} known "
                   f"outcomes on {v} and {baseline['known']} on {b}, {rules.get('min_per_arm')} needed in each")
        evidence = _evidence(check, look, now, verdict="expired", why=why)
        _save_look(check, evidence)
        canary_rollback(project=project, actor="canary", evidence=_brief(evidence), status=LiveCheckStatus.EXPIRED,
                        reason=f"Canary {why}.")
        check.refresh_from_db()
        _tell(check, "canary.expired", f"Canary {v} removed: not enough traffic", why, evidence)
    else:
        _save_look(check, _evidence(check, look, now, verdict="watching"))
    return check.status


def _watch_look(check: LiveCheck, now: datetime) -> str:
    from flywheel.registry import services

    project, rules = check.project, check.rules
    if not _still_serving(check, Alias.PRODUCTION, now):
        return check.status
    after_id = _after_id(check)
    holdback = float(rules.get("holdback") or 0)
    v, b = f"v{check.subject.number}", f"v{check.baseline.number}"
    baseline_names = names_of(project=project, version=check.baseline)
    if holdback > 0:
        # The replaced version's holdback: the same hours, the same maturity of outcomes, the canary's test.
        window, compared = None, f"{b} (holdback)"
        baseline = arm_counts(project=project, names=baseline_names, after_id=after_id)
    else:
        # No holdback: the replaced version's hours before the move, recounted at each look (its outcomes may
        # still be maturing). Alert only: it differs by time of day, so it never rolls back by itself.
        window, compared = (check.baseline_from or check.started_at, check.started_at), f"{b} before the move"
        baseline = arm_counts(project=project, names=baseline_names, window=window)
    subject = arm_counts(project=project, names=names_of(project=project, version=check.subject), after_id=after_id)
    limit = int(rules.get("trajectories") or 0)
    look = _look(check, subject, baseline, min_per_arm=limit or 1)
    # A rollback by rule needs the verdict on vouched evidence too (flywheel.registry.evidence).
    trust = _trusted(check, now, after_id=after_id, min_per_arm=limit or 1, baseline_window=window,
                     weight=holdback if holdback > 0 else None)
    held_before = bool(check.evidence.get("held"))
    worse = trust.look if trust.look.worse else look
    acts, held = trust.acts("worse", subject=v, baseline=compared, min_per_arm=limit or 1) \
        if rules.get("rollback") else (False, "")
    if acts and window is not None:
        acts, held = False, (f"it was compared with {compared}, not at the same hours (no holdback), so the watch "
                             "flags but does not roll back by itself")
    if check.status == LiveCheckStatus.FLAGGED and not (acts and held_before):
        # Worse, told, and waiting for a person: the figures move on, nothing else does.
        kept = {k: check.evidence[k] for k in ("held",) if k in check.evidence}
        _save_look(check, _evidence(check, look, now, verdict="worse", **kept))
    elif worse.worse:
        evidence = _evidence(check, look, now, verdict="worse", **({"held": held} if held else {}))
        if acts:
            _save_look(check, evidence, status=LiveCheckStatus.ROLLED_BACK, now=now)
            # The check is closed first, so the rollback's own end-of-watch finds nothing running.
            event = services.model_rollback(project=project, to_version=check.baseline, actor="watch",
                                            evidence=_brief(evidence),
                                            reason=f"Rolled back by the watch: {worse.reason()}.")
            check.event = event
            check.save(update_fields=["event"])
            _tell(check, "watch.rolled_back", f"Production {v} rolled back to {b} by the watch", worse.reason(),
                  evidence)
        else:
            _save_look(check, evidence, status=LiveCheckStatus.FLAGGED, now=now)
            _tell(check, "watch.flagged", f"Production {v} is worse than {compared}: decide on the Models page",
                  worse.reason() + (f"; not rolled back by itself: {held}" if held else ""), evidence)
    elif now >= check.ends_at or (limit and subject["n"] >= limit):
        if subject["n"] == 0 or baseline["n"] == 0:
            # Nothing to compare: say so rather than "no harm found" (often traffic under an unmapped name).
            empty = v if subject["n"] == 0 else compared
            why = (f"no trajectory of {empty} was counted (names: "
                   f"{', '.join(names_of(project=project, version=check.subject if subject['n'] == 0 else check.baseline))}"
                   "); map the name production traffic carries to the version")
            status, verdict = LiveCheckStatus.EXPIRED, "expired"
        else:
            why = (f"{subject['n']} trajectories on {v}" + (f" (of {limit})" if limit else "")
                   + f" by {now:%Y-%m-%d %H:%M} UTC; no harm found")
            status, verdict = LiveCheckStatus.PASSED, "passed"
        _save_look(check, _evidence(check, look, now, verdict=verdict, why=why), status=status, now=now)
    else:
        _save_look(check, _evidence(check, look, now, verdict="watching"))
    return check.status


def _save_look(check: LiveCheck, evidence: dict[str, Any], *, status: str | None = None,
               now: datetime | None = None) -> None:
    check.evidence = evidence
    check.looks += 1
    fields = ["evidence", "looks"]
    if status is not None:
        check.status, check.decided_at = status, now
        fields += ["status", "decided_at"]
    check.save(update_fields=fields)


def _tell(check: LiveCheck, event_type: str, subject: str, text: str, evidence: dict[str, Any]) -> None:
    notify(project=check.project, event_type=event_type, subject=subject, text=text[:1].upper() + text[1:] + ".",
           payload=_payload(check, _brief(evidence)))


def _brief(evidence: dict[str, Any]) -> dict[str, Any]:
    """Evidence as a move or a notification carries it: the figures, without the page's trail of looks."""
    return {k: v for k, v in evidence.items() if k != "trail"}


# --- for the pages ------------------------------------------------------------------------------------------


def running_checks(*, project: Project) -> dict[str, LiveCheck]:
    """The check of each kind that is running or waits for a person (flagged), newest first."""
    out: dict[str, LiveCheck] = {}
    rows = (LiveCheck.objects.filter(project=project)
            .filter(Q(status=LiveCheckStatus.RUNNING) | Q(status=LiveCheckStatus.FLAGGED))
            .select_related("subject", "baseline", "decided_by").order_by("-started_at", "-id"))
    for check in rows:
        out.setdefault(check.kind, check)
    return out


def checks_of(*, project: Project, limit: int = 50) -> list[LiveCheck]:
    return list(LiveCheck.objects.filter(project=project).select_related("subject", "baseline", "decided_by",
                                                                          "event")[:limit])
