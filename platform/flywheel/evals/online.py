"""Online evaluation of live traffic: a sample of a project's new trajectories is scored as they arrive, per
model version, so a version's quality in production is measured by the same verifiers as offline.

- Settings (`online_settings_set`): off by default; a sample rate, a cap per clock hour, and the verifiers:
  (a) a task set's: a trajectory is scored by the verifier of a task whose declared tool names equal the
  trajectory's (the task with the same request when there is one, else the newest), at the task's turn and
  in its environment, through `promotion.score_episode`: the trainer's code path, as calibration and eval
  runs score; (b) an `llm_judge` on the project's own OpenAI-compatible endpoint, sent through the outbound
  guard (the operator's allowlist). Nothing is sent anywhere unless (b) is configured.
- Sampling (`sampled`): a trajectory is taken when a hash of (project, external_id) falls under the rate, so
  the same trajectory is taken or left the same way every time it is looked at (a re-run, a replay): no
  coin is tossed twice. Only trajectories that arrive after online evaluation was turned on, each considered
  once (the settings' watermark), at most `max_per_hour` per clock hour: past the cap, the hour's other
  sampled trajectories are left unscored (a cap, not a queue: a backlog never grows). Without a judge, only
  trajectories some task can score count towards the cap.
- The sweep (`online_eval_sweep`, in outbox.SWEEPS) hands a Celery task each project with new trajectories;
  the task (`online_eval_process`) claims a batch under the settings' row lock and scores it after.
- A score below the threshold puts the trajectory in the review queue (`low_score`, which the queue asks
  through `failures.queue.queue_reason_register`: the failures app sits below this one and never imports it).
- `scores_by_version`: per model_version string, how many were scored, the mean reward, the pass rate (with
  its 95% Wilson interval) and the share below the threshold, over a window: live metrics join these by the
  strings that name a version.

A sample is as good as it is random: the hash is uniform over external ids, so the scored trajectories are a
simple random sample of the hour's traffic until the cap binds; once it binds, the first ones of the hour
(by id) are taken, which leans towards the start of a busy hour. The page says when the cap bound.
A trajectory whose ingest committed after a later one was considered (ids are given out before commit) is
passed over by the watermark: rare, and unrelated to its content, so it thins the sample without biasing it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Avg, Count, Exists, Max, OuterRef, Q
from django.utils import timezone

from flywheel import fields, outbound, sealed, timelimits
from flywheel.accounts.models import Project
from flywheel.evals import calibration, promotion
from flywheel.evals import rows as row_shape
from flywheel.evals.kinds import train_side
from flywheel.evals.models import EnvType, OnlineEvalSettings, OnlineScore
from flywheel.registry.live import names_of
from flywheel.registry.sequential import wilson
from flywheel.trajectories.models import Trajectory
from trainer.verifiers import SpecError
from trainer.verifiers.base import Score
from trainer.verifiers.parsing import parse_completion
from trainer.verifiers.schemas import tool_index

logger = logging.getLogger(__name__)

BATCH = 2000  # trajectory ids considered per task run; the next sweep takes the rest
JUDGE = "llm_judge"
JUDGE_TIMEOUT_S = 30.0
MAX_PER_HOUR = 100_000


# --- settings ----------------------------------------------------------------------------------------------


def settings_of(*, project: Project) -> OnlineEvalSettings:
    """The project's settings; the defaults (off) unsaved when it never set any."""
    return OnlineEvalSettings.objects.filter(project=project).first() or OnlineEvalSettings(project=project)


