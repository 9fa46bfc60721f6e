"""lowband/bench/runner.py: ``lowband bench`` launching its runs, without real training.

The fake trainer (tests/bench/fake_trainer.py: it writes the files ``lowband train`` writes)
stands in for the training entry point, so that bad input, launching, failure handling and
interrupts are tested on their own. One test runs it under real torchrun (loopback), one in network
namespaces where they can be built.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lowband.bench.runner as runner
import lowband.commands.bench as bench
from lowband.bench.results import load_results
from lowband.cluster import list_namespaces
from lowband.testing.ranks import default_sigint
from tests.bench.fake_trainer import bench_args

pytestmark = pytest.mark.timeout(300)  # 40 s alone; minutes on a loaded machine


# ------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--methods", "adamw,sgd"], ["'sgd'", "adamw", "deto-full", "demo", "flexdemo", "diloco", "noloco"]),
        (["--methods", "flexdemo:topk=8,rank=3"], ["'rank'", "topk", "chunk", "decay"]),
        (["--bandwidth", "100mbit,fast"], ["'fast'", "mbit", "gbit"]),
        (["--model", "t5-huge"], ["'t5-huge'", "t5-tiny", "t5-small", "gpt-small"]),
        (["--data", "/nonexistent/train.jsonl"], ["/nonexistent/train.jsonl", ".jsonl", ".csv"]),
        (["--shards", "3"], ["shards=3", "accepted: 1, 2"]),
        (["--latency", "soon"], ["'soon'", "20ms"]),
        (["--steps", "0"], ["steps=0"]),
    ],
)
def test_bad_input_is_named_before_anything_starts(
    argv: list[str], words: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("a process or network was started despite bad input")

    monkeypatch.setattr(runner, "launch_nodes", forbidden)
    monkeypatch.setattr(runner, "EmulatedNetwork", forbidden)
    monkeypatch.setattr(runner, "netns_available", forbidden)
    monkeypatch.setattr(subprocess, "Popen", forbidden)
    out = tmp_path / "bench"
    rc = bench.main(bench_args(*argv, "--out", str(out), "--emulation", "auto"))
    err = capsys.readouterr().err
    assert rc == 2
    assert all(w in err for w in words), err
    assert not out.exists()


# ------------------------------------------------------------------------------------ real launches


@pytest.mark.multiprocess
def test_failed_run_is_recorded_and_the_others_run(
    tmp_path: Path, fake_trainer: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """Under real torchrun (loopback, shaped): adamw's trainer exits 1, FlexDeMo succeeds."""
    monkeypatch.setenv("FAKE_FAIL_METHODS", "adamw")
    out = tmp_path / "bench"
    argv = ["--methods", "adamw,flexdemo:topk=8", "--steps", "4", "--model", "t5-tiny", "--emulation", "shaped",
            "--entry", str(fake_trainer), "--out", str(out), "--no-progress", "--latency", "5ms"]  # fmt: skip
    assert bench.main(bench_args(*argv)) == 1
    assert "00-adamw-s2-100mbit-seed0 failed: RuntimeError: fake trainer: adamw blew up on purpose" in capsys.readouterr().out
    results = load_results(out)
    failed, ok = results["runs"]
    assert failed.method == "adamw" and failed.status == "failed"
    assert "blew up on purpose" in failed.error and "node 0: exit status 1" in failed.error
    assert "ChildFailedError" not in failed.error  # torchrun's own report is condensed
    assert failed.step_time_s is None
    assert ok.method == "flexdemo" and ok.status == "ok" and ok.error is None
    assert ok.step_time_s > 0 and ok.val_loss is not None and ok.latency_s == 0.005
    assert (out / ok.logs[0]).is_file()
    report = (out / "report.md").read_text()
    assert "## Failed runs" in report and "blew up on purpose" in report


@pytest.mark.multiprocess
@pytest.mark.netns
def test_netns_mode_measures_the_link(tmp_path: Path, fake_trainer: Path) -> None:
    out = tmp_path / "bench"
    argv = ["--methods", "flexdemo:topk=8", "--steps", "4", "--model", "t5-tiny", "--emulation", "netns",
            "--bandwidth", "100mbit", "--entry", str(fake_trainer), "--out", str(out), "--no-progress"]  # fmt: skip
    assert bench.main(bench_args(*argv)) == 0
    results = load_results(out)
    assert results["emulation"]["mode"] == "netns"
    (link,) = results["emulation"]["links"]
    assert 80e6 < link["measured_throughput_bps"] < 101e6
    (run,) = results["runs"]
    assert run.emulation == "netns" and run.status == "ok"
    # The rendezvous alone crosses the link: the wire counter sees it.
    assert run.measured_wire_bytes_per_step > 0 and len(run.measured_wire_bytes_per_step_by_node) == 2
    assert "measured" in (out / "report.md").read_text()


def _processes_mentioning(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline:
                pids.append(int(entry))
    return pids


@pytest.mark.timeout(420)
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "mode, signum",
    [
        pytest.param("netns", signal.SIGINT, marks=pytest.mark.netns),
        ("shaped", signal.SIGTERM),
    ],
)
def test_interrupt_leaves_nothing_behind(tmp_path: Path, fake_trainer: Path, mode: str, signum: int) -> None:
    """Ctrl-C (netns) or SIGTERM (shaped) while a run hangs: no namespace or process is left behind,
    results.json says interrupted, and the report is written."""
    out = tmp_path / "bench"
    env = {**os.environ, "FAKE_HANG_METHODS": "flexdemo"}
    argv = [sys.executable, "-m", "lowband", "bench", "--methods", "flexdemo,adamw", "--steps", "3", "--model",
            "t5-tiny", "--emulation", mode, "--entry", str(fake_trainer), "--out", str(out), "--no-progress",
                "--time-budget", "off"]  # fmt: skip (equal steps: FlexDeMo's run stays the first, 00-flexdemo)
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=default_sigint)
    try:
        started = out / "runs" / "00-flexdemo-top1-s2-100mbit-seed0" / "started-3"
        deadline = time.monotonic() + 240  # a bench and torchrun start in ~10 s alone, minutes on a loaded machine
        while not started.exists():
            assert proc.poll() is None, proc.communicate()[0].decode()
            assert time.monotonic() < deadline, "the hanging run never started"
            time.sleep(0.1)
        proc.send_signal(signum)
        output = proc.communicate(timeout=120)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == (130 if signum == signal.SIGINT else 128 + signum), output
    assert not [n for n in list_namespaces() if n.startswith(f"lb-{proc.pid}-")]
    deadline = time.monotonic() + 10
    while _processes_mentioning(str(fake_trainer)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_mentioning(str(fake_trainer)) == []
    results = load_results(out)
    assert results["interrupted"] is True and results["finished"] is not None
    (run,) = results["runs"]  # adamw never started
    assert run.method == "flexdemo" and run.status == "failed" and "interrupted" in run.error
    assert (out / "report.md").is_file()
