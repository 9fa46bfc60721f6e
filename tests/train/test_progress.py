"""A run that reports itself (lowband/train/progress.py, ranklog.py, trackers.py, metrics.py): the progress
line from given numbers, the bar's TTY rule, each rank's log level and prefix, the trackers' options, and a
trainer run that logs its lines and writes its TensorBoard scalars; W&B in its offline mode (one forked run)."""

from __future__ import annotations

import io
import json
import logging
import math
import struct
import warnings
from pathlib import Path

import pytest

from lowband.train.config import RunConfig, TrainConfig
from lowband.train.progress import ProgressLog, ProgressReport, format_duration, show_progress_bar
from lowband.train.ranklog import QUIET_LOGGERS, configure_rank_logging, rank_identity
from tests.train.corpus import corpus


# --------------------------------------------------------------------------- the line
def test_the_line_says_each_number_with_its_unit():
    r = ProgressReport(step=120, total_steps=1000, loss=3.41234, val_loss=3.5012, tokens_per_s=5213.4,
                       node_mb_per_step=4.194304, comm_share=0.2345, eta_s=307.2)
    assert r.line() == ("step 120/1000 | loss 3.412 | val 3.501 | 5.21k tok/s/rank | 4.19 MB/step out of the node | "
                        "comm 23% | ETA 5m07s")
    r = ProgressReport(step=1, total_steps=5, loss=7.0, val_loss=None, tokens_per_s=812.0, node_mb_per_step=0.0,
                       comm_share=0.0, eta_s=None)
    assert r.line() == "step 1/5 | loss 7 | val - | 812 tok/s/rank | 0 MB/step out of the node | comm 0% | ETA ?"
    assert r.scalars() == {"progress/tokens_per_s_per_rank": 812.0, "progress/node_mb_sent_per_step": 0.0,
                           "progress/comm_share": 0.0}  # no ETA known: none sent
    assert [format_duration(s) for s in (3725, 307, 42.4, 0, -3, None, math.inf)] == [
        "1h02m", "5m07s", "42s", "0s", "0s", "?", "?"]


def _step(p: ProgressLog, step: int, *, loss: float = 1.0, step_time_s: float = 0.5, exposed_s: float = 0.1,
          node_bytes: int = 2_000_000, tokens_per_step: int = 100):
    return p.after_step(step=step, loss=loss, step_time_s=step_time_s, exposed_comm_time_s=exposed_s,
                        node_bytes_sent=node_bytes, tokens=step * tokens_per_step, train_time_s=step * 0.5)


def test_every_n_steps_a_report_of_the_steps_since_the_last():
    p = ProgressLog(every=4, total_steps=100)
    assert [_step(p, s, loss=float(s)) for s in (1, 2, 3)] == [None, None, None]
    p.note_val(2.5)
    r = _step(p, 4, loss=4.0)
    assert r is not None and r.step == 4 and r.val_loss == 2.5
    assert r.loss == pytest.approx((1 + 2 + 3 + 4) / 4)  # the mean over the window
    assert r.tokens_per_s == pytest.approx(100 / 0.5)  # 100 tokens per 0.5 s of training clock
    assert r.node_mb_per_step == pytest.approx(2.0) and r.comm_share == pytest.approx(0.2)
    assert r.eta_s == pytest.approx(96 * 0.5)  # steps left × mean step time
    # The next window starts afresh: its loss and rates are its own steps'.
    assert [_step(p, s, loss=10.0, exposed_s=0.25) for s in (5, 6, 7)] == [None, None, None]
    r = _step(p, 8, loss=10.0, exposed_s=0.25)
    assert r.loss == 10.0 and r.comm_share == pytest.approx(0.5) and r.tokens_per_s == pytest.approx(200)
    # A node that heals jumps ahead: the first step past a multiple reports.
    assert _step(p, 9) is None and _step(p, 13) is not None and _step(p, 15) is None
    assert all(_step(ProgressLog(every=0, total_steps=9), s) is None for s in range(1, 10))  # 0: off
    with pytest.raises(ValueError, match="--log-every must be >= 0"):
        ProgressLog(every=-1, total_steps=9)


