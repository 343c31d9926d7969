"""A web process loads the leakage guard's sentence model and the MLflow client as it starts, beside its first
requests, so that the first "Run checks" of a promotion and the first Promote do not load them inside the
request (16 s and 8 s on two busy cores: bench/actions.py)."""

from __future__ import annotations

import importlib


def test_the_web_process_starts_loading_the_sentence_model_and_mlflow(monkeypatch, settings):
    from flywheel.failures.clustering import embedding
    from flywheel.registry import mlflow_bridge

    started = []
    monkeypatch.setattr(embedding, "preload_shared_model", lambda: started.append("sentence model"))
    monkeypatch.setattr(mlflow_bridge, "preload_client", lambda: started.append("mlflow"))
    import flywheel.wsgi

    settings.FLYWHEEL_PRELOAD = True
    importlib.reload(flywheel.wsgi)
    assert sorted(started) == ["mlflow", "sentence model"]
    settings.FLYWHEEL_PRELOAD = False  # the tests' own web processes, and any operator's choice
    importlib.reload(flywheel.wsgi)
    assert len(started) == 2


def test_the_mlflow_client_is_made_in_a_thread(monkeypatch):
    from flywheel.registry import mlflow_bridge

    made = []
    monkeypatch.setattr(mlflow_bridge, "client", lambda: made.append("client"))
    thread = mlflow_bridge.preload_client()
    thread.join(timeout=10)
    assert thread.daemon and made == ["client"]


def test_the_preload_loads_the_shared_model_in_a_thread(monkeypatch):
    from flywheel.failures.clustering import embedding

    class Model:
        def encode(self, texts):
            encoded.extend(texts)

    encoded: list[str] = []
    monkeypatch.setattr(embedding, "_shared", {})
    monkeypatch.setattr(embedding, "SentenceModel", Model)
    thread = embedding.preload_shared_model()
    thread.join(timeout=10)
    assert thread.daemon and not thread.is_alive()
    assert isinstance(embedding._shared["model"], Model) and encoded == ["warm up"]
