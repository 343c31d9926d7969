"""Cost (flywheel.registry.cost): a version's price per 1M tokens (its own, else its base model's), refused per
field when out of bounds; live traffic priced per 1,000 requests with the GPU time serving reported; the same
figures in the live API, the price API, the Models page, a version's page with its price forms, and the gate's
page; the device time a run holds (flywheel.runs.device_time)."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse

from flywheel import runs
from flywheel.registry import cost, live, serving
from flywheel.registry.models import GateDecision
from flywheel.training.models import TrainingJob
from tests.platform.registry.test_live import record, send
from tests.platform.registry.worlds import versions_with_adapters


@pytest.fixture
def versions(project, user, tmp_path):
    """v1 in production (the base alone) and v2 with an adapter on the same base."""
    return versions_with_adapters(project, user, tmp_path, gated=False)


@pytest.fixture
def keys(make_api_key, project, make_project):
    return {"read": make_api_key(project, scopes=["read"]), "promote": make_api_key(project, scopes=["promote"]),
            "other": make_api_key(make_project("elsewhere"), scopes=["promote", "read"])}


def traffic(project, number: int, n: int, *, first: int = 0, **usage):
    """`n` trajectories of version `number` carrying `usage`."""
    send(project, [record(first + i, serving.adapter_name(project.slug, number), usage=dict(usage))
                   for i in range(n)])
    live.rollup_refresh()


# --- prices -------------------------------------------------------------------------------------------------


def test_a_version_without_its_own_price_uses_its_bases_field_by_field(versions):
    v1, v2 = versions
    assert cost.price_of(v2) == cost.Price(None, None, "")
    cost.price_set(target=v2.base, data={"price_input_per_m": "0.5", "price_output_per_m": 2})
    v2.refresh_from_db()
    assert cost.price_of(v2) == cost.Price(0.5, 2.0, "base")
    cost.price_set(target=v2, data={"price_output_per_m": "1.25"})  # input left out: kept (unset)
    assert cost.price_of(v2) == cost.Price(0.5, 1.25, "version and base")
    v1.refresh_from_db()
    assert cost.price_of(v1) == cost.Price(0.5, 2.0, "base")  # the base's other version is untouched
    cost.price_set(target=v2, data={"price_output_per_m": ""})  # empty clears: the base's again
    assert cost.price_of(v2) == cost.Price(0.5, 2.0, "base")


@pytest.mark.parametrize("value, message", [
    ("-1", "Between 0 and 10,000"), ("10001", "Between 0 and 10,000"), ("nan", "Between 0 and 10,000"),
    ("inf", "Between 0 and 10,000"), ("cheap", "A number"), (True, "not true or false"),
])
def test_a_wrong_price_names_its_field_and_saves_nothing(versions, value, message):
    v2 = versions[1]
    with pytest.raises(ValidationError) as refused:
        cost.price_set(target=v2, data={"price_input_per_m": "1", "price_output_per_m": value})
    assert list(refused.value.message_dict) == ["price_output_per_m"]
    assert message in refused.value.message_dict["price_output_per_m"][0]
    v2.refresh_from_db()
    assert v2.price_input_per_m is None  # the good field was not saved either


# --- live cost per 1,000 requests ---------------------------------------------------------------------------


def test_live_traffic_is_priced_per_thousand_requests_with_the_gpu_time_reported(project, versions):
    v1, v2 = versions
    # v1: 8 requests of 1,000 prompt + 200 completion tokens, 0.5 GPU-s each; 2 more with a total only.
    traffic(project, 1, 8, prompt_tokens=1000, completion_tokens=200, gpu_seconds=0.5)
    traffic(project, 1, 2, first=100, total_tokens=900)
    v1_live = live.live_metrics(project=project, version=v1, window="24h")
    assert v1_live["cost"]["token_cost_per_1k"] is None  # tokens carried, no price: not priced
    assert v1_live["cost"]["input_tokens_per_1k"] == 1_000_000 and v1_live["cost"]["output_tokens_per_1k"] == 200_000
    cost.price_set(target=v1.base, data={"price_input_per_m": "3", "price_output_per_m": "15"})
    v1.refresh_from_db()
    figures = live.live_metrics(project=project, version=v1, window="24h")["cost"]
    # 1k requests: 1M input tokens at $3 + 0.2M output at $15 = $6.
    assert figures["token_cost_per_1k"] == pytest.approx(6.0)
    assert figures["priced_share"] == 0.8 and figures["price_source"] == "base"
    assert figures["gpu_seconds_per_1k"] == pytest.approx(500.0) and figures["gpu_share"] == 0.8

    # v2 inherits the base's price; its own output price wins. OTel's names are read too.
    traffic(project, 2, 4, first=200, input_tokens=500, output_tokens=100)
    cost.price_set(target=v2, data={"price_output_per_m": "5"})
    v2.refresh_from_db()
    v2_cost = live.live_metrics(project=project, version=v2, window="24h")["cost"]
    assert v2_cost["token_cost_per_1k"] == pytest.approx(0.5 * 3 + 0.1 * 5)  # $1.50 + $0.50
    assert v2_cost["gpu_seconds_per_1k"] is None and v2_cost["gpu_share"] == 0

    rows = {r["number"]: r for r in live.live_summary(project=project)["rows"]}
    assert rows[1]["cost"]["token_cost_per_1k"] == pytest.approx(6.0)
    assert rows[2]["cost"]["token_cost_per_1k"] == pytest.approx(2.0)


# --- the API ------------------------------------------------------------------------------------------------


def test_the_live_api_carries_the_cost_and_the_price_api_sets_it_per_field(project, versions, api_client, keys):
    traffic(project, 2, 3, prompt_tokens=2000, completion_tokens=1000, gpu_seconds=2)
    price = "/api/v1/model-versions/2/price"
    assert api_client.put(price, {"price_input_per_m": 1}, key=keys["read"]).status_code == 403
    bad = api_client.put(price, {"price_input_per_m": -1, "price_output_per_m": 10**6}, key=keys["promote"])
    assert bad.status_code == 422
    assert sorted(e["loc"][-1] for e in bad.json()["detail"]) == ["price_input_per_m", "price_output_per_m"]
    assert api_client.put(price, {"price_input_per_m": 1, "on": "model"}, key=keys["promote"]).status_code == 422

    base = api_client.put(price, {"price_input_per_m": 1, "price_output_per_m": 4, "on": "base"}, key=keys["promote"])
    assert base.status_code == 200, base.content
    assert base.json() == {"version": 2, "base_model": "tiny", "own": {"price_input_per_m": None,
                                                                        "price_output_per_m": None},
                           "base": {"price_input_per_m": 1.0, "price_output_per_m": 4.0},
                           "price_input_per_m": 1.0, "price_output_per_m": 4.0, "price_source": "base"}
    own = api_client.put(price, {"price_output_per_m": 2}, key=keys["promote"]).json()
    assert own["own"] == {"price_input_per_m": None, "price_output_per_m": 2.0} and own["price_output_per_m"] == 2
    assert api_client.get(price, key=keys["read"]).json() == own
    assert api_client.put(price, {"price_output_per_m": None}, key=keys["promote"]).json()["price_output_per_m"] == 4

    answer = api_client.get("/api/v1/model-versions/2/live", key=keys["read"]).json()
    # 1k requests: 2M input tokens at $1 + 1M output at $4 = $6; 2,000 GPU-seconds.
    assert answer["cost"]["token_cost_per_1k"] == pytest.approx(6.0)
    assert answer["cost"]["gpu_seconds_per_1k"] == pytest.approx(2000.0)
    assert answer["cost"]["price_source"] == "base" and answer["metrics"]["split_n"] == 3
    assert api_client.get("/api/v1/model-versions/9/price", key=keys["read"]).status_code == 404
    assert api_client.get("/api/v1/model-versions/2/price", key=keys["other"]).status_code == 404


# --- the pages ----------------------------------------------------------------------------------------------


def test_the_models_page_and_a_versions_page_show_the_cost_and_take_a_price(project, versions, user, client_for,
                                                                              make_user, make_membership):
    traffic(project, 1, 5, prompt_tokens=4000, completion_tokens=1000, gpu_seconds=7.2)
    models = client_for(user).get(reverse("registry_page", args=[project.slug])).content.decode()
    assert "Cost / 1k requests" in models and "no price: set one on" in models and "2.00 GPU-h" in models

    url = reverse("registry_version_price", args=[project.slug, 1])
    page = reverse("registry_version", args=[project.slug, 1])
    viewer = make_user("viewer-of-cost")
    make_membership(viewer, project, "viewer")
    assert client_for(viewer).post(url, {"on": "version", "price_input_per_m": "1"}).status_code == 403
    assert 'id="price-version"' not in client_for(viewer).get(page).content.decode()

    refused = client_for(user).post(url, {"on": "base", "price_input_per_m": "-2", "price_output_per_m": "x"})
    assert refused.status_code == 422
    html = refused.content.decode()
    assert html.count('class="field-error"') == 2 and "Between 0 and 10,000" in html and "A number" in html
    assert 'value="-2"' in html  # what was typed stays in its field

    saved = client_for(user).post(url, {"on": "base", "price_input_per_m": "2.5", "price_output_per_m": "10"})
    assert saved.status_code == 302 and saved["Location"].endswith("#price")
    html = client_for(user).get(page).content.decode()
    # 1k requests: 4M input at $2.50 + 1M output at $10 = $20; 7,200 GPU-seconds = 2 GPU-hours.
    assert 'id="live-cost">$20.00<' in html and 'id="live-gpu">2.00 GPU-h<' in html
    assert "$2.50 in / $10.00 out per 1M" in html and "(from the base)" in html
    models = client_for(user).get(reverse("registry_page", args=[project.slug])).content.decode()
    assert "$20.00" in models


def test_the_gate_page_prices_both_sides(project, versions, user, client_for):
    v1, v2 = versions
    cost.price_set(target=v1.base, data={"price_input_per_m": "1", "price_output_per_m": "8"})
    cost.price_set(target=v2, data={"price_output_per_m": "4"})
    traffic(project, 1, 2, prompt_tokens=1000, completion_tokens=500)
    decision = GateDecision.objects.create(project=project, candidate=v2, production=v1, passed=True, report={
        "passed": True, "rules": [{"name": "tokens per case", "production": 250.0, "candidate": 300.0,
                                   "passed": True, "detail": ""}]})
    sides = {s["side"]: s for s in cost.gate_cost(decision=decision)}
    # Holdout, per 1k requests: 250 output tokens at $8 per 1M = $2; the candidate's 300 at its own $4 = $1.20.
    assert sides["production"]["holdout_cost_per_1k"] == pytest.approx(2.0)
    assert sides["candidate"]["holdout_cost_per_1k"] == pytest.approx(1.2)
    # Live: production's 1M input at $1 + 0.5M output at $8 = $5; the candidate serves nothing yet.
    assert sides["production"]["live"]["token_cost_per_1k"] == pytest.approx(5.0)
    assert sides["candidate"]["live_trajectories"] == 0
    html = client_for(user).get(reverse("registry_gate", args=[project.slug, decision.pk])).content.decode()
    production_row = html.split('id="gate-cost-production"')[1].split("</tr>")[0]
    candidate_row = html.split('id="gate-cost-candidate"')[1].split("</tr>")[0]
    assert "$2.00" in production_row and "$5.00" in production_row and "(its base's)" in production_row
    assert "$1.20" in candidate_row and "no traffic" in candidate_row


# --- device time --------------------------------------------------------------------------------------------


def test_a_runs_device_time_counts_the_devices_it_held_and_a_failed_attempt_too(project, user, tmp_path):
    from tests.platform.training.worlds import tickets_world

    world = tickets_world(project, user, tmp_path / "world", holdout_cases=2)
    job = TrainingJob.objects.create(project=project, task_set_version=world["train"],
                                     base_version=world["production"], num_gpus=4)
    with runs.device_time(TrainingJob, job.pk, gpus=2, processes=job.num_gpus):
        pass
    with pytest.raises(RuntimeError), runs.device_time(TrainingJob, job.pk, gpus=2, processes=job.num_gpus):
        raise RuntimeError("the trainer died")
    job.refresh_from_db()
    assert (job.device, job.devices) == ("gpu", 2)  # four asked, two seen: two held
    assert job.wall_seconds > 0 and job.device_seconds == pytest.approx(2 * job.wall_seconds)
    with runs.device_time(TrainingJob, job.pk, gpus=0):
        pass
    job.refresh_from_db()
    assert (job.device, job.devices) == ("cpu", 1) and job.gpu_hours == 0 and job.device_hours > 0
    assert "CPU-hours" in job.usage_text and "wall" in job.usage_text
