"""A simulated production: how fast the canary decision and the watch catch a worse version, how often they
cry wolf, and what keeping live metrics costs ingestion.

    .venv/bin/python bench/production.py [--runs 500] [--rate 8.33] [--grid-streams 200] [--ingest 4000]
                                         [--rounds 3]

1. **Detection and false alarms** (the decisions themselves, `flywheel.registry.sequential`, driven by
   `flywheel.registry.live_simulation` as the product drives them: a look an hour, the canary stopping where
   the product stops, i.e. rolled back when worse, promoted once each arm has `canary_min_per_arm` = 1,000 known
   outcomes (the default) and the bound on its increase is within the 5-point tolerance, expired at 72 h; the
   watch flagging within its 24 h against a 5% holdback). Traffic: `--rate` trajectories a minute (500 an
   hour), production failing 20%. Printed: for a version ten points worse and an equal one, the share called
   worse, the share promoted, the median trajectories (of the worse version) and minutes to the call. Then
   **the grid** (`--grid-streams` streams per cell): canary weights / holdback shares 5, 10 and 50%; failure
   rates 2, 10, 20 and 50%; plain, a +-5-point daily swing, outcomes 2 h late on average, 20% unknown
   outcomes, and all three at once: the false-alarm rate with its 95% interval, and the power against five
   and ten points (the canary: not promoted; the watch: flagged).
2. **One run through the platform** (`--ingest` > 0): a scratch database (PostgreSQL beside `--database-url`,
   else SQLite); trajectories of two
   versions (adapter names `<slug>-v1`, `<slug>-v2`, the second failing ten points more) are ingested in
   batches through the ingestion service, triaged and rolled up as the worker does, and the canary decision
   looks after each batch: the trajectories it needed on the platform's own code path.
3. **The rollup's cost**: ingestion and triage of `--ingest` trajectories (bench/ingest.py's support-agent
   runs, about 10 messages and 2.5 KB each, in batches of 100 as agents send them) with and without the rollup refresh the sweep runs (every `--sweep-every` trajectories: at 1,000 a
   minute, about one sweep of 30 s at 2,000 a minute; everything here happens within the refresh's 2-minute
   overlap, so each refresh also re-reads the trajectories of the ones before, as the worst case), in
   alternating rounds (A/B/B/A…) so the machine's drift falls on both: the rollup's microseconds per
   trajectory and that in-process ratio (`in_process_ratio`, the strictest view: ingestion and triage with no
   HTTP at all). Then the REST API's cost per trajectory (batches of 100 through Django's request handling,
   as agents send them): `ingest_ratio` is api / (api + rollup), the share of its speed ingestion keeps
   when the rollup's worker shares its cores.

Goals: false alarms <= 5% everywhere on the grid (`worst_false_alarm`), a ten-point regression caught,
ingestion at least 0.9x its speed without the rollup. The last line is JSON:
`{"detect_trajectories", "false_alarm_rate", "grid": [{check, share, failure_rate, drift, delay_h,
unknown_share, false_alarm_rate, power_5pt, power_10pt}, …], "worst_false_alarm", "rollup_us_per_traj",
"ingest_ratio", …}`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))

from flywheel.registry import live_simulation as sim  # noqa: E402 (pure modules: no Django needed)

PRODUCTION_FAILURE = 0.20
WORSE_BY = 0.10
MIN_PER_ARM = 1000  # RegistrySettings.canary_min_per_arm's default
GRID_SHARES = (0.05, 0.10, 0.50)
GRID_FAILURES = (0.02, 0.10, 0.20, 0.50)
# (drift in points, outcome delay in hours, share of unknown outcomes): plain, each alone, all three.
GRID_CONDITIONS = ((0.0, 0.0, 0.0), (0.05, 0.0, 0.0), (0.0, 2.0, 0.0), (0.0, 0.0, 0.2), (0.05, 2.0, 0.2))


def rules_figures(*, runs: int, rate_per_min: float) -> dict:
    """The headline figures at the defaults (a 10% canary, a 5% holdback, 20% failures): a ten-point regression
    and an equal version, for the canary and the watch, through the product's decisions
    (flywheel.registry.live_simulation)."""
    rate = rate_per_min * 60
    worse = sim.Traffic(rate=rate, share=0.10, failure=PRODUCTION_FAILURE, worse_by=WORSE_BY)
    equal = sim.Traffic(rate=rate, share=0.10, failure=PRODUCTION_FAILURE)
    held_worse = sim.Traffic(rate=rate, share=0.05, failure=PRODUCTION_FAILURE, worse_by=WORSE_BY)
    held_equal = sim.Traffic(rate=rate, share=0.05, failure=PRODUCTION_FAILURE)

    def figures(outcome: sim.Outcome) -> dict:
        return {"called_worse": outcome.share("worse"), "promoted": outcome.share("promoted"),
                "median_trajectories": outcome.median_at(),
                "median_minutes": 60 * statistics.median(outcome.hours) if outcome.hours else None}

    return {
        "canary_worse": figures(sim.canary(worse, streams=runs, seed=0, min_per_arm=MIN_PER_ARM)),
        "canary_equal": figures(sim.canary(equal, streams=runs, seed=1, min_per_arm=MIN_PER_ARM)),
        "watch_worse": figures(sim.watch(held_worse, streams=runs, seed=2)),
        "watch_equal": figures(sim.watch(held_equal, streams=runs, seed=3)),
    }


def grid_figures(*, streams: int, rate_per_min: float) -> list[dict]:
    """Every condition of the grid, for the canary and the watch (the share is the canary's weight, or the
    watch's holdback): the share of equal versions called worse, and of versions five and ten points worse
    not let through (the canary: not promoted; the watch: flagged within its 24 h)."""
    rows = []
    seed = 100
    for share in GRID_SHARES:
        for failure in GRID_FAILURES:
            for drift, delay, unknown in GRID_CONDITIONS:
                base = dict(rate=rate_per_min * 60, share=share, failure=failure, drift=drift, delay=delay,
                            unknown=unknown)
                for check in ("canary", "watch"):
                    seed += 1
                    run = (lambda t, s: sim.canary(t, streams=streams, seed=s, min_per_arm=MIN_PER_ARM)) \
                        if check == "canary" else (lambda t, s: sim.watch(t, streams=streams, seed=s))
                    equal = run(sim.Traffic(**base), seed)
                    five = run(sim.Traffic(**base, worse_by=0.05), seed + 10_000)
                    ten = run(sim.Traffic(**base, worse_by=0.10), seed + 20_000)
                    caught = (lambda o: 1 - o.share("promoted")) if check == "canary" else \
                        (lambda o: o.share("worse"))
                    low, high = equal.interval("worse")
                    rows.append({"check": check, "share": share, "failure_rate": failure, "drift": drift,
                                 "delay_h": delay, "unknown_share": unknown,
                                 "false_alarm_rate": round(equal.share("worse"), 4),
                                 "false_alarm_interval": [round(low, 4), round(high, 4)],
                                 "power_5pt": round(caught(five), 4), "power_10pt": round(caught(ten), 4)})
    return rows


def _django(workdir: str, database_url: str | None = None) -> None:
    """A scratch platform in `workdir` (MLflow on local files beside it), migrated: on SQLite there, or on a
    fresh PostgreSQL database made beside `database_url`'s (dropped by `_drop`)."""
    os.environ["FLYWHEEL_VAR_DIR"] = workdir
    os.environ.pop("DATABASE_URL", None)
    if database_url:
        from pages import admin_url, run_sql, with_database

        name = f"flywheel_bench_production_{os.getpid()}"
        run_sql(admin_url(database_url), f"CREATE DATABASE {name}")
        os.environ["DATABASE_URL"] = with_database(database_url, name)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{workdir}/mlflow.db"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "flywheel.settings")
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


def _records(rng: np.random.Generator, start: int, n: int, slug: str, canary_share: float,
             failure: tuple[float, float], evidence_key: bytes | None = None) -> tuple[list[dict], int]:
    """`n` trajectories as an agent behind the router sends them: the answering adapter as model_version, one
    tool call and an answer, the outcome drawn with the arm's failure rate, and (with `evidence_key`) the
    router's evidence token, as the wrapper copies it. Returns them and the canary's."""
    from flywheel.router import evidence_sign

    records, canary = [], 0
    for i in range(start, start + n):
        arm = int(rng.random() < canary_share)
        canary += arm
        failed = rng.random() < failure[arm]
        token = (evidence_sign(evidence_key, version=1 + arm, at=int(time.time()), request_id=f"bench-{i:08d}")
                 if evidence_key else None)
        records.append({
            **({"metadata": {"flywheel_evidence": token}} if token else {}),
            "external_id": f"t{i}", "model_version": f"{slug}-v{1 + arm}",
            "outcome": "failure" if failed else "success", "latency_ms": int(rng.integers(200, 2000)),
            "usage": {"total_tokens": int(rng.integers(100, 900))},
            "tools": [{"type": "function", "function": {"name": "get_order", "parameters": {"type": "object"}}}],
            "messages": [
                {"role": "user", "content": f"Where is order {i}?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_order", "arguments": json.dumps({"order_id": str(i)})}}]},
                {"role": "tool", "tool_call_id": "c1", "content": json.dumps({"status": "shipped"})},
                {"role": "assistant", "content": f"Order {i} has shipped."},
            ]})
    return records, canary


