"""lowband/bench/tune.py: --tune's lr search (successive halving), its cache, and where each lr came from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import lowband.bench.runner as runner
import lowband.commands.bench as bench
from lowband.bench import tune
from lowband.bench.config import BenchConfig
from lowband.bench.results import load_results
from tests.bench.fake_trainer import bench_args, in_process_launcher, load_fake


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("LOWBAND_CACHE", str(path))
    return path


def _bench(tmp_path, fake_trainer, monkeypatch, capsys, name: str, *argv: str):
    calls: list = []
    monkeypatch.setattr(runner, "launch_nodes", in_process_launcher(load_fake(fake_trainer), calls))
    out = tmp_path / name
    argv = ("--steps", "12", "--model", "t5-tiny", "--emulation", "shaped", "--out", str(out), "--no-progress", *argv)
    assert bench.main(bench_args(*argv)) == 0
    return load_results(out), out, calls, capsys.readouterr()


def _search_adamw(tmp_path, fake_trainer, monkeypatch, capsys, name: str, *argv: str, **env: str):
    """``--tune`` of adamw alone (with ``argv``, more bench options) against the fake trainer with ``env`` (FAKE_*)
    set: (its search, results, out dir, launches, captured output)."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    results, out, calls, io = _bench(tmp_path, fake_trainer, monkeypatch, capsys, name, "--methods", "adamw", "--tune",
                                     *argv)
    (search,) = results["tuning"]
    return search, results, out, calls, io


