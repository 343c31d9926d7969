"""The whole loop on real parts: PostgreSQL and Redis in CI, a real Celery worker, the real trainer on the tiny
CPU model, MLflow, and a webhook receiver on a local port.

1. Production fails: its failed trajectories are ingested, a reviewer promotes them (the promotion service,
   both verifier checks) into a task set of workplace tasks; a holdout suite of workplace tasks is frozen
   beside them. One click (`job_create(confirm=True)`) measures production, trains, and the gate
   judges the best checkpoint; it passes with every rule's values read from the files both models wrote.
   A maintainer promotes it, then rolls it back: the alias history says who, when, from, to and why, and
   the receiver gets one signed delivery per move, in order.
2. The same recipe with a reward that pays for long argument values instead of the right call: the trainer
   learns what it is paid for (its train reward rises) and the gate rejects the candidate.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from statistics import mean

import pytest

from flywheel.environments.models import TaskSet, TaskSetVersion
from flywheel.evals import rows as row_shape
from flywheel.evals.models import EvalSuite, EvalSuiteVersion
from flywheel.registry import mlflow_bridge
from flywheel.registry import services as registry
from flywheel.registry.models import AliasEvent, GateDecision, RegistrySettings, SyncState
from flywheel.training import services as training
from flywheel.training.models import Checkpoint, JobEvent, JobStatus, TrainingJob

pytestmark = pytest.mark.slow

# The recipe of the second test (a reward that pays for length): the learning test's sampling (G=8,
# temperature 1, grpo loss, no KL), 40 steps of 16 prompts at 5e-4, the holdout sampled at temperature 0.5.
RECIPE = {
    "num_prompts_per_step": 16, "num_generations_per_prompt": 8, "max_new_tokens": 48, "temperature": 1.0,
    "learning_rate": 5e-4, "max_steps": 40, "eval_interval": 40, "eval_samples_per_prompt": 8,
    "eval_temperature": 0.5, "loss_type": "grpo", "beta": 0.0, "scale_rewards": "group", "r": 16, "alpha": 32,
    "seed": 0, "train_batch_size": 64, "num_threads": 1,
}
# The loop's job is the learning test's (tests/trainer/test_learning.py: workplace tasks judged on the final
# state, 80 steps at 1e-3, the holdout sampled at temperature 1), on 240 promoted failures. The tiny model is
# built on each machine and its weights follow the CPU's numerics, so what a recipe does differs between
# machines: on one (AVX2 only) a 40-step job at 5e-4 on 64 single-call failures, sampled at 0.5, gained
# +0.013 (it gained +0.04 where it was written), and 80 steps or 1e-3 did no better; this job gained +0.086
# there (0.287 -> 0.372), as the learning test does on every machine measured.
LOOP_RECIPE = {**RECIPE, "learning_rate": 1e-3, "max_steps": 80, "eval_interval": 80, "eval_temperature": 1.0}
# The gate: a paired bootstrap on per-case success rates (8 samples a case), because on 48 cases a pass/fail
# McNemar sees only the few cases whose majority flips; at 90% confidence. Latency is allowed to double:
# production and candidate are timed by different processes on two busy shared cores, where a 10% bound
# measures the neighbours, not the model. Invalid outputs may rise by three points: at 1e-3 the adapter
# writes malformed JSON now and then (measured on an AVX2-only machine: 1.6% -> 3.4% of samples, while
# success rose 0.287 -> 0.372); a project that trades that for success says so in its rules.
# No regression suite in this test (see below), which the project's rules allow.
GATE_RULES = {"test": "bootstrap", "confidence": 0.9, "latency_tolerance": 1.0, "invalid_tolerance": 0.03,
              "require_regression": False}
TRAIN_TASKS = 240
HOLDOUT_CASES = 48
SECRET = "e2e-secret"
WAIT_S = 600  # a bound for a stuck worker only; the job takes a fraction of it


# --- the production agent's failures ------------------------------------------------------------------------------


def _solution_call(task: dict) -> dict:
    call = next(m for m in task["solution"] if m.get("tool_calls"))["tool_calls"][0]["function"]
    return {"name": call["name"], "arguments": json.loads(call["arguments"])}


def _wrong(call: dict) -> dict:
    """What the agent did instead: the right tool with its first argument's value wrong."""
    arguments = dict(call["arguments"])
    key = sorted(arguments)[0]
    value = arguments[key]
    arguments[key] = value + "-x" if isinstance(value, str) else ["nobody"]
    return {"name": call["name"], "arguments": arguments}


