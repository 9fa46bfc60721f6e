"""lowband/simulate/measure.py: a measured ``lowband simulate`` run at four replicas.

It needs network namespaces (root, iproute2) and skips with the reason otherwise. No test asserts
a speed: the measured figures are checked for presence, not for size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowband.cli import main as cli_main

pytestmark = pytest.mark.timeout(120)


def _netns() -> tuple[bool, str]:
    from lowband.cluster import netns_available

    return netns_available("lbsim")


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_measured_run_at_four_replicas(tmp_path: Path, capsys) -> None:
    ok, reason = _netns()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {reason}")
    out = tmp_path / "sim"
    rc = cli_main(["simulate", "--out", str(out), "--max-replicas", "8", "--samples", "100",
                   "--measure-nodes", "4", "--measure-size", "256KiB", "--measure-reps", "1"])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "MEASURED on this machine vs MODELLED" in text and "network namespaces" in text
    data = json.loads((out / "simulate.json").read_text())
    meas = data["measurement"]
    assert meas["mode"] == "netns"
    (cmp,) = meas["comparisons"]
    assert cmp["num_nodes"] == 4
    rows = {r["quantity"]: r for r in cmp["rows"]}
    ar = rows["all-reduce of M (gloo ring, via Link)"]
    assert ar["measured"] > 0 and ar["modelled"] > 0 and ar["error"] is not None
    for q in ("NoLoCo exchange of 2M (Link.exchange)", "NoLoCo exchange, receives posted first"):
        assert rows[q]["measured"] > 0 and rows[q]["modelled"] > 0
    (summary,) = meas["summaries"]
    assert summary["all_reduce_bytes"] == 256 * 1024 and summary["exchange_bytes"] == 512 * 1024
    assert (out / "simulate.png").stat().st_size > 0
