"""Write a seq2seq corpus that lowband was not tuned on: Python docstrings -> their summary line.

The quality preset's settings (model, steps, learning rates) were chosen on the embedded corpus
(Wikipedia extracts -> one-line descriptions). To check that its conclusions are not an artefact
of that corpus, rerun it on different text with the same shape of task: for every documented
function, class and module of the Python standard library and of the installed numpy and torch,
the source is the docstring without its first line and the target is the first line (the
summary). Offline, deterministic (sorted by qualified name, duplicates removed).

    python benchmarks/docstring_pairs.py --out runs/docstrings.jsonl
    lowband bench --preset quality --data runs/docstrings.jsonl
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import pkgutil
import sys
import warnings
from pathlib import Path

ROOTS = ("json", "email", "http", "logging", "unittest", "xml", "asyncio", "concurrent", "collections",
         "importlib", "multiprocessing", "urllib", "os", "pathlib", "argparse", "inspect", "typing", "re",
         "itertools", "functools", "shutil", "subprocess", "socket", "ssl", "tarfile", "zipfile", "csv",
         "datetime", "decimal", "fractions", "statistics", "random", "string", "textwrap", "difflib",
         "numpy", "torch")
MIN_SOURCE_WORDS = 8


def _modules(root: str):
    try:
        mod = importlib.import_module(root)
    except Exception:  # noqa: BLE001 - a module that does not import is skipped
        return
    yield mod
    for info in pkgutil.walk_packages(getattr(mod, "__path__", []), prefix=root + "."):
        if any(part.startswith("_") or part in ("tests", "testing") for part in info.name.split(".")[1:]):
            continue
        try:
            yield importlib.import_module(info.name)
        except Exception:  # noqa: BLE001
            continue


def _pair(doc: object) -> tuple[str, str] | None:
    if not isinstance(doc, str) or not doc.strip():
        return None
    lines = inspect.cleandoc(doc).splitlines()
    summary, body = lines[0].strip(), " ".join(line.strip() for line in lines[1:] if line.strip())
    if not summary or len(body.split()) < MIN_SOURCE_WORDS or len(summary.split()) < 3:
        return None
    return body, summary


def collect() -> dict[str, tuple[str, str]]:
    """Qualified name -> (source, target) for every usable docstring under ``ROOTS``."""
    pairs: dict[str, tuple[str, str]] = {}
    for root in ROOTS:
        for mod in _modules(root):
            objects = [(mod.__name__, mod)]
            for name, obj in vars(mod).items():
                if not name.startswith("_") and getattr(obj, "__module__", None) == mod.__name__:
                    objects.append((f"{mod.__name__}.{name}", obj))
                    if inspect.isclass(obj):
                        objects += [(f"{mod.__name__}.{name}.{m}", f) for m, f in vars(obj).items()
                                    if not m.startswith("_") and callable(f)]
            for qualname, obj in objects:
                pair = _pair(getattr(obj, "__doc__", None))
                if pair is not None:
                    pairs.setdefault(qualname, pair)
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/docstrings.jsonl"))
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    pairs = collect()
    seen: set[tuple[str, str]] = set()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as f:
        for name in sorted(pairs):
            if pairs[name] in seen:
                continue
            seen.add(pairs[name])
            source, target = pairs[name]
            f.write(json.dumps({"source": source, "target": target, "name": name}) + "\n")
    print(f"{len(seen)} pairs -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
