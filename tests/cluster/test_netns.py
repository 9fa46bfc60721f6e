"""lowband/cluster/netns.py: emulated nodes' namespaces come down after an exception, after a crash (cleanup of leftovers) and on SIGTERM.

Tests that build namespaces skip (with the reason) where that is impossible, e.g. without root."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from lowband.cluster import (
    EmulatedNetwork,
    cleanup_leftovers,
    list_namespaces,
)
from lowband.cluster._procs import is_alive
from lowband.cluster.netns import namespace_pids
from tests.cluster.emulation import (
    PREFIX,
    child_env,
    needs_netns,
    our_namespaces,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.multiprocess
@needs_netns
def test_teardown_after_exception_stops_processes_inside() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedNetwork(3, 50e6, prefix=PREFIX) as net:
            assert net.hub_namespace in list_namespaces()
            sleeper = subprocess.Popen(net.exec_argv(2, ["sleep", "300"]), start_new_session=True)
            # `ip netns exec` enters the namespace only after it starts: under load a process not inside yet is not
            # the network's to stop (as in the crash tests below)
            assert wait_until(lambda: sleeper.pid in namespace_pids(net.node(2).namespace), 60)
            raise RuntimeError("boom")
    assert sleeper.wait(timeout=10) != 0
    assert our_namespaces(os.getpid()) == []
    assert net.closed and net.teardown_s is not None


CRASHER = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    from lowband.cluster import EmulatedNetwork
    from lowband.cluster.netns import namespace_pids
    net = EmulatedNetwork(2, 100e6, prefix=sys.argv[1]).__enter__()
    sleeper = subprocess.Popen(
        net.exec_argv(1, ["sleep", "300"]), start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    # `ip netns exec` enters the namespace only after it starts: under load that takes a while, and a process
    # not inside yet is not the network's to stop. Say the pid once the teardown would see it inside.
    deadline = time.monotonic() + 60
    while sleeper.pid not in namespace_pids(net.node(1).namespace) and time.monotonic() < deadline:
        time.sleep(0.05)
    print(sleeper.pid, flush=True)
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # a crash: no cleanup runs
    time.sleep(60)
    """
)


@pytest.mark.multiprocess
@needs_netns
def test_cleanup_leftovers_after_a_crash() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CRASHER, PREFIX, "kill"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
    )  # fmt: skip
    out, err = child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL, err
    sleeper_pid = int(out.split()[0])
    try:
        leftovers = our_namespaces(child.pid)
        assert len(leftovers) == 2 and is_alive(sleeper_pid)
        removed = cleanup_leftovers(PREFIX)
        assert set(leftovers) <= set(removed)
        assert our_namespaces(child.pid) == []
        assert wait_until(lambda: not is_alive(sleeper_pid), 5.0)
    finally:
        if is_alive(sleeper_pid):
            os.kill(sleeper_pid, signal.SIGKILL)
        cleanup_leftovers(PREFIX)


@pytest.mark.multiprocess
@needs_netns
def test_sigterm_tears_the_network_down() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CRASHER, PREFIX, "wait"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
    )  # fmt: skip
    try:
        assert child.stdout is not None
        sleeper_pid = int(child.stdout.readline())
        assert len(our_namespaces(child.pid)) == 2
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=20) == 128 + signal.SIGTERM
        assert our_namespaces(child.pid) == []
        assert wait_until(lambda: not is_alive(sleeper_pid), 15.0)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
        cleanup_leftovers(PREFIX)
