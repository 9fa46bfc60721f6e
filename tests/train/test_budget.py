"""lowband/train/budget.py: --time-budget stops a run on its training clock, and its lr schedule runs to the budget;
--stop-file ends a running job at a step written into a file."""

from __future__ import annotations

import json

import pytest
import torch

from lowband.testing.ranks import run_ranks
from lowband.train.budget import StopFile, TimeBudget
from lowband.train.config import ScheduleConfig, TrainConfig
from lowband.train.schedule import warmup_cosine_factor


class _Scheduler(torch.optim.lr_scheduler.LambdaLR):
    def step(self, *args) -> None:  # the trainer's order: the optimizer's step, then the schedule's
        self.optimizer.step()
        super().step(*args)


def _scheduler(lr: float = 0.1):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    return _Scheduler(opt, lambda s: 1.0)


def test_the_budget_is_spent_at_the_first_step_past_it_and_sets_the_lr_by_the_further_progress() -> None:
    budget = TimeBudget.of(ScheduleConfig(steps=100, time_budget_s=10.0, lr_schedule="cosine", warmup_steps=2,
                                          min_lr_ratio=0.1))  # fmt: skip
    sched = _scheduler()
    sched.step()  # step 0 done: the scheduler holds step 1's index
    # 5 s of 10 after one step: the time is further along (half) than the steps (1 of 100).
    assert budget.after_step(5.0, sched) is False
    half = warmup_cosine_factor(50.0, warmup_steps=2, total_steps=100, min_ratio=0.1)
    # step 1 is still in warm-up: warm-up stays in steps
    assert sched.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * (1 + 1) / 2)
    sched.step()
    assert budget.after_step(5.0, sched) is False
    assert sched.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * half) and sched.get_last_lr()[0] < 0.1
    sched.step()
    assert budget.after_step(10.0, sched) is False  # exactly at the budget: not past it
    sched.step()
    assert budget.after_step(10.01, sched) is True
    assert sched.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.1)  # decayed to the floor
    # A local-step method stops only at the end of its outer window.
    assert budget.stops(11.0, sched, window_end=False) is False and budget.stops(11.0, sched, window_end=True)


def test_no_budget_and_bad_budgets() -> None:
    assert TimeBudget.of(ScheduleConfig(steps=10)) is None
    for value, needle in ((0.0, "--time-budget must be > 0 s"),):
        with pytest.raises(ValueError, match=needle):
            TrainConfig.from_tables({"schedule": {"time_budget_s": value}}).validate()
    with pytest.raises(ValueError, match="not supported with fault tolerance"):
        TrainConfig.from_tables({"schedule": {"time_budget_s": 5.0},
                                 "fault_tolerance": {"lighthouse": "http://x:1"}}).validate()
    from lowband.train.args import train_overrides

    assert train_overrides(["--time-budget", "90s"])["schedule"]["time_budget_s"] == 90.0
    with pytest.raises(ValueError, match="--time-budget"):
        train_overrides(["--time-budget", "soon"])


# A loaded CI machine once spent 1 s on the first step alone (FSDP's lazy init), leaving nothing to check.
BUDGET_S = 3.0


def _train_budgeted(rank: int, out: str, cache: str) -> dict:
    import os

    os.environ["LOWBAND_CACHE"] = cache
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    from lowband.train.loop import Trainer

    def cfg(method: dict, sub: str) -> TrainConfig:
        return TrainConfig.from_tables({
            "method": method, "model": {"name": "t5-tiny"},
            "schedule": {"steps": 400, "batch_size": 2, "time_budget_s": BUDGET_S, "lr_schedule": "cosine"},
            "data": {"max_examples": 300, "val_size": 16, "max_source_len": 32, "max_target_len": 8, "vocab_size": 512},
            "run": {"val_batches": 2, "val_every": 5, "progress": False, "out": f"{out}/{sub}"},
        })  # fmt: skip

    return {"adamw": Trainer(cfg({"name": "adamw"}, "adamw")).run().to_dict(),
            "diloco": Trainer(cfg({"name": "diloco", "H": 3}, "diloco")).run().to_dict()}