def test_the_eta_honours_a_time_budget_and_a_resume_starts_from_its_counters():
    p = ProgressLog(every=2, total_steps=1000, budget_s=5.0)
    _step(p, 1)
    r = _step(p, 2)  # 998 steps × 0.5 s = 499 s left by steps, but the budget (5 s) has 4 s of clock left
    assert r.eta_s == pytest.approx(4.0)
    p = ProgressLog(every=2, total_steps=1000, budget_s=0.5)
    _step(p, 1)
    assert _step(p, 2).eta_s == 0.0  # spent
    # A resumed run's counters go on from its checkpoint: the first window's rates are its own steps'.
    p = ProgressLog(every=2, total_steps=100, tokens=10 * 100, train_time_s=10 * 0.5)
    assert _step(p, 11) is None
    assert _step(p, 12).tokens_per_s == pytest.approx(200)


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_is_drawn_only_on_rank_0_at_a_terminal():
    assert show_progress_bar(enabled=True, rank=0, stream=_Tty())
    assert not show_progress_bar(enabled=True, rank=0, stream=io.StringIO())  # a cluster's log file
    assert not show_progress_bar(enabled=True, rank=1, stream=_Tty())
    assert not show_progress_bar(enabled=False, rank=0, stream=_Tty())  # --no-progress


# --------------------------------------------------------------------------- each rank's logging
@pytest.fixture()
def root_logger():
    """The root logger's handlers and level, put back after the test (configure_rank_logging replaces them)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    quiet = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    yield root
    logging.captureWarnings(False)
    for name, lvl in quiet.items():
        logging.getLogger(name).setLevel(lvl)
    for h in root.handlers[:]:
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_local_rank_0_logs_info_the_others_warnings_and_every_line_names_node_and_rank(root_logger):
    torchrun = {"RANK": "5", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "2", "WORLD_SIZE": "6"}
    assert rank_identity(torchrun) == rank_identity(torchrun | {"GROUP_RANK": ""})  # the node: rank // ranks per node
    assert rank_identity({}).prefix == "[node 0 rank 0]"  # not under torchrun
    assert rank_identity(torchrun | {"LOCAL_RANK": "0", "RANK": "4"}, node=7).prefix == "[node 7 rank 4]"  # --ft-node
    with pytest.raises(ValueError, match="LOCAL_RANK='x' is not an integer"):
        rank_identity({"LOCAL_RANK": "x"})
    lines = {}
    for name, env in (("leader", torchrun | {"LOCAL_RANK": "0", "RANK": "4"}), ("other", torchrun)):
        stream = io.StringIO()
        configure_rank_logging(rank_identity(env), stream=stream)
        logging.getLogger("lowband.train.loop").info("step 10/100 | loss 3")
        logging.getLogger("lowband.ft.node").warning("the commit vote failed")
        logging.getLogger("torchft.manager").info("should_commit=True")  # every step: held back
        with warnings.catch_warnings():
            warnings.simplefilter("always")  # not only once per place: both ranks warn
            warnings.warn("a library's warning", UserWarning, stacklevel=1)
        lines[name] = stream.getvalue().splitlines()
    assert "[node 2 rank 4] INFO lowband.train.loop: step 10/100" in lines["leader"][0]
    assert "[node 2 rank 5] WARNING lowband.ft.node: the commit vote failed" in lines["other"][0]
    for name, first in (("leader", 2), ("other", 1)):
        assert "WARNING py.warnings:" in lines[name][first] and "a library's warning" in lines[name][first]
        assert not any("should_commit" in line for line in lines[name])


# --------------------------------------------------------------------------- the trackers' options
def test_report_to_names_trackers_and_the_older_tensorboard_key_still_works(monkeypatch):
    from lowband.train import jobfile, trackers
    from lowband.train.args import parse_train_args

    cfg = parse_train_args(["--report-to", "TensorBoard, wandb", "--log-every", "5"])
    assert cfg.run.trackers() == ("tensorboard", "wandb") and cfg.run.log_every == 5
    assert RunConfig().trackers() == () and RunConfig().log_every == 10
    old = TrainConfig.from_tables(jobfile.loads("[run]\ntensorboard = true\n"))  # a job file written before
    assert old.run.trackers() == ("tensorboard",)
    assert RunConfig(tensorboard=True, report_to="tensorboard").trackers() == ("tensorboard",)
    back = TrainConfig.from_tables(jobfile.loads(jobfile.dumps(cfg)))
    assert back.run.trackers() == ("tensorboard", "wandb") and back.run.log_every == 5
    with pytest.raises(ValueError, match=r"--report-to: unknown tracker 'mlflow'; give a comma list of tensorboard, wandb"):
        TrainConfig.from_tables({"run": {"report_to": "mlflow"}}).validate()
    with pytest.raises(ValueError, match="--log-every must be >= 0"):
        TrainConfig.from_tables({"run": {"log_every": -1}}).validate()
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None)  # as where wandb is not installed
    with pytest.raises(ValueError, match=r"--report-to wandb needs the wandb package.*pip install 'lowband\[wandb\]'"):
        TrainConfig.from_tables({"run": {"report_to": "wandb"}}).validate()


# --------------------------------------------------------------------------- a run
def _tiny_run(tmp_path: Path, **run) -> TrainConfig:
    data = tmp_path / "corpus.txt"
    data.write_text("\n".join(corpus(60)) + "\n", encoding="utf-8")
    return TrainConfig.from_tables({
        "method": {"name": "adamw"}, "model": {"name": "gpt-tiny"}, "schedule": {"steps": 4, "batch_size": 2},
        "data": {"path": str(data), "val_size": 10, "max_len": 16, "vocab_size": 300},
        "run": {"out": str(tmp_path / "out"), "val_batches": 1, "log_every": 2, **run},
    })  # fmt: skip


def test_a_run_logs_a_line_every_n_steps_and_its_scalars_reach_tensorboard(tmp_path, fresh_cache, caplog):
    pytest.importorskip("tensorboard", reason="--report-to tensorboard needs tensorboard (pip install -e '.[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lowband.train.loop import Trainer

    with caplog.at_level(logging.INFO, logger="lowband.train.loop"):
        trainer = Trainer(_tiny_run(tmp_path, report_to="tensorboard"))
        summary = trainer.run()
    assert trainer.bar is None  # pytest's stderr is no terminal: no bar, though --progress is on
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 2/4", "step 4/4"], caplog.text
    val0 = summary.val_history[0]["val_loss"]  # the validation before step 1: the last one at both lines
    assert all(f"| val {val0:.4g} |" in line and "tok/s/rank" in line and "ETA" in line for line in lines), lines
    train = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in train if x["type"] == "train"]
    assert f"loss {(losses[2] + losses[3]) / 2:.4g} |" in lines[1]  # the mean of the window's steps
    events = EventAccumulator(str(tmp_path / "out" / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(losses)
    assert [e.step for e in events.Scalars("val/val_loss")] == [0, 4]
    assert [e.step for e in events.Scalars("progress/tokens_per_s_per_rank")] == [2, 4]
    assert all(e.value > 0 for e in events.Scalars("progress/tokens_per_s_per_rank"))


def _wandb_records(path: Path) -> list:
    """The records of an offline W&B run file (``run-ID.wandb``): wandb's protobuf Records, framed as LevelDB's
    log (a 7-byte header; 32 KiB blocks of chunks: crc32, length, type), the framing wandb-core writes."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    block, head, pos, pending, out = 32768, 7, 7, b"", []
    while pos + head <= len(data):
        if block - pos % block < head:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + head])
        pending += data[pos + head:pos + head + n]
        pos += head + n
        if kind in (1, 4):  # FULL or LAST: a record is complete
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            out.append(rec)
            pending = b""
    return out


