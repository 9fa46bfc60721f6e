"""``lowband bench --tune``: a short, budgeted learning-rate search per method variant on the user's data.

For every variant whose lr was not given on the command line (a preset's lr or the method's default:
the grid's centre), before the main runs:

- **Successive halving over a log grid.** Round 1 trains the centre × ``GRID`` (1/3, 1, 3) for
  ``ROUNDS[0]`` (a quarter) of ``--steps`` at the first seed; the ``KEEP`` (2) lowest final
  validation losses go on to round 2 at ``ROUNDS[1]`` (half) of ``--steps``; the lowest there is
  chosen. While round 1's lowest loss lies at the edge of the lrs it tried, it tries one more lr
  beyond that edge (×3 or ×1/3), at most ``MAX_EXTEND`` (2) times: a centre tuned on other data is
  often off by more than one factor of 3. Round 2 does the same while its lowest loss lies at the
  edge of every lr tried (a longer run often wants a smaller lr: on the vim documentation SparseLoCo's
  round 1 preferred 3e-2, its round 2 the grid's lowest, 1e-2). The runs are real bench runs
  (:func:`lowband.bench.runner.run_bench`, equal steps, at the bench's fastest link: the loss per step does not
  depend on the link), written under ``OUT/tune/``.
- **Near-ties go to the smaller lr.** Losses within ``TIE`` (1 %) of a round's lowest are tied, and the
  smallest lr among them leads the round, provided a still smaller lr was tried and ended clearly worse (so
  the tie is a plateau past the lrs that learn, not a run of lrs too small to learn, where the largest
  leads as before). Short runs favour large lrs: on the frontier preset AdamW's round 1 (75 of 300 steps)
  ended 7.045, 7.040 and 7.038 at lr 0.03, 0.09 and 0.27, 7.099 at 0.01 and 7.539 at 0.0033; by the lowest
  loss alone the search chose 0.27, which at 300 steps ended 6.644 against 6.588 at 0.01 (2 seeds each).
  1 % is about the seed spread at the end of those runs (0.05 on AdamW's 6.59, 0.04 on Muon's 6.26): a
  difference below it in one seed's short run is no evidence for the larger lr.
- **What is claimed.** "best of the search" only when the chosen lr lies inside the lrs tried (a
  lower and a higher lr were tried and ended worse); at the grid's edge it is "lowest at the grid's edge"
  (a better lr may lie beyond), and when every search run failed the centre is kept. One seed: a
  search tells which lr trains best here at this seed, not a seed spread.
- **Cost, announced before it starts**: runs × steps and an estimated time (MODELLED:
  ``EST_RUN_OVERHEAD_S`` per run for start-up and validation plus ``EST_STEP_S`` per step; the
  progress bar then gives the measured time left of each round).
- **Cache.** ``$LOWBAND_CACHE/tune/KEY.json`` (default ``~/.cache/lowband``), KEY a hash of the model,
  the data's content (a SHA-256 of the file's bytes, or of the embedded corpus), the method and
  its other hyper-parameters, the centre, the steps, the nodes and ranks, the ``--train-args`` and
  the grid: a re-run with the same settings reuses the search instead of running it.

Where every lr came from (given / preset default / method default / tuned here) is in
``results.json``'s ``lr_sources`` and the report's "Learning rates" section, with a plot per
searched variant (``tune-N.png``: final loss against lr).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lowband.bench.config import BenchConfig
from lowband.bench.methods import BenchMethod, parse_method_spec
from lowband.bench.presets import PRESETS, lrs_tuned_here
from lowband.train.data.sources import default_corpus_path
from lowband.train.tokenizer import cache_root
from lowband.util import file_digest

__all__ = [
    "GRID",
    "KEEP",
    "ROUNDS",
    "TIE",
    "LrSearch",
    "apply_tuning",
    "cost_line",
    "lr_sources",
    "main_runs_line",
    "preset_lr_warning",
    "plan_searches",
    "run_searches",
]

log = logging.getLogger(__name__)

#: Factors of the grid's centre (a log grid).
GRID: tuple[float, ...] = (1 / 3, 1.0, 3.0)
#: Fractions of --steps of each round of successive halving.
ROUNDS: tuple[float, ...] = (0.25, 0.5)
#: Variants kept after round 1.
KEEP = 2
#: Round 1 goes on past the grid's edge by one factor of 3 at a time, at most this often, while its best lr
#: lies at the edge of what it tried (on data the centre was not tuned on, the best lr is often beyond it).
MAX_EXTEND = 2
#: Losses within this fraction of a round's lowest are tied; the smallest tied lr leads (see the module's docstring).
TIE = 0.01
#: MODELLED cost of one search run besides its steps (start-up, validation, exit) and of one step, on 2 CPU cores.
EST_RUN_OVERHEAD_S = 15.0  # start-up of one search run, for the printed estimate (docs/time-to-quality.md)
EST_STEP_S = 0.5
TUNED, GIVEN, PRESET, DEFAULT = "tuned here", "given", "preset default", "method default"


@dataclasses.dataclass(kw_only=True)
class LrSearch:
    """One variant's lr search: its spec without the lr, the grid, what each run ended at, the lr chosen."""

    spec: str  # the variant as the bench names it (the main runs' spec, before tuning)
    centre: float
    centre_source: str  # PRESET or DEFAULT
    key: str
    points: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # {"lr", "round", "steps", "val_loss"}
    chosen: float | None = None
    claim: str = ""  # "best" | "edge" | "failed"
    cached: bool = False

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _lr(spec: BenchMethod) -> float | None:
    lr = getattr(spec.hp, "lr", None)
    return float(lr) if lr is not None else None


