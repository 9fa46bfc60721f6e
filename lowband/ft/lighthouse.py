"""torchft's Lighthouse for a fault-tolerant job (``lowband lighthouse``), behind the job's gate when it has a secret.

The Lighthouse forms the job's quorums from the nodes' requests and heartbeats (docs/fault-tolerance.md).
With the job's secret it listens on loopback only, and the gate of :mod:`lowband.ft.gateway` listens on
the job's address in front of it: only the job's members reach it (docs/internet.md).
"""

from __future__ import annotations

from lowband.ft.gateway import LighthouseGateway, StallBreaker
from lowband.trust.admission import CannotListen

__all__ = ["GatedLighthouse", "start_lighthouse"]


def start_lighthouse(*, bind: str = "127.0.0.1:0", min_nodes: int = 1, join_timeout_s: float = 10.0,
                     heartbeat_timeout_s: float = 3.0, quorum_tick_s: float = 0.05, secret: bytes | None = None,
                     stall_rounds: int = 3, probation_s: float = 30.0, bench_s: float = 600.0, roster=None,
                     completion_file=None):
    """Start a torchft Lighthouse in this process; returns the server (``.address()``, ``.shutdown()``).

    Args:
        bind: address and port to listen on (the job's network; port 0: any free port).
        min_nodes: a quorum needs at least this many nodes.
        join_timeout_s: how long a quorum waits for live nodes of the previous quorum that have not
            asked yet (a dead node, silent for ``heartbeat_timeout_s``, is not waited for). It must
            exceed the skew between nodes at a quorum: DiLoCo's nodes drift apart over H inner steps
            with no exchange, and with 1 s a late node was left out, split the quorum and had to heal.
        heartbeat_timeout_s: a node without a heartbeat for this long is dead and not waited for.
        quorum_tick_s: how often the Lighthouse checks whether a quorum can form.
        secret: the job's secret: torchft's Lighthouse then listens on loopback only and ``bind`` is
            the gate in front of it that lets only the job's members ask for quorums and send
            heartbeats, and serves no status page and no kill route (:mod:`lowband.ft.gateway`).
        stall_rounds, probation_s, bench_s: with the gate, how it finds and keeps out a member that stalls the
            job, and how long it keeps out one that most members reported for bad messages
            (:class:`~lowband.ft.gateway.StallBreaker`).
        roster: the job's roster of members' public keys (:class:`lowband.trust.keys.Roster`; needs ``secret``): the
            gate then takes reports and claims to a node slot only signed by the member's own key.
        completion_file: with the gate, a file that keeps the job's completion record
            (:class:`~lowband.ft.completion.CompletionRecord`): a Lighthouse started again still tells a node
            that comes back after the job's end that it is complete.
    """
    if roster is not None and secret is None:
        raise ValueError("--roster needs the job's secret (--secret-file), which signs it")
    if completion_file is not None and secret is None:
        raise ValueError("--completion-file needs the job's secret (--secret-file): without it there is no gate to "
                         "record the job's end")
    # Here: ft.node imports torch, which the Lighthouse's host need not pay for.
    from lowband.ft.node import require_torchft

    require_torchft()
    from torchft._torchft import LighthouseServer  # optional dependency (the ft extra)

    def lighthouse(at: str):
        try:
            return LighthouseServer(bind=at, min_replicas=min_nodes, join_timeout_ms=int(join_timeout_s * 1000),
                                    quorum_tick_ms=int(quorum_tick_s * 1000),
                                    heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))
        except RuntimeError as e:  # torchft's bind error, as its Rust side words it
            raise CannotListen(f"the Lighthouse cannot listen on {at}: {e}; pass an address this machine holds "
                               "(`ip -brief address` lists them) and a free port") from None

    if secret is None:
        return lighthouse(bind)

    breaker = StallBreaker(stall_rounds=stall_rounds, probation_s=probation_s, bench_s=bench_s)
    return GatedLighthouse(lighthouse("127.0.0.1:0"), bind=bind, secret=secret, breaker=breaker, roster=roster,
                           pin_idle_s=heartbeat_timeout_s, completion_file=completion_file)


class GatedLighthouse:
    """torchft's Lighthouse on loopback behind a :class:`~lowband.ft.gateway.LighthouseGateway` on the job's
    address: ``address()`` is the gate's (what nodes are given), ``status_address()`` torchft's own
    (its status page and kill route: this host only)."""

    def __init__(self, server, *, bind: str, secret: bytes, breaker=None, roster=None, pin_idle_s: float = 3.0,
                 completion_file=None) -> None:

        self._server = server
        self._backend = f"127.0.0.1:{server.address().rsplit(':', 1)[1]}"
        try:
            self.gate = LighthouseGateway(bind=bind, backend=self._backend, secret=secret, breaker=breaker, roster=roster,
                                          pin_idle_s=pin_idle_s, completion_file=completion_file)
        except BaseException:
            server.shutdown()
            raise

    def address(self) -> str:
        return self.gate.address()

    def status_address(self) -> str:
        return f"http://{self._backend}"

    def shutdown(self) -> None:
        self.gate.shutdown()
        self._server.shutdown()
