"""``lowband lighthouse``: torchft's Lighthouse for a fault-tolerant job, behind the job's gate when it has a secret."""

from __future__ import annotations

import time

from lowband.ft.lighthouse import start_lighthouse
from lowband.trust.admission import check_bind, check_port, join_bind, split_bind
from lowband.trust.keys import load_roster
from lowband.trust.secret import load_secret
from lowband.units import parse_duration

__all__ = ["add_arguments", "main"]


def add_arguments(p) -> None:
    p.add_argument("--bind", default="127.0.0.1:29510",
                   help="address:port to listen on: the job's network, loopback (default 127.0.0.1:29510) or this "
                        "host's VPN address, in any spelling (a host name: every address it resolves to); a "
                        "wildcard or public address needs --trusted-network (without "
                        "--secret-file the Lighthouse serves its members and a kill route to whoever reaches it, and "
                        "the traffic is never encrypted; docs/internet.md)")
    p.add_argument("--trusted-network", action="store_true",
                   help="allow --bind on a wildcard or public address: every host that can reach it is trusted")
    p.add_argument("--secret-file", default=None, metavar="PATH",
                   help="the job's secret (or LOWBAND_SECRET_FILE=PATH): only nodes that prove it reach the "
                        "Lighthouse, which then serves no status page and no kill route to the network "
                        "(docs/internet.md). Without one, whoever reaches the port can ask for quorums")
    p.add_argument("--roster", default=None, metavar="PATH",
                   help="the job's roster of members' public keys (`lowband secret PATH --nodes N` writes PATH.roster; "
                        "needs --secret-file, which signs it): the gate then takes a member's reports and its claim to "
                        "its node slot only signed by that member's own key, fresh, and from its own address "
                        "(docs/internet.md, per-member keys)")
    p.add_argument("--completion-file", default=None, metavar="PATH",
                   help="with --secret-file: keep the job's completion record in PATH (written when the job's members "
                        "report its last step), so that a Lighthouse started again still tells a node that comes back "
                        "that the job is complete; delete it to run the job again")
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


def main(args) -> int:
    if args.min_nodes < 1:
        raise ValueError(f"--min-nodes must be >= 1, got {args.min_nodes}")
    if args.stall_rounds < 1 or not args.probation > 0 or not args.bench_time > 0:
        raise ValueError(f"--stall-rounds must be >= 1 and --probation, --bench-time > 0; got {args.stall_rounds}, "
                         f"{args.probation:g} s, {args.bench_time:g} s")
    secret = load_secret(args.secret_file)  # --secret-file, else LOWBAND_SECRET_FILE or LOWBAND_SECRET
    roster = None if args.roster is None else load_roster(args.roster, secret)
    host, port = split_bind(args.bind)
    check_port(port, flag="--bind")
    # What listens binds the checked address as an IP literal, never the spelling given (``[::ffff:0.0.0.0]``
    # is every interface's IPv4 side).
    address = check_bind(host, what="the Lighthouse", flag="--bind", port=port, secret=True,
                         trusted_network=args.trusted_network)
    server = start_lighthouse(bind=join_bind(address, port), min_nodes=args.min_nodes, join_timeout_s=args.join_timeout,
                              heartbeat_timeout_s=args.heartbeat_timeout, secret=secret,
                              stall_rounds=args.stall_rounds, probation_s=args.probation, bench_s=args.bench_time,
                              roster=roster, completion_file=args.completion_file)
    if secret is None:
        gate = ("no secret: whoever reaches it can ask for quorums, read its status page and stop a node; "
                "give it the job's secret: --secret-file PATH")
    else:
        gate = (f"only the job's members pass (its secret{'' if roster is None else f' and the roster of {len(roster)} keys'}); torchft's status page is at "
                f"{server.status_address()}/status, on this host only")
    print(f"lighthouse at {server.address()} (pass --ft-lighthouse http://<this host's address>:<port> to "
          f"every node's `lowband train`; {gate}); Ctrl-C stops it", flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        server.shutdown()