def _failed_trajectory(task: dict, external_id: str) -> dict:
    wrong = _wrong(_solution_call(task))
    return {
        "external_id": external_id, "agent": "workplace-assistant", "outcome": "failure",
        "tools": task["tools"],
        "messages": [
            *task["messages"],
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": wrong["name"], "arguments": json.dumps(wrong["arguments"])}}]},
            {"role": "tool", "tool_call_id": "c1", "content": json.dumps({"ok": True})},
            {"role": "assistant", "content": "Done."},
        ],
    }


def _ingest_and_promote(project, user, tasks: list[dict], target, prefix: str) -> list:
    """Ingest one failed trajectory per task, and promote each at the failed call, with the right call as the
    expectation: the promotion service checks that the verifier fails what the agent did and passes the fix."""
    from flywheel.evals.promotion import trajectory_promote
    from flywheel.trajectories.ingest import ingest_trajectories
    from flywheel.trajectories.models import Trajectory

    records = [_failed_trajectory(task, f"{prefix}-{i}") for i, task in enumerate(tasks)]
    result = ingest_trajectories(project=project, records=records)
    assert result.accepted == len(records) and not result.rejected, result
    items = []
    for record, task in zip(records, tasks, strict=True):
        trajectory = Trajectory.objects.get(project=project, external_id=record["external_id"])
        # A workplace task: the episode runs in the simulated company from the task's initial state, and
        # passes when the company ends in the state the request asked for.
        item, check = trajectory_promote(trajectory=trajectory, target=target, user=user, data={
            "message_index": 2, "expect": "state", "expected_state": task["verifier"]["expected"],
            "env_type": "workplace", "initial_state": task["env"]["initial_state"],
            "max_turns": task["env"]["max_turns"], "reference_calls": [_solution_call(task)]})
        assert check.original_score.failure and not check.original_score.passed, check.original_score
        assert check.reference_score.passed, check.reference_score
        items.append(item)
    return items


def _holdout_rows(tasks: list[dict]) -> list[dict]:
    """Workplace tasks as the generator writes them (the learning test's holdout): judged on the final state."""
    return [{"id": f"case-{i}", "messages": task["messages"], "tools": task["tools"], "verifier": task["verifier"],
             "env": task["env"], "origin": {}} for i, task in enumerate(tasks)]


def _version(model, owner, rows, **owner_fields):
    collection = owner.objects.create(**owner_fields)
    key = "task_set" if model is TaskSetVersion else "suite"
    return model.objects.create(**{key: collection}, number=1, rows=rows, size=len(rows),
                                content_hash=row_shape.content_hash(rows))


@pytest.fixture(scope="module")
def tasks():
    from trainer.envs.workplace import generate_tasks

    return {"train": generate_tasks(TRAIN_TASKS + 40, seed=0, split="train", difficulty="single"),
            "holdout": generate_tasks(HOLDOUT_CASES, seed=1, split="holdout", difficulty="single")}


# --- the webhook receiver -------------------------------------------------------------------------------------------