def _train_with_wandb(rank: int, tmp: str) -> None:
    from lowband.train.loop import Trainer

    Trainer(_tiny_run(Path(tmp), report_to="wandb", run_name="tiny", wandb_project="lowband-test")).run()


@pytest.mark.multiprocess  # wandb runs a service process of its own; here in a forked rank, not in pytest's
def test_wandb_offline_gets_the_scalars_and_the_jobs_config(tmp_path, fresh_cache):
    pytest.importorskip("wandb", reason="--report-to wandb needs wandb (pip install -e '.[wandb]')")
    from lowband.testing.ranks import run_ranks

    run_ranks(_train_with_wandb, world_size=1, args=(str(tmp_path),), timeout_s=180,
              env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb-dir"), "WANDB_SILENT": "true"})
    (run_file,) = (tmp_path / "wandb-dir").glob("wandb/offline-run-*/run-*.wandb")
    records = _wandb_records(run_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.display_name, run.project) == ("tiny", "lowband-test")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    job = (tmp_path / "out" / "config.toml").read_text()
    from lowband.train import jobfile

    assert {k: config[k] for k in jobfile.loads(job)} == jobfile.loads(job)  # the run's config: the job's file
    rows = [{item.nested_key[0] if item.nested_key else item.key: json.loads(item.value_json)
             for item in r.history.item} for r in records if r.WhichOneof("record_type") == "history"]
    train = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    losses = {x["step"]: x["loss"] for x in train if x["type"] == "train"}
    assert {row["step"]: row["train/loss"] for row in rows if "train/loss" in row} == pytest.approx(losses)
    assert sorted(row["step"] for row in rows if "val/val_loss" in row) == [0, 4]
    assert sorted(row["step"] for row in rows if "progress/tokens_per_s_per_rank" in row) == [2, 4]
