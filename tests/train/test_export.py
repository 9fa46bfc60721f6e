"""lowband/train/export.py and `lowband export`: a run's checkpoint as a transformers directory.

The multi-process test trains FlexDeMo, DiLoCo and NoLoCo (gpt-tiny) and DiLoCo (t5-tiny) on a 2 × 2 gloo
mesh, exports each, and loads the directories with transformers' Auto classes: their validation loss on
the run's validation set equals the run's own, and their tokenizer gives the run's token ids. The unit
tests export one-process checkpoints: which parameters (a DiLoCo checkpoint's outer ones), the bad
inputs refused before anything is written, and a failure that leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from lowband.testing.ranks import run_ranks

# H = 2 and 4 steps: the runs end on an outer step, where the outer parameters are the model each replica
# validates.
RUNS = {"flexdemo-gpt": ("flexdemo", "gpt-tiny"), "diloco-gpt": ("diloco", "gpt-tiny"),
        "noloco-gpt": ("noloco", "gpt-tiny"), "diloco-t5": ("diloco", "t5-tiny")}


def _tables(method: str, model: str, out: str) -> dict:
    data = {"max_examples": 300, "val_size": 16, "vocab_size": 512}
    data.update({"max_len": 32} if model.startswith("gpt") else {"max_source_len": 32, "max_target_len": 8})
    return {"method": {"name": method, **({"H": 2} if method in ("diloco", "noloco") else {})},
            "model": {"name": model}, "schedule": {"steps": 4, "batch_size": 2}, "data": data,
            "run": {"val_batches": 2, "progress": False, "out": out, "export_hf": f"{out}-hf"}}


def _train(rank: int, out: str, cache: str) -> dict:
    import os

    os.environ["LOWBAND_CACHE"] = cache
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    from lowband.train.config import TrainConfig
    from lowband.train.loop import Trainer

    return {name: Trainer(TrainConfig.from_tables(_tables(method, model, f"{out}/{name}"))).run().val_loss
            for name, (method, model) in RUNS.items()}


def _hf_val_loss(hf_dir: Path, run: Path) -> tuple[float, dict]:
    """The exported model's validation loss on the run's validation set, by transformers' own loss (weighted by
    tokens as lowband's evaluation weights its batches); and the run's data."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from lowband.train import jobfile
    from lowband.train.config import TrainConfig
    from lowband.train.data import load_data, val_batches
    from lowband.train.models import model_kind

    cfg = TrainConfig.from_tables(jobfile.load(run / "config.toml"))
    kind = model_kind(cfg.model.name)
    data = load_data(dataclasses.replace(cfg.data, kind=kind))
    auto = AutoModelForSeq2SeqLM if kind == "seq2seq" else AutoModelForCausalLM
    model = auto.from_pretrained(hf_dir)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for batch in val_batches(data, batch_size=cfg.schedule.batch_size, max_batches=cfg.run.val_batches):
            n = int((batch["labels"] != -100).sum())
            total += model(**batch).loss.item() * n
            tokens += n
    return total / tokens, {"data": data, "cfg": cfg}


def _check_tokenizer(hf_dir: Path, data, cfg) -> None:
    """AutoTokenizer gives the ids the run trained on (seq2seq: </s> appended, as lowband does)."""
    import numpy as np
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    assert (tok.pad_token_id, tok.eos_token_id) == (data.special.pad, data.special.eos)
    if data.kind == "seq2seq":
        for i in range(3):
            src = tok(data.val.source_text[i], truncation=True, max_length=cfg.data.max_source_len).input_ids
            tgt = tok(data.val.target_text[i], truncation=True, max_length=cfg.data.max_target_len).input_ids
            assert src == data.val.input_ids[i].tolist() and tgt == data.val.target_ids[i].tolist()
    else:  # packed: the validation documents, each followed by </s>, are the stream the blocks are cut from
        stream = np.concatenate(data.val.input_ids).tolist()
        ids = [t for doc in data.val.source_text[:2] for t in [*tok(doc).input_ids, data.special.eos]]
        assert ids[: len(stream)] == stream[: len(ids)]


