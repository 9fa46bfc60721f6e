"""``lowband bench``: every method on the same model, data, seed and link, on emulated nodes.

It trains the same model on the same data with every method, on 2 emulated nodes × 2 ranks joined
by a rate-limited link, and writes a run directory with ``bench.toml`` (the complete job:
:mod:`lowband.bench.jobfile`), ``results.json`` (schema: :mod:`lowband.bench.results`),
``report.md`` (:mod:`lowband.report.render`) and PNG plots (:mod:`lowband.report.plots`). Its
flags are derived from the job's tables (:mod:`lowband.bench.args`). ``main`` returns the process
exit status: 0 ok, 1 some run failed, 2 bad input (nothing started), 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import sys

from lowband.bench import jobfile, tune
from lowband.bench.args import add_arguments, config_from_args
from lowband.bench.data_passes import data_passes_note
from lowband.bench.plan import plan_runs
from lowband.bench.results import RESULTS_FILE, load_results
from lowband.bench.runner import (
    check_out_dir,
    choose_emulation,
    default_out_dir,
    prepare_out_dir,
    run_bench,
)
from lowband.cluster import signals_as_exit
from lowband.report.render import console_summary, write_report

__all__ = ["add_arguments", "config_from_args", "main"]

log = logging.getLogger(__name__)


def main(args: argparse.Namespace) -> int:
    """``lowband bench``: validate everything, run every method, write results, report and plots.

    Returns 0 when every run succeeded, 1 when some failed, 2 on bad input (nothing was
    started), 130 when interrupted (what was done is written).
    """

    try:
        config = config_from_args(args)
        out_dir = check_out_dir(args.out if args.out is not None else default_out_dir())
        mode, reason = choose_emulation(config.emulation)
        passes = data_passes_note(config)  # the data-size guard, before the first run
    except (ValueError, FileNotFoundError) as exc:
        print(f"lowband bench: error: {exc}", file=sys.stderr)
        return 2
    if passes:
        print(f"lowband bench: warning: {passes}", file=sys.stderr, flush=True)

    searches = tune.plan_searches(config) if config.tune else []
    plans = plan_runs(config)
    if searches:
        print(f"lowband bench: {tune.cost_line(config, searches)} {tune.main_runs_line(config, plans)}.",
              file=sys.stderr, flush=True)
    elif not config.tune and (warning := tune.preset_lr_warning(config)):
        print(f"lowband bench: note: {warning}", file=sys.stderr, flush=True)
    prepare_out_dir(out_dir)
    jobfile.write(config, out_dir)  # the complete job: `lowband bench --config OUT/bench.toml` runs it again
    print(
        f"lowband bench: {len(plans)} run(s), emulation {mode}, writing {out_dir}",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    try:
        with signals_as_exit():  # nodes run in sessions of their own: cleanup must run
            extra = {"lr_sources": tune.lr_sources(config)}
            if searches:
                searches = tune.run_searches(config, searches, out_dir, run=lambda c, d: run_bench(
                    c, d, mode=mode, reason=reason, command=list(sys.argv), progress=not args.no_progress))
                config, sources = tune.apply_tuning(config, searches)
                plans = plan_runs(config)  # the same runs, at the chosen lrs
                extra = {"lr_sources": sources, "tuning": [s.as_dict() for s in searches]}
                print(f"lowband bench: lr search done; main runs: {' '.join(map(str, config.methods))}",
                      file=sys.stderr, flush=True)
            results = run_bench(
                config, out_dir, mode=mode, reason=reason, command=list(sys.argv), progress=not args.no_progress,
                extra=extra,
                plans=plans,
            )
    except (KeyboardInterrupt, SystemExit) as exc:
        if (out_dir / RESULTS_FILE).exists():
            try:
                write_report(out_dir, load_results(out_dir))
            except Exception:  # noqa: BLE001 - best effort while stopping
                log.exception("could not write the report of the interrupted bench")
            print(f"lowband bench: interrupted; partial results in {out_dir}", file=sys.stderr)
        elif searches:  # stopped in the lr search, before any main run: there is no report to write
            print(f"lowband bench: interrupted during the lr search, before the main runs (its runs so far are in "
                  f"{out_dir / 'tune'}); every search that finished is cached, and the same command goes on from "
                  "the first that did not", file=sys.stderr)
        else:
            print(f"lowband bench: interrupted before the first run wrote its results ({out_dir})", file=sys.stderr)
        if isinstance(exc, SystemExit) and exc.code not in (None, 0, 130):
            raise
        return 130
    report = write_report(out_dir, results)
    print(console_summary(results))
    print(f"\nResults: {out_dir / 'results.json'}\nReport:  {report}")
    return 0 if all(r.status == "ok" for r in results["runs"]) else 1


