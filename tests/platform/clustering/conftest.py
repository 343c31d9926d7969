"""Fixtures of the clustering tests: the embedder, loaded once per session with the network cut off, and
labeled failures from bench/clustering_fixture.py, ingested and triaged as a project's would be."""

from __future__ import annotations

import importlib
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

BENCH_DIR = Path(__file__).resolve().parents[3] / "bench"


def fixture_module() -> Any:
    # bench/ is a folder of scripts, not a package: import the fixture as the bench does.
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    return importlib.import_module("clustering_fixture")


@pytest.fixture(scope="session")
def fx() -> Any:
    """bench/clustering_fixture.py: labeled failures with known causes."""
    return fixture_module()


class _NoNetwork(RuntimeError):
    pass


@pytest.fixture(scope="session")
def embedder() -> Any:
    """The process's shared embedder, made while any connection attempt raises: loading the packaged model
    must not touch the network (no hub, no telemetry)."""
    from flywheel.failures.clustering import embedding

    attempts: list[Any] = []

    def refuse(self: socket.socket, address: Any) -> None:
        attempts.append(address)
        raise _NoNetwork(f"network access to {address!r} while loading the embedding model")

    original = socket.socket.connect
    socket.socket.connect = refuse  # type: ignore[method-assign]
    try:
        made = embedding.StaticEmbedder()
    finally:
        socket.socket.connect = original  # type: ignore[method-assign]
    assert not attempts, attempts
    embedding._shared["embedder"] = made  # the services' shared_embedder() answers this one
    return made


@pytest.fixture
def labeled_failures(db: None) -> Callable[..., dict[int, str]]:
    """`labeled_failures(project, per_cause, causes=None, seed=0, prefix="fx") -> {trajectory id: cause}`:
    failing trajectories ingested and triaged."""
    from flywheel.trajectories.ingest import ingest_trajectories
    from flywheel.trajectories.models import Trajectory
    from flywheel.trajectories.triage import triage_project

    def make(project: Any, per_cause: int, causes: list[str] | None = None, seed: int = 0, prefix: str = "fx") -> dict[int, str]:
        fixture = fixture_module()
        names = causes or list(fixture.CAUSES)
        data = fixture.failures(per_cause * len(names), seed=seed, prefix=prefix, causes=names)
        result = ingest_trajectories(project=project, records=[r for _, r in data])
        assert not result.rejected, result.rejected[:2]
        triage_project(project_id=project.pk)
        cause_of = {r["external_id"]: c for c, r in data}
        rows = Trajectory.objects.filter(project=project, external_id__in=cause_of).values_list("id", "external_id")
        return {pk: cause_of[ext] for pk, ext in rows}

    return make

