"""A web process loads the leakage guard's sentence model as it starts, beside its first requests, so that the
first "Run checks" of a promotion does not load it inside the request (16 s on two busy cores: bench/actions.py)."""

from __future__ import annotations

import importlib


def test_the_web_process_starts_loading_the_sentence_model(monkeypatch, settings):
    from flywheel.failures.clustering import embedding

    started = []
    monkeypatch.setattr(embedding, "preload_shared_model", lambda: started.append("loading"))
    import flywheel.wsgi

    settings.FLYWHEEL_PRELOAD_SENTENCE_MODEL = True
    importlib.reload(flywheel.wsgi)
    assert started == ["loading"]
    settings.FLYWHEEL_PRELOAD_SENTENCE_MODEL = False  # the tests' own web processes, and any operator's choice
    importlib.reload(flywheel.wsgi)
    assert started == ["loading"]


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
