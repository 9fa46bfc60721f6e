"""The healing state transfer inside torchft's real heal flow: a Lighthouse and two nodes' Managers.

One child process (torchft's runtime must not live in the test process) runs a Lighthouse and two
:class:`lowband.ft.node.FaultTolerance` nodes in threads: node 0 at step 5, node 1 at step 0, so torchft
heals node 1 from node 0 through :class:`lowband.ft.transport.StateTransport`. What must hold:

- an honest source: node 1 loads node 0's tensors and plain data (torchft calls send_checkpoint,
  metadata, recv_checkpoint and disallow_checkpoint as in a job; node 0 votes only once node 1 has
  its state, as the step's first collective would make it);
- a source that stalls mid-state: node 1 abandons it within its timeout, its step is dropped (the commit
  vote says no), nothing hangs. (A pickle, in torchft's own format, is refused in tests/ft/test_transport.py.)
- a source that serves a poisoned state (a NaN in its weights: issue 44 item 3): node 1 refuses it and loads
  nothing, remembers the source as bad, drops its own step and takes part in it with nothing that counts (its
  link is not errored: the others' exchange does not wait for it); node 0 commits.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

if importlib.util.find_spec("torchft") is None:
    pytest.skip("torchft is not installed (pip install -e '.[ft]')", allow_module_level=True)

SCRIPT = r'''
import json, os, sys, threading, time
import torch
from torch.distributed import TCPStore
from lowband.ft.node import FaultTolerance, FaultToleranceConfig
from lowband.ft.lighthouse import start_lighthouse
import lowband.ft.transport as ftt

mode, marker = sys.argv[1], sys.argv[2]
TIMEOUT = 2.0

if mode == "stall":
    def _send(self, h, staged, nonce):
        _, header, tensors = staged
        payload = sum(t.numel() * t.element_size() for t in tensors)
        h.send_response(200)
        h.send_header("Content-Length", str(8 + ftt.HEADER_TAG + len(header) + payload + ftt.TRAILER))
        h.end_headers()
        h.wfile.write(len(header).to_bytes(8, "big") + b"-" * ftt.HEADER_TAG + header)
        h.wfile.flush()
        time.sleep(4 * TIMEOUT)  # then nothing: the healer must not wait for it
    ftt.StateTransport._send = _send

lh = start_lighthouse(bind="127.0.0.1:0", min_nodes=2, join_timeout_s=5.0)
addr = "http://127.0.0.1:" + lh.address().rsplit(":", 1)[1]
out = {}
healed = threading.Event()  # stands for the step's first collective: the source waits for the healer there

def node(i, step):
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    w = torch.full((4, 3), float(i + 1))
    trainer = {"step": step, "lr": [0.1 * (i + 1)], "betas": (0.9, 0.95)}
    def state():
        sent = w.clone()
        if mode == "poison" and i == 0:
            sent[1, 2] = float("nan")
        return {"fingerprint": "fp", "trainer": dict(trainer), "w": sent}
    def load(s):
        w.copy_(s["w"])
        trainer.update(s["trainer"])
        return s["trainer"]["step"]
    cfg = FaultToleranceConfig(lighthouse=addr, node=i, max_nodes=2, timeout_s=TIMEOUT, quorum_timeout_s=30,
                               fingerprint="fp", steps=10)
    ft = FaultTolerance(cfg, rank=0, world_size=1, state_dict=state, load_state_dict=load,
                        store_addr="127.0.0.1", store_port=store.port)
    t0 = time.monotonic()
    ft.start_step(step)
    if i == 1:
        healed.set()
    else:
        healed.wait(30)
    err = ft.manager.errored()
    taking_part = {"participating": ft.participating, "errored": ft.errored, "heal_refused": ft.heal_refused}
    if mode == "poison":  # the step's mean: the node whose heal was refused takes part with nothing that counts
        from lowband.comm.link import Link
        from lowband.distributed.topology import Topology
        link = Link(Topology(num_nodes=1, ranks_per_node=1), ft=ft)
        taking_part["mean"] = link.all_reduce(torch.full((3,), 10.0 * (i + 1)), op="avg").tolist()
        taking_part["counted"], taking_part["torchft_participants"] = link.counted, ft.participants
    ok = ft.commit()
    out[i] = {"healed": ft.healed_at, "commit": ok, "s": time.monotonic() - t0, "w": w.tolist(),
              "error": str(getattr(err, "original_exception", err) or ""),
              "trainer": trainer, "betas_type": type(trainer["betas"]).__name__,
              "bad_sources": {k.split(":")[0]: v for k, v in ft.bad_sources.items()}, **taking_part}
    ft.shutdown()

threads = [threading.Thread(target=node, args=(i, s)) for i, s in ((0, 5), (1, 0))]
for t in threads:
    t.start()
for t in threads:
    t.join(60)
print("RESULT " + json.dumps(out), flush=True)
os._exit(0)
'''


def _run(tmp_path: Path, mode: str) -> tuple[dict, Path]:
    marker = tmp_path / "ran"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LOWBAND_SECRET", None)
    env.pop("LOWBAND_SECRET_FILE", None)
    p = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(marker)], capture_output=True, text=True,
                       timeout=90, env=env, cwd=Path(__file__).resolve().parents[2])
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"no result (rc {p.returncode}): {p.stderr[-3000:]}"
    out = {int(k): v for k, v in json.loads(lines[-1][7:]).items()}
    assert set(out) == {0, 1}, p.stderr[-3000:]
    return out, marker


def test_a_node_heals_from_a_live_peer_through_torchfts_flow_as_tensors_and_plain_data(tmp_path):
    out, _ = _run(tmp_path, "honest")
    assert out[1]["healed"] and out[1]["healed"][0]["step"] == 5, out[1]["error"]
    assert out[1]["w"] == out[0]["w"] == [[1.0] * 3] * 4
    assert out[1]["trainer"] == {"step": 5, "lr": [0.1], "betas": [0.9, 0.95]} and out[1]["betas_type"] == "tuple"
    assert out[0]["commit"] and out[1]["commit"]


def test_a_source_that_stalls_mid_state_is_abandoned_in_time_and_the_step_dropped(tmp_path):
    # (a source that sends a pickle, a wrong length or a wrong tensor: tests/ft/test_transport.py, in-process)
    out, marker = _run(tmp_path, "stall")
    assert not marker.exists()
    assert "stopped sending" in out[1]["error"], out[1]["error"]
    assert out[1]["healed"] == [] and out[1]["commit"] is False  # the step is dropped
    assert out[1]["w"] == [[2.0] * 3] * 4
    assert out[0]["commit"]
    assert out[1]["s"] < 20, out[1]["s"]


def test_a_source_that_serves_a_poisoned_state_is_refused_remembered_and_the_healer_takes_part_uncounted(tmp_path):
    out, _ = _run(tmp_path, "poison")
    assert "NaN or infinite" in out[1]["error"] and "nothing loaded" in out[1]["error"], out[1]["error"]
    assert out[1]["healed"] == [] and out[1]["w"] == [[2.0] * 3] * 4  # nothing of it loaded
    assert list(out[1]["bad_sources"]) == ["lowband_fp_node0"]
    assert out[1]["heal_refused"] and not out[1]["participating"] and not out[1]["errored"]
    assert out[1]["commit"] is False and out[0]["commit"]  # the healer drops its step, the source does not
    assert out[0]["participating"] and not out[0]["errored"]
    # torchft counts the healer as a participant; the mean counts the members whose values count: node 0's alone
    assert out[0]["torchft_participants"] == 2  # torchft's count: the mean over it would be 5.0, diluted by zeros
    assert out[0]["mean"] == [10.0] * 3 and out[0]["counted"] == 1, out[0]
