"""Cost in real Chromium: a maintainer sets a base model's price on a version's page (a wrong one refused beside
its field), reads the cost per 1,000 requests and the GPU time on the version's page and the Models page, both
sides priced on the gate's page, and what a promotion cost and bought on the dashboard. Screenshots go to
FLYWHEEL_SCREENSHOTS when set."""

from __future__ import annotations

import os
import re
from datetime import timedelta

from django.utils import timezone
from playwright.sync_api import expect

from flywheel.registry import live, services
from flywheel.registry.models import AliasEvent, GateDecision
from flywheel.training.models import JobStatus, TrainingJob
from flywheel.trajectories.ingest import ingest_trajectories
from flywheel.trajectories.triage import triage_project
from tests.browser.test_live_browser import shot
from tests.platform.training.worlds import tickets_world


def test_a_maintainer_prices_a_version_and_reads_what_it_costs(open_page, project, user, tmp_path):
    world = tickets_world(project, user, tmp_path / "tiny", holdout_cases=2)
    v1 = world["production"]
    job = TrainingJob.objects.create(project=project, task_set_version=world["train"], base_version=v1,
                                     status=JobStatus.SUCCEEDED, device="gpu", devices=1, wall_seconds=3 * 3600,
                                     device_seconds=3 * 3600)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    v2 = services.model_version_create(project=project, base=v1.base, adapter_path=str(adapter), user=user,
                                       lineage={"job": job.pk})
    decision = GateDecision.objects.create(project=project, candidate=v2, production=v1, passed=True, job=job, report={
        "passed": True, "cases": 40, "rules": [
            {"name": "holdout success", "production": 0.55, "candidate": 0.7, "passed": True, "detail": ""},
            {"name": "tokens per case", "production": 180.0, "candidate": 150.0, "passed": True, "detail": ""}]})
    now = timezone.now()
    services.alias_move(project=project, alias="production", version=v2, user=user, reason="gate passed",
                        kind="promote")
    AliasEvent.objects.filter(project=project, to_version=v2).update(at=now - timedelta(hours=12))
    records = []
    for i in range(60):
        version = 1 if i < 30 else 2
        hours = 13 + i % 10 if version == 1 else 1 + i % 10
        records.append({"external_id": f"t-{i}", "model_version": f"{project.slug}-v{version}",
                        "outcome": "failure" if i % (4 if version == 1 else 6) == 0 else "success",
                        "started_at": (now - timedelta(hours=hours)).isoformat(),
                        "usage": {"prompt_tokens": 1200, "completion_tokens": 300 if version == 1 else 220,
                                  "gpu_seconds": 0.8 if version == 1 else 0.6},
                        "messages": [{"role": "user", "content": "help"}, {"role": "assistant", "content": "done"}]})
    assert not ingest_trajectories(project=project, records=records).rejected
    triage_project(project_id=project.pk)
    live.rollup_refresh()

    page = open_page(user)
    page.goto(f"/p/{project.slug}/models/v2/?window=7d")
    form = page.locator("#price-base")
    form.locator("input[name=price_input_per_m]").fill("-3")
    form.locator("input[name=price_output_per_m]").fill("12")
    form.locator("button").click()
    expect(page.locator("#price-base .field-error")).to_have_text("Between 0 and 10,000 per 1M tokens.")
    page.locator("#price-base input[name=price_input_per_m]").fill("3")
    page.locator("#price-base button").click()
    expect(page).to_have_url(re.compile(r"/models/v2/\?done=price#price$"))
    page.goto(f"/p/{project.slug}/models/v2/?window=7d")
    # 1k requests: 1.2M input at $3 + 0.22M output at $12 = $6.24; 600 GPU-seconds.
    expect(page.locator("#live-cost")).to_have_text("$6.24")
    expect(page.locator("#live-gpu")).to_have_text("600.0 GPU-s")
    shot(page, "cost-version-page.png")

    page.goto(f"/p/{project.slug}/models/?window=7d#live-traffic")
    expect(page.locator("#live-v1 .lt-cost")).to_contain_text("$7.20")  # 1.2M x $3 + 0.3M x $12
    expect(page.locator("#live-v2 .lt-cost")).to_contain_text("$6.24")
    if os.environ.get("FLYWHEEL_SCREENSHOTS"):
        page.locator("#live-traffic").screenshot(path=f"{os.environ['FLYWHEEL_SCREENSHOTS']}/cost-models-live-panel.png")

    page.goto(f"/p/{project.slug}/models/gate/{decision.pk}/")
    expect(page.locator("#gate-cost-production")).to_contain_text("$2.16")  # 180 output tokens x $12 / 1M x 1k
    expect(page.locator("#gate-cost-candidate")).to_contain_text("$1.80")
    expect(page.locator("#gate-cost-candidate")).to_contain_text("$6.24")
    shot(page, "cost-gate.png")

    page.goto(f"/p/{project.slug}/dashboard/#promotions")
    row = page.locator(f"#promotion-{AliasEvent.objects.get(project=project, to_version=v2, kind='promote').pk}")
    expect(row).to_contain_text("3 GPU-hours")
    expect(row).to_contain_text("(+0.150)")
    expect(row).to_contain_text("$7.20")
    expect(row).to_contain_text("$6.24")
    shot(page, "cost-dashboard.png")