def _drop(database_url: str | None) -> None:
    if database_url:
        from django.db import connections
        from pages import admin_url, run_sql

        connections.close_all()
        run_sql(admin_url(database_url), f"DROP DATABASE IF EXISTS flywheel_bench_production_{os.getpid()}")


def _support_records(rng: np.random.Generator, start: int, n: int, slug: str) -> list[dict]:
    """`n` trajectories of the shape bench/ingest.py sends (about 10 messages, three tool calls, ~2.5 KB: a
    support agent's run), served by production or a 10% canary, with an outcome, usage and latency."""
    from ingest import synthetic

    records = []
    for i in range(start, start + n):
        record = synthetic(i, "production")
        record.update({"model_version": f"{slug}-v{1 + int(rng.random() < 0.1)}",
                       "outcome": "failure" if rng.random() < 0.2 else "success",
                       "latency_ms": int(rng.integers(200, 2000)), "usage": {"total_tokens": int(rng.integers(100, 900))}})
        records.append(record)
    return records


def platform_figures(*, per_round: int, rounds: int, batch: int = 100, sweep_every: int = 1000,
                     seed: int = 0, database_url: str | None = None) -> dict:
    """Parts 2 and 3 on the platform's own code: ingestion, triage, the rollup, the canary decision."""
    workdir = tempfile.mkdtemp(prefix="flywheel-production-")
    _django(workdir, database_url)
    try:
        return _platform_figures(workdir, per_round=per_round, rounds=rounds, batch=batch, sweep_every=sweep_every,
                                 seed=seed)
    finally:
        _drop(database_url)


