"""The Models page's canary and watch: the panel's figures and what happens next, a person's decision
(start a canary, promote it, roll it back), the rules form, and a live check's page with its looks."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from flywheel.accounts.access import project_view
from flywheel.accounts.models import Project, Role
from flywheel.registry import canary, selectors, sequential, services
from flywheel.registry.models import (
    Alias,
    AliasAssignment,
    LiveCheck,
    LiveCheckKind,
    LiveCheckStatus,
    ModelVersion,
)

ACTORS = {"gate": "the gate (automatic promotion)", "canary": "the canary decision", "watch": "the watch"}


def _rate(value: float | None) -> str:
    return "—" if value is None else f"{value:.1%}"


def arms(check: LiveCheck) -> list[dict[str, Any]]:
    """Each arm of the last look for a table: version, n, the failure rate over known outcomes, the unknown
    share, and the unsafe rate over triaged trajectories (a look saved before those counts: over n)."""
    look = check.evidence.get("look") or {}
    out = []
    for side, version in (("subject", check.subject), ("baseline", check.baseline)):
        counts = look.get(side) or {}
        n = int(counts.get("n", 0))
        known, triaged = int(counts.get("known", n)), int(counts.get("triaged", n))
        out.append({"side": side, "version": version.number, "n": n, "known": known,
                    "failure": _rate(counts.get("failures", 0) / known if known else None),
                    "unknown": _rate((n - known) / n if n else None),
                    "unsafe": _rate(counts.get("unsafe", 0) / triaged if triaged else None)})
    return out


def bound_text(check: LiveCheck) -> str:
    """The canary's bound on its failure increase against its tolerance, as a phrase; "" for the watch."""
    if check.kind != LiveCheckKind.CANARY:
        return ""
    look = check.evidence.get("look") or {}
    tolerance = float(check.rules.get("tolerance", sequential.TOLERANCE))
    upper = look.get("upper")
    if upper is None:
        return f"failure increase not bounded yet (tolerance {tolerance:.0%})"
    return f"failure increase at most {max(upper, 0.0):.1%} points (always-valid bound; tolerance {tolerance:.0%})"


def trusted_text(check: LiveCheck) -> str:
    """What an automatic action of the check counts (flywheel.registry.evidence), as a sentence; "" before a look."""
    trusted = check.evidence.get("trusted")
    if not trusted:
        return ""
    s, b = trusted.get("subject") or {}, trusted.get("baseline") or {}
    text = (f"Vouched for by the router, and counted for an automatic action: {s.get('n', 0)} of v{check.subject.number}'s "
            f"trajectories and {b.get('n', 0)} of v{check.baseline.number}'s.")
    split = trusted.get("split") or {}
    if split.get("imbalanced"):
        text += (f" The split is far from the weight ({split['share']:.1%} on {split.get('on') or 'the canary'} "
                 f"where {split['weight']:.1%} was expected): nothing acts by itself.")
    return text


