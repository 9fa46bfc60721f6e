"""torchft's Lighthouse for a fault-tolerant job (``lowband lighthouse``), behind the job's gate when it has a secret.

The Lighthouse forms the job's quorums from the nodes' requests and heartbeats (docs/fault-tolerance.md).
With the job's secret it listens on loopback only, and the gate of :mod:`lowband.gateway` listens on
the job's address in front of it: only the job's members reach it (docs/internet.md).
"""

from __future__ import annotations

import time

from lowband.admission import check_bind, split_bind

__all__ = ["GatedLighthouse", "add_lighthouse_arguments", "lighthouse_main", "start_lighthouse"]


def start_lighthouse(*, bind: str = "127.0.0.1:0", min_nodes: int = 1, join_timeout_s: float = 10.0,
                     heartbeat_timeout_s: float = 3.0, quorum_tick_s: float = 0.05, secret: bytes | None = None,
                     stall_rounds: int = 3, probation_s: float = 30.0, bench_s: float = 600.0):
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
            heartbeats, and serves no status page and no kill route (:mod:`lowband.gateway`).
        stall_rounds, probation_s, bench_s: with the gate, how it finds and keeps out a member that stalls the
            job, and how long it keeps out one that most members reported for bad messages
            (:class:`~lowband.gateway.StallBreaker`).
    """
    from lowband.ft import require_torchft

    require_torchft()
    from torchft._torchft import LighthouseServer

    def lighthouse(at: str):
        return LighthouseServer(bind=at, min_replicas=min_nodes, join_timeout_ms=int(join_timeout_s * 1000),
                                quorum_tick_ms=int(quorum_tick_s * 1000),
                                heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))

    if secret is None:
        return lighthouse(bind)
    from lowband.gateway import StallBreaker

    breaker = StallBreaker(stall_rounds=stall_rounds, probation_s=probation_s, bench_s=bench_s)
    return GatedLighthouse(lighthouse("127.0.0.1:0"), bind=bind, secret=secret, breaker=breaker)


class GatedLighthouse:
    """torchft's Lighthouse on loopback behind a :class:`~lowband.gateway.LighthouseGateway` on the job's
    address: ``address()`` is the gate's (what nodes are given), ``status_address()`` torchft's own
    (its status page and kill route: this host only)."""

    def __init__(self, server, *, bind: str, secret: bytes, breaker=None) -> None:
        from lowband.gateway import LighthouseGateway

        self._server = server
        self._backend = f"127.0.0.1:{server.address().rsplit(':', 1)[1]}"
        try:
            self.gate = LighthouseGateway(bind=bind, backend=self._backend, secret=secret, breaker=breaker)
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


# --------------------------------------------------------------------------- lowband lighthouse
def add_lighthouse_arguments(p) -> None:
    from lowband.units import parse_duration

    p.add_argument("--bind", default="127.0.0.1:29510",
                   help="address:port to listen on: the job's network, loopback (default 127.0.0.1:29510) or this "
                        "host's VPN address; a wildcard or public address needs --trusted-network (without "
                        "--secret-file the Lighthouse serves its members and a kill route to whoever reaches it, and "
                        "the traffic is never encrypted; docs/internet.md)")
    p.add_argument("--trusted-network", action="store_true",
                   help="allow --bind on a wildcard or public address: every host that can reach it is trusted")
    p.add_argument("--secret-file", default=None, metavar="PATH",
                   help="the job's secret (or LOWBAND_SECRET_FILE=PATH): only nodes that prove it reach the "
                        "Lighthouse, which then serves no status page and no kill route to the network "
                        "(docs/internet.md). Without one, whoever reaches the port can ask for quorums")
    p.add_argument("--min-nodes", type=int, default=1, help="a quorum needs at least this many nodes")
    p.add_argument("--stall-rounds", type=int, default=3, metavar="N",
                   help="with --secret-file: after N quorum rounds in a row with the same members and no commit, "
                        "the gate leaves one member out for --probation to see whether the others commit without "
                        "it (then it keeps it out: a member that stalls the job)")
    p.add_argument("--probation", type=parse_duration, default=30.0, metavar="DURATION",
                   help="how long a member is left out on probation (more than --heartbeat-timeout and a step)")
    p.add_argument("--bench-time", type=parse_duration, default=600.0, metavar="DURATION",
                   help="how long a member that stalled the job, or that most of the other members reported for "
                        "bad messages, is kept out (twice as long each time again)")
    p.add_argument("--join-timeout", type=parse_duration, default=10.0, metavar="DURATION",
                   help="how long a quorum waits for live nodes of the previous one that have not asked yet "
                        "(more than the nodes' skew at a quorum; dead nodes are not waited for)")
    p.add_argument("--heartbeat-timeout", type=parse_duration, default=3.0, metavar="DURATION",
                   help="a node silent for this long is dead: the next quorum goes on without it")


def lighthouse_main(args) -> int:
    from lowband.secret import load_secret

    if args.min_nodes < 1:
        raise ValueError(f"--min-nodes must be >= 1, got {args.min_nodes}")
    if args.stall_rounds < 1 or not args.probation > 0 or not args.bench_time > 0:
        raise ValueError(f"--stall-rounds must be >= 1 and --probation, --bench-time > 0; got {args.stall_rounds}, "
                         f"{args.probation:g} s, {args.bench_time:g} s")
    secret = load_secret(args.secret_file)  # --secret-file, else LOWBAND_SECRET_FILE or LOWBAND_SECRET
    host, port = split_bind(args.bind)
    check_bind(host, what="the Lighthouse", flag="--bind", port=port, secret=True,
               trusted_network=args.trusted_network)
    server = start_lighthouse(bind=args.bind, min_nodes=args.min_nodes, join_timeout_s=args.join_timeout,
                              heartbeat_timeout_s=args.heartbeat_timeout, secret=secret,
                              stall_rounds=args.stall_rounds, probation_s=args.probation, bench_s=args.bench_time)
    if secret is None:
        gate = ("no secret: whoever reaches it can ask for quorums, read its status page and stop a node; "
                "give it the job's secret: --secret-file PATH")
    else:
        gate = (f"only the job's members pass (its secret); torchft's status page is at "
                f"{server.status_address()}/status, on this host only")
    print(f"lighthouse at {server.address()} (pass --ft-lighthouse http://<this host's address>:<port> to "
          f"every node's `lowband train`; {gate}); Ctrl-C stops it", flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        server.shutdown()
