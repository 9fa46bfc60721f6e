"""Admission with real processes (issue 29 item 1): a job with a secret, a node started with another
job's secret and a fake member that copies a live node's public id from the Lighthouse's status page.
The wrong node is refused with a clear error, the fake is never trained with, and the job drops no step."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

if importlib.util.find_spec("torchft") is None:
    pytest.skip("torchft is not installed (pip install -e '.[ft]')", allow_module_level=True)

# --steps is a bound: the job ends by its stop file once node 2 has been refused (on a loaded CI machine nodes 0
# and 1 ran out 400 steps before node 2 had started, and node 2, alone, trained and exited 0).
ARGS = ["--method", "flexdemo", "--topk", "2", "--steps", "100000", "--model", "t5-tiny", "--max-examples", "600",
        "--val-size", "32", "--vocab-size", "512", "--batch-size", "4", "--val-batches", "1"]

# An outsider on this machine: copies a live id from the status page, asks for quorums under it with its own
# addresses (as a process of its own: torchft's runtime must not live in the test process).
FAKE = r"""
import re, sys, urllib.request
from datetime import timedelta
from torchft._torchft import LighthouseClient
addr = sys.argv[1]
page = urllib.request.urlopen(addr + "/status", timeout=5).read().decode()
ids = re.findall(r"<b>(lowband_[^<]+)</b>", page)
c = LighthouseClient(addr, connect_timeout=timedelta(seconds=5))
for i in range(3):
    c.quorum(replica_id=ids[0].split(":")[0] + ":fake", timeout=timedelta(seconds=20), address="http://127.0.0.1:9",
             store_address="127.0.0.1:9", step=1 << 40, world_size=1)
print("fake asked", len(ids))
"""


def test_a_wrong_secret_and_a_copied_id_are_refused_and_the_job_drops_no_step(tmp_path):
    from lowband.cluster.ftjob import FaultTolerantJob
    from lowband.secret import write_secret

    key, other = write_secret(tmp_path / "job.secret"), write_secret(tmp_path / "other.secret")
    args = [*ARGS, "--stop-file", str(tmp_path / "stop")]
    with FaultTolerantJob(train_args=args, nodes=3, ranks_per_node=1, out=tmp_path, start_nodes=2,
                          secret_file=key) as job:
        job.start(0)
        job.start(1)
        job.wait_for_step(0, 10)
        fake = subprocess.run([sys.executable, "-c", FAKE, job.address], capture_output=True, text=True, timeout=90)
        assert fake.returncode == 0, fake.stderr[-2000:]
        job.start(2, secret_file=other)
        assert job.procs[2].wait(timeout=200) != 0
        job.end_soon()
        codes = job.wait(timeout_s=240)
    assert codes[0] == 0 and codes[1] == 0, (tmp_path / "node0.log").read_text()[-3000:]
    log = (tmp_path / "node2.log").read_text()
    assert "is refused by the job" in log and "lowband secret PATH" in log, log[-3000:]
    for secret in (key, other):
        assert secret.read_text().strip() not in log
    recs = [json.loads((tmp_path / f"node{n}" / "ft_rank0.json").read_text()) for n in (0, 1)]
    assert recs[0]["param_sha256"] == recs[1]["param_sha256"]
    assert recs[0]["dropped_steps"] == 0 and recs[1]["dropped_steps"] == 0, recs
    assert "do not prove the job's secret" in (tmp_path / "node0.log").read_text() + (tmp_path / "node1.log").read_text()
