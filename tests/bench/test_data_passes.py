"""lowband/bench/data_passes.py: the bench says, before its first run, how many times its runs read the data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import lowband.commands.bench as bench
from lowband.bench.config import BenchConfig
from lowband.bench.data_passes import data_passes_note
from tests.bench.fake_trainer import bench_args


def _pairs(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"source": f"text number {i} here", "target": f"t{i}"}) + "\n"
                            for i in range(n)))
    return path


def test_the_passes_of_a_bench_on_small_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOWBAND_CACHE", str(tmp_path / "cache"))
    data = _pairs(tmp_path / "pairs.jsonl", 300)  # 256 validation pairs by default: 44 to train on

    def config(steps: int, model: str, path: Path, **train):
        return BenchConfig.from_tables({"bench": {"methods": "adamw", "steps": steps}, "model": {"name": model},
                                        "data": {"path": str(path), **train.pop("data", {})}, **train})

    note = data_passes_note(config(30, "t5-tiny", data, schedule={"batch_size": 2}))
    # 30 steps × (2 nodes × 2 ranks × 2) = 240 examples over 44: 5.45 passes.
    assert note is not None and "5.45 passes (epochs)" in note and "over 44 training examples of `pairs.jsonl`" in note
    assert data_passes_note(config(1, "t5-tiny", data, schedule={"batch_size": 2})) is None
    txt = tmp_path / "lines.txt"
    txt.write_text("".join(f"line {i} of a small plain text corpus\n" for i in range(400)))
    packed = data_passes_note(config(50, "gpt-tiny", txt, data={"max_len": 16, "vocab_size": 300},
                                     schedule={"batch_size": 2}))
    assert packed is not None and "blocks of 16 packed tokens" in packed


def test_bench_prints_the_passes_before_its_first_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys) -> None:
    monkeypatch.setenv("LOWBAND_CACHE", str(tmp_path / "cache"))
    started: list = []

    def stop(*args, **kwargs):  # the first run: the warning must be out by now
        started.append(capsys.readouterr().err)
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "run_bench", stop)  # the name lowband bench calls
    data = _pairs(tmp_path / "pairs.jsonl", 300)
    argv = ["--methods", "adamw", "--steps", "30", "--model", "t5-tiny", "--data", str(data), "--emulation", "shaped",
            "--out", str(tmp_path / "bench"), "--no-progress", "--train-args=--batch-size 2"]
    assert bench.main(bench_args(*argv)) == 130
    assert "warning: the training data will be read 5.45 times" in started[0]
