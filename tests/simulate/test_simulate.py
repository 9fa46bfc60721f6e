"""lowband/simulate/__init__.py (``lowband simulate``): bad input is a clear error; without measuring it writes the table, the plot and the JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lowband.cli import main as cli_main

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("argv, needle", [
    (["--bandwidth", "fast"], "cannot parse bandwidth 'fast'"),
    (["--replicas", "1"], r"--replicas: 1 is out of range; each must be in \[2, "),
    (["--replicas", "8,x"], "not an integer"),
    (["--max-replicas", "1"], "--max-replicas must be in"),
    (["--sigma", "-0.5"], "sigma .* must be >= 0"),
    (["--latency", "soon"], "cannot parse latency"),
    (["--group-size", "1"], "group size n must be an integer >= 2"),
    (["--measure-size", "3"], "multiple of 4"),
    (["--measure-nodes", "1"], r"--measure-nodes: 1 is out of range"),
    (["--measure-bandwidth", "1000parsec"], "cannot parse bandwidth"),
])  # fmt: skip
def test_cli_bad_input_is_a_clear_error(argv: list[str], needle: str, tmp_path: Path, capsys) -> None:
    rc = cli_main(["simulate", "--out", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert "lowband simulate: error:" in err
    assert re.search(needle, err), err
    assert not (tmp_path / "out").exists()  # validated before anything runs


@pytest.mark.slow
def test_cli_writes_table_plot_and_json_without_measuring(tmp_path: Path, capsys) -> None:
    out = tmp_path / "sim"
    rc = cli_main(["simulate", "--no-measure", "--out", str(out), "--max-replicas", "64", "--replicas", "100",
                   "--samples", "200"])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0
    assert "MODELLED" in text and "MEASURED" not in text
    assert "HEADLINE (MODELLED) at N = 256" in text
    png = out / "simulate.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "simulate.json").read_text())
    assert [r["num_replicas"] for r in data["model"]["rows"]] == [2, 4, 8, 16, 32, 64, 100]
    assert data["model"]["headline"]["num_replicas"] == 256
    assert data["measurement"] is None and data["error"] is None
