"""Fixtures of the bench tests: the fake trainer written to a file."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.fake_trainer import FAKE_TRAINER


@pytest.fixture()
def fake_trainer(tmp_path: Path) -> Path:
    path = tmp_path / "fake_trainer.py"
    path.write_text(FAKE_TRAINER)
    return path