class _Receiver(BaseHTTPRequestHandler):
    received: list[tuple[dict, bytes]] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Receiver.received.append((dict(self.headers), body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    _Receiver.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/flywheel"
    server.shutdown()


@pytest.fixture
def loop(project, user, tiny_model, tasks, receiver):
    """Production (the tiny model), the project's gate and webhook, and the holdout suite."""
    RegistrySettings.objects.create(project=project, webhook_url=receiver, webhook_secret=SECRET,
                                    gate_rules=GATE_RULES)
    production = registry.base_model_register(project=project, name="tiny", path=str(tiny_model), user=user)
    holdout = _version(EvalSuiteVersion, EvalSuite, _holdout_rows(tasks["holdout"]), project=project,
                       name="workplace holdout", kind="holdout")
    return {"project": project, "user": user, "production": production, "holdout": holdout}


def _finished(celery_worker, job) -> TrainingJob:
    done = celery_worker.wait_for(
        lambda: TrainingJob.objects.filter(pk=job.pk, status__in=(JobStatus.SUCCEEDED, JobStatus.FAILED,
                                                                  JobStatus.CANCELLED)).first(),
        timeout=WAIT_S, interval=0.5)
    assert done.status == JobStatus.SUCCEEDED, (done.error, celery_worker.log_tail())
    return done


def _cases(path) -> dict[str, dict]:
    return {case["id"]: case for case in map(json.loads, path.read_text().splitlines())}


def _rules(decision: GateDecision) -> dict[str, dict]:
    return {rule["name"]: rule for rule in decision.report["rules"]}


# --- 1. the loop -------------------------------------------------------------------------------------------------


def test_failures_become_a_model_that_passes_the_gate_is_promoted_and_rolled_back(
    loop, tasks, celery_worker, make_user, make_membership, api_client, make_api_key,
):
    project, user = loop["project"], loop["user"]
    from flywheel.environments.services import task_set_create

    task_set = task_set_create(project=project, name="workplace failures", user=user)
    _ingest_and_promote(project, user, tasks["train"][:TRAIN_TASKS], task_set, "prod")
    task_set_version = task_set.versions.order_by("-number").first()
    assert task_set_version.size == TRAIN_TASKS
    assert all(row["origin"]["trajectory_id"] for row in task_set_version.rows)

    # No regression suite here: which cases production passes depends on the tiny model as built on this
    # machine, and a case passed by 5 of 8 samples fails or not by luck (seen: 2 of 5 chosen cases "broken"
    # on one machine). The regression rule runs through a real worker in tests/platform/training.
    job = training.job_create(project=project, task_set_version=task_set_version,
                              holdout_version=loop["holdout"], config=LOOP_RECIPE, user=user, confirm=True)
    job = _finished(celery_worker, job)
    folder = training.job_dir(job)

    # Training moved holdout success, as the job's own curve shows (step 0 is production before training).
    curves = training.job_page_data(job=job)
    assert curves["holdout"]["step"] == [0, LOOP_RECIPE["max_steps"]]
    assert len(curves["train"]["step"]) == LOOP_RECIPE["max_steps"]

    # The gate passed, and every rule's values are those of the files both models wrote.
    decision = GateDecision.objects.get(job=job)
    reward = [e.data["reward_mean"] for e in JobEvent.objects.filter(job=job, kind="step").order_by("step")]
    print(f"\ntrain reward {mean(reward[:10]):.3f} -> {mean(reward[-10:]):.3f}")
    assert decision.error == "" and decision.passed, [
        (r["name"], r["production"], r["candidate"], r["passed"], r["detail"]) for r in decision.report["rules"]]
    assert decision.candidate == job.candidate_version and decision.production == loop["production"]
    assert decision.rules["test"] == "bootstrap" and decision.rules["confidence"] == 0.9
    best = Checkpoint.objects.get(job=job, best=True)
    assert best.step == job.result["best_step"]
    production_cases = _cases(folder / "production-holdout.jsonl")
    # The candidate is measured as production was: the same command and settings, fresh samples.
    assert decision.report["measurement"]["fresh"]
    candidate_cases = _cases(folder / "gate" / "holdout.jsonl")
    assert decision.report["cases"] == HOLDOUT_CASES == len(production_cases) == len(candidate_cases)
    rules = _rules(decision)
    assert list(rules) == ["holdout success", "holdout size", "invalid outputs", "unsafe actions",
                           "time per token", "tokens per case", "regression cases"]
    assert rules["regression cases"]["detail"] == "no regression suite measured"  # allowed by the rules
    assert all(rule["passed"] for rule in rules.values())
    success = rules["holdout success"]
    measured = job.advice["metrics"]  # production on the holdout, measured before training
    assert success["production"] == pytest.approx(measured["success_rate"], abs=1e-4)
    assert success["production"] == pytest.approx(mean(c["pass_rate"] for c in production_cases.values()), abs=1e-4)
    fresh = next(e for e in JobEvent.objects.filter(job=job, kind="measured") if e.data["split"] == "holdout")
    assert success["candidate"] == pytest.approx(fresh.data["metrics"]["success_rate"], abs=1e-4)
    assert success["candidate"] == pytest.approx(mean(c["pass_rate"] for c in candidate_cases.values()), abs=1e-4)
    assert success["candidate"] > success["production"]
    assert "lower bound of the gain is +" in success["detail"]
    print(f"\ngate passed: holdout success {success['production']} -> {success['candidate']}; {success['detail']}")
    assert (rules["invalid outputs"]["production"], rules["invalid outputs"]["candidate"]) == (
        pytest.approx(measured["invalid_output_rate"], abs=1e-4),
        pytest.approx(fresh.data["metrics"]["invalid_output_rate"], abs=1e-4))
    # The holdout's verifier flags deleting and cancelling as unsafe, which some requests ask for: both
    # models do some, and the candidate not shown to do more.
    assert (rules["unsafe actions"]["production"], rules["unsafe actions"]["candidate"]) == (
        pytest.approx(measured["unsafe_action_rate"], abs=1e-4),
        pytest.approx(fresh.data["metrics"]["unsafe_action_rate"], abs=1e-4))
    for name in ("time per token", "tokens per case"):
        rule = rules[name]
        if rule["production"] is None or rule["candidate"] is None:
            assert rule["detail"] == "not measured on both: not checked"
        else:
            assert rule["passed"]

    # The candidate is a version with its lineage back to the promoted failures.
    candidate = job.candidate_version
    assert candidate.lineage["job"] == job.pk and len(candidate.adapter_sha256) == 64
    # The lineage names the trajectories behind the task set, the first 200 of them (it is kept small).
    behind = sorted({r["origin"]["trajectory_id"] for r in task_set_version.rows})
    assert candidate.lineage["trajectories"] == behind[:200] and len(behind) == TRAIN_TASKS

    # A maintainer promotes it, then a reviewer of the incident rolls it back.
    maintainer = make_user("maintainer-on-call")
    make_membership(maintainer, project, "maintainer")
    promoted = registry.model_promote(project=project, version=candidate, user=user,
                                      reason=f"Gate passed for job {job.pk}")
    rolled_back = registry.model_rollback(project=project, user=maintainer, reason="Support tickets rose")
    key = make_api_key(project, scopes=["read"])
    assert api_client.get("/api/v1/models/production", key=key).json()["version"] == loop["production"].number

    history = list(AliasEvent.objects.filter(project=project, alias="production").order_by("at", "id"))
    assert [(e.kind, e.from_version_id, e.to_version_id, e.user_id, e.reason) for e in history] == [
        ("set", None, loop["production"].pk, user.pk, "First model of the project."),
        ("promote", loop["production"].pk, candidate.pk, user.pk, f"Gate passed for job {job.pk}"),
        ("rollback", candidate.pk, loop["production"].pk, maintainer.pk, "Support tickets rose"),
    ]
    assert history[0].at <= history[1].at <= history[2].at
    assert [history[1].pk, history[2].pk] == [promoted.pk, rolled_back.pk]
    assert AliasEvent.objects.get(project=project, alias="candidate").to_version == candidate

    # The worker mirrors each move to MLflow and announces it, signed, once and in order.
    celery_worker.wait_for(lambda: len(_Receiver.received) >= 3 and not AliasEvent.objects.filter(
        project=project).exclude(webhook_state=SyncState.DONE, mlflow_state=SyncState.DONE).exists(), timeout=60)
    assert len(_Receiver.received) == 3
    bodies = []
    for headers, body in _Receiver.received:
        timestamp = headers["X-Flywheel-Timestamp"]
        signed = hmac.new(SECRET.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
        assert hmac.compare_digest(headers["X-Flywheel-Signature"], "sha256=" + signed)
        assert abs(int(timestamp) - history[0].at.timestamp()) < 3600
        bodies.append(json.loads(body))
    assert [(b["id"], b["kind"], b["from_version"], b["version"], b["reason"]) for b in bodies] == [
        (e.pk, e.kind, e.from_version.number if e.from_version else None, e.to_version.number, e.reason)
        for e in history]
    assert bodies[1]["adapter_sha256"] == candidate.adapter_sha256
    assert bodies[1]["vllm_lora_name"] == f"{project.slug}-v{candidate.number}"
    for event in history:
        assert [(d.target, d.status_code, d.error) for d in event.deliveries.all()] == [("webhook", 204, "")]
    assert mlflow_bridge.alias_get(project_slug=project.slug, alias="production") == (
        type(candidate).objects.get(pk=loop["production"].pk).mlflow_version)


# --- 2. a reward that pays for something else ----------------------------------------------------------------------

# Paid for: a free-text argument (a title, a subject, an assignee) longer than the one asked for, in steps
# of 1, 4, 8 and 16 characters; the right call is scored too, with weight 0, so the step events show it.
LONGER_BY = (1, 4, 8, 16)


def _pays_for_length(task: dict, row_id: str) -> dict | None:
    call = _solution_call(task)
    free = [k for k in ("title", "subject", "assignee") if isinstance(call["arguments"].get(k), str)]
    if not free:
        return None
    key, wanted = free[0], call["arguments"][free[0]]
    reward = [{"name": f"longer{extra}", "weight": 1 / len(LONGER_BY), "verifier": {
        "type": "tool_call", "allow_extra_arguments": True, "expected_calls": [
            {"name": call["name"], "arguments": {key: {"regex": f"^.{{{len(wanted) + extra},}}$"}}}]}}
        for extra in LONGER_BY]
    reward.append({"name": "calls", "weight": 0.0, "verifier": {"type": "tool_call", "expected_calls": [call]}})
    return {"id": row_id, "messages": task["messages"], "tools": task["tools"], "reward": reward, "origin": {}}


def test_a_job_paid_for_length_learns_it_and_the_gate_rejects_it(loop, tasks, celery_worker):
    from trainer.envs.workplace import generate_tasks

    project = loop["project"]
    rows = [row for i, task in enumerate(generate_tasks(160, seed=0, split="train", difficulty="single"))
            if (row := _pays_for_length(task, f"long-{i}")) is not None]
    hacked = _version(TaskSetVersion, TaskSet, rows, project=project, name="pays for length")
    job = training.job_create(project=project, task_set_version=hacked, holdout_version=loop["holdout"],
                              config=RECIPE, user=loop["user"], confirm=True)
    job = _finished(celery_worker, job)

    # It learned what it was paid for: the reward it trained on rose.
    steps = list(JobEvent.objects.filter(job=job, kind="step").order_by("step"))
    assert len(steps) == RECIPE["max_steps"]
    reward = [e.data["reward_mean"] for e in steps]
    first, last = mean(reward[:10]), mean(reward[-10:])
    assert last > first + 0.03, reward
    assert mean(e.data["reward/longer1"] for e in steps[-10:]) > mean(e.data["reward/longer1"] for e in steps[:10])

    # The gate rejects it on holdout success, and it cannot be promoted.
    decision = GateDecision.objects.get(job=job)
    assert decision.error == "" and not decision.passed
    success = _rules(decision)["holdout success"]
    assert not success["passed"] and "lower bound of the gain is" in success["detail"]
    print(f"\ngate rejected: holdout success {success['production']} -> {success['candidate']}; {success['detail']}; "
          f"train reward {first:.3f} -> {last:.3f}")
    with pytest.raises(registry.RegistryError, match="did not pass the gate"):
        registry.model_promote(project=project, version=job.candidate_version)
    from flywheel.registry.selectors import production_of

    assert production_of(project=project) == loop["production"]