@pytest.mark.timeout(180)
def test_tune_searches_each_variant_uses_the_chosen_lr_says_where_it_came_from_and_reuses_its_cache(
        tmp_path, fake_trainer, monkeypatch, capsys, cache) -> None:  # fmt: skip
    monkeypatch.setenv("FAKE_BEST_LR", "0.001")  # the fake's loss is lowest at lr 1e-3 (adamw's default: the centre)
    results, out, calls, io = _bench(tmp_path, fake_trainer, monkeypatch, capsys, "first",
                                     "--methods", "adamw", "adamw:lr=0.01,nseeds=1", "--tune")
    # The cost is announced before the first search run; the given lr (adamw:lr=0.01) is not searched.
    assert "lr search (--tune): 1 variant(s), 0 from the cache; to run: 1 × (3 lrs × 3 steps + 2 × 6 steps) = 5 runs, " \
           "21 steps (and up to 2 runs of 3 steps, then of 6 steps, more per variant whose best lr lies at the edge of the lrs " \
           "tried in that round" in io.err
    assert "(estimated:" in io.err
    # and the main runs' cost after it: adamw and adamw:lr=0.01 at one seed, 12 steps each (2 × 15 s + 24 × 0.5 s)
    assert "Then the main runs: 2 run(s), 24 steps, about 1 min (estimated as the search's" in io.err
    assert io.err.index("lr search (--tune)") < io.err.index("lr search 1/1: adamw, round 1: lr 0.000333, 0.001, 0.003")
    assert len(calls) == 5 + 2
    (search,) = results["tuning"]
    assert search["chosen"] == 0.001 and search["claim"] == "best" and not search["cached"]
    assert [(p["lr"], p["round"], p["steps"]) for p in search["points"]] == [
        (0.000333, 1, 3), (0.001, 1, 3), (0.003, 1, 3), (0.001, 2, 6), (0.003, 2, 6)]
    main = [r.spec for r in results["runs"]]
    assert main == ["adamw:lr=0.001", "adamw:lr=0.01,nseeds=1"]
    assert results["lr_sources"] == {
        "adamw:lr=0.001": "tuned here (best of the search; centre: method default 0.001)",
        "adamw:lr=0.01,nseeds=1": "given"}
    report = (out / "report.md").read_text()
    assert "## Learning rates" in report and "| adamw:lr=0.01,nseeds=1 | 0.01 | given |" in report
    assert "Centre 0.001 (method default); chosen 0.001, the best of the search." in report
    assert "![lr search](tune-0.png)" in report and (out / "tune-0.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "tune" / "00-adamw" / "round1" / "results.json").is_file()
    # Again with the same model, data, method and steps: the cache answers, no search run starts.
    results, out, calls, io = _bench(tmp_path, fake_trainer, monkeypatch, capsys, "again",
                                     "--methods", "adamw", "adamw:lr=0.01,nseeds=1", "--tune")
    assert "1 variant(s), 1 from the cache; to run: 0 ×" in io.err and len(calls) == 2
    assert results["tuning"][0]["cached"] and "(from the cache)" in (out / "report.md").read_text()
    assert len(list((cache / "tune").glob("*.json"))) == 1


@pytest.mark.timeout(180)
def test_a_lowest_loss_at_the_grids_edge_is_not_called_best(tmp_path, fake_trainer, monkeypatch, capsys,
                                                            cache) -> None:  # fmt: skip
    monkeypatch.setenv("FAKE_BEST_LR", "10")
    results, out, calls, io = _bench(tmp_path, fake_trainer, monkeypatch, capsys, "edge", "--methods", "adamw",
                                     "--tune")
    (search,) = results["tuning"]
    # Round 1 went past the grid's edge twice (0.009, 0.027), round 2 twice more (0.081, 0.243), still lowest at
    # the edge: no best claimed.
    assert [p["lr"] for p in search["points"] if p["round"] == 1] == [0.000333, 0.001, 0.003, 0.009, 0.027]
    assert [p["lr"] for p in search["points"] if p["round"] == 2] == [0.009, 0.027, 0.081, 0.243]
    assert "round 1: lowest at the edge (0.003), also lr 0.009" in io.err
    assert "round 2: lowest at the edge (0.081), also lr 0.243" in io.err and len(calls) == 3 + 2 + 2 + 2 + 1
    assert search["chosen"] == 0.243 and search["claim"] == "edge"
    assert "lowest at the grid's edge" in results["lr_sources"]["adamw:lr=0.243"]
    assert "a better lr may lie beyond it, so no best lr is claimed" in (out / "report.md").read_text()


@pytest.mark.timeout(180)
def test_a_best_lr_beyond_the_grid_is_found_by_extending_it_and_then_called_best(
        tmp_path, fake_trainer, monkeypatch, capsys, cache) -> None:  # fmt: skip
    monkeypatch.setenv("FAKE_BEST_LR", "0.009")  # 9x the centre: one extension reaches it, the next passes it
    results, _, calls, _ = _bench(tmp_path, fake_trainer, monkeypatch, capsys, "beyond", "--methods", "adamw", "--tune")
    (search,) = results["tuning"]
    assert [p["lr"] for p in search["points"] if p["round"] == 1] == [0.000333, 0.001, 0.003, 0.009, 0.027]
    assert search["chosen"] == 0.009 and search["claim"] == "best" and len(calls) == 3 + 2 + 2 + 1
    assert results["lr_sources"]["adamw:lr=0.009"].startswith("tuned here (best of the search")


@pytest.mark.timeout(180)
def test_round_two_goes_past_the_edge_when_the_longer_runs_want_a_smaller_lr(
        tmp_path, fake_trainer, monkeypatch, capsys, cache) -> None:  # fmt: skip
    # Round 1 (3 steps) is best near the centre 1e-3 (3.33e-4 second); runs of 6 steps and more are best at 1e-4 (as
    # SparseLoCo on the vim documentation: 3e-2 at 50 steps, 1e-2 or lower at 100).
    search, _, _, calls, io = _search_adamw(tmp_path, fake_trainer, monkeypatch, capsys, "longer",
                                            FAKE_BEST_LR="0.0008", FAKE_BEST_LR_FROM="6:0.0001")
    assert [p["lr"] for p in search["points"] if p["round"] == 1] == [0.000333, 0.001, 0.003]  # no edge there
    # Round 2 kept 1e-3 and 3.33e-4; the lower won, at the edge of all tried: 1.11e-4 (better), then 3.7e-5 (worse).
    assert [p["lr"] for p in search["points"] if p["round"] == 2] == [0.000037, 0.000111, 0.000333, 0.001]
    assert "round 2: lowest at the edge (0.000333), also lr 0.000111" in io.err and len(calls) == 3 + 2 + 2 + 1
    assert search["chosen"] == 0.000111 and search["claim"] == "best"  # worse at 3.7e-5 and 3.33e-4, both 6 steps


@pytest.mark.timeout(180)
def test_a_near_tie_of_large_lrs_in_short_runs_goes_to_the_smaller_lr(
        tmp_path, fake_trainer, monkeypatch, capsys, cache) -> None:  # fmt: skip
    # Runs under 12 steps end level at every lr above 1e-3, 0.001 lower per decade (as AdamW's 75-step runs on the
    # frontier: 7.045, 7.040, 7.038 at 0.03, 0.09, 0.27); the 12-step main runs are best at 1e-3. By the lowest
    # loss alone the search went up to 0.243 ("edge"), a main-run loss 1.1 above 1e-3's.
    search, results, out, calls, io = _search_adamw(tmp_path, fake_trainer, monkeypatch, capsys, "plateau",
                                                    FAKE_BEST_LR="0.001", FAKE_PLATEAU="12:0.001")
    # 3e-3 ended lowest (by 0.0005), tied with 1e-3 within 1 %; 3.33e-4 clearly worse: 1e-3 leads, no edge.
    r1 = {p["lr"]: p["val_loss"] for p in search["points"] if p["round"] == 1}
    assert list(r1) == [0.000333, 0.001, 0.003] and min(r1, key=r1.get) == 0.003 and "lowest at the edge" not in io.err
    assert [p["lr"] for p in search["points"] if p["round"] == 2] == [0.001, 0.003] and len(calls) == 3 + 2 + 1
    assert search["chosen"] == 0.001 and search["claim"] == "best"
    assert [r.spec for r in results["runs"]] == ["adamw:lr=0.001"]
    report = (out / "report.md").read_text()
    assert "losses within 1% of a round's lowest are tied" in report
    # The report says where the choice is not the round's lowest loss, and why.
    assert "chosen 0.001, the best of the search (round 2's lowest loss was at lr 0.003, 3.9995 against 4.0000: " \
           "within 1%, a tie, and the smaller lr leads)." in report


def test_a_tie_leads_with_its_smallest_lr_only_past_an_lr_that_ended_clearly_worse() -> None:
    # A plateau past a worse lr: the smallest tied lr leads; the others stay by loss.
    assert tune._ranked({0.000333: 4.0455, 0.001: 4.0, 0.003: 3.9995}) == [
        (4.0, 0.001), (3.9995, 0.003), (4.0455, 0.000333)]
    # lrs too small to learn also end level (within 1 %) but nothing below them ended worse: the lowest loss leads,
    # so the search goes on up, not down.
    assert tune._ranked({1e-5: 10.40, 3e-5: 10.39, 1e-4: 10.38})[0] == (10.38, 1e-4)
    # Round 2's finalists tie: the smaller leads when round 1 saw a worse lr below them, else the lower loss.
    assert tune._ranked({0.01: 6.80, 0.27: 6.75}, {0.0033})[0] == (6.80, 0.01)
    assert tune._ranked({0.01: 6.80, 0.27: 6.75})[0] == (6.75, 0.27)
    assert tune._ranked({0.01: 6.90, 0.27: 6.75}, {0.0033})[0] == (6.75, 0.27)  # 2 % apart: no tie
    assert tune._ranked({0.01: None, 0.03: 6.8}) == [(6.8, 0.03)]  # a failed run is left out


def test_the_cache_key_follows_the_datas_content_not_its_path(tmp_path, cache) -> None:
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    rows = "\n".join(json.dumps({"source": f"text {i}", "target": f"t {i}"}) for i in range(40))
    a.write_text(rows)
    b.write_text(rows)
    c.write_text(rows + "\n" + json.dumps({"source": "one more", "target": "x"}))

    def key(path, **kw):
        cfg = BenchConfig.from_tables({"bench": {"methods": "adamw", **kw}, "model": {"name": "t5-tiny"},
                                       "data": {"path": str(path)}})
        (search,) = tune.plan_searches(cfg)
        return search.key

    assert key(a) == key(b) != key(c)
    assert key(a) != key(a, steps=80) and key(a) != key(a, nodes=3)


def test_a_preset_on_other_data_says_before_it_starts_that_its_lrs_were_tuned_elsewhere() -> None:
    args = bench_args("--preset", "quality", "--model", "t5-tiny")
    warning = tune.preset_lr_warning(bench.config_from_args(args))
    assert warning is not None and "tuned on t5-mini" in warning and "Add --tune" in warning
    assert tune.preset_lr_warning(bench.config_from_args(bench_args("--preset", "quality"))) is None
    sources = tune.lr_sources(bench.config_from_args(bench_args("--preset", "quality")))
    assert sources["adamw:lr=0.03"] == "preset default"


@pytest.mark.timeout(180)
def test_an_interrupt_during_the_search_says_where_its_runs_are_and_that_a_rerun_goes_on(
        tmp_path, fake_trainer, monkeypatch, capsys, cache) -> None:  # fmt: skip
    """Ctrl-C in the lr search, before any main run: no results.json exists yet, so there is no report to write;
    the bench says so (no traceback), names where the search's runs are, and exits 130."""
    calls: list = []
    inner = in_process_launcher(load_fake(fake_trainer), calls)

    def launch(**kwargs):
        if len(calls) == 2:  # the search's third run
            raise KeyboardInterrupt
        return inner(**kwargs)

    monkeypatch.setattr(runner, "launch_nodes", launch)
    out = tmp_path / "stopped"
    argv = ("--steps", "12", "--model", "t5-tiny", "--emulation", "shaped", "--out", str(out), "--no-progress",
            "--methods", "adamw", "--tune")
    assert bench.main(bench_args(*argv)) == 130
    err = capsys.readouterr().err
    assert f"interrupted during the lr search, before the main runs (its runs so far are in {out / 'tune'})" in err
    assert "Traceback" not in err and "could not write the report" not in err
    assert not (out / "results.json").exists() and not list(cache.glob("tune/*.json"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("noise, says", [
    ("0.001", "the search's choice is beyond that seed noise."),
    ("0.5", "within that seed noise, so the search (one seed) does not tell these lrs apart"),
])
def test_the_report_sets_the_searchs_deciding_margin_beside_the_main_runs_seed_spread(
        tmp_path, fake_trainer, monkeypatch, capsys, cache, noise, says) -> None:  # fmt: skip
    """Round 2's lrs 1e-3 and 3e-3 end 0.2·log10(3)² ≈ 0.046 apart (the fake's loss is lowest at 1e-3); the main runs
    at 1e-3 spread 0.001 or 0.5 over seeds 0 and 1."""
    monkeypatch.setenv("FAKE_SEED_NOISE", noise)
    search, _, out, _, _ = _search_adamw(tmp_path, fake_trainer, monkeypatch, capsys, f"noise{noise}",
                                         "--seeds", "0,1", FAKE_BEST_LR="0.001")
    assert search["chosen"] == 0.001
    report = (out / "report.md").read_text()
    assert f"Round 2's nearest other lr ended 0.0455 from the chosen one; the main runs at the chosen lr spread " \
           f"{float(noise):.4f} over 2 seeds: {says}" in report
