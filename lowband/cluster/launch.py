"""Start one ``torchrun`` per emulated node and wait for all of them.

With an :class:`~lowband.cluster.netns.EmulatedNetwork`, node ``i``'s torchrun runs inside
namespace ``i`` with ``GLOO_SOCKET_IFNAME`` set to its veth, and the static rendezvous (the c10d
store) listens on node 0's address: all traffic between nodes crosses the rate-limited links.
Without one (``net=None``), every node runs on loopback (master 127.0.0.1) and the caller passes
the environment that makes the library shape traffic in-process.

Every torchrun gets its own session; on a timeout, a failed node, Ctrl-C or SIGTERM the whole
process tree of every node (torchrun puts each worker in a session of its own too) is sent
SIGTERM, then SIGKILL after a grace period, so that no process outlives the launch. If this
process is killed outright (SIGKILL, OOM), the kernel sends every torchrun SIGTERM
(:func:`~lowband.cluster._procs.die_with_parent`), and torchrun stops its workers.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lowband.cluster._procs import ProcessTracker, die_with_parent, kill_trees, signals_as_exit
from lowband.cluster.netns import EmulatedNetwork

log = logging.getLogger(__name__)

_TAIL_LINES = 40
_TAIL_BYTES = 16_384


@dataclass
class LaunchResult:
    """What became of one launch: per node return code, log file and the end of its log.

    ``returncodes[i]`` is the exit status of node ``i``'s torchrun (negative: killed by that
    signal). ``timed_out`` is set when ``timeout_s`` ran out; ``killed[i]`` when node ``i`` was
    stopped by the launcher (timeout, or another node failed first).
    """

    returncodes: list[int | None]
    wall_time_s: float
    log_paths: list[Path]
    log_tails: list[str]
    timed_out: bool = False
    killed: list[bool] = field(default_factory=list)
    master_addr: str = ""
    master_port: int = 0
    commands: list[list[str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every node exited with status 0."""
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)

    def failure_message(self) -> str:
        """A human-readable account of what failed, with the tail of each failing node's log."""
        if self.ok:
            return "all nodes exited with status 0"
        parts = []
        if self.timed_out:
            parts.append(
                f"the launch timed out after {self.wall_time_s:.0f} s (raise timeout_s if it is slow)"
            )
        for i, rc in enumerate(self.returncodes):
            if rc != 0:
                why = "killed by the launcher" if self.killed and self.killed[i] else f"exit status {rc}"
                parts.append(f"node {i}: {why}; log {self.log_paths[i]}, last lines:\n{self.log_tails[i]}")
        return "\n".join(parts)

    def raise_for_failure(self) -> None:
        """Raise RuntimeError with :meth:`failure_message` unless every node succeeded."""
        if not self.ok:
            raise RuntimeError(self.failure_message())


def free_loopback_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now (bind to port 0 and release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - _TAIL_BYTES))
            data = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-_TAIL_LINES:])


def torchrun_argv(
    *,
    num_nodes: int,
    ranks_per_node: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
    local_addr: str,
    module_args: Sequence[str],
    module: str = "lowband",
    script: Path | None = None,
) -> list[str]:
    """The torchrun command line of one node (``python -m torch.distributed.run ...``)."""
    argv = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(num_nodes),
        "--nproc-per-node", str(ranks_per_node),
        "--node-rank", str(node_rank),
        "--master-addr", master_addr,
        "--master-port", str(master_port),
        "--local-addr", local_addr,
        "--max-restarts", "0",
        "--monitor-interval", "0.1",
    ]  # fmt: skip
    if script is not None:
        argv += [str(script), *module_args]
    else:
        argv += ["-m", module, *module_args]
    return argv


def launch_nodes(
    *,
    num_nodes: int,
    ranks_per_node: int,
    module_args: Sequence[str],
    env: Mapping[str, str],
    net: EmulatedNetwork | None,
    timeout_s: float,
    log_dir: Path,
    module: str = "lowband",
    script: Path | None = None,
    failure_grace_s: float = 15.0,
    kill_grace_s: float = 5.0,
) -> LaunchResult:
    """Run ``torchrun ... -m <module> <module_args>`` once per node and wait for all of them.

    Args:
        num_nodes, ranks_per_node: the emulated cluster (WORLD_SIZE = their product).
        module_args: arguments after the entry point, e.g. ``["train", "--steps", "10"]``.
        env: extra environment for every node, on top of this process's environment and
            ``OMP_NUM_THREADS=1`` / ``PYTHONUNBUFFERED=1`` (which it may override).
            ``GLOO_SOCKET_IFNAME`` is always set by the launcher (veth, or ``lo``).
        net: the emulated network to run in (``net.num_nodes`` must equal ``num_nodes``), or
            None to run every node on loopback.
        timeout_s: wall-clock limit for the whole launch; then every node is killed.
        log_dir: receives ``node<i>.log`` (stdout and stderr of node i's torchrun and workers).
        module: the module torchrun runs with ``-m`` (default ``lowband``).
        script: run this Python file instead of ``-m module`` (torchrun's script form).
        failure_grace_s: once a node exits non-zero, the others get this long to finish
            (they usually fail on their own when a peer vanishes) before they are killed.
        kill_grace_s: time between SIGTERM and SIGKILL when stopping a node.

    On KeyboardInterrupt or SystemExit (e.g. from the network's SIGTERM handler) every node is
    killed, ``net`` is closed, and the exception propagates. A node that fails does not raise:
    check ``result.ok`` or call ``result.raise_for_failure()``.
    """
    if num_nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"num_nodes={num_nodes}, ranks_per_node={ranks_per_node}: both must be at least 1")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s}: give the launch a positive time limit in seconds")
    if net is not None:
        if net.num_nodes != num_nodes:
            raise ValueError(
                f"the emulated network has {net.num_nodes} nodes but num_nodes={num_nodes}: "
                "create EmulatedNetwork(num_nodes, ...) with the same count"
            )
        if net.closed or net.setup_s is None:
            raise RuntimeError(f"{net!r} is not running: launch inside `with EmulatedNetwork(...) as net:`")
    if script is not None and not Path(script).is_file():
        raise ValueError(f"script {script} does not exist: pass the path of a Python file")
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)

    if net is not None:
        master_addr, master_port = net.nodes[0].ip, net.allocate_port()
    else:
        master_addr, master_port = "127.0.0.1", free_loopback_port()

    base_env = dict(os.environ)
    base_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    base_env.update(env)

    with signals_as_exit():
        return _run_nodes(
            num_nodes=num_nodes, ranks_per_node=ranks_per_node, module_args=module_args, module=module,
            script=script, net=net, base_env=base_env, master_addr=master_addr, master_port=master_port,
            timeout_s=timeout_s, log_dir=log_dir, failure_grace_s=failure_grace_s, kill_grace_s=kill_grace_s,
        )  # fmt: skip


