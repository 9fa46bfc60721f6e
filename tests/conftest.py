"""Two layers of tests: fast unit tests, and ``multiprocess`` tests that start processes.

``pytest -m "not multiprocess and not slow"`` runs the unit layer (no process, no namespace;
under a minute); ``slow`` marks single-process tests that take seconds each (the whole embedded
corpus, full-size models); ``pytest -m multiprocess`` runs gloo ranks, torchrun launches, network
namespaces and the bench end to end. A test that starts a process must carry the marker (on the test, or
``pytestmark`` on its module): in an unmarked test, forking or spawning fails with a message
saying so, so the unit layer cannot silently grow slow.
"""

from __future__ import annotations

import multiprocessing.forkserver
import multiprocessing.util
import os
import platform
import subprocess
from functools import lru_cache

import pytest

MARKER = "multiprocess"

# Both start a process once per process (or machine) and cache the result, so they run here, not
# inside a unit test: platform.platform() runs `uname -p`; matplotlib's font manager runs `fc-list`
# when it builds its font cache (the first plot on a fresh machine).
platform.platform()
import matplotlib.font_manager  # noqa: E402,F401


def _bytecode_note() -> str | None:
    # A check that the suite's hundreds of processes start from cached bytecode: with pip's --no-compile and
    # PYTHONDONTWRITEBYTECODE set (as on some machines), each compiled torch's and transformers' sources again.
    import importlib.util
    import sys

    torch_init = importlib.util.find_spec("torch").origin
    if not sys.dont_write_bytecode or os.path.exists(importlib.util.cache_from_source(torch_init)):
        return None
    return ("bytecode: torch's is not cached and this Python writes none (PYTHONDONTWRITEBYTECODE): every process "
            "the tests start compiles torch's sources again (about 4 s of CPU each); install without --no-compile")


def pytest_terminal_summary(terminalreporter) -> None:
    note = _bytecode_note()
    if note:
        terminalreporter.write_line(note, yellow=True)


@lru_cache(maxsize=1)
def netns_status() -> tuple[bool, str]:
    """Whether network namespaces work here, and why not; probed once, by the first test marked ``netns``."""
    from lowband.cluster import netns_available

    return netns_available("lbtest")


def pytest_runtest_setup(item: pytest.Item) -> None:
    # The probe creates a namespace: it runs only for a test that needs one (never at collection,
    # never in the unit layer).
    if item.get_closest_marker("netns") is not None:
        ok, reason = netns_status()
        if not ok:
            pytest.skip(f"network namespaces unavailable: {reason}")


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(
            f"this test {what}, but is not marked {MARKER!r}: add @pytest.mark.{MARKER} to it "
            f"(or pytestmark = pytest.mark.{MARKER} to its module) so that it runs in the multi-process layer"
        )

    return refuse


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker(MARKER) is not None:
        return
    monkeypatch.setattr(os, "fork", _refuse("forks a process"))
    monkeypatch.setattr(subprocess, "_fork_exec", _refuse("starts a subprocess"))
    monkeypatch.setattr(subprocess, "_USE_POSIX_SPAWN", False)
    for name in ("posix_spawn", "posix_spawnp"):
        monkeypatch.setattr(os, name, _refuse("spawns a process"))
    # multiprocessing's other start methods: "spawn" execs through util.spawnv_passfds (which also
    # starts the fork server), "forkserver" asks a running fork server for each new process.
    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", _refuse("spawns a process (multiprocessing)"))
    monkeypatch.setattr(multiprocessing.forkserver.ForkServer, "connect_to_new_process",
                        _refuse("starts a process through multiprocessing's fork server"))


# With pytest-xdist (the README's `-n 2`), two workers share this machine's two cores, in two lanes:
# - "multiprocess": the tests that start processes and time their peers (fault tolerance with its
#   heartbeats and timeouts, admission, launches killed or hung, the bench runner's interrupts, time budgets,
#   measured link times), one after another on one worker, as without xdist: two of them at once would load
#   the clocks they watch;
# - "beside": on the other worker, one after another too, the benches that wait on an emulated link most
#   of their time (100 ms per message: the cores are mostly idle) and the multi-process tests that time
#   nothing, whose checks are exact or loose in loss (golden trajectories, every method learns, the
#   examples, the optimizers' and the trainer's gloo tests): they fill the cores the link-bound benches leave
#   idle. The unit and slow layers (one process each) fill both workers' gaps.
BESIDE = (
    "tests/e2e/test_bench.py::test_bench_with_faults_end_to_end",
    "tests/e2e/test_bench.py::test_bench_runs_real_training_side_by_side",
    "tests/e2e/test_learns.py::test_every_method_learns_to_reverse",
    "tests/e2e/test_golden.py::test_every_method_follows_its_golden_trajectory",
    "tests/e2e/test_examples.py::test_flexdemo_example_trains_across_two_nodes",
    "tests/e2e/test_examples.py::test_diloco_example_syncs_every_h_steps",
    "tests/bench/test_runner.py::test_failed_run_is_recorded_and_the_others_run",
    "tests/optim/test_diloco.py::test_diloco_outer_step_numerics_fsdp2_and_heavy_ball_equivalence",
    "tests/optim/test_diloco.py::test_checkpoint_mid_phase_resumes_exactly_with_fsdp2",
    "tests/optim/test_diloco.py::test_diloco_demo_like_every_rank_a_replica",
    "tests/train/test_tokenizer.py::test_tokenizer_cache_is_safe_for_ranks_starting_together",
    "tests/train/test_pretrained.py::test_a_pretrained_model_of_each_family_fine_tunes_on_its_own_tokenizer",
)
# Whole files of multi-process tests that time nothing (exact checks on gloo ranks).
BESIDE_FILES = (
    "tests/optim/test_flexdemo.py",
    "tests/optim/test_flexdemo_overlap.py",
    "tests/optim/test_muon.py",
    "tests/optim/test_noloco.py",
    "tests/optim/test_sparseloco.py",
    "tests/distributed/test_sharding.py",
    "tests/distributed/test_tied_embedding.py",
    "tests/checkpoint/test_dcp.py",
    "tests/train/test_loop.py",
    "tests/train/test_export.py",
    "tests/train/test_step.py",
    "tests/train/test_heal.py",
)


def lane_of(nodeid: str) -> str:
    """The xdist lane of a multi-process test (its node id)."""
    beside = nodeid.split("[")[0] in BESIDE or nodeid.split("::")[0] in BESIDE_FILES
    return "beside" if beside else "multiprocess"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if item.get_closest_marker(MARKER) is None:
            continue
        item.add_marker(pytest.mark.xdist_group(lane_of(item.nodeid)))


def pytest_collection_finish(session: pytest.Session) -> None:
    # After every pytest_collection_modifyitems, xdist's included (it appends each test's group to its id).
    if not session.config.getoption("loadgroup", default=False):  # set on xdist's workers under --dist loadgroup
        return
    lost = [item.nodeid for item in session.items if item.get_closest_marker(MARKER) and "@" not in item.nodeid]
    if lost:
        raise pytest.UsageError(
            f"--dist loadgroup did not take the lanes of tests/conftest.py ({lost[0]} has no group): this "
            f"pytest ({pytest.__version__}) and pytest-xdist do not work together, and multi-process tests "
            "would run two at once. Install the project's test extras (pip install -e '.[test]', pytest < 9.2) "
            "or run without -n.")
