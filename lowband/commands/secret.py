"""``lowband secret PATH``: write a new job secret to a file (mode 0600)."""

from __future__ import annotations

from lowband.trust.secret import write_secret

__all__ = ["add_arguments", "main"]


def add_arguments(p) -> None:
    p.add_argument("path", metavar="PATH", help="the file to write (it must not exist); copy it to every node of "
                   "the job and pass --secret-file PATH (or LOWBAND_SECRET_FILE=PATH) to each")


def main(args) -> int:
    path = write_secret(args.path)  # the secret is never printed
    print(f"wrote a new job secret to {path} (mode 0600); give every node of the job a copy: "
          f"--secret-file {path} or LOWBAND_SECRET_FILE={path}")
    return 0
