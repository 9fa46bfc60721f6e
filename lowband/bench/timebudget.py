"""Equal training time: ``lowband bench --time-budget``, and the report's table at equal time.

- ``--time-budget SECONDS``: every run trains for that much training clock (start-up and
  validation excluded; :mod:`lowband.train.budget`) on its link, up to ``STEP_CAP_FACTOR`` ×
  ``--steps`` steps.
- ``--time-budget auto`` (the default of a plain ``lowband bench`` whose methods hold the reference):
  the reference (AdamW, its first spec) runs first, for ``--steps`` steps and no budget, at each
  link and seed; every other run at that link and seed then gets the reference's measured training
  time as its budget (the mean over the reference's seeds at the link when its own seed did not run
  or failed; when no reference run finished, ``--steps`` steps and no budget, and the record says so).
- The lr schedule under a budget: its length stays the run's most steps (``STEP_CAP_FACTOR`` ×
  ``--steps``), and its progress is the further of step / most steps and training clock / budget,
  so a cosine schedule has decayed to its floor when the budget stops the run (warm-up stays in
  steps).

Nothing here imports the bench's config, runner or report: they call in.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

from lowband.bench.quality import REFERENCE
from lowband.bench.record import RunRecord
from lowband.train.methods import reference_method
from lowband.units import parse_duration, split_list

__all__ = [
    "AUTO",
    "STEP_CAP_FACTOR",
    "budget_plan",
    "check_time_budget",
    "default_time_budget",
    "parse_time_budget",
    "reference_first",
]

#: ``--time-budget auto``: every method gets the reference's measured training time.
AUTO = "auto"
#: Under a budget a run may take up to this many times ``--steps`` (a faster step takes more of them).
STEP_CAP_FACTOR = 4
_OFF = ("off", "none", "no")


def parse_time_budget(value: Any) -> float | str | None:
    """``"auto"``, ``"off"``/None, or seconds (``90``, ``"90s"``) -> AUTO, None or a positive float."""
    if value is None or (isinstance(value, str) and value.strip().lower() in _OFF):
        return None
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    try:
        seconds = parse_duration(value, what="--time-budget")
    except ValueError:
        raise ValueError(f"--time-budget {value!r}: give seconds (e.g. 90 or 90s), 'auto' (every method gets "
                         f"{REFERENCE}'s measured training time) or 'off'") from None
    if seconds <= 0:
        raise ValueError(f"--time-budget {value!r}: give a positive number of seconds, 'auto' or 'off'")
    return seconds


def default_time_budget(methods: Any, *, preset: str | None, ft: str, faults: str | None) -> str | None:
    """``lowband bench``'s default: ``auto`` for a plain bench whose methods hold the reference, else None.

    A preset keeps its equal steps (its figures in the docs were measured so); fault tolerance cannot
    run under a budget; without the reference there is no time to give the others.
    """
    names = [str(m).split(":", 1)[0].strip().lower() for m in split_list(methods)]
    if preset is None and ft == "off" and not faults and reference_method() in names:
        return AUTO
    return None


def check_time_budget(budget: float | str | None, specs: Sequence[Any], *, ft: str, faults: Sequence) -> None:
    """Refuse a budget the bench cannot honour, before anything starts."""
    if budget is None:
        return
    if budget == AUTO and not any(s.name == reference_method() for s in specs):
        raise ValueError(f"--time-budget auto gives every method {REFERENCE}'s measured training time, but --methods "
                         f"has no {reference_method()}; add {reference_method()} to --methods, or give the budget in "
                         "seconds (--time-budget 90)")
    if ft != "off" or faults:
        raise ValueError("--time-budget is not supported with --ft/--faults (nodes that die and join cannot agree on "
                         "one training clock); give --time-budget off")


def reference_first(specs: Sequence[Any], budget: float | str | None) -> tuple:
    """Under ``auto``: the specs with the reference's first spec moved to the front (it sets the budget)."""
    specs = tuple(specs)
    if budget != AUTO:
        return specs
    ref = next(s for s in specs if s.name == reference_method())
    return (ref, *(s for s in specs if s is not ref))


def _is_reference_plan(plan: Any, specs: Sequence[Any]) -> bool:
    ref = next((s for s in specs if s.name == reference_method()), None)
    return ref is not None and plan.spec == str(ref)


def budget_plan(plan: Any, config: Any, done: Sequence[RunRecord]) -> Any:
    """The run plan with its step count and time budget (``dataclasses.replace`` of a RunPlan).

    ``done``: the records of the runs before it (``auto`` reads the reference's training time there).
    """
    budget = getattr(config, "time_budget", None)
    if budget is None:
        return plan
    cap = STEP_CAP_FACTOR * config.steps
    if budget != AUTO:
        return dataclasses.replace(plan, steps=cap, time_budget_s=float(budget))
    if _is_reference_plan(plan, config.methods):
        return dataclasses.replace(plan, steps=config.steps, time_budget_s=None)
    ref_spec = str(reference_first(config.methods, budget)[0])
    refs = [r for r in done if r.spec == ref_spec and r.status == "ok" and r.train_time_s
            and r.bandwidth_bps == plan.bandwidth_bps and not (r.fault_tolerance or {}).get("faults")]
    own = [r for r in refs if r.seed == plan.seed]
    times = [float(r.train_time_s) for r in (own or refs)]
    if not times:
        return dataclasses.replace(plan, steps=config.steps, time_budget_s=None)
    return dataclasses.replace(plan, steps=cap, time_budget_s=statistics.fmean(times))




