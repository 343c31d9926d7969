"""Clustering failures whose texts the project did not write: bench/clustering_api_fixture.py builds them
from the REST operations the installed Databricks SDK documents (1,400-odd operations, each its own tool name,
argument names and summary), failing for one of five causes that fall on any operation. Groups must follow
the cause, not the tool or the argument names."""

from __future__ import annotations

import importlib

import numpy as np
from sklearn import metrics

from flywheel.failures.clustering import engine

from .conftest import fixture_module


def test_failures_on_real_api_descriptions_group_by_cause(embedder):
    fixture_module()  # puts bench/ on the path
    api = importlib.import_module("clustering_api_fixture")
    truth, signatures = fixture_module().signatures(api.failures(600, seed=1, prefix="q"))
    assert len({s.tool for s in signatures}) > 200  # the causes fall on hundreds of different operations
    labels = engine.cluster(engine.features(signatures, embedder))
    homogeneity = metrics.homogeneity_score(truth, labels)
    coverage = float(np.mean(labels >= 0))
    print(f"real API failures: homogeneity {homogeneity:.3f}, coverage {coverage:.2f}, {len(set(labels.tolist()) - {-1})} groups")
    # Measured: 0.948 and 0.95 (7 groups); with the argument names at 0.8 and the structure at 0.7, 0.71 (one
    # group of 160 held four causes).
    assert homogeneity >= 0.8 and coverage >= 0.5