@pytest.mark.multiprocess
def test_a_budgeted_run_stops_on_its_training_clock_validates_and_records_its_steps(tmp_path, tmp_path_factory):
    cache = str(tmp_path_factory.getbasetemp() / "lowband-cache")
    results = run_ranks(_train_budgeted, world_size=4, ranks_per_node=2, args=(str(tmp_path), cache), timeout_s=300)
    for name in ("adamw", "diloco"):
        steps = {r[name]["steps"] for r in results}
        assert len(steps) == 1, f"{name}: the ranks stopped at different steps {steps}"
        (n,) = steps
        assert 1 <= n < 400
        s = results[0][name]
        # The run stops on the largest clock over the ranks (TimeBudget.agree), not rank 0's own.
        assert s["val_history"][-1]["step"] == n and max(r[name]["train_time_s"] for r in results) > BUDGET_S
        lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        train = [x for x in lines if x["type"] == "train"]
        assert train[-1]["step"] == n
        assert len(train) >= 2, f"{name}: one step filled the {BUDGET_S} s budget; the test needs a few"
        assert train[-2]["train_time_s"] <= BUDGET_S or name == "diloco"  # the step before was within the budget
        assert train[-1]["lr"] < train[0]["lr"]  # the cosine schedule ran toward the budget
        if name == "diloco":
            assert n % 3 == 0, f"DiLoCo H=3 stopped at step {n}, inside an outer window"


class _Outer:
    """An optimizer stand-in whose every H-th step is an outer step (as DiLoCo's ``communicates_next``)."""

    def __init__(self, h: int) -> None:
        self.h, self.inner = h, 0

    def communicates_next(self) -> bool:
        return (self.inner + 1) % self.h == 0


@pytest.mark.parametrize(("local", "h", "expected"), [(False, 1, 4), (True, 3, 6)])
def test_the_loop_stops_at_the_first_step_past_the_budget_or_at_the_end_of_that_outer_window(local, h, expected):
    from lowband.ft.session import Solo
    from lowband.train.loop import Trainer

    t = Trainer.__new__(Trainer)  # the loop alone: steps that each take 1 s of training clock
    t.cfg = TrainConfig.from_tables({"schedule": {"steps": 50, "time_budget_s": 3.5}})
    t.start_step, t.membership, t.local, t.optimizer = 0, Solo(), local, _Outer(h)
    t.clock = {"train_time_s": 0.0, "tokens": 0}
    t.scheduler = _scheduler()
    t.budget, t.stop = TimeBudget.of(t.cfg.schedule), None
    validated = []

    def step(s: int) -> None:
        t.clock["train_time_s"] += 1.0
        t.optimizer.inner += 1
        t.scheduler.step()

    t.train_step, t._after_step = step, validated.append
    t._run_steps()
    # 4 s > 3.5 s after step 4; DiLoCo H=3 goes on to its outer step at 6. No validation at the stopping step
    # (run() validates there once).
    assert t.steps_done == expected and validated == list(range(1, expected))


def _loop(steps: int, *, local: bool, h: int, stop: StopFile, on_step=None):
    """The loop alone (Trainer._run_steps) over stand-in steps: (steps done, steps validated after)."""
    from lowband.ft.session import Solo
    from lowband.train.loop import Trainer

    t = Trainer.__new__(Trainer)
    t.cfg = TrainConfig.from_tables({"schedule": {"steps": steps}})
    t.start_step, t.membership, t.local, t.optimizer, t.budget, t.stop = 0, Solo(), local, _Outer(h), None, stop
    validated = []

    def step(s: int) -> None:
        t.optimizer.inner += 1
        if on_step:
            on_step(s + 1)

    t.train_step, t._after_step = step, validated.append
    t._run_steps()
    return t.steps_done, validated


@pytest.mark.parametrize(("local", "h", "expected"), [(False, 1, 7), (True, 3, 9)])
def test_a_stop_file_ends_the_run_after_its_step_or_that_windows_outer_step(tmp_path, local, h, expected):
    path = tmp_path / "stop"
    # Written while the run is at step 2, naming step 7: the run ends after 7 (DiLoCo H=3: its outer step at 9).
    done, validated = _loop(50, local=local, h=h, stop=StopFile(path),
                            on_step=lambda s: s == 2 and path.write_text("7\n"))
    assert done == expected and validated == list(range(1, expected))


def test_a_stop_file_that_is_absent_late_or_not_a_step_changes_nothing(tmp_path, caplog):
    path = tmp_path / "stop"
    assert _loop(12, local=False, h=1, stop=StopFile(path))[0] == 12  # no file: --steps
    path.write_text("soon")
    assert _loop(12, local=False, h=1, stop=StopFile(path))[0] == 12
    assert "not a step number" in caplog.text
    stop = StopFile(path)
    done = _loop(12, local=False, h=1, stop=stop, on_step=lambda s: s == 6 and path.write_text("4"))[0]
    assert done == 12 and stop.step is None and "already passed" in caplog.text  # a node could not agree on it
