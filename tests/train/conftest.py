"""Fixtures of the trainer's tests: every cache in a temporary directory, offline.

``_session_cache`` is session-scoped and autouse: from the first test under tests/train/ on, the
session's caches (tokenizers, token caches) live in one temporary directory and Hugging Face stays
offline. ``fresh_cache`` gives one test an empty cache of its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory: pytest.TempPathFactory):
    """Keep every cache of this file in a temporary directory, and stay offline."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOWBAND_CACHE", str(tmp_path_factory.mktemp("lowband-cache")))
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture()
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("LOWBAND_CACHE", str(cache))
    return cache
