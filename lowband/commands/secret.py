"""``lowband secret PATH [--nodes N]``: write a new job secret to a file (mode 0600); with ``--nodes``, also one key pair
per node slot and the job's roster of public keys, signed by the secret (:mod:`lowband.trust.keys`)."""

from __future__ import annotations

from pathlib import Path

from lowband.trust.keys import write_keys
from lowband.trust.secret import write_secret

__all__ = ["add_arguments", "main"]


def add_arguments(p) -> None:
    p.add_argument("path", metavar="PATH", help="the file to write (it must not exist, unless --nodes adds keys to an "
                   "existing secret); copy it to every node of the job and pass --secret-file PATH (or "
                   "LOWBAND_SECRET_FILE=PATH) to each")
    p.add_argument("--nodes", type=int, default=None, metavar="N",
                   help="also write a key pair for each node slot 0..N-1: PATH.node{i}.key (mode 0600, node i's "
                        "alone: --key-file) and PATH.roster (the public keys, signed by the secret: --roster on every "
                        "node and on the Lighthouse). A job with a roster refuses reports, claims and healing states "
                        "that are not signed by their member's own key (docs/internet.md)")


def main(args) -> int:
    if args.nodes is None:
        path = write_secret(args.path)  # the secret is never printed
        print(f"wrote a new job secret to {path} (mode 0600); give every node of the job a copy: "
              f"--secret-file {path} or LOWBAND_SECRET_FILE={path}")
        return 0
    existed = Path(args.path).exists()
    roster, keys = write_keys(args.path, args.nodes)
    print(f"{'used the job secret at' if existed else 'wrote a new job secret to'} {args.path} (mode 0600); wrote "
          f"{len(keys)} member keys ({keys[0]} .. {keys[-1]}, mode 0600) and the roster {roster}. Node i gets "
          f"--secret-file {args.path} --key-file {args.path}.node<i>.key --roster {roster}; the Lighthouse "
          f"--secret-file {args.path} --roster {roster}. A key is its node's alone: copy node i's to node i only")
    return 0