@pytest.mark.multiprocess
def test_exported_runs_load_in_transformers_with_the_runs_validation_loss(tmp_path, tmp_path_factory, monkeypatch):
    from safetensors.torch import load_file

    from lowband.cli import main

    cache = str(tmp_path_factory.getbasetemp() / "lowband-cache")
    monkeypatch.setenv("LOWBAND_CACHE", cache)
    losses = run_ranks(_train, world_size=4, ranks_per_node=2, args=(str(tmp_path), cache), timeout_s=300)[0]
    for name, (method, _) in RUNS.items():
        run, hf = tmp_path / name, tmp_path / f"{name}-hf"
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json"} <= {p.name for p in hf.iterdir()}
        assert (run / "tokenizer" / "tokenizer.json").is_file()
        loss, ctx = _hf_val_loss(hf, run)
        want = json.loads((run / "summary_rank0.json").read_text())["val_loss"]
        assert want == losses[name]
        assert abs(loss - want) < 1e-4, (name, loss, want)
        _check_tokenizer(hf, ctx["data"], ctx["cfg"])
        record = json.loads((hf / "lowband_export.json").read_text())
        assert record["step"] == 4 and record["method"] == method
        assert record["parameters"] == ("model" if method == "flexdemo" else "outer (slow) parameters of replica 0")
        assert record["topology"]["replicas"] == 2 and record["topology"]["shards"] == 2
    # `lowband export RUN` gives what --export-hf gave.
    assert main(["export", str(tmp_path / "diloco-gpt"), "--out", str(tmp_path / "again")]) == 0
    a, b = load_file(tmp_path / "diloco-gpt-hf" / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- one process
SECRET = b"0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """A one-process DiLoCo run directory (3 steps at H = 2: θ has moved past the outer parameters φ), signed
    with SECRET, and the same model saved as an AdamW run's (its parameters are the model's own)."""
    from lowband.checkpoint.dcp import save_checkpoint
    from lowband.train.methods import build_optimizer
    from lowband.train.models import build_model, compute_loss
    from lowband.train.tokenizer import save_for_transformers, train_tokenizer

    root = tmp_path_factory.mktemp("export")
    tok = train_tokenizer([f"the number {i} is {'even' if i % 2 == 0 else 'odd'}" for i in range(200)], 300)
    model = build_model("gpt-tiny", vocab_size=tok.get_vocab_size(), seed=0).model
    opt = build_optimizer("diloco", model.named_parameters(), link=None, hp={"H": 2})
    ids = torch.randint(3, tok.get_vocab_size(), (4, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        opt.zero_grad()
        compute_loss(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}).backward()
        opt.step()
    out = {}
    for method, optimizer, secret in (("diloco", opt, SECRET), ("adamw", None, None)):
        run = root / method
        save_checkpoint(run / "checkpoints" / "step_000003", model=model, optimizer=optimizer, secret=secret,
                        extra={"method": method, "model": "gpt-tiny", "step": 3})
        save_for_transformers(tok, run / "tokenizer", seq2seq=False)
        out[method] = run
    params = dict(model.named_parameters())
    out["theta"] = {n: p.detach().clone() for n, p in params.items()}
    out["phi"] = {n: opt.state[p]["slow"].clone() for n, p in params.items()}
    out["ids"] = ids
    return out


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(directory).named_parameters())


def test_diloco_exports_its_outer_parameters_and_adamw_its_model(runs, tmp_path):
    from lowband.train.export import export_checkpoint

    export_checkpoint(runs["diloco"], tmp_path / "diloco", secret=SECRET)
    export_checkpoint(runs["adamw"] / "checkpoints" / "step_000003", tmp_path / "adamw")
    phi, theta = _weights(tmp_path / "diloco"), _weights(tmp_path / "adamw")
    name = "transformer.h.0.mlp.c_fc.weight"
    assert not torch.equal(runs["phi"][name], runs["theta"][name])  # the check below can tell them apart
    for n in runs["phi"]:
        assert torch.equal(phi[n], runs["phi"][n]) and torch.equal(theta[n], runs["theta"][n]), n
    # The tokenizer read back as lowband reads one gives the run's ids (it tokenises without special tokens).
    from lowband.train.tokenizer import load_tokenizer

    text = "the number 7 is odd"
    assert load_tokenizer(tmp_path / "adamw").encode(text, add_special_tokens=False).ids == \
        load_tokenizer(runs["adamw"] / "tokenizer").encode(text, add_special_tokens=False).ids
    # --replica: the one replica of a one-process run, or none for a method whose replicas agree.
    export_checkpoint(runs["diloco"], tmp_path / "mean", secret=SECRET, replica="mean")
    assert torch.equal(_weights(tmp_path / "mean")[name], runs["phi"][name])
    with pytest.raises(ValueError, match=r"--replica 1: .* holds 1 replica\(s\)"):
        export_checkpoint(runs["diloco"], tmp_path / "r1", secret=SECRET, replica=1)
    with pytest.raises(ValueError, match="the replicas of adamw hold the same parameters"):
        export_checkpoint(runs["adamw"], tmp_path / "r0", replica=0)
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r0").exists()


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_bad_inputs_are_refused_before_anything_is_written(runs, tmp_path):
    from lowband.checkpoint.signatures import CheckpointRefused
    from lowband.train.export import export_checkpoint, parse_replica

    out = tmp_path / "hf"
    with pytest.raises(FileNotFoundError, match="does not exist: give a run's directory"):
        export_checkpoint(tmp_path / "missing", out)
    (tmp_path / "empty-run").mkdir()
    (tmp_path / "empty-run" / "config.toml").write_text("")
    with pytest.raises(FileNotFoundError, match="is a run directory without a checkpoint.*--ckpt-at-end"):
        export_checkpoint(tmp_path / "empty-run", out)
    with pytest.raises(CheckpointRefused, match="signed with another secret"):
        export_checkpoint(runs["diloco"], out, secret=b"another job's secret, 32 bytes!!")
    with pytest.raises(CheckpointRefused, match="signed with a job secret and none is set"):
        export_checkpoint(runs["diloco"], out)
    with pytest.raises(FileNotFoundError, match="tokenizer not found"):
        export_checkpoint(runs["adamw"], out, tokenizer=tmp_path / "nope.json")
    with pytest.raises(ValueError, match="is or holds .* which the export reads"):
        export_checkpoint(runs["adamw"], runs["adamw"], force=True)
    with pytest.raises(ValueError, match="lies inside checkpoint"):
        export_checkpoint(runs["adamw"], runs["adamw"] / "checkpoints" / "step_000003" / "hf")
    with pytest.raises(ValueError, match="--replica 'two'"):
        parse_replica("two")
    assert not out.exists() and _leftovers(tmp_path) == []
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not empty: .* --force"):
        export_checkpoint(runs["adamw"], out)
    assert (out / "keep.txt").read_text() == "mine"
    export_checkpoint(runs["adamw"], out, force=True)  # replaced, once complete
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


def test_a_failed_export_leaves_nothing_behind(runs, tmp_path, monkeypatch):
    import lowband.train.export as export

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(export, "for_transformers", fail)  # the tokenizer's files: after the weights
    with pytest.raises(OSError, match="disk full"):
        export.export_checkpoint(runs["adamw"], tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


def test_lowband_export_command_reports_a_bad_input(runs, tmp_path, capsys):
    from lowband.cli import main

    assert main(["export", str(tmp_path / "missing"), "--out", str(tmp_path / "hf")]) == 2
    assert "lowband export: error: " in capsys.readouterr().err
    assert main(["export", str(runs["adamw"]), "--out", str(tmp_path / "hf")]) == 0
    assert "trained by adamw, step 3 (model)" in capsys.readouterr().out


def test_export_hf_that_is_not_empty_is_refused_before_the_run(tmp_path):
    from lowband.train.config import TrainConfig

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "x").write_text("")
    cfg = TrainConfig.from_tables({"run": {"out": str(tmp_path / "run"), "export_hf": str(tmp_path / "hf")}})
    with pytest.raises(ValueError, match="exists and is not empty"):
        cfg.validate()
    cfg = TrainConfig.from_tables({"run": {"out": str(tmp_path / "run"), "export_hf": str(tmp_path / "run")}})
    with pytest.raises(ValueError, match="which the export reads"):
        cfg.validate()