def _source(spec: BenchMethod, config: BenchConfig) -> str:
    preset = PRESETS.get(config.preset or "")
    if preset is not None and str(spec) in preset.bench.methods:
        return PRESET
    return GIVEN if "lr" in spec.given else DEFAULT


def lr_sources(config: BenchConfig) -> dict[str, str]:
    """``{spec: where its lr came from}`` for a bench without a search (:func:`apply_tuning` gives them with one)."""
    return {str(spec): _source(spec, config) for spec in config.methods}


def _tuned_source(s: LrSearch) -> str:
    what = {"best": "best of the search", "edge": "lowest at the grid's edge"}[s.claim]
    return f"{TUNED} ({what}{', from the cache' if s.cached else ''}; centre: {s.centre_source} {s.centre:g})"


def _parse(text: str) -> BenchMethod:

    return parse_method_spec(text)


def _spec_at(spec: BenchMethod, lr: float) -> BenchMethod:
    given = spec.given if "lr" in spec.given else (*spec.given, "lr")
    return dataclasses.replace(spec, hp=dataclasses.replace(spec.hp, lr=float(f"{lr:.3g}")), given=given, nseeds=None)


def _data_digest(data: str | None) -> str:
    if data is None:
        path = default_corpus_path()
    else:
        path = Path(data)

    return file_digest(path)


def _key(spec: BenchMethod, config: BenchConfig, digest: str) -> str:
    hp = {k: repr(v) for k, v in dataclasses.asdict(spec.hp).items() if k != "lr"}
    what = {"model": config.model, "data": digest, "method": spec.name, "hp": hp, "centre": _lr(spec),
            "shards": spec.shards, "steps": config.steps, "nodes": config.nodes,
            "ranks_per_node": config.ranks_per_node, "train_args": list(config.train_args), "grid": list(GRID),
            "rounds": list(ROUNDS), "keep": KEEP, "extend": MAX_EXTEND, "extend_rounds": [1, 2], "tie": TIE,
            "seed": config.seeds[0]}  # fmt: skip
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:20]


def _cache_dir() -> Path:

    return cache_root() / "tune"


def plan_searches(config: BenchConfig) -> list[LrSearch]:
    """One search per variant whose lr was not given on the command line (and whose method has an lr)."""
    digest = _data_digest(config.data)
    out, seen = [], set()
    for spec in config.methods:
        if _lr(spec) is None or _source(spec, config) == GIVEN or str(spec) in seen:
            continue
        seen.add(str(spec))
        key = _key(spec, config, digest)
        search = LrSearch(spec=str(spec), centre=_lr(spec), centre_source=_source(spec, config), key=key)
        cached = _cache_dir() / f"{key}.json"
        if cached.is_file():
            try:
                body = json.loads(cached.read_text())
                search = dataclasses.replace(search, points=body["points"], chosen=body["chosen"],
                                             claim=body["claim"], cached=True)  # fmt: skip
            except (ValueError, KeyError, TypeError):
                log.warning("ignoring an unreadable tuning cache %s", cached)
        out.append(search)
    return out


def _tied(losses: Mapping[float, float | None]) -> set[float]:
    """The lrs whose loss lies within ``TIE`` of the round's lowest."""
    ok = [v for v in losses.values() if v is not None]
    if not ok:
        return set()
    low = min(ok)
    return {lr for lr, v in losses.items() if v is not None and v <= low + TIE * abs(low)}


def _worse(losses: Mapping[float, float | None]) -> set[float]:
    """The lrs of a round that ended clearly worse than its lowest (outside the tie)."""
    return {lr for lr, v in losses.items() if v is not None} - _tied(losses)


