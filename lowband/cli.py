"""``lowband train | export | bench | report | lighthouse | secret | simulate``: one subcommand each, its module imported only when used."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from lowband.ft.completion import JobComplete
from lowband.trust.admission import CannotListen, RemovedFromJob

__all__ = ["main", "build_parser"]

# command -> (module, its add-arguments function, its main function, help); imported only when used.
COMMANDS = {
    "train": ("lowband.commands.train", "add_arguments", "main",
              "train on this rank (launch with torchrun on real clusters)"),
    "export": ("lowband.commands.export", "add_arguments", "main",
               "a run's model as a transformers directory (config.json, model.safetensors, tokenizer)"),
    "bench": ("lowband.commands.bench", "add_arguments", "main",
              "methods × links on emulated nodes: tables, results.json and plots"),
    "report": ("lowband.commands.report", "add_arguments", "main",
               "re-render report.md and plots of a bench run directory"),
    "lighthouse": ("lowband.commands.lighthouse", "add_arguments", "main",
                   "run the torchft Lighthouse that a fault-tolerant job's nodes report to"),
    "secret": ("lowband.commands.secret", "add_arguments", "main",
               "write a new job secret to a file (mode 0600) for --secret-file / LOWBAND_SECRET_FILE"),
    "simulate": ("lowband.commands.simulate", "add_arguments", "main",
                 "model DiLoCo's all-reduce against NoLoCo's gossip for 2..1024 replicas, check it on emulated links"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lowband", description="Training across nodes joined by slow links.")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name, (module, add_fn, _, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if command in (None, name):
            try:
                getattr(importlib.import_module(module), add_fn)(p)
            except ModuleNotFoundError as e:
                if command == name:
                    raise
                logging.getLogger(__name__).debug("%s unavailable: %s", name, e)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in COMMANDS else None
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module, _, main_fn, _ = COMMANDS[args.command]
    try:
        return int(getattr(importlib.import_module(module), main_fn)(args) or 0)
    except JobComplete as e:
        print(f"lowband {args.command}: {e}")
        # Not an error: the job this node would join has ended. torchft's Manager server (if it started) would
        # hold the process until its last quorum request, refused at the gate, times out: leave now.
        _leave_now(0)
    except ValueError as e:
        print(f"lowband {args.command}: error: {e}", file=sys.stderr)
        if isinstance(e, RemovedFromJob):
            # torchft's Manager server would hold the process until its last quorum request times out (2 min): it
            # retries a request the Lighthouse's gate refuses. The node has nothing left to save; leave now.
            _leave_now(2)
        return 2
    except (FileNotFoundError, CannotListen) as e:
        print(f"lowband {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        # A lost peer or a timeout carries its own explanation; anything else keeps its traceback.
        from lowband.comm.link import PeerLostError, PeerTimeoutError

        if isinstance(e, PeerLostError | PeerTimeoutError):
            print(f"lowband {args.command}: error: {e}", file=sys.stderr)
            return 1
        raise
    except FloatingPointError as e:  # NonFiniteGradientError, or a non-finite training loss
        print(f"lowband {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"lowband {args.command}: interrupted", file=sys.stderr)
        return 130


def _leave_now(code: int) -> int:
    """Exit with ``code`` at once, output flushed, without waiting for threads that torchft left waiting."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
