"""Clustering quality holds as a project grows: both labeled fixtures (the project's generator, and failures
built from real API descriptions, where the cause does not follow the tool) at 10,000 and 100,000 failures.
At 100,000, HDBSCAN runs on a draw of engine.SAMPLE failures and the others join their nearest drawn one's
group; before that draw, the job read at most 50,000 failures and HDBSCAN on all of them took 80-100 s."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from sklearn import metrics

from flywheel.failures.clustering import engine

from .conftest import fixture_module

FIXTURES = {"generator": ("clustering_fixture", "q"), "real API": ("clustering_api_fixture", "api")}


# Measured (bench/clustering.py, the same fixtures and seed): generator 0.997 / 0.99 at 10,000 and 0.996 /
# 0.985 at 100,000 (homogeneity / coverage); real API 0.922 / 0.924 and 0.922 / 0.931. With 16 PCA dimensions
# instead of 12, the real API failures at 100,000 fell into three groups, one of four causes (0.33).
@pytest.mark.slow
@pytest.mark.parametrize("kind", FIXTURES)
@pytest.mark.parametrize("n", [10_000, 100_000])
def test_groups_follow_the_cause_at_ten_and_a_hundred_thousand_failures(embedder, kind, n):
    fixture_module()  # puts bench/ on the path
    module, prefix = FIXTURES[kind]
    truth, signatures = fixture_module().signatures(importlib.import_module(module).failures(n, seed=1, prefix=prefix))
    labels = engine.cluster(engine.features(signatures, embedder))
    homogeneity = metrics.homogeneity_score(truth, labels)
    coverage = float(np.mean(labels >= 0))
    print(f"{kind}, {n} failures: homogeneity {homogeneity:.3f}, coverage {coverage:.3f}, {len(set(labels.tolist()) - {-1})} groups")
    assert homogeneity >= 0.8 and coverage >= 0.5


def test_failures_beyond_the_draw_join_the_group_of_their_nearest_drawn_failure(monkeypatch):
    """Three tight blobs of 400 and a few points far from all: with a draw of 300, no blob member gets another
    blob's group and nearly all get their own (a member on a blob's rim, beyond its nearest drawn failure's
    core distance, is noise: measured 5-7.5%), and the far points are noise."""
    rng = np.random.default_rng(0)
    centres = np.eye(3, 8, dtype=np.float32) * 10
    blobs = np.vstack([c + rng.normal(0, 0.05, (400, 8)) for c in centres]).astype(np.float32)
    far = (np.ones((5, 8)) * -10 + rng.normal(0, 3, (5, 8))).astype(np.float32)
    vectors = np.vstack([blobs, far])
    monkeypatch.setattr(engine, "SAMPLE", 300)
    labels = engine.cluster(vectors, min_cluster_size=20)
    groups = [labels[b * 400 : (b + 1) * 400] for b in range(3)]
    own = [int(np.bincount(g[g >= 0]).argmax()) for g in groups]
    assert len(set(own)) == 3  # one group per blob
    for group, label in zip(groups, own, strict=True):
        assert set(group.tolist()) <= {label, -1} and np.mean(group == label) >= 0.9
    assert (labels[1200:] == -1).all()
