"""``lowband report RUN_DIR``: re-render report.md and the plots of a bench run from its results.json."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lowband.bench.quality import annotate_time_to_target
from lowband.bench.results import load_results
from lowband.report.render import console_summary, write_report

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``lowband report`` options to ``parser``."""
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a bench run directory (holding results.json)")
    parser.add_argument(
        "--target-loss", type=float, default=None, metavar="LOSS",
        help="time every run to this validation loss instead of the bench's target (results.json is not changed)",
    )  # fmt: skip


def main(args: argparse.Namespace) -> int:
    """``lowband report RUN_DIR``: re-render report.md and the plots from results.json."""
    try:
        results = load_results(args.run_dir)
        if args.target_loss is not None and not args.target_loss > 0:
            raise ValueError(f"--target-loss {args.target_loss}: give a positive validation loss")
    except ValueError as exc:
        print(f"lowband report: error: {exc}", file=sys.stderr)
        return 2
    annotate_time_to_target(results, args.target_loss)
    report = write_report(args.run_dir, results)
    print(console_summary(results))
    print(f"\nReport: {report}")
    return 0