def _ranked(losses: Mapping[float, float | None], worse: set[float] = frozenset()) -> list[tuple[float, float]]:
    """``[(loss, lr)]`` of a round's finished runs, its leader first: the lowest loss, or the smallest lr tied with
    it when an lr below the tie ended clearly worse (in this round or in ``worse``, an earlier round's)."""
    ranked = sorted((v, lr) for lr, v in losses.items() if v is not None)
    tied = _tied(losses)
    if tied:
        lead = min(tied)
        if any(w < lead for w in worse) or any(lr < lead for _, lr in ranked):  # below the tie: clearly worse
            ranked.sort(key=lambda p: p[1] != lead)  # stable: the others stay by loss
    return ranked


def _round_steps(config: BenchConfig) -> list[int]:
    return [max(1, round(config.steps * f)) for f in ROUNDS]


def cost_line(config: BenchConfig, searches: Sequence[LrSearch]) -> str:
    """The search's cost in words: runs × steps and a MODELLED time; what the cache covers."""
    todo = [s for s in searches if not s.cached]
    steps = _round_steps(config)
    runs_per = len(GRID) + KEEP
    steps_per = len(GRID) * steps[0] + KEEP * steps[1]
    est = len(todo) * (runs_per * EST_RUN_OVERHEAD_S + steps_per * EST_STEP_S)
    text = (f"lr search (--tune): {len(searches)} variant(s), {len(searches) - len(todo)} from the cache; to run: "
            f"{len(todo)} × ({len(GRID)} lrs × {steps[0]} steps + {KEEP} × {steps[1]} steps) = {len(todo) * runs_per} "
            f"runs, {len(todo) * steps_per} steps")
    if todo:
        text += (f" (and up to {MAX_EXTEND} runs of {steps[0]} steps, then of {steps[1]} steps, more per variant whose "
                 "best lr lies at the edge of the lrs tried in that round: the grid is extended by ×3 that way)")
        text += (f", about {est / 60:.0f} min (estimated: {EST_RUN_OVERHEAD_S:g} s per run for start-up and validation "
                 f"+ {EST_STEP_S:g} s per step)")
    return text + "."


def main_runs_line(config: BenchConfig, plans: Sequence[Any]) -> str:
    """The main runs' cost in words, after the search's (:func:`cost_line`), estimated the same way (MODELLED)."""
    steps = sum(p.steps or config.steps for p in plans)
    est = len(plans) * EST_RUN_OVERHEAD_S + steps * EST_STEP_S
    return (f"Then the main runs: {len(plans)} run(s), {steps} steps, about {est / 60:.0f} min (estimated as the "
            "search's; an lr search may add a run at the edge of its grid)")


def preset_lr_warning(config: BenchConfig) -> str | None:
    """Before a preset runs on a model or data its lrs were not tuned on, without --tune: a line that says so."""

    preset = PRESETS.get(config.preset or "")
    if preset is None or not preset.lrs_tuned_on or lrs_tuned_here(preset, config.as_dict()):
        return None
    return (f"the {preset.name} preset's lrs were tuned on {preset.lrs_tuned_on}, not on this {config.model} on "
            f"{'the embedded corpus' if config.data is None else Path(config.data).name}: a method that trails may "
            "only have the wrong lr here. Add --tune to search them on this data first.")


def _search_config(config: BenchConfig, specs: Sequence[BenchMethod], steps: int) -> BenchConfig:
    return dataclasses.replace(config, methods=tuple(specs), steps=steps, seeds=config.seeds[:1],
                               bandwidths_bps=(max(config.bandwidths_bps),), time_budget=None, target_loss=None,
                               preset=None, ft="off", faults=())  # fmt: skip


def _run_round(config: BenchConfig, spec: BenchMethod, lrs: Sequence[float], steps: int, out_dir: Path,
               run: Callable[..., dict[str, Any]]) -> dict[float, float | None]:  # fmt: skip
    h = getattr(spec.hp, "sync_every", None)
    if h:  # a whole number of outer windows, at least one: an outer step must merge the replicas
        steps = max(h, math.ceil(steps / h) * h)
    specs = [_spec_at(spec, lr) for lr in lrs]
    out_dir.mkdir(parents=True, exist_ok=True)
    results = run(_search_config(config, specs, steps), out_dir)
    losses: dict[float, float | None] = {}
    for s, lr in zip(specs, lrs, strict=True):
        rec = next((r for r in results["runs"] if r.spec == str(s)), None)
        ok = rec is not None and rec.status == "ok" and rec.val_loss is not None and math.isfinite(rec.val_loss)
        losses[lr] = float(rec.val_loss) if ok else None
    return losses