def _platform_figures(workdir: str, *, per_round: int, rounds: int, batch: int, sweep_every: int,
                      seed: int) -> dict:
    from flywheel.accounts.services import project_create
    from flywheel.registry import canary, live, services
    from flywheel.registry.models import GateDecision, LiveCheck, RegistrySettings
    from flywheel.trajectories.ingest import ingest_trajectories
    from flywheel.trajectories.triage import triage_project

    rng = np.random.default_rng(seed)
    project = project_create(slug="bench-production", name="Bench production")
    model = Path(workdir) / "base"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    v1 = services.base_model_register(project=project, name="base", path=str(model))
    adapter = Path(workdir) / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    v2 = services.model_version_create(project=project, base=v1.base, adapter_path=str(adapter))
    GateDecision.objects.create(project=project, candidate=v2, production=v1, passed=True)
    RegistrySettings.objects.create(project=project, canary_auto=True)

    # Part 2: a canary at 10% that fails ten points more often, looked at after every batch; its traffic comes
    # through the router, which vouches for each answer (only vouched evidence acts by itself).
    from flywheel.trajectories.vouch import evidence_keys

    check = canary.canary_start(project=project, version=v2)
    sent = canary_sent = 0
    status = "running"
    while status == "running" and canary_sent < 4 * MIN_PER_ARM:
        records, k = _records(rng, sent, batch, project.slug, 0.1, (PRODUCTION_FAILURE, PRODUCTION_FAILURE + WORSE_BY),
                              evidence_key=evidence_keys(project.pk)[0])
        ingest_trajectories(project=project, records=records)
        sent, canary_sent = sent + batch, canary_sent + k
        triage_project(project_id=project.pk)
        live.rollup_refresh()
        status = canary.live_check_look(check_id=check.pk)
    check = LiveCheck.objects.get(pk=check.pk)
    print(f"platform canary: {status} after {canary_sent} canary trajectories ({sent} in all): "
          f"{check.evidence.get('look', {}).get('reason', '')}")

    # Part 3: ingestion + triage, with and without the rollup after each batch, rounds alternating A/B/B/A.
    timings: dict[str, list[float]] = {"without": [], "with": []}
    rollup_s = 0.0
    order = [("without", "with")[(r // 1 + r // 2) % 2] for r in range(2 * rounds)]
    for mode in order:
        started = time.perf_counter()
        for first in range(0, per_round, batch):
            records = _support_records(rng, sent + first, batch, project.slug)
            ingest_trajectories(project=project, records=records)
            triage_project(project_id=project.pk)
            if mode == "with" and (first + batch) % sweep_every == 0:
                t = time.perf_counter()
                live.rollup_refresh()
                rollup_s += time.perf_counter() - t
        timings[mode].append(time.perf_counter() - started)
        sent += per_round
        if mode == "without":
            live.rollup_refresh()  # off the clock: the next round's refreshes count only their own
    with_rate = per_round * len(timings["with"]) / sum(timings["with"])
    without_rate = per_round * len(timings["without"]) / sum(timings["without"])
    rollup_us = rollup_s * 1e6 / (per_round * rounds)
    print(f"ingest + triage in one process: {without_rate:.0f} trajectories/s without the rollup, {with_rate:.0f} "
          f"with it (ratio {with_rate / without_rate:.3f}); rollup {rollup_us:.0f} µs a trajectory")

    # The REST API as agents call it (batches of 100, a key with the ingest scope): its cost per trajectory,
    # against which the rollup's is set. The rollup runs on a worker, not in the request: on a machine where
    # both share the cores, ingestion keeps api / (api + rollup) of its speed.
    from django.test import Client

    from flywheel.accounts.services import api_key_create

    key = api_key_create(project=project, name="bench", scopes=["ingest"]).raw_key
    client = Client(HTTP_AUTHORIZATION=f"Bearer {key}")
    bodies = [json.dumps(_support_records(rng, sent + first, batch, project.slug))
              for first in range(0, per_round, batch)]
    started = time.perf_counter()
    for body in bodies:
        answer = client.post("/api/v1/trajectories", data=body, content_type="application/json")
        assert answer.status_code in (200, 201, 207), answer.content[:300]
    api_us = (time.perf_counter() - started) * 1e6 / per_round
    api_ratio = api_us / (api_us + rollup_us)
    print(f"REST ingestion: {api_us:.0f} µs a trajectory; with the rollup's {rollup_us:.0f} µs beside it, "
          f"ingestion keeps {api_ratio:.3f} of its speed")
    return {"platform_canary_status": status, "platform_detect_trajectories": canary_sent,
            "rollup_us_per_traj": round(rollup_us, 1), "ingest_ratio": round(api_ratio, 3),
            "api_ingest_us_per_traj": round(api_us, 1),
            "in_process_ratio": round(with_rate / without_rate, 3),
            "ingest_per_s_without": round(without_rate, 1), "ingest_per_s_with": round(with_rate, 1)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--rate", type=float, default=500 / 60, help="trajectories a minute, both versions together")
    parser.add_argument("--ingest", type=int, default=4000, help="trajectories a round for parts 2-3; 0: skip")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--grid-streams", type=int, default=200,
                        help="simulated streams per condition of the grid (0: skip the grid)")
    parser.add_argument("--sweep-every", type=int, default=1000, help="trajectories between two rollup refreshes")
    parser.add_argument("--database-url", default=os.environ.get("DATABASE_URL"),
                        help="a PostgreSQL server to make a scratch database on (default: $DATABASE_URL; unset: SQLite)")
    args = parser.parse_args(argv)

    rules = rules_figures(runs=args.runs, rate_per_min=args.rate)
    for name, figures in rules.items():
        print(f"{name:14} called worse {figures['called_worse']:6.1%}   promoted {figures['promoted']:6.1%}   "
              f"median trajectories {figures['median_trajectories']}   median minutes {figures['median_minutes']}")
    grid = grid_figures(streams=args.grid_streams, rate_per_min=args.rate) if args.grid_streams else []
    if grid:
        print(f"\n{'check':7}{'share':>6}{'fail':>6}{'drift':>6}{'delay':>6}{'unkn':>6}  {'false alarm':>24}"
              f"{'5 pt':>7}{'10 pt':>7}")
        for row in grid:
            low, high = row["false_alarm_interval"]
            print(f"{row['check']:7}{row['share']:6.0%}{row['failure_rate']:6.0%}{row['drift']:6.2f}"
                  f"{row['delay_h']:6.1f}{row['unknown_share']:6.0%}  {row['false_alarm_rate']:8.1%} "
                  f"[{low:5.1%}, {high:5.1%}]{row['power_5pt']:7.0%}{row['power_10pt']:7.0%}")
    result = {
        "detect_trajectories": rules["canary_worse"]["median_trajectories"],
        "detect_minutes": rules["canary_worse"]["median_minutes"],
        "canary_caught_within_2000": rules["canary_worse"]["called_worse"],
        "watch_detect_trajectories": rules["watch_worse"]["median_trajectories"],
        "watch_caught_within_2000": rules["watch_worse"]["called_worse"],
        "false_alarm_rate": max(rules["canary_equal"]["called_worse"], rules["watch_equal"]["called_worse"]),
        "rate_per_min": args.rate,
        "grid": grid,
        "worst_false_alarm": max((row["false_alarm_rate"] for row in grid), default=None),
    }
    if args.ingest:
        result.update(platform_figures(per_round=args.ingest, rounds=args.rounds, sweep_every=args.sweep_every,
                                       database_url=args.database_url))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