def online_settings_set(*, project: Project, data: Mapping[str, Any], user: AbstractBaseUser | None = None
                        ) -> OnlineEvalSettings:
    """Replace the project's online evaluation settings with `data` (the page's form or the API's body: the
    same names). `judge_api_key` absent or None keeps the stored key; "" clears it. The key is bound to the
    judge_url's origin: a judge_url on another origin without the key given again (or cleared) is an error
    on judge_api_key, so a new address never receives the old one's key. Raises ValidationError naming each
    wrong field; nothing changes then. Turning it on starts from the trajectories that arrive from now on."""
    from flywheel.outbound import check_url_field

    errors: dict[str, str] = {}
    enabled = fields.flag(data, "enabled", errors, default=False)
    rate = fields.number(data, "sample_rate", errors, low=0.0, high=1.0, example="0.1 (a tenth of new trajectories)",
                         label="sample_rate, the share of new trajectories scored", required=True)
    cap = fields.whole(data, "max_per_hour", errors, low=1, high=MAX_PER_HOUR, label="max_per_hour", required=True)
    threshold = fields.number(data, "threshold", errors, low=0.0, high=1.0, label="threshold, a reward",
                              required=True)
    task_set = None
    raw_set = data.get("task_set")
    if raw_set not in (None, ""):
        pk = str(raw_set).strip()
        sets = train_side().collection.objects.filter(project=project)
        task_set = sets.filter(pk=int(pk)).first() if pk.isascii() and pk.isdigit() and len(pk) <= 18 else None
        if task_set is None:
            errors["task_set"] = f"task set {pk[:40]!r}: no such task set in {project.slug}"
        elif task_set.server_id is not None:
            errors["task_set"] = (f"task set {task_set.name!r} runs its tasks on an environment server; online "
                                  "evaluation sends nothing there: choose a task set without a server")
    judge_enabled = fields.flag(data, "judge_enabled", errors, default=False)
    url = str(data.get("judge_url") or "").strip()
    model = str(data.get("judge_model") or "").strip()
    rubric = str(data.get("judge_rubric") or "").strip()
    if judge_enabled:
        if not url:
            errors["judge_url"] = "the judge's OpenAI-compatible base URL (e.g. http://judge.internal:8000/v1)"
        if not model:
            errors["judge_model"] = "the model name the judge endpoint serves"
        if not rubric:
            errors["judge_rubric"] = "what a good answer does: the judge grades against it"
    if url:
        if len(url) > 500 or not url.startswith(("http://", "https://")):
            errors["judge_url"] = "an http:// or https:// URL of at most 500 characters"
        else:
            try:
                check_url_field(url, "judge_url")
            except ValidationError as exc:
                errors.update({k: "; ".join(v) for k, v in exc.message_dict.items()})
    if len(model) > 200:
        errors["judge_model"] = "at most 200 characters"
    key = data.get("judge_api_key")
    if key is not None and len(str(key)) > 500:
        errors["judge_api_key"] = "at most 500 characters"
    if enabled and task_set is None and not judge_enabled and "task_set" not in errors:
        errors["enabled"] = "choose what scores the trajectories first: a task set, the judge, or both"
    rebind = _key_rebind_error(OnlineEvalSettings.objects.filter(project=project).first(), url, key)
    if rebind and "judge_api_key" not in errors:
        errors["judge_api_key"] = rebind
    if errors:
        raise ValidationError({name: [message] for name, message in errors.items()})
    with transaction.atomic():
        config, _ = OnlineEvalSettings.objects.select_for_update().get_or_create(project=project)
        rebind = _key_rebind_error(config, url, key)  # again under the lock: a save may have come between
        if rebind:
            raise ValidationError({"judge_api_key": [rebind]})
        if enabled and not config.enabled:
            # From now on only: what arrived before was never a sample of this setting's traffic.
            config.enabled_at = timezone.now()
            config.watermark = Trajectory.objects.filter(project=project).aggregate(m=Max("id"))["m"] or 0
        config.enabled, config.sample_rate, config.max_per_hour, config.threshold = enabled, rate, cap, threshold
        config.task_set, config.judge_enabled = task_set, judge_enabled
        config.judge_url, config.judge_model, config.judge_rubric = url, model, rubric
        if key is not None:
            config.judge_api_key = str(key).strip()
        config.updated_by = user if user is not None and user.is_authenticated else None
        config.save()
    return config


