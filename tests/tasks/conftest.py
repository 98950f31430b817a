from __future__ import annotations

import pytest


@pytest.fixture
def offline(monkeypatch):
    """The hub out of reach as HF_HUB_OFFLINE / HF_DATASETS_OFFLINE put it, however early the
    libraries read them. Tests name an id no cache can hold, so the answer never depends on what
    this machine has cached."""
    datasets = pytest.importorskip("datasets")
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