def run_searches(config: BenchConfig, searches: Sequence[LrSearch], out_dir: Path,
                 run: Callable[..., dict[str, Any]]) -> list[LrSearch]:  # fmt: skip
    """Run the searches not in the cache (``run(config, out_dir)``: the runner), cache them; returns them all."""

    steps = _round_steps(config)
    done = []
    todo = [s for s in searches if not s.cached]
    t0 = time.monotonic()
    for i, search in enumerate(searches):
        if search.cached:
            done.append(search)
            continue
        n = todo.index(search) + 1
        spec = _parse(search.spec)
        slug = re.sub(r"[^a-z0-9]+", "-", search.spec.lower()).strip("-")
        lrs = [float(f"{search.centre * f:.3g}") for f in GRID]
        print(f"lr search {n}/{len(todo)}: {search.spec}, round 1: lr {', '.join(f'{x:g}' for x in lrs)} at "
              f"{steps[0]} steps", file=sys.stderr, flush=True)
        first = _run_round(config, spec, lrs, steps[0], out_dir / "tune" / f"{i:02d}-{slug}" / "round1", run)
        for extension in range(1, MAX_EXTEND + 1):  # the best at an edge: one more lr beyond it
            ranked = _ranked(first)
            if not ranked or min(first) < ranked[0][1] < max(first):
                break
            beyond = float(f"{ranked[0][1] * (3.0 if ranked[0][1] == max(first) else 1 / 3):.3g}")
            print(f"lr search {n}/{len(todo)}: {search.spec}, round 1: lowest at the edge ({ranked[0][1]:g}), also lr "
                  f"{beyond:g}", file=sys.stderr, flush=True)
            first |= _run_round(config, spec, [beyond], steps[0],
                                out_dir / "tune" / f"{i:02d}-{slug}" / f"round1-edge{extension}", run)
        lrs = sorted(first)
        points = [{"lr": lr, "round": 1, "steps": steps[0], "val_loss": first[lr]} for lr in lrs]
        ranked = _ranked(first)
        chosen, claim = search.centre, "failed"
        if ranked:
            keep = [lr for _, lr in ranked[:KEEP]]
            print(f"lr search {n}/{len(todo)}: {search.spec}, round 2: lr {', '.join(f'{x:g}' for x in keep)} at "
                  f"{steps[1]} steps", file=sys.stderr, flush=True)
            second = _run_round(config, spec, keep, steps[1], out_dir / "tune" / f"{i:02d}-{slug}" / "round2", run)
            for extension in range(1, MAX_EXTEND + 1):
                # A longer run often wants a smaller lr: round 2's lowest at the edge of every lr tried gets one
                # more lr beyond it at round 2's steps, so that "best" is claimed against worse neighbours.
                finals = _ranked(second, _worse(first))
                tried = set(lrs) | set(second)
                if not finals or min(tried) < finals[0][1] < max(tried):
                    break
                beyond = float(f"{finals[0][1] * (3.0 if finals[0][1] == max(tried) else 1 / 3):.3g}")
                print(f"lr search {n}/{len(todo)}: {search.spec}, round 2: lowest at the edge ({finals[0][1]:g}), "
                      f"also lr {beyond:g}", file=sys.stderr, flush=True)
                second |= _run_round(config, spec, [beyond], steps[1],
                                     out_dir / "tune" / f"{i:02d}-{slug}" / f"round2-edge{extension}", run)
            points += [{"lr": lr, "round": 2, "steps": steps[1], "val_loss": v} for lr, v in sorted(second.items())]
            finals = _ranked(second, _worse(first)) or ranked
            chosen = finals[0][1]
            tried = set(lrs) | set(second)
            claim = "best" if min(tried) < chosen < max(tried) else "edge"
        search = dataclasses.replace(search, points=points, chosen=chosen, claim=claim)
        if claim != "failed":
            cache = _cache_dir()
            cache.mkdir(parents=True, exist_ok=True)
            (cache / f"{search.key}.json").write_text(json.dumps(search.as_dict(), indent=1))
        done.append(search)
        spent = time.monotonic() - t0
        print(f"lr search {n}/{len(todo)}: {search.spec}: chosen {search.chosen:g} ({search.claim}); {spent:.0f} s so "
              f"far, about {spent / n * (len(todo) - n):.0f} s left (measured)", file=sys.stderr, flush=True)
    return done


def apply_tuning(config: BenchConfig, searches: Sequence[LrSearch]) -> tuple[BenchConfig, dict[str, str]]:
    """The configuration with every searched variant at its chosen lr (a failed search keeps its lr), and
    ``{spec: where its lr came from}`` for its specs."""
    by_spec = {s.spec: s for s in searches if s.chosen is not None and s.claim != "failed"}
    methods, sources = [], {}
    for m in config.methods:
        s = by_spec.get(str(m))
        new = m if s is None else dataclasses.replace(_spec_at(m, s.chosen), nseeds=m.nseeds)
        methods.append(new)
        sources[str(new)] = _source(m, config) if s is None else _tuned_source(s)
    return dataclasses.replace(config, methods=tuple(methods)), sources




