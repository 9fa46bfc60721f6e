"""lowband/cluster/launch.py: the launcher of emulated nodes (torchrun per node): argument errors,
torchrun's argv, the loopback fallback, failed or hanging nodes killed, torchrun across two
emulated nodes, interrupts and a SIGKILLed launcher leaving nothing behind.

Tests that build namespaces skip (with the reason) where that is impossible, e.g. without root.
The namespace and process helpers are in tests/cluster/emulation.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lowband.cluster import (
    EmulatedNetwork,
    cleanup_leftovers,
    default_burst_bytes,
    launch_nodes,
    torchrun_argv,
)
from lowband.cluster._procs import kill_trees
from lowband.testing.ranks import default_sigint
from tests.cluster.emulation import (
    PREFIX,
    child_env,
    needs_netns,
    our_namespaces,
    processes_mentioning,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

# The tiny distributed job: a gloo all_reduce over all ranks plus checks of the torchrun env.
JOB = textwrap.dedent(
    """
    import os, sys, time
    mode = sys.argv[1]
    Path = __import__("pathlib").Path
    (Path(sys.argv[2]) / f"started-{os.environ['RANK']}").touch()
    if mode == "hang":
        time.sleep(300)
    if mode == "fail":
        if os.environ["GROUP_RANK"] == "1":
            sys.exit(3)
        time.sleep(300)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    assert os.environ["WORLD_SIZE"] == "4", os.environ["WORLD_SIZE"]
    assert os.environ["LOCAL_WORLD_SIZE"] == "2", os.environ["LOCAL_WORLD_SIZE"]
    assert os.environ["OMP_NUM_THREADS"] == "1"
    assert os.environ["LB_TEST_ENV"] == "passed-through"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.full((4096,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.all(t == 10.0), t[:4]
    # One write per line: the ranks of a node share the log file.
    sys.stdout.write(f"JOB-OK rank={rank} node={os.environ['GROUP_RANK']} if={os.environ['GLOO_SOCKET_IFNAME']}\\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    """
)


def _write_job(tmp_path: Path) -> Path:
    script = tmp_path / "lbjob.py"
    script.write_text(JOB)
    return script


# --------------------------------------------------------------------------------- no root needed


def test_argument_errors_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="prefix"):
        EmulatedNetwork(2, 1e8, prefix="bad-prefix")
    with pytest.raises(ValueError, match="num_nodes"):
        EmulatedNetwork(0, 1e8)
    with pytest.raises(ValueError, match="bandwidth_bps"):
        EmulatedNetwork(2, 10.0)
    with pytest.raises(ValueError, match="timeout_s"):
        launch_nodes(
            num_nodes=2, ranks_per_node=1, module_args=[], env={}, net=None, timeout_s=0, log_dir=tmp_path
        )
    with pytest.raises(ValueError, match="script"):
        launch_nodes(
            num_nodes=2, ranks_per_node=1, module_args=[], env={}, net=None, timeout_s=5,
            log_dir=tmp_path, script=tmp_path / "missing.py",
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="not running"):
        EmulatedNetwork(2, 1e8, prefix=PREFIX).tx_bytes(0)
    assert default_burst_bytes(100e6) == 50_000 and default_burst_bytes(1e6) == 16 * 1024


def test_torchrun_argv_shapes() -> None:
    argv = torchrun_argv(
        num_nodes=3, ranks_per_node=2, node_rank=1, master_addr="10.77.0.1", master_port=29500,
        local_addr="10.77.0.2", module_args=["bench", "--x"],
    )  # fmt: skip
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    joined = " ".join(argv)
    for part in ("--nnodes 3", "--nproc-per-node 2", "--node-rank 1", "--master-addr 10.77.0.1",
                 "--master-port 29500", "--max-restarts 0"):  # fmt: skip
        assert part in joined
    assert argv[-4:] == ["-m", "lowband", "bench", "--x"]
    script_argv = torchrun_argv(
        num_nodes=1, ranks_per_node=1, node_rank=0, master_addr="127.0.0.1", master_port=1,
        local_addr="127.0.0.1", module_args=["a"], script=Path("/x/job.py"),
    )  # fmt: skip
    assert script_argv[-2:] == ["/x/job.py", "a"]


@pytest.mark.multiprocess
def test_loopback_fallback_runs_the_job(tmp_path: Path) -> None:
    script = _write_job(tmp_path)
    result = launch_nodes(
        num_nodes=2, ranks_per_node=2, module_args=["run", str(tmp_path)],
        env={"LB_TEST_ENV": "passed-through"}, net=None, timeout_s=90, log_dir=tmp_path / "logs",
        script=script,
    )  # fmt: skip
    assert result.ok, result.failure_message()
    assert result.master_addr == "127.0.0.1"
    logs = "".join(p.read_text() for p in result.log_paths)
    assert sorted(re.findall(r"JOB-OK (rank=\d+)", logs)) == [
        "rank=0", "rank=1", "rank=2", "rank=3",
    ]  # fmt: skip
    assert "if=lo" in logs
    assert processes_mentioning(str(tmp_path)) == []


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["fail", "hang"])
def test_failed_or_hanging_nodes_are_killed(tmp_path: Path, mode: str) -> None:
    """A node that fails brings the others down after failure_grace_s; a hang hits timeout_s."""
    script = _write_job(tmp_path)
    result = launch_nodes(
        num_nodes=2, ranks_per_node=1, module_args=[mode, str(tmp_path)], env={}, net=None,
        timeout_s=40 if mode == "fail" else 8, log_dir=tmp_path / "logs", script=script,
        failure_grace_s=1.0, kill_grace_s=2.0,
    )  # fmt: skip
    assert not result.ok
    if mode == "fail":
        assert result.returncodes[1] not in (0, None) and not result.killed[1]
        assert result.killed[0] and not result.timed_out
    else:
        assert result.timed_out and all(result.killed)
        assert "timed out" in result.failure_message()
    assert all(rc is not None for rc in result.returncodes)
    assert processes_mentioning(str(tmp_path)) == []


