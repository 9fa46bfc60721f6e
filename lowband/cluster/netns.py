"""Emulated nodes on one machine: one network namespace per node, joined by rate-limited links.

Layout (all addresses live only inside namespaces created here)::

    2 nodes:   [lb-PID-n0] lbv0 <==veth==> lbv1 [lb-PID-n1]
    N nodes:   [lb-PID-nI] lbvI <==veth==> pI -- br0 [lb-PID-hub]   for every node I

Node ``i`` has the address ``10.77.0.{i+1}/24`` on ``lbv{i}``. Each node's egress is limited by a
``tbf`` qdisc at ``bandwidth_bps``; with a hub, the hub's port towards each node is limited as
well (``shape_ingress``), so a node's downlink is as slow as its uplink even when several peers
send to it at once. Traffic between ranks of one node stays on the namespace's loopback and is
not shaped.

Every link is created directly inside its namespace (``ip link add ... netns NS``), so nothing
is ever added to the root namespace and deleting the namespaces removes everything.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from lowband.cluster._procs import hold_signals_as_exit, is_alive, kill_pids, release_signals_as_exit

log = logging.getLogger(__name__)

_CMD_TIMEOUT_S = 20.0
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_]{1,16}$")
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: `ip netns exec NS` bind-mounts the files in /etc/netns/NS/ over /etc/ (hosts, resolv.conf).
ETC_NETNS = Path("/etc/netns")
#: Smallest tbf bucket: a few full-size frames, so that one TSO/GSO segment never stalls.
MIN_BURST_BYTES = 16 * 1024
#: The bucket holds 4 ms of traffic (one tick at HZ=250): it absorbs timer slack on a busy machine.
BURST_TIME_S = 1.0 / 250


@dataclass(frozen=True)
class EmulatedNode:
    """One emulated node: where its ranks run and how they reach the other nodes."""

    index: int
    namespace: str
    interface: str
    ip: str


def default_burst_bytes(bandwidth_bps: float) -> int:
    """The tbf bucket size used for ``bandwidth_bps``: max(16 KiB, 4 ms of traffic at that rate)."""
    return max(MIN_BURST_BYTES, int(bandwidth_bps / 8 * BURST_TIME_S))


def _run(argv: Sequence[str], *, check: bool = True, timeout_s: float = _CMD_TIMEOUT_S) -> str:
    """Run a short administrative command; raise RuntimeError naming it when it fails."""
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"`{' '.join(argv)}` did not finish within {timeout_s:.0f} s") from exc
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(argv)}` failed with exit code {proc.returncode}: {proc.stderr.strip()}"
        )
    return proc.stdout


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    out = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(namespace: str) -> list[int]:
    """Pids of the processes whose network namespace is ``namespace``."""
    out = _run(["ip", "netns", "pids", namespace], check=False)
    return [int(tok) for tok in out.split() if tok.isdigit()]


def _remove_etc(names: Sequence[str]) -> None:
    for name in names:
        shutil.rmtree(ETC_NETNS / name, ignore_errors=True)
    try:
        ETC_NETNS.rmdir()  # only when empty; another run may still use it
    except OSError:
        pass


def _delete_namespaces(names: Sequence[str]) -> None:
    """Stop every process inside ``names``, then delete the namespaces (with their links)."""
    pids = [pid for name in names for pid in namespace_pids(name)]
    if pids:
        log.info("stopping %d process(es) still inside namespaces %s", len(pids), list(names))
        kill_pids(pids, grace_s=2.0)
    for name in names:
        proc = subprocess.run(
            ["ip", "netns", "del", name], capture_output=True, text=True, timeout=_CMD_TIMEOUT_S
        )
        if proc.returncode != 0 and name in list_namespaces():
            log.warning("could not delete network namespace %s: %s", name, proc.stderr.strip())
    _remove_etc(names)


def _check_prefix(prefix: str) -> None:
    if not _PREFIX_RE.match(prefix):
        raise ValueError(
            f"namespace prefix {prefix!r} must be 1-16 letters, digits or underscores "
            "(it is followed by '-<pid>-' in namespace names): pass e.g. prefix='lb'"
        )


def netns_available(prefix: str = "lb") -> tuple[bool, str]:
    """Whether emulated nodes can be built here: (True, "") or (False, the reason).

    Checks for root, for ``ip`` and ``tc``, and creates (then deletes) a probe namespace with a
    veth pair and a tbf qdisc.
    """
    _check_prefix(prefix)
    if os.geteuid() != 0:
        return False, "network namespaces need root: run as root or pass --emulation shaped"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` not found: install iproute2 or pass --emulation shaped"
    probe = f"{prefix}-{os.getpid()}-probe"
    try:
        _run(["ip", "netns", "add", probe])
        try:
            _run(["ip", "-n", probe, "link", "add", "lbp0", "type", "veth", "peer", "name", "lbp1"])
            _run(["tc", "-n", probe, "qdisc", "add", "dev", "lbp0", "root", "tbf",
                  "rate", "100mbit", "burst", "16384", "latency", "50ms"])  # fmt: skip
        finally:
            _run(["ip", "netns", "del", probe], check=False)
    except (RuntimeError, OSError) as exc:
        return (
            False,
            f"cannot create a network namespace with a tbf-shaped veth ({exc}): pass --emulation shaped",
        )
    return True, ""


def cleanup_leftovers(prefix: str = "lb") -> list[str]:
    """Remove namespaces ``<prefix>-<pid>-*`` whose creating process ``pid`` is no longer alive.

    Processes still running inside such a namespace (e.g. torchrun workers orphaned by a crash)
    are stopped first. Links need no separate cleanup: they are only ever created inside the
    namespaces and vanish with them. Returns the names removed.
    """
    _check_prefix(prefix)
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)-")
    names = set(list_namespaces())
    if ETC_NETNS.is_dir():
        names |= {p.name for p in ETC_NETNS.iterdir()}
    stale = []
    for name in sorted(names):
        m = pattern.match(name)
        if m and int(m.group(1)) != os.getpid() and not is_alive(int(m.group(1))):
            stale.append(name)
    if stale:
        log.warning("removing network namespaces left by an earlier run: %s", stale)
        _delete_namespaces(stale)
    return stale


# ---------------------------------------------------------------------------------------------
# Process-wide cleanup: every live network of this process is closed at exit, and SIGTERM/SIGHUP
# raise SystemExit (lowband.cluster._procs.signals_as_exit) so that it gets there; Ctrl-C is a
# KeyboardInterrupt already.

_LIVE: set[EmulatedNetwork] = set()
_LIVE_LOCK = threading.RLock()
_ATEXIT_REGISTERED = False


def _close_all_live() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for net in live:
        try:
            net.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            log.exception("cleaning up emulated network %s failed", net.name)


def _install_handlers() -> None:
    """While a network is live: atexit closes it, and SIGTERM/SIGHUP unwind (``with`` blocks close it)."""
    global _ATEXIT_REGISTERED
    if not _ATEXIT_REGISTERED:
        atexit.register(_close_all_live)
        _ATEXIT_REGISTERED = True
    hold_signals_as_exit()


# ---------------------------------------------------------------------------------------------


class EmulatedNetwork:
    """``num_nodes`` network namespaces joined by links limited to ``bandwidth_bps`` each way.

    Use as a context manager (or call :meth:`start` / :meth:`close`)::

        with EmulatedNetwork(2, 100e6) as net:
            net.nodes[0].namespace, net.nodes[0].interface, net.nodes[0].ip
            before = net.tx_bytes(0)

    Args:
        num_nodes: number of emulated nodes (1-250).
        bandwidth_bps: egress limit of every node in bits/s; ``None`` leaves links unshaped.
        prefix: namespace names are ``<prefix>-<pid>-n<i>`` (and ``-hub``).
        queue_s: tbf ``latency``: the longest a packet may wait in the shaper's queue.
        burst_bytes: tbf bucket size; default :func:`default_burst_bytes`.
        shape_ingress: with a hub (N != 2), also limit the hub's port towards each node, so
            that each node's download is limited like its upload.
    """

    def __init__(
        self,
        num_nodes: int,
        bandwidth_bps: float | None,
        *,
        prefix: str = "lb",
        queue_s: float = 0.05,
        burst_bytes: int | None = None,
        shape_ingress: bool = True,
    ) -> None:
        _check_prefix(prefix)
        if not 1 <= num_nodes <= 250:
            raise ValueError(f"num_nodes={num_nodes}: an emulated network holds 1 to 250 nodes")
        if bandwidth_bps is not None and not bandwidth_bps >= 8_000:
            raise ValueError(
                f"bandwidth_bps={bandwidth_bps}: give a link rate of at least 8000 bit/s, "
                "or None for unshaped links"
            )
        if not queue_s > 0:
            raise ValueError(f"queue_s={queue_s}: the shaper's queue time must be positive, e.g. 0.05")
        if burst_bytes is not None and burst_bytes < 2048:
            raise ValueError(f"burst_bytes={burst_bytes}: the tbf bucket must hold a full frame (>= 2048)")
        self.num_nodes = num_nodes
        self.bandwidth_bps = bandwidth_bps
        self.prefix = prefix
        self.queue_s = queue_s
        self.burst_bytes = (
            burst_bytes if burst_bytes is not None
            else default_burst_bytes(bandwidth_bps) if bandwidth_bps is not None
            else None
        )  # fmt: skip
        self.shape_ingress = shape_ingress
        self.name = f"{prefix}-{os.getpid()}"
        self.hub_namespace: str | None = None if num_nodes == 2 else f"{self.name}-hub"
        self.nodes: list[EmulatedNode] = [
            EmulatedNode(i, f"{self.name}-n{i}", f"lbv{i}", f"10.77.0.{i + 1}") for i in range(num_nodes)
        ]
        self.setup_s: float | None = None
        self.teardown_s: float | None = None
        self._owner_pid = os.getpid()
        self._created: list[str] = []
        self._started = False
        self._closed = False
        self._holds_signals = False
        self._next_port = 29500

    # -- life cycle ---------------------------------------------------------------------------

    def __enter__(self) -> EmulatedNetwork:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> None:
        """Create the namespaces, links, addresses and shapers. Cleans up itself if it fails."""
        if self._started:
            raise RuntimeError(f"emulated network {self.name} was already started: create a new one")
        if os.geteuid() != 0:
            raise RuntimeError("network namespaces need root: run as root or pass --emulation shaped")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"`{tool}` not found: install iproute2 or pass --emulation shaped")
        cleanup_leftovers(self.prefix)
        existing = [n for n in list_namespaces() if n.startswith(self.name + "-")]
        if existing:
            raise RuntimeError(
                f"namespaces {existing} already exist for this process: close the other "
                f"EmulatedNetwork first or use a different prefix"
            )
        self._started = True
        with _LIVE_LOCK:
            _LIVE.add(self)
        _install_handlers()
        self._holds_signals = True
        t0 = time.perf_counter()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self.setup_s = time.perf_counter() - t0
        log.info(
            "emulated network %s: %d nodes, %s, set up in %.2f s",
            self.name,
            self.num_nodes,
            "unshaped" if self.bandwidth_bps is None else f"{self.bandwidth_bps / 1e6:g} Mbit/s per node",
            self.setup_s,
        )

    def _add_namespace(self, name: str) -> None:
        self._created.append(name)  # before creation: a half-made namespace is still removed
        _run(["ip", "netns", "add", name])
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _shape(self, namespace: str, interface: str) -> None:
        if self.bandwidth_bps is None:
            return
        _run([
            "tc", "-n", namespace, "qdisc", "add", "dev", interface, "root", "tbf",
            "rate", f"{int(self.bandwidth_bps)}bit", "burst", str(self.burst_bytes),
            "latency", f"{int(self.queue_s * 1e6)}us",
        ])  # fmt: skip

    def _build(self) -> None:
        for node in self.nodes:
            self._add_namespace(node.namespace)
        if self.hub_namespace is None:
            a, b = self.nodes
            _run(["ip", "link", "add", a.interface, "netns", a.namespace,
                  "type", "veth", "peer", "name", b.interface, "netns", b.namespace])  # fmt: skip
        else:
            hub = self.hub_namespace
            self._add_namespace(hub)
            _run(["ip", "-n", hub, *"link add br0 type bridge forward_delay 0 stp_state 0".split()])
            _run(["ip", "-n", hub, "link", "set", "br0", "up"])
            for node in self.nodes:
                port = f"p{node.index}"
                _run(["ip", "link", "add", node.interface, "netns", node.namespace,
                      "type", "veth", "peer", "name", port, "netns", hub])  # fmt: skip
                _run(["ip", "-n", hub, "link", "set", port, "master", "br0"])
                _run(["ip", "-n", hub, "link", "set", port, "up"])
                if self.shape_ingress:
                    self._shape(hub, port)
        self._write_etc()
        for node in self.nodes:
            _run(["ip", "-n", node.namespace, "addr", "add", f"{node.ip}/24", "dev", node.interface])
            _run(["ip", "-n", node.namespace, "link", "set", node.interface, "up"])
            self._shape(node.namespace, node.interface)

    def _write_etc(self) -> None:
        """Give each node a hosts file naming every node (and this machine's hostname as itself).

        Without it, c10d's reverse lookups of 10.77.0.x fail with a warning in every log ("The
        hostname of the client socket cannot be retrieved") and the hostname resolves to an
        address outside the node.
        An empty resolv.conf keeps name lookups from leaving the namespace.
        """
        hostname = socket.gethostname()
        for node in self.nodes:
            lines = ["127.0.0.1 localhost", f"{node.ip} {hostname} lbnode{node.index}"]
            lines += [f"{other.ip} lbnode{other.index}" for other in self.nodes if other is not node]
            # c10d's server socket is dual-stack: it looks peers up as v4-mapped IPv6 addresses.
            lines += [f"::ffff:{other.ip} lbnode{other.index}" for other in self.nodes]
            etc = ETC_NETNS / node.namespace
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("\n".join(lines) + "\n")
            (etc / "resolv.conf").write_text("options timeout:1 attempts:1\n")

    def close(self) -> None:
        """Stop processes left inside the namespaces and delete them. Idempotent, signal-safe."""
        if self._closed or not self._started or os.getpid() != self._owner_pid:
            return
        # Block the handled signals so that a second Ctrl-C cannot abort the teardown half-way;
        # they are delivered when the mask is restored.
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, set(_HANDLED_SIGNALS))
        try:
            if self._closed:
                return
            t0 = time.perf_counter()
            _delete_namespaces(list(reversed(self._created)))
            self._closed = True
            self.teardown_s = time.perf_counter() - t0
            log.info("emulated network %s torn down in %.2f s", self.name, self.teardown_s)
            with _LIVE_LOCK:
                _LIVE.discard(self)
            if self._holds_signals:
                self._holds_signals = False
                release_signals_as_exit()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    @property
    def closed(self) -> bool:
        """True once the network has been torn down."""
        return self._closed

    # -- use ----------------------------------------------------------------------------------

    def node(self, index: int) -> EmulatedNode:
        """The node with this index; raises ValueError for an index out of range."""
        if not 0 <= index < self.num_nodes:
            raise ValueError(f"node {index} does not exist: this network has nodes 0..{self.num_nodes - 1}")
        return self.nodes[index]

    def _require_live(self) -> None:
        if not self._started or self._closed:
            raise RuntimeError(
                f"emulated network {self.name} is not running: use it inside `with EmulatedNetwork(...)`"
            )

    def exec_argv(self, index: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside node ``index``'s namespace (``ip netns exec NS ...``)."""
        self._require_live()
        return ["ip", "netns", "exec", self.node(index).namespace, *argv]

    def _counters(self, index: int) -> tuple[int, int]:
        node = self.node(index)
        base = f"/sys/class/net/{node.interface}/statistics"
        out = _run(self.exec_argv(index, ["cat", f"{base}/tx_bytes", f"{base}/rx_bytes"]))
        tx, rx = (int(tok) for tok in out.split())
        return tx, rx

    def tx_bytes(self, index: int) -> int:
        """Bytes node ``index`` has sent on its link (Ethernet frames, as counted by the kernel)."""
        return self._counters(index)[0]

    def rx_bytes(self, index: int) -> int:
        """Bytes node ``index`` has received on its link."""
        return self._counters(index)[1]

    def allocate_port(self) -> int:
        """A TCP port for a new rendezvous on node 0.

        The namespaces are private to this network, so a port only has to differ from the ones
        handed out before (whose sockets may linger in TIME_WAIT).
        """
        self._require_live()
        port = self._next_port
        self._next_port += 1
        return port

    def __repr__(self) -> str:
        rate = "unshaped" if self.bandwidth_bps is None else f"{self.bandwidth_bps:g} bit/s"
        state = "closed" if self._closed else "running" if self._started else "not started"
        return f"EmulatedNetwork({self.name}, {self.num_nodes} nodes, {rate}, {state})"
