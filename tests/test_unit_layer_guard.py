"""The unit layer's guard (tests/conftest.py): an unmarked test cannot start a process, whatever the way."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest

NEEDLE = "is not marked 'multiprocess'"


def _noop() -> None:  # pragma: no cover (never runs: the start is refused)
    pass


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_every_multiprocessing_start_method_is_refused(method):
    ctx = multiprocessing.get_context(method)
    with pytest.raises(RuntimeError, match=NEEDLE):
        ctx.Process(target=_noop).start()


def test_subprocess_and_posix_spawn_are_refused():
    with pytest.raises(RuntimeError, match=NEEDLE):
        subprocess.run([sys.executable, "-c", "pass"], check=False)
    with pytest.raises(RuntimeError, match=NEEDLE):
        os.posix_spawn(sys.executable, [sys.executable, "-c", "pass"], dict(os.environ))


@pytest.mark.multiprocess
def test_a_marked_test_may_start_a_process():
    assert subprocess.run([sys.executable, "-c", "pass"], check=False).returncode == 0


def test_the_beside_lane_names_tests_that_exist():
    """A renamed test or file named in tests/conftest.py's BESIDE lists would fall back to the timed lane unseen."""
    from pathlib import Path

    from tests.conftest import BESIDE, BESIDE_FILES, lane_of

    root = Path(__file__).resolve().parents[1]
    for nodeid in BESIDE:
        path, name = nodeid.split("::")
        assert f"def {name}(" in (root / path).read_text(), nodeid
        assert lane_of(nodeid + "[x]") == "beside"
    for path in BESIDE_FILES:
        assert "multiprocess" in (root / path).read_text(), path
        assert lane_of(path + "::test_x") == "beside"
    assert lane_of("tests/e2e/test_fault_tolerance.py::test_x") == "multiprocess"
