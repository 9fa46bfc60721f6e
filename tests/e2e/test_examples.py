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


# --------------------------------------------------------------------------- the SLURM recipe
# Stand-ins for SLURM's commands, first on PATH: srun starts its task once per node of the allocation, here, with
# the variables srun gives each task (and --output's %n, the node's index); scontrol expands a node list.
SRUN = '''#!{python}
"""A stand-in for SLURM's srun on one machine: the task once per node of the allocation, all here."""
import os, subprocess, sys

args, opts = sys.argv[1:], {{}}
while args and args[0].startswith("-"):
    key, _, value = args.pop(0).partition("=")
    opts[key] = value
procs = []
for node in range(int(opts.get("--nodes", os.environ["SLURM_NNODES"]))):
    env = dict(os.environ, SLURM_NODEID=str(node), SLURM_PROCID=str(node), SLURM_LOCALID="0",
               SLURMD_NODENAME="localhost")
    out = open(opts["--output"].replace("%n", str(node)), "w") if "--output" in opts else None
    procs.append(subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT if out else None))
codes = [p.wait() for p in procs]
sys.exit(next((c for c in codes if c), 0))
'''
SCONTROL = '''#!/bin/bash
# A stand-in for `scontrol show hostnames LIST`: LIST's names (here comma-separated), one a line.
[[ $1 == show && $2 == hostnames ]] || {{ echo "stand-in scontrol: only 'show hostnames'" >&2; exit 1; }}
tr ',' '\\n' <<< "$3"
'''


def test_slurm_recipe_runs_a_fault_tolerant_job_node_by_node(tmp_path: Path) -> None:
    """examples/slurm/train.sbatch as sbatch runs it (2 nodes × 2 ranks), with srun and scontrol stood in: a
    Lighthouse behind the job's secret, one torchrun per node, every node ends with the same parameters, and
    each node's log has its local rank 0's progress lines and no INFO line from its other rank."""
    import importlib.util
    import subprocess
    import sys

    from lowband.cluster._procs import descendants, kill_trees
    from lowband.testing.ranks import free_port
    from tests.train.corpus import corpus

    if importlib.util.find_spec("torchft") is None:
        pytest.skip("torchft is not installed (pip install -e '.[ft]')")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN.format(python=sys.executable)), ("scontrol", SCONTROL.format())):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    data = tmp_path / "corpus.txt"
    data.write_text("\n".join(corpus(80)) + "\n", encoding="utf-8")
    out, port = tmp_path / "run", free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("LOWBAND_SECRET", "LOWBAND_SECRET_FILE")}
    env.update(
        PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env.get("PATH", "")]),
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
        OMP_NUM_THREADS="1", RUST_LOG="error", LOWBAND_CACHE=str(tmp_path / "cache"),
        SLURM_JOB_ID="4242", SLURM_JOB_NAME="lowband-test", SLURM_NNODES="2", SLURM_JOB_NODELIST="localhost,localhost",
        SLURM_SUBMIT_DIR=str(tmp_path), GPUS_PER_NODE="2", LIGHTHOUSE_PORT=str(port),
        SECRET_FILE=str(tmp_path / "secret" / "job.secret"), OUT=str(out),
    )  # fmt: skip
    steps = 10
    argv = ["bash", str(REPO / "examples" / "slurm" / "train.sbatch"), "--method", "flexdemo", "--topk", "2",
            "--model", "gpt-tiny", "--data", str(data), "--max-len", "16", "--vocab-size", "300", "--val-size", "10",
            "--batch-size", "2", "--val-batches", "1", "--steps", str(steps), "--log-every", "5"]
    job = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        console, _ = job.communicate(timeout=240)
    finally:
        kill_trees([job.pid], grace_s=2.0)
    logs = {n: (out / f"node{n}.log").read_text() if (out / f"node{n}.log").exists() else "" for n in (0, 1)}
    assert job.returncode == 0, f"{console}\n" + "\n".join(f"--- node {n}\n{t[-3000:]}" for n, t in logs.items())
    assert not descendants([job.pid])
    assert f"lighthouse at http://127.0.0.1:{port} " in (out / "lighthouse.log").read_text()
    assert (tmp_path / "secret" / "job.secret").stat().st_mode & 0o777 == 0o600  # made by the recipe
    for rank in (0, 1):  # the same shard on both nodes, bit for bit, after the same steps
        recs = [json.loads((out / f"node{n}" / f"ft_rank{rank}.json").read_text()) for n in (0, 1)]
        assert {r["steps"] for r in recs} == {steps} and len({r["param_sha256"] for r in recs}) == 1, recs
    for n, text in logs.items():
        lines = text.splitlines()
        progress = [line for line in lines if f"[node {n} rank 0] INFO lowband.train.loop: step " in line]
        assert [line.split("lowband.train.loop: ")[1].split(" | ")[0] for line in progress] == [
            "step 5/10", "step 10/10"], text[-3000:]
        assert not [line for line in lines if f"[node {n} rank 1] INFO" in line], text[-3000:]  # warnings only
        assert " INFO torchft" not in text  # torchft's lines of every step are held back
