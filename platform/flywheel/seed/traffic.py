"""The workplace demo's live traffic (`make run`): while a canary or a watch runs on the demo project, the gpu
worker plays fresh workplace requests through the serving split every FLYWHEEL_DEMO_TRAFFIC_S seconds, as an
agent behind the reference router would send them, so that the canary's and the watch's looks have traffic to
judge and a newcomer sees the live loop end (a canary ready to promote or worse, a watch that passes).

Each request goes to an arm as the router sends one without a route key (`flywheel.router.arm_for`: the
canary's weight, then the holdback's, production the rest); each arm's model (its base and adapter) answers its
requests with the trainer's evaluate command, one sample at temperature 1 as the demo played them; the answers
are ingested as trajectories under the arm's adapter name with an evidence token the platform signs, as the
router would (they count as vouched live evidence), the verifier's verdict as the outcome and the tokens the
model read and wrote as usage (so a price set on a version gives the demo's live cost). No latency: the answers
are generated in batches.

Requests are drawn from the demo's own population (the generator's train split, single-call requests) with a
new seed each round. Nothing is played while no check runs: the demo costs no CPU between canaries."""

from __future__ import annotations

import random
import time
import uuid
from pathlib import Path
from typing import Any

from django.utils import timezone

from flywheel.accounts.models import Project
from flywheel.registry.canary import running_checks
from flywheel.registry.serving import serving_split
from flywheel.router import arm_for, evidence_sign
from flywheel.training.demo import LOOP_SLUG, demo_row, loop_demo_seeded, play
from flywheel.trajectories.ingest import ingest_trajectories
from flywheel.trajectories.vouch import METADATA_KEY, evidence_keys

REQUESTS_PER_ROUND = 40


def demo_traffic_round(*, requests: int = REQUESTS_PER_ROUND, seed: int | None = None) -> dict[str, Any]:
    """Play one round of the demo's live traffic; what was played, by adapter, or why nothing was."""
    project = Project.objects.filter(slug=LOOP_SLUG).first()
    if project is None or not loop_demo_seeded(project):
        return {"played": 0, "why": "the workplace demo is not seeded"}
    if not running_checks(project=project):
        return {"played": 0, "why": "no canary or watch runs"}
    split = serving_split(project)
    if split["production"] is None:
        return {"played": 0, "why": "no production version"}
    from trainer.envs.workplace import generate_tasks

    rng = random.Random(seed)
    round_seed = rng.randrange(1_000_000, 2**31)  # above the seeds the demo's own sets were drawn with
    tasks = generate_tasks(requests, seed=round_seed, split="train", difficulty="single")
    by_adapter: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {}
    for i, task in enumerate(tasks):
        arm = arm_for(split, rng.random())
        by_adapter.setdefault(arm["adapter"], (arm, []))[1].append(demo_row(task, f"live-{round_seed}-{i}"))
    key = evidence_keys(project.pk)[0]
    records = []
    for adapter, (arm, rows) in by_adapter.items():
        cases = {str(c["id"]): c for c in play(Path(arm["base_model_path"]), rows,
                                               adapter_path=arm["adapter_path"] or "", seed=round_seed)}
        now = timezone.now()
        for row in rows:
            case = cases[row["id"]]
            sample = (case.get("samples") or [{}])[0]
            token = evidence_sign(key, version=arm["version"], at=int(time.time()), request_id=uuid.uuid4().hex)
            records.append({
                "external_id": f"workplace-{row['id']}", "agent": "workplace-assistant", "model_version": adapter,
                "started_at": now.isoformat(), "messages": row["messages"] + (sample.get("messages") or []),
                "tools": row["tools"], "outcome": "success" if case["passed"] else "failure",
                "usage": {name: sample[name] for name in ("prompt_tokens", "completion_tokens") if name in sample},
                "metadata": {"demo": True, "live": True, "failure": sample.get("failure"), METADATA_KEY: token},
            })
    result = ingest_trajectories(project=project, records=records, source="demo")
    return {"played": len(records), "created": result.created, "rejected": len(result.rejected),
            "by_adapter": {adapter: len(rows) for adapter, (_, rows) in by_adapter.items()}}