# ---------------------------------------------------------------------------------- needs netns


@pytest.mark.multiprocess
@needs_netns
def test_torchrun_across_two_emulated_nodes(tmp_path: Path) -> None:
    script = _write_job(tmp_path)
    with EmulatedNetwork(2, 100e6, prefix=PREFIX) as net:
        tx_before = [net.tx_bytes(i) for i in range(2)]
        result = launch_nodes(
            num_nodes=2, ranks_per_node=2, module_args=["run", str(tmp_path)],
            env={"LB_TEST_ENV": "passed-through"}, net=net, timeout_s=90, log_dir=tmp_path / "logs",
            script=script,
        )  # fmt: skip
        assert result.ok, result.failure_message()
        sent = [net.tx_bytes(i) - tx_before[i] for i in range(2)]
    assert result.master_addr == "10.77.0.1"
    logs = [p.read_text() for p in result.log_paths]
    for node, text in enumerate(logs):
        ok_lines = re.findall(r"JOB-OK rank=\d+ node=\d+ if=\w+", text)
        assert len(ok_lines) == 2 and all(f"node={node} if=lbv{node}" in line for line in ok_lines), text
    # The all_reduce of 4096 floats crossed the link both ways (gloo sends at least a share of it).
    assert all(s >= 4096 for s in sent), sent
    assert our_namespaces(os.getpid()) == []
    assert processes_mentioning(str(tmp_path)) == []


LAUNCHER = textwrap.dedent(
    """
    import logging, sys
    from pathlib import Path
    from lowband.cluster import EmulatedNetwork, launch_nodes
    logging.basicConfig(level=logging.INFO)
    prefix, mode, tmp = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    kwargs = dict(num_nodes=2, ranks_per_node=2, module_args=["hang", str(tmp)], env={}, timeout_s=120,
                  log_dir=tmp / "logs", script=tmp / "lbjob.py", kill_grace_s=2.0)
    if mode == "netns":
        with EmulatedNetwork(2, 100e6, prefix=prefix) as net:
            launch_nodes(net=net, **kwargs)
    else:
        launch_nodes(net=None, **kwargs)
    """
)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "mode, signum",
    [pytest.param("netns", signal.SIGINT, marks=needs_netns), ("loopback", signal.SIGTERM)],
    ids=["netns-ctrl-c", "loopback-sigterm"],
)
def test_interrupted_launch_leaves_nothing_behind(tmp_path: Path, mode: str, signum: int) -> None:
    """Ctrl-C or SIGTERM while the nodes run: every process and namespace is gone afterwards."""
    _write_job(tmp_path)
    child = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, PREFIX, mode, str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), preexec_fn=default_sigint,
    )  # fmt: skip
    try:
        started = wait_until(lambda: len(list(tmp_path.glob("started-*"))) == 4, 60.0)
        assert started, "the hanging job never started all 4 ranks"
        if mode == "netns":
            assert len(our_namespaces(child.pid)) == 2
        child.send_signal(signum)
        _, err = child.communicate(timeout=30)
        if signum == signal.SIGINT:
            assert "KeyboardInterrupt" in err, err[-2000:]
        else:
            assert child.returncode == 128 + signal.SIGTERM, err[-2000:]
        assert our_namespaces(child.pid) == []
        assert wait_until(lambda: processes_mentioning(str(tmp_path)) == [], 5.0)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
        if mode == "netns":
            cleanup_leftovers(PREFIX)


@pytest.mark.multiprocess
def test_sigkilled_launcher_takes_its_nodes_with_it(tmp_path: Path) -> None:
    """The bench killed outright (SIGKILL: no handler, no cleanup runs): its torchruns and their
    workers must end too, instead of running on orphaned."""
    _write_job(tmp_path)
    child = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, PREFIX, "loopback", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env(),
    )  # fmt: skip
    try:
        started = wait_until(lambda: len(list(tmp_path.glob("started-*"))) == 4, 60.0)
        assert started, "the hanging job never started all 4 ranks"
        assert len(processes_mentioning(str(tmp_path))) >= 6  # 2 torchruns and 4 workers
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        gone = wait_until(lambda: processes_mentioning(str(tmp_path)) == [], 45.0)
        assert gone, f"processes outlived the SIGKILLed launcher: {processes_mentioning(str(tmp_path))}"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
        orphans = processes_mentioning(str(tmp_path))
        if orphans:
            kill_trees(orphans, grace_s=1.0)