def next_step(check: LiveCheck) -> str:
    """What will happen next and when, in a sentence a maintainer reads on the panel."""
    rules, look = check.rules, check.evidence.get("look") or {}
    v, b = f"v{check.subject.number}", f"v{check.baseline.number}"
    every = f"every {settings.FLYWHEEL_SWEEP_INTERVAL_S:g} s"
    worse = (f"shown worse (always-valid p ≤ {sequential.RULE_ALPHA:.3g} on failures, on unsafe actions or on "
             "unknown outcomes)")
    when = timezone.localtime(check.ends_at).strftime("%Y-%m-%d %H:%M")
    verdict = check.evidence.get("verdict")
    held = check.evidence.get("held")  # why a rule that acts by itself did not (flywheel.registry.evidence)
    if check.kind == LiveCheckKind.CANARY:
        if check.status == LiveCheckStatus.FLAGGED:
            if verdict == "worse":
                if held:
                    return (f"{v} was {worse}, but it was not rolled back by itself: {held}. Roll it back, or "
                            "promote it anyway.")
                return f"{v} was {worse}, and this project does not act by itself: roll it back, or promote it anyway."
            refused = check.evidence.get("refused") or held
            return (f"No harm found with {rules.get('min_per_arm')} known outcomes in each arm and the failure rate's "
                    f"increase bounded within {float(rules.get('tolerance', sequential.TOLERANCE)):.0%}: promote {v} to all "
                    f"traffic, or roll it back." + (f" It was not promoted by itself: {refused}" if refused else ""))
        if check.status != LiveCheckStatus.RUNNING:
            return check.get_status_display() + "."
        auto = bool(rules.get("auto"))
        n_s = (look.get("subject") or {}).get("known", (look.get("subject") or {}).get("n", 0))
        n_b = (look.get("baseline") or {}).get("known", (look.get("baseline") or {}).get("n", 0))
        upper = look.get("upper")
        bound = "not bounded yet" if upper is None else f"at most {upper:.1%} points now"
        tolerance = float(rules.get("tolerance", sequential.TOLERANCE))
        return (f"Looked at {every}. If {v} is {worse} it is "
                + ("rolled back at once" if auto else "flagged for you") + ". Once each arm has "
                f"{rules.get('min_per_arm')} known outcomes (now {n_s} and {n_b}) with no harm found, and the failure "
                f"rate's increase is bounded within {tolerance:.0%} ({bound}), it is "
                + ("promoted to all traffic" if auto else "flagged ready for you to promote")
                + f". If neither has happened by {when} it is removed (expired).")
    if check.status == LiveCheckStatus.FLAGGED:
        why = (f"it was not rolled back by itself: {held}" if held else "this project does not roll back by itself")
        against = f"{b}'s holdback" if float(rules.get("holdback") or 0) > 0 else f"{b}'s traffic before the move"
        return (f"Production {v} is {worse} against {against}, and {why}: roll back to {b} "
                "from the Production panel, or leave it.")
    if check.status != LiveCheckStatus.RUNNING:
        return check.get_status_display() + "."
    limit = int(rules.get("trajectories") or 0)
    holdback = float(rules.get("holdback") or 0)
    if holdback > 0:
        compared = f"{v}'s traffic since the move against {b}'s holdback ({holdback:.0%} of traffic, the same hours)"
        acts = f"rolled back to {b} at once" if rules.get("rollback") else "flagged for you"
    else:
        compared = (f"{v}'s traffic since the move against {b}'s in the {rules.get('hours')} h before (no holdback: "
                    "flagged only, never rolled back by itself, since other hours differ)")
        acts = "flagged for you"
    return (f"Looked at {every}: {compared}. "
            f"If {v} is {worse} it is " + acts
            + f". Passes at {when}" + (f" or after {limit} trajectories" if limit else "") + " with no harm found.")


def rules_text(check: LiveCheck) -> str:
    """The rules a check runs under, as a sentence."""
    r = check.rules
    if check.kind == LiveCheckKind.CANARY:
        return (f"a {float(r.get('weight', 0)):.0%} share, {r.get('min_per_arm')} known outcomes per arm and a "
                f"failure increase bounded within {float(r.get('tolerance', sequential.TOLERANCE)):.0%} before a "
                f"promotion, at most {r.get('max_hours')} h, "
                + ("acts by itself" if r.get("auto") else "a person decides"))
    holdback = float(r.get("holdback") or 0)
    return (f"{r.get('hours')} h" + (f" or {r['trajectories']} trajectories" if r.get("trajectories") else "")
            + (f", a {holdback:.0%} holdback on the replaced version" if holdback else ", no holdback")
            + ", " + ("rolls back by itself" if r.get("rollback") else "flags for a person"))


def live_context(*, project: Project) -> dict[str, Any]:
    """What the Models page's canary and watch panel needs."""
    current = AliasAssignment.objects.filter(project=project, alias=Alias.CANARY).select_related("version__base").first()
    checks = canary.running_checks(project=project)
    config = selectors.settings_of(project=project)
    panel = []
    for kind in (LiveCheckKind.CANARY, LiveCheckKind.WATCH):
        check = checks.get(kind)
        if check is not None:
            panel.append({"check": check, "arms": arms(check), "next": next_step(check),
                          "look": check.evidence.get("look") or {}, "trusted": trusted_text(check),
                          "bound": bound_text(check)})
    from flywheel.registry.serving import serving_split

    return {"canary_alias": current, "live_panel": panel, "live_rules": canary.live_rules_of(config),
            "holdback": serving_split(project)["holdback"],
            "canary_percent": f"{config.canary_weight:.0%}", "canary_percent_number": round(config.canary_weight * 100),
            "live_checks": canary.checks_of(project=project, limit=10),
            "actors": ACTORS}


