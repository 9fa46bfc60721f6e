"""``report.md``'s "Learning rates" section and the lr-search plots: what ``lowband bench --tune`` searched and chose."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lowband.bench.tune import GRID, KEEP, TIE, _lr, _parse, _spec_at
from lowband.report.tables import markdown_table

__all__ = ["tuning_section", "write_tune_plots"]


def _plot_name(i: int) -> str:
    return f"tune-{i}.png"


def write_tune_plots(results: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """One plot per searched variant: final validation loss against lr (log axis), per round; the chosen lr marked."""
    searches = results.get("tuning") or []
    if not searches:
        return []
    import matplotlib  # heavy: only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: only the plots need it

    paths = []
    for i, s in enumerate(searches):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for rnd, marker in ((1, "o"), (2, "s")):
            pts = sorted((p["lr"], p["val_loss"]) for p in s["points"] if p["round"] == rnd and p["val_loss"] is not None)
            if pts:
                steps = next(p["steps"] for p in s["points"] if p["round"] == rnd)
                ax.plot(*zip(*pts, strict=True), marker=marker, label=f"round {rnd}: {steps} steps")
        if s.get("chosen") is not None and s.get("claim") != "failed":
            ax.axvline(s["chosen"], color="grey", linestyle=":", label=f"chosen {s['chosen']:g}")
        ax.set_xscale("log")
        ax.set_xlabel("lr")
        ax.set_ylabel("final validation loss")
        ax.set_title(s["spec"], fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = Path(out_dir) / _plot_name(i)
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def _lr_text(spec: str) -> str:
    try:
        lr = _lr(_parse(spec))
    except ValueError:  # a spec this lowband no longer reads (an old results.json)
        return "-"
    return "-" if lr is None else f"{lr:g}"


def _tie_note(s: Mapping[str, Any]) -> str:
    """Where the tie rule chose over a lower loss in the deciding round: which lr ended lower, and why it lost."""
    last = max((p["round"] for p in s["points"] if p["lr"] == s["chosen"]), default=None)
    done = {p["lr"]: p["val_loss"] for p in s["points"] if p["round"] == last and p["val_loss"] is not None}
    if s["chosen"] not in done or min(done.values()) >= done[s["chosen"]]:
        return ""
    low = min(done, key=done.__getitem__)
    return (f" (round {last}'s lowest loss was at lr {low:g}, {done[low]:.4f} against {done[s['chosen']]:.4f}: within "
            f"{TIE:.0%}, a tie, and the smaller lr leads)")


def _noise_note(s: Mapping[str, Any], runs: Sequence[Any]) -> str:
    """The deciding round's margin (the chosen lr's loss against the nearest other lr's) beside the seed spread of
    the variant's main runs at the chosen lr: a search at one seed tells lrs apart only beyond that noise."""
    if s.get("claim") not in ("best", "edge") or s.get("chosen") is None:
        return ""
    last = max(p["round"] for p in s["points"] if p["lr"] == s["chosen"])
    done = {p["lr"]: p["val_loss"] for p in s["points"] if p["round"] == last and p["val_loss"] is not None}
    if s["chosen"] not in done or len(done) < 2:
        return ""
    margin = min(abs(v - done[s["chosen"]]) for lr, v in done.items() if lr != s["chosen"])
    orig = _parse(s["spec"])
    tuned = str(dataclasses.replace(_spec_at(orig, s["chosen"]), nseeds=orig.nseeds))
    losses = [r.val_loss for r in runs if r.spec == tuned and r.status == "ok" and r.val_loss is not None]
    if len(losses) < 2:
        return ""
    spread = max(losses) - min(losses)
    head = (f"Round {last}'s nearest other lr ended {margin:.4f} from the chosen one; the main runs at the chosen lr "
            f"spread {spread:.4f} over {len(losses)} seeds")
    if margin > spread:
        return head + ": the search's choice is beyond that seed noise."
    return (head + ": within that seed noise, so the search (one seed) does not tell these lrs apart; a neighbouring "
            "lr may train as well.")


def tuning_section(results: Mapping[str, Any], plots: Sequence[str] = ()) -> list[str]:
    """``report.md``'s "Learning rates" section: where every lr came from, and each search ([] without sources)."""
    sources = results.get("lr_sources") or {}
    searches = results.get("tuning") or []
    if not sources and not searches:
        return []
    out = ["## Learning rates", "",
           "Where each variant's lr came from: *given* on the command line, a *preset default* (tuned on the "
           "preset's own model and data), the *method default*, or *tuned here* by `--tune` (successive halving "
           f"over lr × {', '.join(f'{f:.3g}' for f in GRID)} around the centre, the best {KEEP} again at "
           f"twice the steps, one seed, on this model and data; losses within {TIE:.0%} of a round's lowest are tied and "
           "the smallest tied lr leads, where a smaller lr ended worse: short runs favour large lrs). \"Best of the "
           "search\" only where a lower and a higher lr were tried and ended worse.", ""]  # fmt: skip
    if sources:
        out += [markdown_table(["Variant", "lr", "lr from"], [[k, _lr_text(k), v] for k, v in sources.items()]), ""]
    for i, s in enumerate(searches):
        rows = [[f"{p['lr']:g}", str(p["round"]), str(p["steps"]),
                 "failed" if p["val_loss"] is None else f"{p['val_loss']:.4f}"] for p in s["points"]]
        verdict = {"best": f"chosen {s['chosen']:g}, the best of the search",
                   "edge": f"chosen {s['chosen']:g}, the lowest loss but at the grid's edge: a better lr may lie "
                           "beyond it, so no best lr is claimed",
                   "failed": f"every search run failed: the centre {s['centre']:g} is kept"}.get(s["claim"], "")
        noise = _noise_note(s, results.get("runs") or [])
        out += [f"### lr search: {s['spec']}" + (" (from the cache)" if s.get("cached") else ""), "",
                f"Centre {s['centre']:g} ({s['centre_source']}); {verdict}{_tie_note(s)}." + (f" {noise}" if noise else ""),
                ""]
        if _plot_name(i) in plots:
            out += [f"![lr search]({_plot_name(i)})", ""]
        out += [markdown_table(["lr", "round", "steps", "final val loss"], rows), ""]
    return out
