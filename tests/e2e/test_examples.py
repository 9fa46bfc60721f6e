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


def _clip_on_shards(rank: int) -> tuple[float, float, float]:
    """(unsharded norm of the node's mean gradient, clip_grad_norm_'s norm on the shards, norm after the clip)."""
    import torch
    from torch.distributed.tensor import DTensor
    from transformers import GPT2Config, GPT2LMHeadModel

    from lowband.sharding import shard_model
    from lowband.topology import Topology
    from lowband.train.models import transformer_blocks

    config = GPT2Config(vocab_size=512, n_positions=16, n_embd=64, n_layer=2, n_head=2, bos_token_id=None,
                        eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    def ids(r: int) -> torch.Tensor:
        return torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(r))

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    topo = Topology.from_env()
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(config)
    node = topo.shard_group_ranks(rank)
    (sum(ref(input_ids=ids(r), labels=ids(r), use_cache=False).loss for r in node) / len(node)).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model = shard_model(model, topo, blocks=transformer_blocks(model))
    model(input_ids=ids(rank), labels=ids(rank), use_cache=False).loss.backward()
    assert all(isinstance(p.grad, DTensor) for p in model.parameters())
    norm = full(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)).item()
    after = full(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])).item()
    return expected, norm, after


def test_clip_grad_norm_on_fsdp2_shards_is_the_model_copys() -> None:
    """What the README and the FlexDeMo example rely on: clip_grad_norm_ on a sharded model (tied embedding
    row-sharded too) takes the norm of the node's whole gradient and scales every shard by the same factor."""
    from transformers import GPT2LMHeadModel  # noqa: F401 - imported once here; the forked ranks inherit it

    from lowband.testing import run_ranks

    results = run_ranks(_clip_on_shards, world_size=4, ranks_per_node=2, timeout_s=120)
    for expected, norm, after in results:
        assert norm == pytest.approx(expected, rel=1e-5), results
        assert after == pytest.approx(0.1, rel=1e-4), results
    assert results[0][1] == results[1][1] and results[2][1] == results[3][1], results  # one norm per node
    assert results[0][1] != results[2][1], results  # each node clips its own gradient
