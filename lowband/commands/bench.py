"""``lowband bench``: every method on the same model, data, seed and link, on emulated nodes.

It trains the same model on the same data with every method, on 2 emulated nodes × 2 ranks joined
by a rate-limited link, and writes a run directory with ``results.json`` (schema:
:mod:`lowband.bench.results`), ``report.md`` (:mod:`lowband.report.render`) and PNG plots
(:mod:`lowband.report.plots`). ``main`` returns the process exit status: 0 ok, 1 some run failed,
2 bad input (nothing started), 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from lowband.bench.config import BenchConfig, make_config
from lowband.bench.defaults import (
    DEFAULT_BANDWIDTHS,
    DEFAULT_ENTRY,
    DEFAULT_METHODS,
    DEFAULT_MODEL,
    DEFAULT_NODES,
    DEFAULT_RANKS_PER_NODE,
    DEFAULT_RUN_TIMEOUT_S,
    DEFAULT_SEED,
    DEFAULT_STEPS,
    EMULATION_MODES,
)
from lowband.bench.methods import METHODS, accepted_params
from lowband.bench.plan import plan_runs
from lowband.bench.presets import PRESETS
from lowband.bench.timebudget import default_time_budget
from lowband.cluster import signals_as_exit

__all__ = ["add_arguments", "config_from_args", "main"]

log = logging.getLogger(__name__)


def _method_help() -> str:
    return "; ".join(f"{name}: {', '.join(accepted_params(name))}" for name in METHODS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``lowband bench`` options to ``parser``."""
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default=None,
        help="a named bench; options given beside it win. "
             + "; ".join(f"{p.name}: {p.description}" for p in PRESETS.values()),
    )  # fmt: skip
    parser.add_argument(
        "--methods", nargs="+", metavar="SPEC", default=None,
        help=f"method specs NAME[:key=value,...], space- or comma-separated "
             f"(default: {' '.join(DEFAULT_METHODS)}). Methods and their hyper-parameters: {_method_help()}",
    )  # fmt: skip
    parser.add_argument(
        "--bandwidth", default=None, metavar="LIST",
        help="link rate(s) per node, comma-separated, e.g. 100mbit,500mbit,1gbit: every method runs at "
             f"each (Table 1's rows). Default: {','.join(DEFAULT_BANDWIDTHS)}",
    )  # fmt: skip
    parser.add_argument(
        "--shards", default=None, metavar="LIST",
        help="shard counts for FlexDeMo-family methods (deto-full, demo, flexdemo), e.g. 1,2: each runs "
             "at every count (Table 2's rows; shards=1 is DeMo). Default: each method's own "
             "(DeMo 1, others ranks per node)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=None, help=f"training steps per run (default: {DEFAULT_STEPS})")
    parser.add_argument(
        "--model", default=None,
        help=f"model size (see `lowband train --help`) or a local model directory (default: {DEFAULT_MODEL})",
    )  # fmt: skip
    parser.add_argument("--data", default=None, help="data file (.jsonl, .json, .csv, .tsv, .txt); default: the embedded corpus")
    parser.add_argument(
        "--emulation", choices=EMULATION_MODES, default="auto",
        help="netns: network namespaces with tbf-limited veth links (root); shaped: in-process shaping by "
             "each rank's link; auto: netns where possible (default)",
    )  # fmt: skip
    parser.add_argument(
        "--latency", default="0", metavar="DURATION",
        help="per-message latency of operations that cross nodes, added in-process by the link in both emulation modes (tbf has no delay), e.g. 20ms. Default: 0",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="run directory (default: a new runs/bench-YYYYmmdd-HHMMSS/)")  # fmt: skip
    parser.add_argument("--nodes", type=int, default=DEFAULT_NODES, help="emulated nodes (default: %(default)s)")
    parser.add_argument("--ranks-per-node", type=int, default=DEFAULT_RANKS_PER_NODE,
                        help="ranks per node (default: %(default)s)")  # fmt: skip
    parser.add_argument(
        "--seeds", "--seed", dest="seeds", default=None, metavar="LIST",
        help="seeds, comma-separated: every method runs at each (model init, data order, dropout), and the "
             f"report shows mean and min-max over them, e.g. --seeds 0,1,2. Default: {DEFAULT_SEED}",
    )  # fmt: skip
    parser.add_argument(
        "--target-loss", type=float, default=None, metavar="LOSS",
        help="validation loss to time every run to (default: AdamW's final validation loss in the bench)",
    )  # fmt: skip
    parser.add_argument("--run-timeout", type=float, default=DEFAULT_RUN_TIMEOUT_S, metavar="SECONDS",
                        help="wall-clock limit of one run; it is then recorded as failed (default: %(default)g)")  # fmt: skip
    parser.add_argument(
        "--train-args", default=None, metavar="ARGS",
        help='extra `lowband train` arguments for every run, e.g. --train-args="--batch-size 4"',
    )  # fmt: skip
    parser.add_argument(
        "--entry", default=DEFAULT_ENTRY, metavar="MODULE|SCRIPT.py",
        help="what each node runs with `train ...` arguments (default: %(default)s, i.e. "
             "`python -m lowband train`); for tests and custom trainers",
    )  # fmt: skip
    parser.add_argument(
        "--ft", choices=("off", "on", "both"), default="off",
        help="fault tolerance (torchft; one torchrun per node and a Lighthouse): off (default), on, or both "
             "(every method with and without it, side by side: what it costs when nothing fails)",
    )  # fmt: skip
    parser.add_argument(
        "--faults", default=None, metavar="PLAN",
        help="kill and restart nodes during every run, e.g. 'node1:kill@30,node1:start@60' (steps of the job, "
             "or @45s: seconds after the start); also node1:intrude@40 (the job's command line without its "
             "secret, in node 1's slot: it must be refused) and node1:poison@30 (or poison-flip, poison-nan, "
             "poison-index: from step 30 on node 1 sends updates x1000, sign-flipped, NaN or with out-of-range "
             "indices; the last two fail the message checks and, where the messages name their sender, the "
             "others report node 1 to the Lighthouse's gate, which removes it from the quorum); each method "
             "then also runs fault-free under "
             "fault tolerance, and the report sets the faulted run beside its twin. Implies --ft on",
    )  # fmt: skip
    parser.add_argument(
        "--time-budget", default=None, metavar="SECONDS|auto|off",
        help="equal wall-clock time: every method trains for the same training-clock time (start-up and "
             "validation excluded) on the given link, up to 4 x --steps steps. auto: the reference (adamw) runs "
             "--steps steps first, then every other method gets its measured training time. Default: auto for a "
             "plain bench whose --methods hold adamw (no --preset, --ft or --faults), else off (--steps steps each)",
    )  # fmt: skip
    parser.add_argument(
        "--tune", action="store_true",
        help="first a short lr search per method variant on this model and data (successive halving over "
             "lr x 1/3, 1, 3 around its preset or default lr, a quarter then half of --steps, one seed; cached "
             "under $LOWBAND_CACHE/tune), then the main runs at the chosen lrs. Its cost is printed before it "
             "starts. An lr given in a spec (adamw:lr=0.01) is kept, not searched, unless the spec is written as "
             "the --preset has it (the preset's lrs were tuned on its own data: they are searched)",
    )  # fmt: skip
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Build and validate the bench configuration from parsed ``lowband bench`` options.

    A ``--preset`` supplies the settings it names; every option given on the command line wins
    over it (``--train-args`` are appended after the preset's, so they win too).
    """
    import shlex

    settings: dict = dict(
        methods=DEFAULT_METHODS, bandwidths=DEFAULT_BANDWIDTHS, steps=DEFAULT_STEPS, model=DEFAULT_MODEL,
        seeds=(DEFAULT_SEED,), train_args=(),
    )  # fmt: skip
    preset = getattr(args, "preset", None)
    if preset is not None:
        settings.update(PRESETS[preset].settings)
    given = {"methods": args.methods, "bandwidths": args.bandwidth, "steps": args.steps, "model": args.model,
             "seeds": args.seeds}  # fmt: skip
    settings.update({k: v for k, v in given.items() if v is not None})
    if args.train_args:
        settings["train_args"] = (*settings["train_args"], *shlex.split(args.train_args))
    time_budget = getattr(args, "time_budget", None)
    if time_budget is None:
        time_budget = default_time_budget(settings["methods"], preset=preset, ft=args.ft, faults=args.faults)
    return make_config(
        **settings,
        shards=args.shards,
        data=args.data,
        emulation=args.emulation,
        latency=args.latency,
        nodes=args.nodes,
        ranks_per_node=args.ranks_per_node,
        target_loss=args.target_loss,
        preset=preset,
        run_timeout_s=args.run_timeout,
        entry=args.entry,
        ft=args.ft,
        faults=args.faults,
        time_budget=time_budget,
    )


def main(args: argparse.Namespace) -> int:
    """``lowband bench``: validate everything, run every method, write results, report and plots.

    Returns 0 when every run succeeded, 1 when some failed, 2 on bad input (nothing was
    started), 130 when interrupted (what was done is written).
    """
    from lowband.bench.data_passes import data_passes_note
    from lowband.bench.results import RESULTS_FILE, load_results
    from lowband.bench.runner import (
        check_out_dir,
        choose_emulation,
        default_out_dir,
        prepare_out_dir,
        run_bench,
    )
    from lowband.report.render import console_summary, write_report

    try:
        config = config_from_args(args)
        out_dir = check_out_dir(args.out if args.out is not None else default_out_dir())
        mode, reason = choose_emulation(config.emulation)
        passes = data_passes_note(config)  # the data-size guard, before the first run
    except ValueError as exc:
        print(f"lowband bench: error: {exc}", file=sys.stderr)
        return 2
    if passes:
        print(f"lowband bench: warning: {passes}", file=sys.stderr, flush=True)
    from lowband.bench import tune

    searches = tune.plan_searches(config) if getattr(args, "tune", False) else []
    plans = plan_runs(config)
    if searches:
        print(f"lowband bench: {tune.cost_line(config, searches)} {tune.main_runs_line(config, plans)}.",
              file=sys.stderr, flush=True)
    elif not getattr(args, "tune", False) and (warning := tune.preset_lr_warning(config)):
        print(f"lowband bench: note: {warning}", file=sys.stderr, flush=True)
    prepare_out_dir(out_dir)
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


