"""``lowband report RUN_DIR``: the command-line pair that ``lowband/cli.py`` loads for ``report``."""

from __future__ import annotations

from lowband.bench import REPORT_DESCRIPTION, add_report_arguments, report_main

__all__ = ["DESCRIPTION", "add_arguments", "main"]

DESCRIPTION = REPORT_DESCRIPTION
add_arguments = add_report_arguments
main = report_main
