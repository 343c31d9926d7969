"""Training jobs, one function per action: create (with the leakage guard and the config checked field by
field), measure production and advise, confirm, run (the worker's side of the trainer's job contract),
cancel, retry from the last checkpoint, reap a job whose worker vanished, and finish (register the best
adapter as a version, make it the candidate, run the gate)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from flywheel import gpu_queue, outbound, outbox, runs, timelimits
from flywheel.accounts.models import Project, WorkerHeartbeat
from flywheel.accounts.services import gpus_visible, project_lock
from flywheel.environments.services import env_url_allowed
from flywheel.evals import leakage
from flywheel.registry import selectors as registry_selectors
from flywheel.supervise import Refused, supervise, trainer_env, worker_name
from flywheel.timelimits import SoftTimeLimitExceeded
from flywheel.training.models import Checkpoint, JobEvent, JobStatus, TrainingJob
from trainer import events, jobdir

logger = logging.getLogger(__name__)

# The field's recipe for a first GRPO job: 8 samples a prompt, an eval every 10 steps.
RECIPE: dict[str, Any] = {"num_generations_per_prompt": 8, "eval_interval": 10}
STDERR_TAIL = 4000


# --- creating a job ----------------------------------------------------------------------------------------------


def project_defaults(project: Project | None) -> dict[str, Any]:
    """The GRPOConfig values a project saved as its own recipe (empty when it saved none)."""
    from flywheel.training.models import TrainingDefaults

    found = TrainingDefaults.objects.filter(project=project).first() if project is not None else None
    return dict(found.config) if found else {}


def config_check(*, algorithm: str, config: dict[str, Any], project: Project | None = None) -> dict[str, Any]:
    """Every GRPOConfig field as a new job of `algorithm` runs it: the field's recipe, then the project's saved
    defaults, then the algorithm's own defaults, then the user's values, checked once by the trainer's config
    class (types and ranges). A wrong value is a field error named after the GRPOConfig field."""
    from trainer.config import ALGORITHM_DEFAULTS, GRPO_ALGORITHMS, SpecError, resolve_config

    if not isinstance(config, dict):
        raise ValidationError({"config": "The advanced settings must be a JSON object of GRPOConfig fields."})
    layers = {**(RECIPE if algorithm in GRPO_ALGORITHMS else {}), **project_defaults(project)}
    # An algorithm's own defaults win over the project's saved recipe, a GRPO one whose loss and KL mean
    # something else to DPO; only the user's values win over them.
    for name in ALGORITHM_DEFAULTS.get(algorithm, {}):
        layers.pop(name, None)
    try:
        resolved = resolve_config({**layers, **config}, algorithm).to_dict()
    except SpecError as exc:
        raise ValidationError({name.removeprefix("config."): message for name, message in exc.errors.items()}
                              ) from None
    limit = settings.FLYWHEEL_MAX_STEPS
    if 0 < limit < resolved["max_steps"]:
        raise ValidationError({"max_steps": f"At most {limit} steps a job (FLYWHEEL_MAX_STEPS), not "
                                            f"{resolved['max_steps']}."})
    return resolved


def job_config(job: TrainingJob):
    """The GRPOConfig a job runs with, read from what it stored: every field for a job made now, only the
    fields set for an older one (the rest resolve as the trainer resolves them). A name this trainer no longer
    knows is left out."""
    from dataclasses import fields

    from trainer.config import GRPOConfig, resolve_config

    known = {f.name for f in fields(GRPOConfig)}
    return resolve_config({k: v for k, v in (job.config or {}).items() if k in known}, job.algorithm)


def defaults_save(*, project: Project, config: dict[str, Any], user=None):
    """Make `config` (GRPOConfig values, checked like a job's) the project's own recipe; an empty one clears it."""
    from flywheel.training.models import TrainingDefaults

    if not config:
        TrainingDefaults.objects.filter(project=project).delete()
        return None
    config_check(algorithm="grpo", config=config)
    saved, _ = TrainingDefaults.objects.update_or_create(project=project,
                                                         defaults={"config": config, "updated_by": user})
    return saved


# The kinds the platform writes. `python` (code a row names) is for the trainer's command line only: from the
# platform it would let a task row run any code. `http` runs only on a server at a URL the operator lists
# (FLYWHEEL_ENV_URL_ALLOWLIST): a registered environment server's task sets write such rows.
PLATFORM_ENV_TYPES = ("single_turn", "replay", "workplace")


def rows_check(train_rows: list[dict], *suite_versions) -> list[str]:
    """Every row a job would read, checked by the trainer's own row validation, plus the platform's kinds."""
    from trainer.envs import validate_task

    problems = []
    for rows in (train_rows, *[v.rows for v in suite_versions if v is not None]):
        for row in rows:
            env = (row.get("env") or {}) if isinstance(row, dict) else {}
            kind = env.get("type", "single_turn")
            if kind == "http" and not env_url_allowed(str(env.get("url"))):
                problems.append(f"task {row.get('id')!r}: env.url {env.get('url')!r} is not an environment server "
                                "the operator allows (FLYWHEEL_ENV_URL_ALLOWLIST)")
            elif kind not in (*PLATFORM_ENV_TYPES, "http"):
                problems.append(f"task {row.get('id')!r}: env type {kind!r} runs from the trainer's command line "
                                "only, not from the platform")
            else:
                problems += validate_task(row)
    return problems


# A job holds one of its project's places (FLYWHEEL_MAX_JOBS_PER_PROJECT) until it ends.
UNFINISHED = (JobStatus.EVALUATING, JobStatus.READY, JobStatus.QUEUED, JobStatus.RUNNING)


def gpus_reported() -> int:
    """The most GPUs a job may ask for: the most any worker of the `gpu` queue reported when it started
    (WorkerHeartbeat.gpus). 1 when none has reported any: a one-process job runs on whatever its worker has (the
    CPU under `make run`), while more processes need a worker that said it has the devices."""
    queue = gpu_queue.queue_name()
    reported = [beat.gpus for beat in WorkerHeartbeat.objects.filter(gpus__isnull=False)
                if queue in (beat.queues or [])]
    return max([1, *reported])


def _limit_check(project: Project) -> None:
    runs.run_limit_check(TrainingJob, project=project, statuses=UNFINISHED,
                         limit=settings.FLYWHEEL_MAX_JOBS_PER_PROJECT, setting="FLYWHEEL_MAX_JOBS_PER_PROJECT")


def job_create(
    *, project: Project, task_set_version, holdout_version=None, regression_version=None,
    algorithm: str = "grpo", config: dict[str, Any] | None = None, num_gpus: int = 1, user=None,
    confirm: bool = False,
) -> TrainingJob:
    """A job in `evaluating`: a worker measures production on the holdout, then the advice waits for a person.

    Refused, with the conflicting rows listed, when the task set shares a trajectory or a request with the
    holdout or the regression suite (the leakage guard). Bounded: `num_gpus` by what the GPU workers reported
    (`gpus_reported`), `config.max_steps` by FLYWHEEL_MAX_STEPS and a suite's cases × eval samples by
    FLYWHEEL_MAX_EVAL_GENERATIONS (field errors); a project's jobs not yet ended by
    FLYWHEEL_MAX_JOBS_PER_PROJECT (Refused, 409)."""
    from flywheel.evals.runs import generations_problem
    from flywheel.evals.services import version_freeze

    errors: dict[str, Any] = {}
    if algorithm not in ALGORITHMS:
        errors["algorithm"] = "Choose grpo, sft, dpo or sft_grpo."
    elif algorithm == "dpo" and task_set_version is not None and not preference_pairs(task_set_version.rows):
        errors["algorithm"] = ("DPO needs pairs: promoted failures with the agent's output and a reference that "
                               "states the whole answer. This task set has none; choose grpo or sft.")
    elif (algorithm in ("sft", "sft_grpo") and task_set_version is not None
          and not any(map(imitable, task_set_version.rows))):
        errors["algorithm"] = ("SFT needs something to imitate: tasks with a reference or a solution, or good "
                               "trajectories. This task set has none; choose grpo.")
    gpus = gpus_reported()
    if not 1 <= int(num_gpus) <= gpus:
        errors["num_gpus"] = (f"Between 1 and {gpus} GPUs: the most a GPU worker reported having." if gpus > 1 else
                              "1 GPU: no GPU worker has reported more (a worker reports its GPUs when it starts).")
    for field, version in (("task_set_version", task_set_version), ("holdout_version", holdout_version),
                           ("regression_version", regression_version)):
        if version is None:
            continue
        owner = getattr(version, "task_set", None) or version.suite
        if owner.project_id != project.pk:
            errors[field] = "That version belongs to another project."
    if holdout_version is not None and holdout_version.suite.kind != "holdout":
        errors["holdout_version"] = "Choose a holdout suite."
    if task_set_version is None:
        errors["task_set_version"] = "Choose the task set version to train on."
    elif not task_set_version.rows:
        errors["task_set_version"] = "That task set version has no tasks."
    production = registry_selectors.production_of(project=project)
    if production is None:
        errors["model"] = "Register a base model on the Models page first: a job starts from production."
    merged: dict[str, Any] = {}  # every GRPOConfig field, as the job will run it
    try:
        merged = config_check(algorithm=algorithm, config=config or {}, project=project)
    except ValidationError as exc:
        errors.update({f"config.{k}" if k != "config" else k: v for k, v in exc.message_dict.items()})
    for version in (holdout_version, regression_version):
        if merged and version is not None and "config.eval_samples_per_prompt" not in errors and (
                problem := generations_problem(cases=version.size, samples=merged["eval_samples_per_prompt"])):
            errors["config.eval_samples_per_prompt"] = f"{version}: {problem}"
    if errors:
        raise ValidationError(errors)

    problems = rows_check(task_set_version.rows, holdout_version, regression_version)
    if problems:
        raise ValidationError({"task_set_version": problems[:20]})

    # The guard's own rules (the same trajectory, the same normalised request, any rule added to it), on the
    # frozen rows the job will read; a pair it is unsure of was put to a person when its row came in.
    conflicts = leakage.certain(
        conflict
        for suite_version in (holdout_version, regression_version) if suite_version is not None
        for conflict in leakage.rows_conflicts(rows=task_set_version.rows, other_rows=suite_version.rows,
                                               other_label=str(suite_version))
    )
    if conflicts:
        raise leakage.LeakageError(conflicts)

    with transaction.atomic():
        project_lock(project=project)
        _limit_check(project)
        for version in (task_set_version, holdout_version, regression_version):
            if version is not None:
                version_freeze(version=version, user=user)  # a job trains and measures on frozen rows only
        job = TrainingJob.objects.create(
            project=project, task_set_version=task_set_version, holdout_version=holdout_version,
            regression_version=regression_version, base_version=production, algorithm=algorithm,
            config=merged, num_gpus=int(num_gpus), max_steps=merged["max_steps"],
            status=JobStatus.EVALUATING, created_by=user, queued_at=timezone.now(), confirmed_in_advance=confirm,
        )
        _event(job, "created", data={"by": user.get_username() if user else None})
        outbox.send_on_commit(gpu_queue.gpu_turn_task, job.pk)
    return job


def _event(job: TrainingJob, kind: str, *, step: int | None = None, data: dict | None = None) -> JobEvent:
    return JobEvent.objects.create(job=job, attempt=job.attempt, kind=kind, step=step, data=data or {})


# --- the job directory -------------------------------------------------------------------------------------------


def job_dir(job: TrainingJob) -> Path:
    return Path(settings.FLYWHEEL_JOBS_DIR) / job.project.slug / f"job-{job.pk}"


def _prepare_dir(job: TrainingJob) -> Path:
    """spec.json and the three JSONL files, as the trainer's job contract says (`trainer.jobdir`)."""
    from trainer.config import write_jsonl

    folder = job_dir(job)
    folder.mkdir(parents=True, exist_ok=True)
    rows = job.task_set_version.rows
    write_jsonl(folder / jobdir.TRAIN, preference_pairs(rows) if job.algorithm == "dpo" else rows)
    suites = {"holdout": job.holdout_version, "regression": job.regression_version}
    for name, version in suites.items():
        if version is not None:
            write_jsonl(folder / jobdir.suite_file(name), version.rows)
    base = job.base_version
    spec = {
        "model": base.base.path,
        "adapter": base.adapter_path or None,
        "algorithm": job.algorithm,
        "config": job.config,
        "train": jobdir.TRAIN,
        **{name: jobdir.suite_file(name) if version else None for name, version in suites.items()},
        "tracking_uri": settings.MLFLOW_TRACKING_URI,
        "experiment_name": f"flywheel-{job.project.slug}",
        "run_name": f"job-{job.pk}",
        "num_gpus": job.num_gpus,
    }
    (folder / jobdir.SPEC).write_text(json.dumps(spec, indent=2))
    return folder


@contextlib.contextmanager
def _dir_lock(folder: Path):
    """One run per job directory at a time, across workers on this host: an flock held while it runs."""
    handle = (folder / ".lock").open("w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise Refused(f"{folder} is in use by another run") from None
    try:
        yield
    finally:
        handle.close()


# --- running the trainer -----------------------------------------------------------------------------------------


def trainer_command(job: TrainingJob, folder: Path) -> list[str]:
    """`python -m trainer train`, under torchrun on this host when the job takes more than one GPU."""
    from trainer.distributed import launch_command

    return launch_command(folder / jobdir.SPEC, job.num_gpus)


def _stderr_tail(path: Path) -> str:
    try:
        data = path.read_bytes()[-STDERR_TAIL:]
    except OSError:
        return ""
    return data.decode("utf-8", "replace").strip()


def _run_subprocess(job: TrainingJob, command: list[str], folder: Path, *,
                    on_event: Callable[[events.Event], None]) -> tuple[int, bool]:
    """Run the trainer, record its events, beat the heart, honour cancel. Returns (exit status, cancelled)."""
    kind = next((k for k in ("evaluate", "latency") if k in command), "train")
    stderr_path = jobdir.stderr_log(folder, job.attempt, kind)
    # Only what the trainer needs (no entry points, the outbound policy, none of the worker's secrets).
    env = trainer_env(MLFLOW_TRACKING_URI=settings.MLFLOW_TRACKING_URI)

    def on_tick() -> bool:
        TrainingJob.objects.filter(pk=job.pk).update(heartbeat_at=timezone.now())
        return TrainingJob.objects.filter(pk=job.pk, cancel_requested=True).exists()

    return supervise(command, cwd=folder, env=env, stderr_path=stderr_path, on_event=on_event,
                     on_start=lambda pid: TrainingJob.objects.filter(pk=job.pk).update(pid=pid), on_tick=on_tick)


# --- measuring production and advising ---------------------------------------------------------------------------


ALGORITHMS = ("grpo", "sft", "dpo", "sft_grpo")  # trainer.config.ALGORITHMS, without importing torch here


def imitable(row: dict[str, Any]) -> bool:
    """Whether SFT has something to learn from a task-set row (`trainer.sft.conversation` decides for good,
    replaying solutions; this is its cheap half): a solution, a stated or literal reference, or a good
    trajectory's own assistant turns."""
    from trainer.references import reference_messages

    if row.get("outcome") == "failure":
        return False
    return bool(row.get("solution")) or reference_messages(row) is not None or any(
        isinstance(m, dict) and m.get("role") == "assistant" for m in row.get("messages") or [])


def preference_pairs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """DPO rows from a task set's rows: each promoted failure whose reference states the whole answer
    (`trainer.references`), chosen, over the agent's own output at that turn, rejected (the trajectory's
    message right after the row's `messages`). Rows without either are left out."""
    from flywheel.evals.rows import origin_of
    from flywheel.trajectories.models import Trajectory
    from trainer.references import reference_messages

    wanted = {tid for row in rows if (tid := origin_of(row).trajectory_id) is not None}
    messages = dict(Trajectory.objects.filter(pk__in=wanted).values_list("pk", "messages")) if wanted else {}
    pairs = []
    for row in rows:
        trajectory = messages.get(origin_of(row).trajectory_id)
        chosen = reference_messages(row)
        at = len(row.get("messages") or [])
        if not trajectory or chosen is None or at >= len(trajectory) or trajectory[at].get("role") != "assistant":
            continue
        rejected = trajectory[at]
        if [rejected] == chosen:
            continue
        pairs.append({**row, "chosen": chosen, "rejected": rejected})
    return pairs


def advise(metrics: dict[str, Any] | None, *, pairs: int = 0) -> dict[str, Any]:
    """One recommendation from production's holdout results (and the promoted failures' preference pairs):
    the algorithm whose signal the holdout says is there, with why."""
    if not metrics:
        return {"recommendation": "grpo", "reason": "No holdout to measure on: train, but the gate cannot judge "
                "the result without a holdout suite.", "metrics": None, "pairs": pairs}
    success = float(metrics.get("success_rate", 0.0))
    n = int(metrics.get("n", 0)) or 1
    failures = metrics.get("failures") or {}
    format_share = failures.get("invalid_format", 0) / max(1, sum(failures.values()))
    if success < 0.05 and format_share < 0.5 and pairs:
        recommendation, reason = "dpo", (
            f"Production succeeds on {success:.0%} of the holdout: RL has no signal when nearly every sample "
            f"scores zero. The {pairs} promoted failures each give a preferred/rejected pair (the corrected "
            "reference over the agent's output): DPO learns from them without sampling.")
    elif success < 0.05:
        recommendation, reason = "sft_grpo", (
            f"Production succeeds on {success:.0%} of the holdout"
            + (f" and {format_share:.0%} of its failures are format errors" if format_share >= 0.5 else "")
            + ": RL has no signal when nearly every sample scores zero. Warm-start with SFT on references first, "
            "then GRPO: the sft_grpo algorithm does both in one job.")
    elif success >= 0.95:
        recommendation, reason = "none", (
            f"Production already succeeds on {success:.0%} of the holdout: little left to learn here. Add harder "
            "tasks or failures the holdout does not cover.")
    else:
        recommendation, reason = "grpo", (
            f"Production succeeds on {success:.0%} of the holdout: right sometimes, not reliably. That is where "
            "GRPO learns best.")
    return {"recommendation": recommendation, "reason": reason, "metrics": metrics, "pairs": pairs,
            "cases": n}


def _evaluate_command(job: TrainingJob, split: str, suite: Path, out: Path, *, adapter_path: str | None = None,
                      seed: int | None = None) -> list[str]:
    """Production (or, given `adapter_path`, a checkpoint of the job) on a whole suite: the one command both
    sides of the gate are measured by, with the job's sampling settings (samples, temperature, tokens, turns,
    sequence length, engine), so the two differ only in the adapter and the seed. A regression suite is
    sampled `regression_samples_per_prompt` times a case, the holdout `eval_samples_per_prompt`."""
    from flywheel.evals.runs import evaluate_command

    cfg = job_config(job)
    samples = cfg.regression_samples_per_prompt if split == "regression" else cfg.eval_samples_per_prompt
    return evaluate_command(
        model_path=job.base_version.base.path,
        adapter_path=job.base_version.adapter_path if adapter_path is None else adapter_path, suite=suite, out=out,
        samples=samples, temperature=cfg.eval_temperature, max_new_tokens=cfg.max_new_tokens,
        seed=seed, max_turns=cfg.max_turns, max_seq_len=cfg.max_seq_len, engine=cfg.rollout_engine,
    )


def _evaluate_claim(job_id: int) -> bool:
    """Take a job waiting for its measurement for this worker (compare-and-set: of two workers, one wins)."""
    now = timezone.now()
    return bool(TrainingJob.objects.filter(
        pk=job_id, status=JobStatus.EVALUATING, heartbeat_at__isnull=True, cancel_requested=False,
    ).update(worker=worker_name(), heartbeat_at=now, started_at=now))


def job_evaluate(*, job_id: int) -> TrainingJob | None:
    """The worker claims the job's measurement, then makes it (`job_evaluate_claimed`). A duplicate message
    finds it taken."""
    if not _evaluate_claim(job_id):
        return None
    return job_evaluate_claimed(job_id=job_id)


def job_evaluate_claimed(*, job_id: int) -> TrainingJob:
    """`_job_evaluate_claimed`, its device time recorded on the job (flywheel.runs.device_time): one device, as
    the measurement is one evaluate process whatever the job's num_gpus."""
    with runs.device_time(TrainingJob, job_id, gpus=gpus_visible()):
        job = _job_evaluate_claimed(job_id=job_id)
    job.refresh_from_db(fields=runs.USAGE_FIELDS)
    return job


def _job_evaluate_claimed(*, job_id: int) -> TrainingJob:
    """The worker measures production on the holdout (for the advice and the gate) and the regression suite
    (for the gate), then the job waits for a person to confirm."""
    job = TrainingJob.objects.select_related("project", "base_version__base", "task_set_version",
                                             "holdout_version__suite", "regression_version").get(pk=job_id)
    folder = _prepare_dir(job)
    metrics: dict[str, Any] = {}
    with _dir_lock(folder):
        for name, version in (("holdout", job.holdout_version), ("regression", job.regression_version)):
            if version is None:
                continue
            outcome = events.Outcome()
            try:
                status, _ = _run_subprocess(job, _evaluate_command(job, name, folder / jobdir.suite_file(name),
                                                                   jobdir.production_results(folder, name)),
                                            folder, on_event=outcome.on_event)
            except SoftTimeLimitExceeded as exc:
                return _fail(job, f"Measuring production on the {name} suite: {timelimits.stopped_reason(exc)}",
                             step=0)
            if status != 0 or "metrics" not in outcome.done:
                reason = (outcome.error
                          or _stderr_tail(jobdir.stderr_log(folder, job.attempt, "evaluate"))[-500:])
                return _fail(job, f"Measuring production on the {name} suite failed: {reason}", step=0)
            metrics[name] = outcome.done["metrics"]
    pairs = len(preference_pairs(job.task_set_version.rows))
    advice = advise(metrics.get("holdout"), pairs=pairs)
    if job.holdout_version is not None:
        advice["power"] = _holdout_power(job, jobdir.production_results(folder, "holdout"))
    TrainingJob.objects.filter(pk=job.pk, status=JobStatus.EVALUATING).update(
        status=JobStatus.READY, advice=advice, heartbeat_at=None,
    )
    job.refresh_from_db()
    _event(job, "advice", data=job.advice)
    if job.confirmed_in_advance:
        job_confirm(job=job)
        job.refresh_from_db()
    return job


def _holdout_power(job: TrainingJob, production_cases: Path) -> dict[str, Any]:
    """The smallest gain this job's holdout can show, from production's per-case rates just measured."""
    from flywheel.registry.gate import power_of
    from flywheel.registry.gate_runs import read_results, rules_for

    return power_of(read_results(production_cases), rules_for(job.project))


# --- confirm, run, cancel, retry ---------------------------------------------------------------------------------


def job_confirm(*, job: TrainingJob, user=None) -> TrainingJob:
    """A person read the advice and starts training."""
    with transaction.atomic():
        if not TrainingJob.objects.filter(pk=job.pk, status=JobStatus.READY).update(
            status=JobStatus.QUEUED, queued_at=timezone.now()
        ):
            raise Refused(f"The job is {job.get_status_display().lower()}: there is nothing to confirm.")
        job.refresh_from_db()
        _event(job, "confirmed", data={"by": user.get_username() if user else None})
        outbox.send_on_commit(gpu_queue.gpu_turn_task, job.pk)
    return job


def _measure_best(job: TrainingJob, folder: Path, done: dict[str, Any]) -> tuple[bool, str | None]:
    """The gate judges the chosen checkpoint as production was judged: the same command with the same
    settings on the whole holdout and regression suites (`_evaluate_command`), on fresh samples
    (jobdir.FRESH_SEED), written to `gate/`. The trainer's own evals may cap prompts, turns or sequence length
    differently, and the best of several looks is biased upwards by the samples that picked it. Then both
    models are timed on holdout cases for the latency rule (`_measure_latency`).
    Returns (cancelled, error)."""
    gate_dir = folder / "gate"
    for stale in [*gate_dir.glob("*.jsonl"), gate_dir / jobdir.LATENCY_NOT_MEASURED]:
        stale.unlink(missing_ok=True)  # an earlier attempt's: never judge this one by it
    looks = jobdir.holdout_looks(folder)
    best = int(done.get("best_step") or 0)
    if not done.get("adapter") or job.holdout_version is None:
        return False, None
    gate_dir.mkdir(exist_ok=True)
    for name, version in (("holdout", job.holdout_version), ("regression", job.regression_version)):
        if version is None:
            continue
        outcome = events.Outcome()
        command = _evaluate_command(job, name, folder / f"{name}.jsonl", gate_dir / f"{name}.jsonl",
                                    adapter_path=str(done["adapter"]), seed=jobdir.FRESH_SEED)
        status, cancelled = _run_subprocess(job, command, folder, on_event=outcome.on_event)
        if cancelled:
            return True, None
        if status != 0 or "metrics" not in outcome.done:
            reason = outcome.error or _stderr_tail(folder / f"stderr-{job.attempt}-evaluate.log")[-500:]
            return False, (f"Measuring the best checkpoint (step {best}) on fresh samples of the {name} suite "
                           f"failed: {reason}. Retry measures it again.")
        _event(job, "measured", step=best, data={
            "split": name, "metrics": outcome.done["metrics"], "seed": jobdir.FRESH_SEED, "looks": looks,
            "why": (f"step {best} was the best of {len(looks)} holdout evaluations: " if len(looks) > 1 else "")
                   + "the gate judges it as production was measured, on fresh samples of the whole suite"})
    return _measure_latency(job, folder, str(done["adapter"]), best), None


def _measure_latency(job: TrainingJob, folder: Path, adapter: str, best: int) -> bool:
    """Time production and the candidate case by case on the holdout (`python -m trainer latency`: one base
    model in one process, one request at a time, A/B/B/A per case), for the gate's latency rule, into
    `gate/LATENCY_RESULTS`. A failure never fails the job: the reason goes to `gate/LATENCY_NOT_MEASURED`, and
    the rule says it was not measured and why. Returns whether the job was cancelled meanwhile."""
    import sys
    import time

    from flywheel.registry.gate_runs import rules_for

    gate_dir = jobdir.gate_dir(folder)
    out = gate_dir / jobdir.LATENCY_RESULTS
    cases = rules_for(job.project).latency_cases
    cfg = job_config(job)
    engine = cfg.rollout_engine
    outcome = events.Outcome()
    wall_seconds = None
    reason = ""
    if cases == 0:
        reason = "the project's gate rules time no cases (latency_cases is 0)"
    elif engine != "hf":
        reason = (f"the job samples with {engine}; the latency probe times transformers generation only "
                  "(vLLM's per-request metrics would serve)")
    else:
        command = [sys.executable, "-m", "trainer", "latency", "--model", job.base_version.base.path,
                   "--adapter-a", job.base_version.adapter_path or "", "--adapter-b", adapter,
                   "--suite", str(folder / jobdir.suite_file("holdout")), "--cases", str(cases),
                   "--max-new-tokens", str(cfg.max_new_tokens), "--seed", str(jobdir.FRESH_SEED), "--out", str(out),
                   # One request at a time on one CPU thread: on a shared CPU more threads wait on each other
                   # and the timings spread (sd of the per-case log ratio 0.8 at two threads under load, 0.1 at
                   # one); a GPU's kernels do not depend on it.
                   "--threads", "1"]
        start = time.monotonic()
        try:
            status, cancelled = _run_subprocess(job, command, folder, on_event=outcome.on_event)
            wall_seconds = round(time.monotonic() - start, 2)  # with the start and model load
        except OSError as exc:
            status, cancelled, outcome.error = 1, False, str(exc)
        if cancelled:
            return True
        if status != 0 or not out.exists():
            tail = _stderr_tail(jobdir.stderr_log(folder, job.attempt, "latency"))[-300:]
            reason = f"the latency probe failed: {outcome.error or tail or f'exit status {status}'}"
    if reason:
        out.unlink(missing_ok=True)
        (gate_dir / jobdir.LATENCY_NOT_MEASURED).write_text(reason)
        _event(job, "latency", step=best, data={"measured": False, "why": reason})
    else:
        _event(job, "latency", step=best, data={"measured": True, "cases": outcome.done.get("cases"),
                                                "seconds": wall_seconds})
    return False


def _fail(job: TrainingJob, message: str, *, step: int | None) -> TrainingJob:
    message = outbound.redact(message)  # a trainer's error or stderr may quote a URL with its credentials
    TrainingJob.objects.filter(pk=job.pk).update(
        status=JobStatus.FAILED, error=message[:4000], failed_step=step, finished_at=timezone.now(), pid=None,
        heartbeat_at=None,
    )
    job.refresh_from_db()
    _event(job, "failed", step=step, data={"message": message[:4000]})
    return job


def _run_claim(job_id: int) -> bool:
    return runs.run_claim(TrainingJob, job_id, failed_step=None)


def job_run(*, job_id: int) -> TrainingJob | None:
    """The GPU worker's side: claim the job, then run it (`job_run_claimed`). A duplicate message finds the job
    no longer queued and does nothing."""
    if not _run_claim(job_id):
        return None
    return job_run_claimed(job_id=job_id)


def job_run_claimed(*, job_id: int) -> TrainingJob:
    """`_job_run_claimed`, its device time recorded on the job (flywheel.runs.device_time)."""
    processes = TrainingJob.objects.filter(pk=job_id).values_list("num_gpus", flat=True).first() or 1
    with runs.device_time(TrainingJob, job_id, gpus=gpus_visible(), processes=processes):
        job = _job_run_claimed(job_id=job_id)
    job.refresh_from_db(fields=runs.USAGE_FIELDS)
    return job


def _job_run_claimed(*, job_id: int) -> TrainingJob:
    """Run the trainer for a job this worker claimed, record its events, finish or fail it."""
    job = TrainingJob.objects.select_related("project", "base_version__base", "task_set_version",
                                             "holdout_version", "regression_version").get(pk=job_id)
    folder = _prepare_dir(job)
    last: dict[str, Any] = {"error": None, "done": None, "eval": {}}

    def on_event(event: events.Event) -> None:
        kind, step, data = event.kind, event.step, event.data
        if kind == "eval" and "case" in data:
            return  # per-case rows stay in the job directory's files
        JobEvent.objects.create(job=job, attempt=job.attempt, kind=kind, step=step, data=data)
        if kind == "step" and step is not None:
            TrainingJob.objects.filter(pk=job.pk).update(step=step, heartbeat_at=timezone.now())
        elif kind == "eval" and step is not None:
            last["eval"][step] = data.get("metrics") or {}
        elif kind == "checkpoint" and step is not None:
            best = bool(data.get("best"))
            if best:
                Checkpoint.objects.filter(job=job).update(best=False)
            Checkpoint.objects.update_or_create(job=job, step=step, defaults={
                "path": str(data.get("path", "")), "holdout": last["eval"].get(step, {}), "best": best,
            })
        elif kind == "error":
            last["error"] = event.record()
        elif kind == "done":
            last["done"] = event.record()

    measure_error = None
    try:
        with _dir_lock(folder):
            status, cancelled = _run_subprocess(job, trainer_command(job, folder), folder, on_event=on_event)
            if status == 0 and not cancelled and last["done"] is not None:
                cancelled, measure_error = _measure_best(job, folder, last["done"])
    except Refused as exc:
        return _fail(job, str(exc), step=job.step)
    except SoftTimeLimitExceeded as exc:  # supervise killed the trainer's process group on the way out
        job.refresh_from_db()
        return _fail(job, f"{timelimits.stopped_reason(exc)} Retry resumes from the last checkpoint.", step=job.step)
    job.refresh_from_db()
    if cancelled:
        TrainingJob.objects.filter(pk=job.pk).update(status=JobStatus.CANCELLED, finished_at=timezone.now(),
                                                    pid=None, heartbeat_at=None)
        _event(job, "cancelled", step=job.step)
        job.refresh_from_db()
        return job
    if measure_error:
        return _fail(job, measure_error, step=job.step)
    if status == 0 and last["done"] is not None:
        return job_finish(job=job, done=last["done"])
    if last["error"] is not None:
        return _fail(job, str(last["error"].get("message", "the trainer failed")), step=last["error"].get("step"))
    tail = _stderr_tail(jobdir.stderr_log(folder, job.attempt, "train"))
    return _fail(job, f"The trainer exited with status {status} without saying why. Last lines of its log:\n{tail}",
                 step=job.step)


def job_cancel(*, job: TrainingJob, user=None) -> TrainingJob:
    """Ask the worker to stop the trainer (its whole process group). A job not yet running stops at once."""
    with transaction.atomic():
        job = runs.run_cancel(job)
        _event(job, "cancel requested" if job.status == JobStatus.RUNNING else "cancelled",
               data={"by": user.get_username() if user else None})
    return job


def job_retry(*, job: TrainingJob, user=None) -> TrainingJob:
    """Queue a failed or cancelled job again: training when production was measured, else the measurement.
    The trainer resumes from the last checkpoint in its directory. Refused, like a new job, when the project has
    as many jobs not yet ended as its limit."""
    measured = bool(job.advice)
    with transaction.atomic():
        project_lock(project=job.project)
        _limit_check(job.project)
        job = runs.run_retry(job, task=gpu_queue.gpu_turn_task,
                             status=JobStatus.QUEUED if measured else JobStatus.EVALUATING)
        checkpoint = Checkpoint.objects.filter(job=job).order_by("-step").first()
        _event(job, "retried", data={"by": user.get_username() if user else None,
                                     "resume_from_step": checkpoint.step if checkpoint else None})
    return job


def job_reap() -> int:
    """Fail running jobs whose heartbeat stopped: their worker vanished (killed, host lost). Retry resumes."""
    failed, _ = runs.run_reap(TrainingJob)
    for job in failed:
        _event(job, "reaped", step=job.step, data={"worker": job.worker})
    return len(failed)


def training_sweep() -> int:
    """The outbox sweep: reap vanished runs, and send again jobs that waited too long for a worker."""
    return job_reap() + runs.run_requeue(TrainingJob, task=gpu_queue.gpu_turn_task)


# What the `gpu` queue's turns run of this app (flywheel.gpu_queue.KINDS): a job's measurement of production,
# then its training.
GPU_WORK = (
    gpu_queue.GpuWork(name="measure production", model=TrainingJob,
                      waiting=Q(status=JobStatus.EVALUATING, heartbeat_at__isnull=True, cancel_requested=False),
                      claim=_evaluate_claim, run=lambda pk: job_evaluate_claimed(job_id=pk)),
    gpu_queue.GpuWork(name="train", model=TrainingJob, waiting=Q(status=JobStatus.QUEUED, cancel_requested=False),
                      claim=_run_claim, run=lambda pk: job_run_claimed(job_id=pk)),
)


# --- finishing: the candidate and the gate -----------------------------------------------------------------------


def _lineage(job: TrainingJob) -> dict[str, Any]:
    from flywheel.evals.rows import origins_of

    origins = origins_of(job.task_set_version.rows)  # what the dashboard recomputes while the job is there
    return {
        "job": job.pk,
        "task_set_version": str(job.task_set_version),
        "task_set_hash": job.task_set_version.content_hash[:12],
        "failure_modes": sorted(origins.failure_modes),
        "trajectories": sorted(origins.trajectories)[:200],
    }


def job_finish(*, job: TrainingJob, done: dict[str, Any]) -> TrainingJob:
    """Register the best adapter as a version, make it the candidate, run the gate against production, and
    only then say the job succeeded: a page that sees `succeeded` sees the candidate and its verdict too."""
    from flywheel.registry import services as registry
    from flywheel.registry.gate_runs import gate_decide_for_job

    adapter = done.get("adapter")
    decision = None
    with transaction.atomic():
        job.result = done
        job.mlflow_run_id = done.get("mlflow_run_id") or ""
        if adapter:
            job.candidate_version = registry.model_version_create(
                project=job.project, base=job.base_version.base, adapter_path=str(adapter), lineage=_lineage(job),
                description=f"Job {job.pk}, best checkpoint at step {done.get('best_step')}", user=job.created_by,
            )
            registry.alias_move(project=job.project, alias="candidate", version=job.candidate_version,
                                user=job.created_by, reason=f"Best checkpoint of job {job.pk}")
            decision = gate_decide_for_job(job=job, folder=job_dir(job))
            _record_eval_runs(job=job, best_step=int(done.get("best_step") or 0))
        job.status = JobStatus.SUCCEEDED
        job.finished_at = timezone.now()
        job.pid = None
        job.heartbeat_at = None
        job.save(update_fields=["result", "mlflow_run_id", "candidate_version", "status", "finished_at", "pid",
                                "heartbeat_at"])
    if decision is not None and decision.passed:
        _auto_promote(job=job)
    return job


def _record_eval_runs(*, job: TrainingJob, best_step: int) -> None:
    """The job's measurements as eval runs: production before training and the candidate's best checkpoint,
    on the holdout and the regression suite, so the dashboard and the runs page read the gate's numbers."""
    from flywheel.evals.runs import eval_run_record
    from flywheel.registry.gate_runs import candidate_results

    folder = job_dir(job)
    checkpoint = Checkpoint.objects.filter(job=job, step=best_step).first()
    for split, suite_version in (("holdout", job.holdout_version), ("regression", job.regression_version)):
        if suite_version is None:
            continue
        production = jobdir.production_results(folder, split)
        candidate = candidate_results(folder, split, best_step)
        if production.exists():
            metrics = (job.advice or {}).get("metrics") if split == "holdout" else {}
            eval_run_record(project=job.project, model_version=job.base_version, suite_version=suite_version,
                            cases=jobdir.read_cases(production), metrics=metrics or {}, job=job, step=0)
        if candidate.exists():
            if candidate == jobdir.gate_results(folder, split):  # measured afresh: its metrics, not the trainer's
                event = (JobEvent.objects.filter(job=job, attempt=job.attempt, kind="measured",
                                                 data__split=split).order_by("-id").first())
                metrics = event.data.get("metrics") if event else {}
            else:
                metrics = checkpoint.holdout if (checkpoint and split == "holdout") else {}
            eval_run_record(project=job.project, model_version=job.candidate_version, suite_version=suite_version,
                            cases=jobdir.read_cases(candidate), metrics=metrics or {}, job=job, step=best_step)


def _auto_promote(*, job: TrainingJob) -> None:
    """Projects that opted in promote a candidate that passed the gate at once; others click Promote."""
    from flywheel.registry import services as registry
    from flywheel.registry.models import RegistrySettings

    config = RegistrySettings.objects.filter(project=job.project).first()
    if not (config and config.auto_promote):
        return
    try:
        registry.model_promote(project=job.project, version=job.candidate_version, actor="gate",
                               reason=f"Passed the gate (job {job.pk}); automatic promotion is on")
        _event(job, "promoted", data={"version": job.candidate_version.number})
    except registry.RegistryError as exc:
        _event(job, "promotion failed", data={"message": str(exc)})


def job_page_data(*, job: TrainingJob, after_id: int = 0) -> dict[str, Any]:
    """The curves' points and the events after `after_id`, for the job page's polling."""
    points: dict[str, list] = {"step": [], "reward": [], "kl": [], "completion_length": []}
    holdout: dict[str, list] = {"step": [], "success_rate": []}
    for event in JobEvent.objects.filter(job=job, kind__in=("step", "eval")).order_by("id"):
        if event.kind == "step" and event.step is not None:
            points["step"].append(event.step)
            points["reward"].append(event.data.get("reward_mean", event.data.get("reward")))
            points["kl"].append(event.data.get("kl"))
            points["completion_length"].append(event.data.get("completion_length",
                                                              event.data.get("mean_completion_tokens")))
        elif event.kind == "eval" and event.step is not None and (event.data.get("split", "holdout") == "holdout"):
            holdout["step"].append(event.step)
            holdout["success_rate"].append((event.data.get("metrics") or {}).get("success_rate"))
    return {"train": points, "holdout": holdout}
