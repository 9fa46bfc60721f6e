"""Fault tolerance with real processes: 3 nodes × 2 ranks, one node killed (SIGKILL to all its processes)
mid-run and started again, for every method that runs under fault tolerance.

Each node is its own torchrun; a torchft Lighthouse runs in the test process. What must hold:

- every node's run finishes (exit 0): the survivors went on without the dead node;
- at most one step is dropped per fault (DiLoCo: at most one outer step);
- the restarted node copied its state from a live peer (over the network, no checkpoint on disk) and,
  after training on, holds the same parameters as the others, bit for bit (every method keeps its
  parameters equal across replicas after each step; DiLoCo's run ends on an outer step). NoLoCo's
  replicas may differ by design (each averages only inside its group, and the replicas' outer
  weights differ): there the restarted node must have healed and every node must end with a finite
  loss;
- nothing is left behind: no process of the job outlives it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import time

import pytest

from lowband.cluster._procs import descendants, is_alive

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

# Not imported here: torchft's runtime must not live in the test process, which forks ranks later.
if importlib.util.find_spec("torchft") is None:
    pytest.skip("torchft is not installed (pip install -e '.[ft]')", allow_module_level=True)

COMMON = ["--model", "t5-tiny", "--max-examples", "1500", "--val-size", "64", "--vocab-size", "512",
          "--batch-size", "4", "--val-batches", "2"]


def _records(out) -> dict[int, list[dict]]:
    recs: dict[int, list[dict]] = {}
    for node in range(3):
        for rank in range(2):
            path = out / f"node{node}" / f"ft_rank{rank}.json"
            assert path.exists(), f"node {node} rank {rank} wrote no ft record: {(out / f'node{node}.log').read_text()[-3000:]}"
            recs.setdefault(node, []).append(json.loads(path.read_text()))
    return recs


def _records_of(out, node: int, kind: str) -> list[dict]:
    return [rec for line in (out / f"node{node}" / "metrics.jsonl").read_text().splitlines()
            if (rec := json.loads(line))["type"] == kind]


def _membership(out, node: int) -> list[dict]:
    events = []
    for line in (out / f"node{node}" / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["type"] == "membership":
            events.append(rec)
    return events


@pytest.mark.parametrize("method, extra, steps", [
    ("flexdemo", ["--topk", "2"], 260),
    ("adamw", [], 260),
    ("deto-full", [], 260),
    ("diloco", ["--sync-every", "5"], 260),
    ("noloco", ["--sync-every", "5"], 260),
])
def test_a_killed_node_leaves_the_others_training_and_rejoins_equal(tmp_path, method, extra, steps):
    from lowband.cluster.ftjob import FaultTolerantJob

    args = ["--method", method, *extra, "--steps", str(steps), *COMMON]
    with FaultTolerantJob(train_args=args, nodes=3, ranks_per_node=2, out=tmp_path) as job:
        job.start_all()
        job.wait_for_step(2, 20)
        pids = [job.procs[2].pid, *descendants([job.procs[2].pid])]
        assert len(pids) >= 3, "node 2 should be torchrun and its two ranks"
        job.kill(2)
        deadline = time.monotonic() + 10.0  # SIGKILL is delivered at once; the kernel takes a moment
        while any(is_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(is_alive(p) for p in pids), "a process of the killed node survived"
        job.wait_for_step(0, 40)  # the survivors went on past the fault
        job.start(2)
        codes = job.wait(timeout_s=360)
        all_pids = [p.pid for p in job.procs.values()]
    assert codes == {0: 0, 1: 0, 2: 0}, {n: (tmp_path / f"node{n}.log").read_text()[-3000:] for n in codes}
    assert not descendants(all_pids), "processes of the job outlived it"

    recs = _records(tmp_path)
    # The survivors saw the membership go 3 -> 2 -> 3.
    for node in (0, 1):
        seen = [e["replicas"] for e in _membership(tmp_path, node)]
        assert 2 in seen and seen[-1] == 3, (node, seen)
        for r in recs[node]:
            assert r["dropped_steps"] <= 1, r  # at most one step (DiLoCo: outer step) lost to the fault
    # The restarted node healed from a live peer, at a step the others had reached.
    for r in recs[2]:
        assert r["healed"], f"node 2 rank {r['rank']} did not heal: {r}"
        assert r["healed"][-1]["step"] >= 40
    if method == "noloco":
        for node in range(3):
            losses = [e["loss"] for e in _records_of(tmp_path, node, "train")]
            final_val = _records_of(tmp_path, node, "val")[-1]
            assert losses and all(math.isfinite(x) for x in losses), (node, losses[-5:])
            assert final_val["step"] == steps and math.isfinite(final_val["val_loss"]), (node, final_val)
            ops = json.loads((tmp_path / f"node{node}" / "summary_rank0.json").read_text())["link_ops"]
            assert set(ops) == {"exchange"}, ops  # point to point through torchft's group, nothing else
        return
    # Same shard, same parameters on every node, bit for bit.
    for rank in range(2):
        digests = {recs[node][rank]["param_sha256"] for node in range(3)}
        assert len(digests) == 1, f"shard {rank} differs between nodes: {[recs[n][rank] for n in range(3)]}"


def test_a_node_of_another_job_is_refused_and_the_job_goes_on(tmp_path):
    """A node of another job (same Lighthouse, another seed, later another lr) asks to join, once when the
    job starts (all at step 0: no heal would notice it) and once while it runs: each time it leaves with a
    clear error, and the job drops no step and ends with its nodes equal."""
    from lowband.cluster.ftjob import FaultTolerantJob

    # Enough steps that the job still runs when the second foreign node is up (a start takes 10-20 s here).
    args = ["--method", "flexdemo", "--steps", "700", *COMMON]
    with FaultTolerantJob(train_args=args, nodes=3, ranks_per_node=2, out=tmp_path, start_nodes=2) as job:
        job.start(0)
        job.start(1)
        job.train_args = [*args, "--seed", "7"]
        job.start(2)  # at the same moment as the job's nodes
        first = job.procs[2].wait(timeout=240)
        assert first != 0, (tmp_path / "node2.log").read_text()[-3000:]
        job.wait_for_step(0, 20)
        job.train_args = [*args, "--lr", "0.003"]
        job.start(2)  # into the running job
        codes = job.wait(timeout_s=360)
    assert codes[0] == 0 and codes[1] == 0, (tmp_path / "node0.log").read_text()[-3000:]
    assert codes[2] != 0
    log = (tmp_path / "node2.log").read_text()
    assert log.count("run another job, model, method or hyper-parameters") >= 2, log[-3000:]
    assert "This node leaves; the running job goes on" in log, log[-3000:]
    recs = [json.loads((tmp_path / f"node{n}" / "ft_rank0.json").read_text()) for n in (0, 1)]
    assert recs[0]["param_sha256"] == recs[1]["param_sha256"]
    assert recs[0]["dropped_steps"] == 0 and recs[1]["dropped_steps"] == 0, recs
    assert "of another job joined the quorum" in (tmp_path / "node0.log").read_text()


def test_a_second_process_for_a_live_node_is_refused_and_a_killed_agent_takes_its_ranks_with_it(tmp_path):
    """Two ways a node's slot gets two processes: a user starts ``--ft-node 1`` twice, or kills only the
    torchrun agent of node 1 (its ranks, in sessions of their own, would train on as orphans) and starts
    node 1 again. The twin is refused and the live node goes on; the orphans end by themselves; the
    restarted node heals and the job ends with the nodes equal."""
    from lowband.cluster.ftjob import FaultTolerantJob

    # Enough steps that node 0 is still training when node 1 is back (a start takes 10-20 s here).
    args = ["--method", "flexdemo", "--steps", "700", *COMMON]
    with FaultTolerantJob(train_args=args, nodes=2, ranks_per_node=2, out=tmp_path) as job:
        job.start_all()
        job.wait_for_step(1, 20)
        twin = job.start_twin(1)
        assert twin.wait(timeout=180) != 0
        log = (tmp_path / "node1-twin.log").read_text()
        assert "node slot 1 is already live in this job" in log, log[-3000:]
        assert job.procs[1].poll() is None and job.procs[0].poll() is None  # the live nodes go on
        ranks = job._ranks(1)
        assert len(ranks) == 2
        job.kill(1, "agent")
        deadline = time.monotonic() + 15.0
        while any(is_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(is_alive(p) for p in ranks), "the ranks of a node whose torchrun agent died live on"
        job.start(1)
        codes = job.wait(timeout_s=360)
    assert codes == {0: 0, 1: 0}, {n: (tmp_path / f"node{n}.log").read_text()[-3000:] for n in codes}
    recs = [[json.loads((tmp_path / f"node{n}" / f"ft_rank{r}.json").read_text()) for r in range(2)] for n in range(2)]
    assert all(r["healed"] for r in recs[1])  # the restarted node copied the live one
    for rank in range(2):
        assert recs[0][rank]["param_sha256"] == recs[1][rank]["param_sha256"]


def test_when_every_node_dies_the_job_resumes_from_checkpoints_with_the_same_command_line(tmp_path):
    """Nothing is left to heal from: the nodes are started again with the same arguments and each
    resumes from its newest checkpoint (``--resume if-any`` started afresh the first time). FlexDeMo's
    state is created by its first step, which torch.distributed.checkpoint runs at zero lr to load it:
    before any quorum the link is a group of one and that step commits."""
    from lowband.cluster.ftjob import FaultTolerantJob

    args = ["--method", "flexdemo", "--steps", "200", *COMMON, "--ckpt-every", "20", "--resume", "if-any"]
    with FaultTolerantJob(train_args=args, nodes=2, ranks_per_node=2, out=tmp_path) as job:
        job.start_all()
        job.wait_for_step(0, 45)
        job.kill(0)
        job.kill(1)
        job.start_all()
        codes = job.wait(timeout_s=360)
    assert codes == {0: 0, 1: 0}, {n: (tmp_path / f"node{n}.log").read_text()[-3000:] for n in codes}
    import re

    for n in range(2):
        log = (tmp_path / f"node{n}.log").read_text()
        resumed = [int(m) for m in re.findall(r"resumed from \S+ at step (\d+)", log)]
        assert resumed and min(resumed) >= 40, log[-3000:]  # a checkpoint at or after step 40, not step 0
    recs = [[json.loads((tmp_path / f"node{n}" / f"ft_rank{r}.json").read_text()) for r in range(2)] for n in range(2)]
    for rank in range(2):
        assert recs[0][rank]["param_sha256"] == recs[1][rank]["param_sha256"]
