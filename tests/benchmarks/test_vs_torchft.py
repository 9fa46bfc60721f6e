"""benchmarks/vs_torchft.py's pure helpers: the link model applied to torchft, the summaries and the table."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vs_torchft.py"


@pytest.fixture(scope="module")
def vt():
    spec = importlib.util.spec_from_file_location("vs_torchft", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["vs_torchft"] = module
    spec.loader.exec_module(module)
    return module


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0
        self.slept: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


class FakeWork:
    def __init__(self) -> None:
        self.waited = 0

    def wait(self, *args, **kwargs):
        self.waited += 1
        return True

    def get_future(self):
        return "the real work's future"


def test_shaped_allreduce_charges_what_lowbands_link_charges(vt):
    # 1 MB/s, 10 ms per message: an all-reduce of 1,000 bytes over 2 nodes sends 2(G-1)/G * 1,000 = 1,000 bytes,
    # takes 1 ms on the uplink and 2(G-1) = 2 latencies; a second one started at once queues behind it.
    shaper = vt.ShapedAllreduce(bandwidth_bps=8e6, latency_s=0.01)
    assert shaper.schedule(5.0, 1000, 2) == pytest.approx(5.0 + 0.001 + 0.02)
    assert shaper.schedule(5.0, 1000, 2) == pytest.approx(5.0 + 0.002 + 0.02)
    # 4 nodes: each rank sends 2*3/4 of the payload (6,000 bytes, 6 ms), 6 messages
    assert vt.ShapedAllreduce(bandwidth_bps=8e6, latency_s=0.01).schedule(0.0, 4000, 4) == pytest.approx(0.006 + 0.06)
    # alone: nothing crosses, nothing is charged
    assert vt.ShapedAllreduce(bandwidth_bps=8e6, latency_s=0.01).schedule(7.0, 1000, 1) == 7.0
    sent, modelled_last, ops = shaper.take()
    assert (sent, ops) == (2000, 2) and modelled_last == pytest.approx(0.022)
    assert shaper.take() == (0, 0.0, 0)
    with pytest.raises(ValueError, match="bandwidth_bps"):
        vt.ShapedAllreduce(bandwidth_bps=0, latency_s=0.0)


def test_the_wrapped_allreduce_returns_no_earlier_than_the_model(vt):
    clock = FakeClock()
    shaper = vt.ShapedAllreduce(bandwidth_bps=8e6, latency_s=0.01, sleep=clock.sleep, now=clock.now)
    work = FakeWork()
    calls = []

    def allreduce(tensor, should_quantize=False):
        calls.append((tensor.numel(), should_quantize))
        return work

    shaped = shaper.wrap(allreduce, lambda: 2)(torch.zeros(250), should_quantize=True)  # 1,000 bytes
    assert calls == [(250, True)]
    assert shaped.get_future() == "the real work's future"
    assert shaped.wait() is True and work.waited == 1
    assert clock.slept == [pytest.approx(0.021)]
    clock.t += 1.0  # waited on long after the data arrived: no more delay
    shaped.wait()
    assert len(clock.slept) == 1


def test_each_quorum_costs_one_modelled_round_trip(vt):
    class Client:
        heartbeat = "delegated"

        def _quorum(self, **kwargs):
            return kwargs["step"]

    slept = []
    q = vt.DelayedQuorum(Client(), 0.1, sleep=slept.append)
    assert q._quorum(step=3) == 3 and slept == [0.1] and len(q.quorum_s) == 1
    assert q.heartbeat == "delegated"
    vt.DelayedQuorum(Client(), 0.0, sleep=slept.append)._quorum(step=1)
    assert slept == [0.1]


def _rank(walls, syncs, val, loss):
    return dict(params=10, outer_applied=3, peak_rss_train_bytes=200, rss_before_train_bytes=100, peak_rss_setup_bytes=150,
                val_loss=val, steps=[dict(loss=x, step_s=st, optim_cpu_s=st / 10) for x, st in zip(loss, (0.25, 1.0) * 3, strict=False)],
                outers=[dict(wall_s=w, cpu_s=1.0, sync_step_s=s, sync_step_cpu_s=s, modelled_link_s=0.5, quorum_s=0.0,
                             inter_node_bytes_sent=40,
                             collectives=None, counted=dict(inter_node_bytes_sent=40, inter_node_collectives=1))
                        for w, s in zip(walls, syncs, strict=True)])


def test_summary_takes_the_slowest_rank_and_leaves_the_first_outer_step_out(vt):
    s = vt.summarize_diloco([_rank([9.0, 1.0, 3.0], [1, 1, 1], 2.0, [4.0, 3.0] * 3),
                             _rank([1.0, 2.0, 2.0], [1, 2, 4], 2.5, [5.0, 2.0] * 3)])
    assert s["outer_s_each"] == [9.0, 2.0, 3.0] and s["outer_s"] == 2.5 and s["first_outer_s"] == 9.0
    assert s["sync_step_s"] == 3.0  # max over ranks per outer step (2, 4), then the mean
    assert s["bytes_per_outer"] == 40 and s["collectives_per_outer"] == 1
    assert s["val_loss"] == 2.25 and s["val_loss_nodes_differ"] == 0.5 and s["outer_applied"] == 3
    assert s["train_loss"] == [4.5, 2.5] * 3
    assert s["inner_step_s"] == 0.25 and s["inner_optim_cpu_s"] == pytest.approx(0.025)  # H = 2: every second step syncs


def test_interleaving_spread_table_and_goals(vt):
    assert vt.interleaved(("lowband", "torchft"), [0, 1]) == [(0, "lowband"), (0, "torchft"), (1, "lowband"),
                                                                (1, "torchft")]
    assert vt.spread([3.0, 1.0]) == dict(mean=2.0, min=1.0, max=3.0, spread=2.0, n=2)
    keys = ["outer_s", "bytes_per_outer", "val_loss", "outer_applied"]
    runs = {"lowband": [dict(outer_s=1.0, bytes_per_outer=104, val_loss=3.0, outer_applied=5),
                        dict(outer_s=1.2, bytes_per_outer=104, val_loss=3.2, outer_applied=5)],
            "torchft": [dict(outer_s=1.5, bytes_per_outer=100, val_loss=3.05, outer_applied=5),
                        dict(outer_s=1.3, bytes_per_outer=100, val_loss=3.25, outer_applied=5)]}
    agg = vt.aggregate(runs, keys)
    table = vt.render_table(agg, [("s / outer step", "outer_s", lambda x: f"{x:.2f}"),
                                  ("bytes", "bytes_per_outer", lambda x: f"{x:.0f}")])
    head, secs, byts = table.splitlines()
    assert "lowband DiLoCo" in head and "torchft DiLoCo" in head
    assert secs.split()[-4:] == ["1.10", "(1.00–1.20)", "1.40", "(1.30–1.50)"]
    assert byts.split()[-2:] == ["104", "100"]  # equal over the seeds: no range
    checks = dict((name.split(":")[0], ok) for name, ok in vt.diloco_checks(agg, 5))
    assert checks == {"lowband at least as fast": True, "lowband no more bytes": False,
                      "validation loss within the seeds' spread": True, "every run applied all 5 outer steps": True}
    far = dict(runs, torchft=[dict(r, val_loss=r["val_loss"] + 1) for r in runs["torchft"]])
    assert not vt.diloco_checks(vt.aggregate(far, keys), 5)[2][1]
    dropped = dict(runs, torchft=[dict(r, outer_applied=4) for r in runs["torchft"]])
    assert not vt.diloco_checks(vt.aggregate(dropped, keys), 5)[3][1]
    assert vt.trajectory_gap([1.0, 2.0], [1.5, 2.0]) == dict(mean_abs_diff=0.25, max_abs_diff=0.5)
