"""The scripts in examples/ run as a user runs them: under torchrun, 2 nodes × 2 ranks on loopback.

Each node is its own ``torchrun --nnodes 2 --nproc-per-node 2`` (:func:`lowband.cluster.launch_nodes`
without a network: master 127.0.0.1, a free port), so the 4 ranks form the 2 × 2 mesh of a real
two-machine job and the link counts the bytes between the two nodes. PYTHONPATH points at this
checkout, so the examples import the lowband under test (torchrun puts examples/ on sys.path, not
the repository root).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

from lowband.cluster import launch_nodes

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
# One line per step, printed by rank 0 (node 0's log).
STEP_LINE = re.compile(r"^step (\d+) loss (\S+) inter-node bytes sent (\d+)$", re.MULTILINE)


def _run_example(tmp_path: Path, script: str, *args: str) -> tuple[list[tuple[int, float, int]], Path]:
    """Run ``examples/<script>`` on 2 nodes × 2 ranks; its (step, loss, inter-node bytes) lines and --out."""
    out = tmp_path / "out"
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    result = launch_nodes(
        num_nodes=2, ranks_per_node=2, script=REPO / "examples" / script, module_args=[*args, "--out", str(out)],
        env={"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}, net=None, timeout_s=240, log_dir=tmp_path / "logs",
    )  # fmt: skip
    assert result.ok, result.failure_message()
    log = result.log_paths[0].read_text()
    rows = [(int(step), float(loss), int(sent)) for step, loss, sent in STEP_LINE.findall(log)]
    assert STEP_LINE.findall(result.log_paths[1].read_text()) == []  # only rank 0 prints
    return rows, out


def _check_run(rows: list[tuple[int, float, int]], out: Path, steps: int) -> None:
    assert [step for step, _, _ in rows] == list(range(1, steps + 1)), rows
    losses = [loss for _, loss, _ in rows]
    assert all(math.isfinite(loss) for loss in losses), losses
    # Random init over a 512-token vocabulary starts near ln 512 = 6.24; the counting sequences are
    # learnable, so a run whose optimizer moved nothing (or the wrong way) would not fall this much.
    assert abs(losses[0] - math.log(512)) < 0.3, losses
    assert losses[-1] < losses[0] - 0.1, losses
    ckpt = out / "checkpoints" / f"step_{steps:06d}"
    assert (ckpt / ".metadata").is_file(), sorted(out.rglob("*"))
    assert json.loads((ckpt / "lowband_extra.json").read_text()) == {"step": steps}
    assert not list((out / "checkpoints").glob("*.tmp"))


def test_flexdemo_example_trains_across_two_nodes(tmp_path: Path) -> None:
    rows, out = _run_example(tmp_path, "flexdemo_causal_lm.py", "--steps", "8")
    _check_run(rows, out, 8)
    sent = [s for _, _, s in rows]
    # FlexDeMo exchanges every step, the same payload size each time (one all-gather of top-k DCT values).
    assert sent[0] > 0 and len(set(sent)) == 1, sent


def test_diloco_example_syncs_every_h_steps(tmp_path: Path) -> None:
    rows, out = _run_example(tmp_path, "diloco_causal_lm.py", "--steps", "8", "--sync-every", "4")
    _check_run(rows, out, 8)
    sent = {step: s for step, _, s in rows}
    # Inner steps stay inside the node; the outer steps (after steps 4 and 8) cross between nodes.
    assert [step for step, s in sent.items() if s > 0] == [4, 8], sent
    assert sent[4] == sent[8], sent
