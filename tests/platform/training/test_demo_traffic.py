"""The workplace demo's live traffic (`make run`, flywheel.seed.traffic): while a canary runs, fresh requests go
through the serving split, each arm's model answers its own, and the answers come in as vouched live evidence
that the canary's look counts; while nothing runs, nothing is played."""

from __future__ import annotations

from flywheel.registry import services as registry
from flywheel.registry.canary import canary_start, live_check_look, live_rules_of
from flywheel.registry.demo import DEMO_MODEL_NAME
from flywheel.registry.models import GateDecision, LiveCheck, RegistrySettings
from flywheel.seed.traffic import demo_traffic_round
from flywheel.training.demo import DEMO_LIVE_RULES, loop_demo_seed, loop_project
from flywheel.trajectories.models import Trajectory, Vouch


def test_the_demo_plays_live_traffic_through_the_split_while_a_canary_runs(user, tiny_model):
    assert demo_traffic_round(requests=8, seed=0)["why"] == "the workplace demo is not seeded"
    project = loop_project(owner=user)
    v1 = registry.base_model_register(project=project, name=DEMO_MODEL_NAME, path=str(tiny_model), user=user)
    loop_demo_seed(project=project, model_dir=tiny_model, user=user, n_train=12, n_holdout=6, n_regression=3)
    # The demo's rules are met by its own traffic in minutes.
    rules = live_rules_of(RegistrySettings.objects.get(project=project))
    assert {name: rules[name] for name in DEMO_LIVE_RULES} == DEMO_LIVE_RULES
    seeded = Trajectory.objects.filter(project=project).count()
    assert demo_traffic_round(requests=8, seed=0) == {"played": 0, "why": "no canary or watch runs"}
    assert Trajectory.objects.filter(project=project).count() == seeded

    v2 = registry.model_version_create(project=project, base=v1.base, user=user, description="the candidate")
    GateDecision.objects.create(project=project, candidate=v2, production=v1, passed=True)
    check = canary_start(project=project, version=v2, user=user, weight=0.5)
    assert check.rules["min_per_arm"] == DEMO_LIVE_RULES["canary_min_per_arm"]
    played = demo_traffic_round(requests=24, seed=1)
    assert played["played"] == 24 and played["created"] == 24 and played["rejected"] == 0, played
    by_adapter = played["by_adapter"]
    assert set(by_adapter) == {"workplace-v1", "workplace-v2"} and sum(by_adapter.values()) == 24
    live = Trajectory.objects.filter(project=project).exclude(external_id__startswith="workplace-req-")
    assert live.count() == 24
    for trajectory in live:
        # Each answer is its arm's model's, after the request, and the platform vouches for the version.
        assert trajectory.messages[-1]["role"] == "assistant"
        assert trajectory.vouch == Vouch.VOUCHED, (trajectory.external_id, trajectory.vouch)
        assert trajectory.outcome in ("success", "failure")
        # What the model read and wrote, as a serving stack reports usage: the live cost prices it.
        assert trajectory.usage["prompt_tokens"] > 0 and trajectory.usage["completion_tokens"] > 0, trajectory.usage
    assert {v: live.filter(model_version=v).count() for v in by_adapter} == by_adapter

    # The canary's look counts them: every one of its arm's, and production's since it started.
    live_check_look(check_id=check.pk)
    look = LiveCheck.objects.get(pk=check.pk).evidence["look"]
    assert (look["subject"]["n"], look["baseline"]["n"]) == (by_adapter["workplace-v2"], by_adapter["workplace-v1"]), look
    # A second round draws other requests: new trajectories, none overwritten.
    again = demo_traffic_round(requests=10, seed=2)
    assert again["created"] == 10 and live.all().count() == 34  # all(): the loop above filled live's cache