def _run_nodes(
    *,
    num_nodes: int,
    ranks_per_node: int,
    module_args: Sequence[str],
    module: str,
    script: Path | None,
    net: EmulatedNetwork | None,
    base_env: dict[str, str],
    master_addr: str,
    master_port: int,
    timeout_s: float,
    log_dir: Path,
    failure_grace_s: float,
    kill_grace_s: float,
) -> LaunchResult:
    """Start the nodes, wait, and stop them on timeout, failure or interruption."""
    procs: list[subprocess.Popen[bytes]] = []
    log_paths = [log_dir / f"node{i}.log" for i in range(num_nodes)]
    commands: list[list[str]] = []
    returncodes: list[int | None] = [None] * num_nodes
    killed = [False] * num_nodes
    timed_out = False
    tracker = ProcessTracker()
    t0 = time.monotonic()
    try:
        for i in range(num_nodes):
            local_addr = net.nodes[i].ip if net is not None else "127.0.0.1"
            argv = torchrun_argv(
                num_nodes=num_nodes, ranks_per_node=ranks_per_node, node_rank=i,
                master_addr=master_addr, master_port=master_port, local_addr=local_addr,
                module_args=module_args, module=module, script=script,
            )  # fmt: skip
            node_env = dict(base_env)
            if net is not None:
                node_env["GLOO_SOCKET_IFNAME"] = net.nodes[i].interface
                argv = net.exec_argv(i, argv)
            else:
                node_env["GLOO_SOCKET_IFNAME"] = "lo"
            commands.append(argv)
            with open(log_paths[i], "wb") as logf:
                procs.append(
                    subprocess.Popen(
                        argv,
                        stdout=logf,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env=node_env,
                        start_new_session=True,
                        preexec_fn=die_with_parent(),  # SIGTERM to torchrun if we die, however we die
                    )
                )
        log.info(
            "launched %d node(s) x %d rank(s) %s, master %s:%d, logs in %s",
            num_nodes, ranks_per_node, "in network namespaces" if net else "on loopback",
            master_addr, master_port, log_dir,
        )  # fmt: skip
        deadline = t0 + timeout_s
        first_failure_t: float | None = None
        next_scan_t = 0.0
        while True:
            if time.monotonic() >= next_scan_t:
                tracker.update(p.pid for p in procs if p.poll() is None)
                next_scan_t = time.monotonic() + 1.0
            for i, p in enumerate(procs):
                if returncodes[i] is None and p.poll() is not None:
                    returncodes[i] = p.returncode
                    if p.returncode != 0 and first_failure_t is None:
                        first_failure_t = time.monotonic()
                        log.warning("node %d exited with status %d", i, p.returncode)
            running = [i for i, rc in enumerate(returncodes) if rc is None]
            if not running:
                break
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                log.error("launch timed out after %.0f s: killing nodes %s", timeout_s, running)
            elif first_failure_t is not None and now - first_failure_t >= failure_grace_s:
                log.error("a node failed; stopping nodes %s that are still running", running)
            else:
                time.sleep(0.1)
                continue
            for i in running:
                killed[i] = True
            kill_trees([procs[i].pid for i in running], grace_s=kill_grace_s)
            for i in running:
                returncodes[i] = procs[i].wait(timeout=30)
            break
    except BaseException as exc:
        # Ctrl-C, SystemExit from a signal handler, or an error while starting: leave nothing
        # behind. A second Ctrl-C must not cut this short, so the signals wait until it is done.
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
        try:
            tracker.update(p.pid for p in procs if p.poll() is None)
            kill_trees([p.pid for p in procs if p.poll() is None], grace_s=kill_grace_s)
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    log.error("torchrun pid %d did not exit after SIGKILL", p.pid)
            tracker.kill_survivors(grace_s=kill_grace_s)
            if net is not None and isinstance(exc, (KeyboardInterrupt, SystemExit)):
                net.close()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        raise
    finally:
        # Workers that outlived their agent (e.g. an agent killed by the OOM killer) are stopped too.
        tracker.kill_survivors(grace_s=kill_grace_s)
    wall = time.monotonic() - t0
    result = LaunchResult(
        returncodes=returncodes,
        wall_time_s=wall,
        log_paths=log_paths,
        log_tails=[_tail(p) for p in log_paths],
        timed_out=timed_out,
        killed=killed,
        master_addr=master_addr,
        master_port=master_port,
        commands=commands,
    )
    log.info("launch finished in %.1f s with return codes %s", wall, returncodes)
    return result