def _key_rebind_error(config: OnlineEvalSettings | None, url: str, key: Any) -> str | None:
    if config is None:
        return None
    return outbound.secret_rebind_error(
        old_url=config.judge_url, new_url=url, secret_set=bool(config.judge_api_key), secret_given=key is not None,
        what="API key", clear_hint="clear it (\"Remove the stored key\"; in the API, judge_api_key \"\")")


# --- sampling ----------------------------------------------------------------------------------------------


def sample_point(project_id: int, external_id: str) -> float:
    """Where a trajectory falls in [0, 1): the first 8 bytes of SHA-256 over (project, external id). Uniform
    over distinct ids, and the same for the same trajectory every time."""
    digest = hashlib.sha256(f"{project_id}\x00{external_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def sampled(project_id: int, external_id: str, rate: float) -> bool:
    return sample_point(project_id, external_id) < rate


def _hour(now: dt.datetime) -> dt.datetime:
    return now.replace(minute=0, second=0, microsecond=0)


def cap_reached(config: OnlineEvalSettings, now: dt.datetime | None = None) -> bool:
    """Whether this hour's cap is used up: sampled trajectories are being left unscored until the hour ends."""
    return bool(config.enabled and config.cap_hour == _hour(now or timezone.now())
                and config.cap_used >= config.max_per_hour)


def _tool_names(tools: Any) -> frozenset[str]:
    return frozenset(tool_index(tools if isinstance(tools, list) else []) or {})


@dataclass(frozen=True)
class TaskVerifiers:
    """A task set's tasks that can score live traffic offline (no environment server), by their tool names."""

    label: str
    by_tools: dict[frozenset[str], list[Any]]

    @classmethod
    def of(cls, task_set: Any) -> TaskVerifiers | None:
        if task_set is None:
            return None
        by_tools: dict[frozenset[str], list[Any]] = {}
        for task in train_side().item.objects.filter(task_set=task_set).order_by("-pk"):
            env_type = task.env.get("type") if isinstance(task.env, dict) else EnvType.SINGLE_TURN
            if env_type in EnvType.values and isinstance(task.verifier, dict) and task.verifier:
                by_tools.setdefault(_tool_names(task.tools), []).append(task)
        return cls(f"task_set:{task_set.pk}", by_tools)

    def match(self, trajectory: Trajectory) -> Any:
        """The task whose declared tool names equal the trajectory's: the one with the same request when there
        is one, else the newest. None when no task declares exactly these tools."""
        tasks = self.by_tools.get(_tool_names(trajectory.tools)) or []
        digest = row_shape.prompt_digest(trajectory.messages) if tasks else ""
        same = [t for t in tasks if digest and t.prompt_digest == digest]
        return (same or tasks or [None])[0]


@dataclass
class Claimed:
    """What one run of the task took: the trajectories to score and the settings they are scored with."""

    config: OnlineEvalSettings | None = None
    tasks: TaskVerifiers | None = None
    considered: int = 0
    sampled: int = 0
    ids: list[int] = field(default_factory=list)


def _claim(project_id: int, now: dt.datetime) -> Claimed:
    """Under the settings' row lock: the next batch after the watermark, its sampled ids up to the hour's cap,
    and the watermark moved past the batch. Two runs never take the same trajectory."""
    claimed = Claimed()
    with transaction.atomic():
        config = (OnlineEvalSettings.objects.select_for_update(of=("self",)).select_related("task_set")
                  .filter(project_id=project_id, enabled=True).first())
        if config is None:
            return claimed
        claimed.config = config
        batch = list(Trajectory.objects.filter(project_id=project_id, id__gt=config.watermark,
                                               created_at__gte=config.enabled_at)
                     .order_by("id").values_list("id", "external_id")[:BATCH])
        if not batch:
            return claimed
        claimed.tasks = TaskVerifiers.of(config.task_set)
        if config.cap_hour != _hour(now):
            config.cap_hour, config.cap_used = _hour(now), 0
        picked = [pk for pk, external_id in batch if sampled(project_id, external_id, config.sample_rate)]
        claimed.considered, claimed.sampled = len(batch), len(picked)
        if not config.judge_enabled and picked:
            # Only a task can score them: a trajectory no task matches must not use up the hour's cap.
            tools = Trajectory.objects.filter(pk__in=picked).values_list("id", "tools")
            scorable = {pk for pk, declared in tools if claimed.tasks and _tool_names(declared) in claimed.tasks.by_tools}
            picked = [pk for pk in picked if pk in scorable]
        claimed.ids = picked[:max(0, config.max_per_hour - config.cap_used)]
        config.cap_used += len(claimed.ids)
        config.watermark = batch[-1][0]
        OnlineEvalSettings.objects.filter(pk=config.pk).update(watermark=config.watermark, cap_hour=config.cap_hour,
                                                               cap_used=config.cap_used)
    return claimed


# --- scoring -----------------------------------------------------------------------------------------------


def task_score(task: Any, trajectory: Trajectory) -> Score:
    """The task's verifier on the trajectory: at the task's turn (the nearest assistant turn), in its
    environment, as calibration scores a task's verifier (`calibration.Scoring`)."""
    scoring = calibration.Scoring.of(task)
    turn = promotion.default_message_index(trajectory, scoring.message_index)
    if turn is None:
        return Score(0.0, False, {"turn": {"ok": False, "reason": "no assistant turn to score"}}, "missing_call")
    turns = [m for m in trajectory.messages[turn:] if isinstance(m, dict) and m.get("role") == "assistant"]
    return promotion.score_episode(calibration._row(task.verifier, trajectory, turn, scoring), turns)


def judge_score(config: OnlineEvalSettings, trajectory: Trajectory) -> Score:
    """The project's judge on the trajectory's last answer and every call it made (`score_judge`, the
    verifier's own prompt and parsing). Raises what the endpoint or the outbound guard raises."""
    from trainer.verifiers.llm_judge import compile_judge, score_judge

    problems: list[str] = []
    spec = compile_judge({"type": JUDGE, "rubric": config.judge_rubric, "threshold": config.threshold,
                          "model": config.judge_model}, problems)
    if problems:
        raise SpecError(problems)
    assistant = [m for m in trajectory.messages if isinstance(m, dict) and m.get("role") == "assistant"]
    calls = [call for m in assistant for call in parse_completion(m).calls]
    last = assistant[-1] if assistant else {}
    answer = parse_completion(last).content if last else ""
    # A key that is set but that no key of this server opens raises here: the judge is not called without it.
    endpoint = {"endpoint": config.judge_url.rstrip("/"), "model": config.judge_model,
                "api_key": sealed.readable(config.judge_api_key) or None, "timeout": JUDGE_TIMEOUT_S}
    return score_judge(spec, answer, calls, config=endpoint)


def _judge_tokens(label: str, score: Score) -> dict[str, int | None]:
    """The judge's spend on a score (its answer's usage, read by the verifier), for OnlineScore's columns."""
    said = (score.checks.get("judge") or {}) if label == JUDGE else {}
    return {"input_tokens": said.get("input_tokens"), "output_tokens": said.get("output_tokens")}


def judge_spend(*, project: Project, start: dt.datetime | None = None, end: dt.datetime | None = None
                ) -> dict[str, int]:
    """The online judge's tokens over [start, end) of scoring time: input and output, and the scores."""
    from django.db.models import Count, Sum

    rows = OnlineScore.objects.filter(project=project, verifier=JUDGE)
    if start is not None:
        rows = rows.filter(scored_at__gte=start)
    if end is not None:
        rows = rows.filter(scored_at__lt=end)
    got = rows.aggregate(input_tokens=Sum("input_tokens"), output_tokens=Sum("output_tokens"), scores=Count("id"))
    return {k: v or 0 for k, v in got.items()}


def online_eval_process(*, project_id: int, now: dt.datetime | None = None) -> int:
    """Claim the project's next batch and score what it sampled; the number of scores stored."""
    claimed = _claim(project_id, now or timezone.now())
    config = claimed.config
    if config is None or not claimed.ids:
        return 0
    tasks = claimed.tasks
    scores: list[OnlineScore] = []
    errors: list[str] = []
    judge_down = False
    trajectories = (Trajectory.objects.filter(pk__in=claimed.ids).order_by("id")
                    .only("id", "project_id", "model_version", "messages", "tools").prefetch_related("signals"))
    try:
        for trajectory in trajectories:
            verdicts: list[tuple[str, str, Score]] = []
            task = tasks.match(trajectory) if tasks is not None else None
            if task is not None:
                try:
                    verdicts.append((tasks.label, task.row_id, task_score(task, trajectory)))
                except (SpecError, ValueError) as exc:  # the trainer refused the row: nothing to store
                    errors.append(f"{task.row_id} could not score trajectory {trajectory.pk}: {exc}")
            if config.judge_enabled and not judge_down:
                try:
                    verdicts.append((JUDGE, config.judge_model, judge_score(config, trajectory)))
                except timelimits.SoftTimeLimitExceeded:
                    raise
                except Exception as exc:  # the endpoint is a boundary we do not own: say why, leave it unscored
                    # One failure stops the judge for this run: a judge that is down would otherwise hold the
                    # worker for a timeout per trajectory. The run's other sampled trajectories go without it.
                    judge_down = True
                    errors.append(outbound.redact(f"the judge could not score trajectory {trajectory.pk} "
                                                  f"({type(exc).__name__}: {exc})"))
            now_scored = timezone.now()
            scores += [OnlineScore(project_id=project_id, trajectory_id=trajectory.pk,
                                   model_version=trajectory.model_version, verifier=label, source=source[:80],
                                   reward=score.reward, passed=score.passed, below_threshold=score.reward < config.threshold,
                                   failure=score.failure or "", checks=score.checks, scored_at=now_scored,
                                   **_judge_tokens(label, score))
                       for label, source, score in verdicts]
    except timelimits.SoftTimeLimitExceeded as exc:
        # What was scored is kept, and the page says where the run stopped: the batch's other sampled
        # trajectories go unscored (its watermark moved on when it was claimed).
        scored = len({score.trajectory_id for score in scores})
        errors.insert(0, f"{timelimits.stopped_reason(exc)} {scored} of the {len(claimed.ids)} sampled trajectories "
                         "were scored.")
    for error in errors:
        logger.warning("online evaluation of project %s: %s", project_id, error)
    # The page shows the last run's first problem (or none): a failing judge is said where people look.
    OnlineEvalSettings.objects.filter(pk=config.pk).update(
        last_error=errors[0][:500] if errors else "", last_error_at=timezone.now() if errors else None)
    OnlineScore.objects.bulk_create(scores, ignore_conflicts=True)  # a message run twice stores once
    return len(scores)


def online_eval_sweep() -> int:
    """The outbox sweep: hand the task each enabled project with trajectories past its watermark. Cheap: one
    query (an index scan per project); the scoring runs on a worker."""
    from flywheel import outbox
    from flywheel.evals.tasks import online_eval_task

    newer = Trajectory.objects.filter(project_id=OuterRef("project_id"), id__gt=OuterRef("watermark"))
    due = OnlineEvalSettings.objects.filter(enabled=True).filter(Exists(newer)).values_list("project_id", flat=True)
    sent = 0
    for project_id in due[:100]:
        try:
            outbox.send(online_eval_task, project_id)
        except outbox.BrokerUnavailable:
            break
        sent += 1
    return sent


# --- what the scores say -----------------------------------------------------------------------------------


def low_score() -> Q:
    """The review queue's condition for a trajectory with a score below its project's threshold."""
    return Q(Exists(OnlineScore.objects.filter(trajectory_id=OuterRef("pk"), below_threshold=True)))


def _summary(n: int, trajectories: int, reward: float | None, passed: int, below: int) -> dict[str, Any]:
    return {"n": n, "trajectories": trajectories, "mean_reward": reward, "pass_rate": passed / n if n else None,
            "pass_rate_ci": wilson(passed, n), "passed": passed, "below": below,
            "below_share": below / n if n else None}


def scores_by_version(*, project: Project, model_versions: Iterable[str] | None = None,
                      since: dt.datetime | None = None, until: dt.datetime | None = None,
                      verifier: str | None = None) -> dict[str, dict[str, Any]]:
    """Per model_version string (only `model_versions` when given; a version's strings are its names in
    live metrics), over scores made in [since, until): `n` scores, `trajectories` scored, `mean_reward`,
    `pass_rate` with its 95% Wilson interval `pass_rate_ci`, and `below_share` (the share under the
    threshold, i.e. sent to review). Each verifier's score counts once (narrow with `verifier`). One grouped
    query on (project, model_version, scored_at)."""
    qs = OnlineScore.objects.filter(project=project)
    if model_versions is not None:
        qs = qs.filter(model_version__in=list(model_versions))
    if since is not None:
        qs = qs.filter(scored_at__gte=since)
    if until is not None:
        qs = qs.filter(scored_at__lt=until)
    if verifier:
        qs = qs.filter(verifier=verifier)
    rows = (qs.values("model_version").order_by("model_version")
            .annotate(n=Count("id"), trajectories=Count("trajectory_id", distinct=True), reward=Avg("reward"),
                      passed=Count("id", filter=Q(passed=True)), below=Count("id", filter=Q(below_threshold=True))))
    return {r["model_version"]: _summary(r["n"], r["trajectories"], r["reward"], r["passed"], r["below"]) for r in rows}


def version_scores(*, project: Project, model_versions: Iterable[str], since: dt.datetime | None = None,
                   until: dt.datetime | None = None) -> dict[str, Any]:
    """The scores of one version (all its model_version strings together) over a window: `scores_by_version`'s
    figures summed over the strings, for a version's live metrics."""
    parts = scores_by_version(project=project, model_versions=model_versions, since=since, until=until)
    n = sum(p["n"] for p in parts.values())
    reward = sum(p["mean_reward"] * p["n"] for p in parts.values()) / n if n else None
    return _summary(n, sum(p["trajectories"] for p in parts.values()), reward,
                    sum(p["passed"] for p in parts.values()), sum(p["below"] for p in parts.values()))


def live_metrics_extra(*, project: Project, names: Iterable[str], since: dt.datetime, until: dt.datetime
                       ) -> dict[str, Any]:
    """A version's online scores as flat entries of its live metrics (`registry.live`'s `metrics`): the
    registry sits below this app and cannot import it, so the live metrics take these through a hook this app
    registers. Over scores made in [since, until): within a sweep of the trajectories' arrival."""
    figures = version_scores(project=project, model_versions=names, since=since, until=until)
    return {"online_scored": figures["n"], "online_mean_reward": figures["mean_reward"],
            "online_pass_rate": figures["pass_rate"], "online_pass_rate_ci": figures["pass_rate_ci"],
            "online_below_share": figures["below_share"]}


def live_source(*, project: Project, version: Any, start: dt.datetime, end: dt.datetime) -> dict[str, Any]:
    """`live_metrics_extra` for one registry version: the hook `registry.live.metric_source_register` takes."""
    return live_metrics_extra(project=project, names=names_of(project=project, version=version), since=start,
                              until=end)


def lowest_scored(*, project: Project, since: dt.datetime | None = None, limit: int = 20) -> list[OnlineScore]:
    """The lowest-scored trajectories of the window (lowest reward first, newest first among equals)."""
    qs = OnlineScore.objects.filter(project=project)
    if since is not None:
        qs = qs.filter(scored_at__gte=since)
    return list(qs.select_related("trajectory").only(
        "id", "trajectory_id", "model_version", "verifier", "source", "reward", "passed", "below_threshold",
        "failure", "scored_at", "trajectory__id", "trajectory__title", "trajectory__external_id",
        "trajectory__reviewed_outcome").order_by("reward", "-scored_at")[:limit])
