"""Small made-up corpora for the tokenizer and data tests."""

from __future__ import annotations

import json
from pathlib import Path


def corpus(n: int = 60) -> list[str]:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()
    return [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(5 + i % 9)) for i in range(n)]


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
