"""A fault-tolerant job on this machine: one Lighthouse, one torchrun per node, nodes killed and restarted.

Used by the multi-process tests and for trying faults by hand::

    job = FaultTolerantJob(train_args=["--method", "flexdemo", "--steps", "60"], nodes=3, ranks_per_node=2,
                           out="runs/ft")
    job.start_all()
    job.wait_for_step(2, 15)      # node 2 has trained 15 steps
    job.kill(2)                   # SIGKILL to every process of node 2 (torchrun and its ranks)
    job.start(2)                  # it rejoins and heals from a live peer
    codes = job.wait()            # {node: exit code}

Every node is its own process group (session), so :meth:`kill` takes the whole node down at once
as a machine failure would, and :meth:`close` leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from lowband.cluster._procs import descendants, kill_trees
from lowband.ft.node import require_torchft
from lowband.trust.keys import key_path, roster_path
from lowband.trust.secret import ENV_SECRET, ENV_SECRET_FILE

#: How long :meth:`FaultTolerantJob.run_plan` waits, once the job has ended, for an intruder still running.
INTRUDER_GRACE_S = 60.0

__all__ = ["FaultTolerantJob"]


class FaultTolerantJob:
    """Lighthouse + ``nodes`` torchrun launches of ``lowband train --ft-lighthouse ...`` on this machine.

    Args:
        train_args: ``lowband train`` arguments shared by every node (not --out and the --ft-* flags).
        nodes: node slots (``--ft-max-nodes``).
        ranks_per_node: ranks of each node (``--nproc-per-node``).
        out: run directory; node i writes ``out/node{i}`` and its log ``out/node{i}.log``.
        heartbeat_timeout_s, join_timeout_s, min_nodes: the Lighthouse's (see
            :func:`lowband.ft.lighthouse.start_lighthouse`). ``min_nodes`` = ``nodes`` makes the job start with every
            node at once (the first node up does not train alone while the others start), but then no
            quorum forms while a node is down: for measurements without faults.
        ft_timeout_s: each node's ``--ft-timeout``.
        start_nodes: each node's ``--ft-start-nodes`` (None: theirs by default, every node slot): a test
            that starts fewer nodes than ``nodes`` sets it, or the first step waits for the others.
        secret_file: the job's secret (:mod:`lowband.trust.secret`), given to every node as LOWBAND_SECRET_FILE
            (never on a command line); :meth:`start` can give one node another. The Lighthouse gets it too,
            and then sits behind its gate (:mod:`lowband.ft.gateway`).
        lighthouse_args: more ``lowband lighthouse`` arguments (the gate's ``--probation``, ...).
        roster: with ``secret_file``, a job with per-member keys (:mod:`lowband.trust.keys`, written beside the secret
            by ``lowband secret --nodes``): the Lighthouse gets ``--roster``, node i ``--key-file`` and ``--roster``.
    """

    def __init__(self, *, train_args: list[str], nodes: int, ranks_per_node: int, out: str | Path,
                 heartbeat_timeout_s: float = 2.0, join_timeout_s: float = 10.0, ft_timeout_s: float = 5.0,
                 min_nodes: int = 1, start_nodes: int | None = None,
                 net=None, node_dirs: Path | None = None, log_dir: Path | None = None,
                 secret_file: str | Path | None = None, lighthouse_args: list[str] | None = None,
                 roster: bool = False) -> None:

        require_torchft()
        if net is not None and net.num_nodes != nodes:
            raise ValueError(f"the emulated network has {net.num_nodes} nodes, the job {nodes}")
        self.net = net
        self.node_dirs = Path(node_dirs) if node_dirs is not None else None
        self.log_dir = Path(log_dir) if log_dir is not None else Path(out)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.t0 = time.time()
        self.train_args = list(train_args)
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.ft_timeout_s = ft_timeout_s
        self.start_nodes = start_nodes
        self.secret_file = secret_file
        self.roster = roster_path(secret_file) if roster and secret_file else None
        if self.roster is not None:
            lighthouse_args = [*(lighthouse_args or []), "--roster", str(self.roster)]
        # The Lighthouse runs as a process of its own, as on a cluster (and so that torchft's runtime
        # threads never live in a process that later forks).
        # In a network namespace setup it runs in node 0's namespace, reachable at node 0's address.
        host = net.nodes[0].ip if net is not None else "127.0.0.1"
        argv = [sys.executable, "-m", "lowband.cli", "lighthouse", "--bind", f"{host}:0",
                "--heartbeat-timeout", f"{heartbeat_timeout_s}s", "--join-timeout", f"{join_timeout_s}s",
                "--min-nodes", str(min_nodes), *(lighthouse_args or [])]
        if net is not None:
            argv = net.exec_argv(0, argv)

        env = {k: v for k, v in os.environ.items() if k not in (ENV_SECRET, ENV_SECRET_FILE)}
        env["RUST_LOG"] = os.environ.get("RUST_LOG", "error")
        if secret_file:  # the job's gate admits only its members (lowband.ft.gateway); by the environment, as for nodes
            env[ENV_SECRET_FILE] = str(secret_file)
        self.lighthouse = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=open(self.log_dir / "lighthouse.log", "w"), text=True,  # noqa: SIM115
            env=env, start_new_session=True)
        line = self.lighthouse.stdout.readline()
        #: torchft's own status page behind the gate (on the Lighthouse's host only), when the job has a secret.
        self.status = line.split("status page is at ", 1)[1].split()[0].rstrip(",") if "status page is at " in line else None
        if not line.startswith("lighthouse at "):
            self.lighthouse.kill()
            raise RuntimeError(f"the Lighthouse did not start: {line!r}; see {self.log_dir / 'lighthouse.log'}")
        port = line.split()[2].rsplit(":", 1)[1]
        self.address = f"http://{host}:{port}"
        self.procs: dict[int, subprocess.Popen] = {}
        self.orphans: dict[int, list[int]] = {}  # ranks left running by kill(node, "agent")
        self.events: list[dict] = []  # what was done to which node, and when

    def node_out(self, node: int) -> Path:
        return (self.node_dirs or self.out) / f"node{node}"

    def log_path(self, node: int) -> Path:
        return self.log_dir / f"node{node}.log"

    def start(self, node: int, *, secret_file: str | Path | None = None) -> None:
        """Start (or restart) node ``node``: a torchrun of ``ranks_per_node`` ranks in its own session
        (``secret_file``: another secret than the job's, for a node that must be refused)."""
        if node in self.procs and self.procs[node].poll() is None:
            raise RuntimeError(f"node {node} is running")
        self.procs[node] = self._launch(node, self.node_out(node), self.log_path(node), secret_file=secret_file)
        self.events.append({"event": "start", "node": node, "unix_s": time.time()})

    def start_twin(self, node: int) -> subprocess.Popen:
        """Start a second torchrun for the slot of live node ``node`` (a user's mistake: the same
        ``--ft-node`` twice), into ``out/node{N}-twin``; the caller owns (and waits for) the process."""
        self.events.append({"event": "start-twin", "node": node, "unix_s": time.time()})
        p = self._launch(node, self.out / f"node{node}-twin", self.log_dir / f"node{node}-twin.log")
        self.orphans.setdefault(node, []).append(p.pid)  # close() takes it down if the caller did not
        return p

    def start_foreign(self, node: int, train_args: list[str], name: str) -> subprocess.Popen:
        """Start a node of ANOTHER job (``train_args`` instead of the job's) in slot ``node`` against this
        job's Lighthouse, into ``out/{name}`` with its log appended to ``{name}.log``; the caller owns (and
        waits for) the process."""
        self.events.append({"event": "start-foreign", "node": node, "name": name, "unix_s": time.time()})
        p = self._launch(node, self.out / name, self.log_dir / f"{name}.log", train_args=train_args)
        self.orphans.setdefault(node, []).append(p.pid)  # close() takes it down if the caller did not
        return p

    def start_intruder(self, node: int) -> subprocess.Popen:
        """Start an outsider in slot ``node``: the job's command line, but not its secret (none at all), as
        anyone who reaches the job's network and read its command line could; into ``out/intruder{K}``
        with its log in ``intruder{K}.log`` (K counts the intruders). The caller owns (and waits for) it."""
        k = sum(1 for e in self.events if e["event"] == "intrude") + 1
        name = f"intruder{k}"
        self.events.append({"event": "intrude", "node": node, "name": name, "unix_s": time.time(),
                            "step": self.job_step()})
        p = self._launch(node, self.out / name, self.log_dir / f"{name}.log", secret_file=False)
        self.orphans.setdefault(node, []).append(p.pid)  # close() takes it down if it is still there
        return p

    def _launch(self, node: int, out: Path, log_path: Path, *, train_args: list[str] | None = None,
                secret_file=None) -> subprocess.Popen:
        """``secret_file``: None for the job's, a path for another one, False for none at all."""
        train_args = self.train_args if train_args is None else train_args
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={self.ranks_per_node}", "-m", "lowband.cli", "train", *train_args,
               "--ft-lighthouse", self.address, "--ft-node", str(node), "--ft-max-nodes", str(self.nodes),
               "--ft-timeout", f"{self.ft_timeout_s}s", "--out", str(out), "--no-progress"]
        if self.start_nodes is not None:
            cmd += ["--ft-start-nodes", str(self.start_nodes)]
        if self.roster is not None and secret_file is None:  # the job's own keys (a node given another secret: none)
            cmd += ["--key-file", str(key_path(self.secret_file, node)), "--roster", str(self.roster)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   RUST_LOG=os.environ.get("RUST_LOG", "error"))
        secret = self.secret_file if secret_file is None else secret_file

        for name in (ENV_SECRET, ENV_SECRET_FILE):  # only what this job gives the node, never this shell's
            env.pop(name, None)
        if secret:  # by the environment, never on the command line
            env[ENV_SECRET_FILE] = str(secret)
        if self.net is not None:
            env.update(GLOO_SOCKET_IFNAME=self.net.nodes[node].interface, LOWBAND_FT_ADVERTISE=self.net.nodes[node].ip)
            cmd = self.net.exec_argv(node, cmd)
        else:
            env.update(GLOO_SOCKET_IFNAME="lo", LOWBAND_FT_ADVERTISE="127.0.0.1")
        log = open(log_path, "a")  # noqa: SIM115 (closed with the process)
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        return p

    def start_all(self) -> None:
        for i in range(self.nodes):
            self.start(i)

    def kill(self, node: int, what: str = "all") -> None:
        """SIGKILL processes of ``node``.

        ``what``: ``"all"`` (its torchrun agent and all its ranks at once, as a machine failure would),
        ``"ranks"`` (every rank, the agent lives and sees its workers fail), ``"rank"`` (one rank, its
        last), or ``"agent"`` (torchrun only; its ranks are orphaned).

        torchrun starts each rank in a session of its own, so the agent's process group is not enough:
        every descendant is found first, then all are killed together. With ``"all"`` the call returns
        once the agent is reaped; otherwise the agent (or the orphans) may still be winding down."""

        if what not in ("all", "ranks", "rank", "agent"):
            raise ValueError(f"kill what={what!r}: one of all, ranks, rank, agent")
        p = self.procs[node]
        self.events.append({"event": "kill", "what": what, "node": node, "unix_s": time.time(),
                            "step": self.steps_done(node)})
        ranks = self._ranks(node)
        victims = {"all": [p.pid, *descendants([p.pid])], "ranks": ranks, "rank": ranks[-1:],
                   "agent": [p.pid]}[what]
        if what == "agent":
            self.orphans.setdefault(node, []).extend(descendants([p.pid]))
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if what in ("all", "agent"):
            p.wait()

    def _ranks(self, node: int) -> list[int]:
        """PIDs of the node's ranks: the agent's descendants that run ``lowband.cli train``."""

        out = []
        for pid in descendants([self.procs[node].pid]):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if b"train" in argv and b"torch.distributed.run" not in argv:
                out.append(pid)
        return sorted(out)

    def freeze(self, node: int, seconds: float) -> None:
        """SIGSTOP every process of ``node`` for ``seconds``, then SIGCONT: a node that hangs, or whose
        link drops for a while, and then comes back with stale state."""

        p = self.procs[node]
        pids = [p.pid, *descendants([p.pid])]
        self.events.append({"event": "freeze", "node": node, "seconds": seconds, "unix_s": time.time(),
                            "step": self.steps_done(node)})
        for sig in (signal.SIGSTOP, signal.SIGCONT):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            if sig == signal.SIGSTOP:
                time.sleep(seconds)

    def steps_done(self, node: int) -> int:
        """The last training step node ``node`` recorded (0 before its first)."""
        path = self.node_out(node) / "metrics.jsonl"
        last = 0
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line being written
                if rec.get("type") == "train":
                    last = int(rec["step"])
        return last

    def wait_for_step(self, node: int, step: int, *, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.steps_done(node) < step:
            if self.procs[node].poll() is not None:
                raise RuntimeError(f"node {node} exited with {self.procs[node].returncode} before step {step}; "
                                   f"see {self.log_path(node)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {node} did not reach step {step} in {timeout_s:g} s")
            time.sleep(0.2)

    def end_soon(self, ahead: int = 8) -> int:
        """End the job cleanly ``ahead`` steps from node 0's last step, on every node at the same step, by
        writing the step into the job's ``--stop-file`` (which each node reads at every step; the nodes of a
        quorum are at most a step apart). A test gives a large ``--steps`` as a bound and ends the job this
        way once nothing is left to check: on a loaded machine a fixed --steps runs out while a node restarts.
        Returns the step named."""
        if "--stop-file" not in self.train_args:
            raise ValueError("end_soon needs --stop-file PATH in the job's train_args")
        stop_at = self.steps_done(0) + ahead
        Path(self.train_args[self.train_args.index("--stop-file") + 1]).write_text(f"{stop_at}\n")
        return stop_at

    def wait(self, *, timeout_s: float = 600.0) -> dict[int, int]:
        """Wait for every running node; {node: exit code}."""
        deadline = time.monotonic() + timeout_s
        codes = {}
        for node, p in self.procs.items():
            codes[node] = p.wait(timeout=max(deadline - time.monotonic(), 1.0))
        return codes

    def job_step(self) -> int:
        """The job's progress: the last step any running node has finished."""
        return max((self.steps_done(n) for n, p in self.procs.items() if p.poll() is None), default=0)

    def run_plan(self, faults, *, timeout_s: float) -> dict[int, int | None]:
        """Start every node, carry out ``faults`` (:class:`lowband.bench.faults.FaultEvent`) in order, wait.

        Returns {node: exit code} (None: still running when ``timeout_s`` ran out; then all are killed).
        A node killed by the plan and not started again has the code of its kill (-9). An intruder's exit
        code goes in its event (``exit``; None: it was still running when the job had ended and was waited
        for up to ``INTRUDER_GRACE_S``).
        """
        self.start_all()
        intruders: list[tuple[dict, subprocess.Popen]] = []
        pending = list(faults)
        deadline = time.monotonic() + timeout_s
        while True:
            if pending:
                ev = pending[0]
                due = (time.time() - self.t0 >= ev.at_s) if ev.at_s is not None else self.job_step() >= ev.step
                if due:
                    pending.pop(0)
                    if ev.action == "kill":
                        self.kill(ev.node)
                    elif ev.action == "intrude":
                        p = self.start_intruder(ev.node)
                        intruders.append((self.events[-1], p))
                    else:
                        self.start(ev.node)
                    self.events[-1]["planned"] = str(ev)
                    self.events[-1]["job_step"] = self.job_step()
                    continue
            running = [n for n, p in self.procs.items() if p.poll() is None]
            if not running and not pending:
                break
            if not running and pending:  # every node gone (e.g. failed) before the plan finished
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        grace = time.monotonic() + INTRUDER_GRACE_S
        for event, p in intruders:
            try:
                event["exit"] = p.wait(timeout=max(grace - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                event["exit"] = None
        return {n: p.poll() for n, p in self.procs.items()}

    def close(self) -> None:
        """Kill whatever still runs and stop the Lighthouse."""

        kill_trees([p.pid for p in self.procs.values() if p.poll() is None]
                   + [pid for pids in self.orphans.values() for pid in pids], grace_s=2.0)
        for p in self.procs.values():
            p.wait()
        self.lighthouse.kill()
        self.lighthouse.wait()

    def __enter__(self) -> FaultTolerantJob:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