def _page_error(request: HttpRequest, project: Project, message: str, status: int) -> HttpResponse:
    from flywheel.registry.views import _context

    return render(request, "registry/models.html", _context(request, project, action_error=message), status=status)


def _back(project: Project, note: str) -> HttpResponse:
    from flywheel.registry.views import _back as back

    return back(project, note)


@require_POST
@project_view(Role.MAINTAINER)
def version_canary(request: HttpRequest, project: Project, version_number: int) -> HttpResponse:
    version = get_object_or_404(ModelVersion, project=project, number=version_number)
    # The page's field is a percent (10); `weight`, the API's fraction (0.1), is taken too.
    percent, raw = request.POST.get("percent", "").strip(), request.POST.get("weight", "").strip()
    try:
        weight = float(percent) / 100 if percent else (float(raw) if raw else None)
    except ValueError:
        return _page_error(request, project, "The canary's share is a percent of traffic, like 10.", 400)
    try:
        canary.canary_start(project=project, version=version, user=request.user, weight=weight,
                            reason=request.POST.get("reason", ""))
    except ValidationError as exc:
        return _page_error(request, project, " ".join(exc.messages), 400)
    except services.RegistryError as exc:
        return _page_error(request, project, str(exc), 409)
    return _back(project, "canary")


def _decide(request: HttpRequest, project: Project, decide, done: str) -> HttpResponse:  # noqa: ANN001
    """A person's decision on the canary: back to the Models page, or the page with why not (409)."""
    try:
        decide(project=project, user=request.user, reason=request.POST.get("reason", ""))
    except services.RegistryError as exc:
        return _page_error(request, project, str(exc), 409)
    return _back(project, done)


@require_POST
@project_view(Role.MAINTAINER)
def canary_promote(request: HttpRequest, project: Project) -> HttpResponse:
    return _decide(request, project, canary.canary_promote, "canary-promoted")


@require_POST
@project_view(Role.MAINTAINER)
def canary_rollback(request: HttpRequest, project: Project) -> HttpResponse:
    return _decide(request, project, canary.canary_rollback, "canary-rolled-back")


@require_POST
@project_view(Role.MAINTAINER)
def live_rules_save(request: HttpRequest, project: Project) -> HttpResponse:
    from flywheel.registry.views import _context

    data = {name: request.POST.get(name, "") for name in canary.LIVE_RULE_FIELDS}
    for name in ("canary_auto", "watch_rollback"):  # an unticked box is not sent
        data[name] = "true" if request.POST.get(name) == "on" else "false"
    try:
        canary.live_rules_set(project=project, data=data)
    except ValidationError as exc:
        context = _context(request, project, live_errors=exc.message_dict, live_form=data)
        return render(request, "registry/models.html", context, status=422)
    return _back(project, "live-rules")


@require_GET
@project_view()
def live_check_page(request: HttpRequest, project: Project, check_id: int) -> HttpResponse:
    check = get_object_or_404(LiveCheck.objects.select_related("subject", "baseline", "decided_by", "event"),
                              project=project, pk=check_id)
    trail = [{"at": at, "subject_n": sn, "baseline_n": bn, "failure_p": fp, "unsafe_p": up}
             for at, sn, bn, fp, up in check.evidence.get("trail", [])]
    chart = {"n": [t["subject_n"] for t in trail], "failure_p": [t["failure_p"] for t in trail],
             "unsafe_p": [t["unsafe_p"] for t in trail], "alpha": sequential.RULE_ALPHA,
             "x_label": f"v{check.subject.number} trajectories" + (" (canary)" if check.kind == "canary" else "")}
    return render(request, "registry/live_check.html", {
        "project": project, "check": check, "arms": arms(check), "next": next_step(check), "chart": chart, "rules": rules_text(check),
        "look": check.evidence.get("look") or {}, "trail": list(reversed(trail)), "alpha": sequential.RULE_ALPHA,
        "bound": bound_text(check),
        "is_maintainer": request.membership.grants(Role.MAINTAINER),
        "canary_serving": check.kind == LiveCheckKind.CANARY and AliasAssignment.objects.filter(
            project=project, alias=Alias.CANARY, version=check.subject).exists(),
    })
