"""lowband/train/pretrained.py and the model resolution of lowband/train/models.py: a pretrained model trains on its
own tokenizer by default; a --tokenizer that does not fit it, an unknown hub id, a directory without a config are
refused with errors that name the problem and the fix (one process, no network)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lowband.train.data import DataConfig, collate, load_data
from lowband.train.methods import METHODS
from lowband.train.models import build_model, resolve_model
from lowband.train.pretrained import check_tokenizer, data_config_for
from lowband.train.tokenizer import get_tokenizer
from tests.train.pretrained_models import (
    FAMILIES,
    pairs,
    save_pretrained_model,
    texts,
    write_causal,
    write_seq2seq,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pretrained")
    out = {family: save_pretrained_model(root / family, family) for family in FAMILIES}
    out["causal-data"] = write_causal(root / "train.txt", 24)
    out["seq2seq-data"] = write_seq2seq(root / "train.jsonl", 24)
    return out


@pytest.fixture()
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face hub cache of this test's own (the machine's is never looked at)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def _cache_snapshot(cache: Path, repo_id: str, model_dir: Path, files: list[str]) -> Path:
    """``files`` of ``model_dir`` laid out in ``cache`` as huggingface_hub caches a download of ``repo_id``."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name in files:
        shutil.copy(model_dir / name, snapshot / name)
    return snapshot


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_with_weights_trains_on_its_own_tokenizer_by_default(saved, family: str) -> None:
    from transformers import AutoTokenizer

    model_dir = saved[family]
    kind = "seq2seq" if family == "t5" else "causal"
    data_file = saved[f"{kind}-data"]
    cfg = data_config_for(str(model_dir), DataConfig(path=str(data_file), val_size=4, packing="lines"))
    assert cfg.kind == kind and cfg.tokenizer == str(model_dir)
    data = load_data(cfg)
    own = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    assert data.vocab_size == len(own)
    pad = own.pad_token_id if own.pad_token_id is not None else own.eos_token_id  # no pad token: pad with eos
    assert (data.special.eos, data.special.pad, data.special.bos) == (own.eos_token_id, pad, own.bos_token_id)
    # The ids are the model's own tokenizer's (each text, then its eos), not a tokenizer trained on the data.
    lengths = [len(x) for x in data.train.input_ids]
    batch = collate(data, data.train, [lengths.index(min(lengths)), lengths.index(max(lengths))])
    for i, example in enumerate(data.train.input_ids[:3]):
        expected = own(data.train.source_text[i], add_special_tokens=False).input_ids + [own.eos_token_id]
        assert example.tolist() == expected
    padded = batch["attention_mask"] == 0
    assert padded.any() and (batch["input_ids"][padded] == pad).all()
    if kind == "causal":
        assert (batch["labels"][padded] == -100).all()
    spec = build_model(str(model_dir), vocab_size=data.vocab_size, seed=123, special=data.special)
    assert spec.pretrained and spec.kind == kind
    from safetensors.torch import load_file

    saved_weights = load_file(str(model_dir / "model.safetensors"))
    state = spec.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved_weights.items())  # loaded, not initialised from the seed


def test_an_older_saved_model_without_tokenizer_json_uses_its_vocab_and_merges(saved, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    older = tmp_path / "older-gpt2"
    older.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(saved["gpt2"] / name, older / name)
    Tokenizer.from_file(str(saved["gpt2"] / "tokenizer.json")).model.save(str(older))  # vocab.json, merges.txt
    cfg = data_config_for(str(older), DataConfig(path=str(saved["causal-data"]), val_size=4, packing="lines"))
    assert cfg.tokenizer == str(older)
    data, reference = load_data(cfg), load_data(data_config_for(str(saved["gpt2"]), cfg))
    assert data.special == reference.special and data.special.eos == 340  # <|endoftext|>, GPT2Tokenizer's own
    assert all(a.tolist() == b.tolist() for a, b in zip(data.train.input_ids, reference.train.input_ids, strict=True))


def test_a_tokenizer_of_another_vocabulary_is_refused_naming_both(saved, tmp_path: Path) -> None:
    model_dir = saved["gpt2"]
    # The case: a tokenizer trained on the data, of another size and other ids.
    trained = get_tokenizer(texts(200), 300)
    path = tmp_path / "trained.json"
    trained.save(str(path))
    with pytest.raises(ValueError) as err:
        data_config_for(str(model_dir), DataConfig(path=str(saved["causal-data"]), tokenizer=str(path)))
    msg = str(err.value)
    assert f"--tokenizer {path} ({trained.get_vocab_size()} entries" in msg
    assert f"pretrained model {model_dir} (341 embedding rows" in msg
    assert "vocabulary is not the model's own tokenizer's (341 entries" in msg
    assert "its eos is 1, the model's 340" in msg
    assert f"leave --tokenizer out to train with the model's own tokenizer (in {model_dir})" in msg
    # The same refusal before a trainer starts anything.
    from lowband.train.config import TrainConfig
    from lowband.train.loop import Trainer

    cfg = TrainConfig.from_tables({"model": {"name": str(model_dir)},
                                   "data": {"path": str(saved["causal-data"]), "tokenizer": str(path)},
                                   "run": {"out": str(tmp_path / "out")}})
    with pytest.raises(ValueError, match="does not fit the pretrained model"):
        Trainer(cfg)
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_with_other_special_ids_is_refused_and_the_same_one_elsewhere_is_taken(saved, tmp_path) -> None:
    from transformers import AutoTokenizer

    model_dir = saved["llama"]
    own = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    # Another copy of the model's own tokenizer, in another directory: it fits.
    same = tmp_path / "same"
    own.save_pretrained(same)
    check_tokenizer(same, str(model_dir))
    assert data_config_for(str(model_dir), DataConfig(tokenizer=str(same), kind="causal")).tokenizer == str(same)
    # The same vocabulary with another eos (the unknown token's id) is refused, naming the ids.
    other = tmp_path / "other-eos"
    own.save_pretrained(other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["eos_token"] = "<unk>"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        check_tokenizer(other, str(model_dir))
    msg = str(err.value)
    assert f"--tokenizer {other} (340 entries; eos 0, bos 1" in msg and "its eos is 0, the model's 2" in msg
    assert "vocabulary" not in msg.split("):", 1)[1]  # the vocabulary itself is the model's
    # A model without weights takes any tokenizer: it is trained from scratch on it.
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(model_dir / "config.json", config_only / "config.json")
    check_tokenizer(other, str(config_only))


def test_a_model_without_a_tokenizer_needs_one_that_fits_its_embedding(saved, tmp_path: Path) -> None:
    bare = tmp_path / "weights-only"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(saved["gpt2"] / name, bare / name)
    with pytest.raises(ValueError, match="has weights but no tokenizer .* --tokenizer PATH"):
        data_config_for(str(bare), DataConfig(kind="causal"))
    check_tokenizer(saved["gpt2"], str(bare))  # the tokenizer it was trained with: 341 entries, eos 340
    # Without a tokenizer to compare vocabularies with, the size and the special ids are checked: a tokenizer
    # larger than the embedding is refused, and so is one that fits it with another eos.
    large, small = tmp_path / "large.json", tmp_path / "small.json"
    tok = get_tokenizer(texts(200), 300)
    tok.save(str(small))
    tok.add_tokens([f"extra{i}" for i in range(400 - tok.get_vocab_size())])
    tok.save(str(large))
    with pytest.raises(ValueError) as err:
        check_tokenizer(large, str(bare))
    assert "its 400 entries do not fit the model's 341 embedding rows" in str(err.value)
    assert "pass the tokenizer this model was trained with" in str(err.value)
    with pytest.raises(ValueError) as err:
        check_tokenizer(small, str(bare))
    assert "its eos is 1, the model's 340" in str(err.value) and "entries do not fit" not in str(err.value)


def test_an_unknown_hub_id_is_not_downloaded_and_the_error_says_how_to_get_it(hub_cache: Path) -> None:
    with pytest.raises(FileNotFoundError) as err:
        resolve_model("nobody-here/no-such-model")
    msg = str(err.value)
    assert "'nobody-here/no-such-model' is not a named size or a local directory, and it is not in the local " \
           f"Hugging Face cache ({hub_cache}); lowband downloads nothing" in msg
    assert "`hf download nobody-here/no-such-model`" in msg and "local directory" in msg
    # A bare word that is no size is most likely a mistyped size: the sizes are listed.
    with pytest.raises(ValueError, match="unknown model 'gpt-tinyy'; named sizes: t5-tiny"):
        resolve_model("gpt-tinyy")


def test_a_hub_id_in_the_local_cache_is_used_offline(saved, hub_cache: Path) -> None:
    files = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    snapshot = _cache_snapshot(hub_cache, "tiny-org/tiny-gpt2", saved["gpt2"], files)
    source = resolve_model("tiny-org/tiny-gpt2")
    assert source.path == snapshot and source.hub_id == "tiny-org/tiny-gpt2" and source.has_weights
    cfg = data_config_for("tiny-org/tiny-gpt2", DataConfig(path=str(saved["causal-data"])))
    assert cfg.kind == "causal" and cfg.tokenizer == str(snapshot)
    assert build_model("tiny-org/tiny-gpt2", vocab_size=341, seed=0).pretrained
    # Only the config cached (a partial download): refused, not trained from a random start.
    _cache_snapshot(hub_cache, "tiny-org/config-only", saved["gpt2"], ["config.json"])
    with pytest.raises(FileNotFoundError, match="its config.json and weights are not"):
        resolve_model("tiny-org/config-only")


def test_bad_model_paths_are_refused_with_what_a_model_directory_needs(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="is a directory without config.json; a model directory needs one"):
        resolve_model(str(empty))
    afile = tmp_path / "model.safetensors"
    afile.write_bytes(b"")
    with pytest.raises(ValueError, match="is a file; give a model directory"):
        resolve_model(str(afile))


# --------------------------------------------------------------------------- fine-tuning on 2 nodes × 2 ranks
#: (model directory name, family, methods): each family with FlexDeMo and DiLoCo, the Llama with every method; a
#: Llama with tied embeddings (as Qwen-style configs have), through the row-sharded tied embedding, with FlexDeMo.
_RUNS = (("gpt2", "gpt2", ("flexdemo", "diloco")), ("llama", "llama", tuple(METHODS)),
         ("t5", "t5", ("flexdemo", "diloco")), ("llama-tied", "llama", ("flexdemo",)))
_WORLD, _BATCH, _MAX_LEN = 4, 2, 64


def _finetune(rank: int, root: str, cache: str) -> dict:
    import os

    os.environ["LOWBAND_CACHE"] = cache
    from lowband.train.config import TrainConfig
    from lowband.train.loop import Trainer

    out = {}
    for name, family, methods in _RUNS:
        ext = "jsonl" if family == "t5" else "txt"
        for method in methods:
            t = Trainer(TrainConfig.from_tables({
                "method": {"name": method, **({"H": 2} if METHODS[method].family == "local" else {})},
                "model": {"name": f"{root}/{name}"}, "schedule": {"steps": 2, "batch_size": _BATCH},
                "data": {"path": f"{root}/train.{ext}", "val_path": f"{root}/val.{ext}", "packing": "lines",
                         "max_len": _MAX_LEN},
                "run": {"val_batches": 1, "progress": False, "out": f"{root}/runs/{name}-{method}"},
            }))  # fmt: skip
            losses: list[float] = []
            step = t.train_step
            t.train_step = lambda s, step=step, losses=losses: losses.append(step(s)) or losses[-1]
            summary = t.run()
            out[f"{name}/{method}"] = {"losses": losses, "val": [v["val_loss"] for v in summary.val_history],
                                       "pretrained": t.spec.pretrained, "vocab": t.data.vocab_size}
    return out


def _own_loss(model_dir: Path, family: str, examples: list, *, max_len: int) -> float:
    """The saved model's own loss, by transformers, on ``examples`` tokenised by its own tokenizer as lowband cuts
    data (each text truncated, then its eos; padding masked)."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)

    def ids(text: str, limit: int) -> list[int]:
        return tok(text, add_special_tokens=False).input_ids[: limit - 1] + [tok.eos_token_id]

    def pad(rows: list[list[int]], value: int) -> torch.Tensor:
        width = max(len(r) for r in rows)
        return torch.tensor([r + [value] * (width - len(r)) for r in rows])

    if family == "t5":
        sources = [ids(e["source"], 128) for e in examples]
        inputs = {"input_ids": pad(sources, 0), "attention_mask": pad([[1] * len(r) for r in sources], 0),
                  "labels": pad([ids(e["target"], 32) for e in examples], -100)}
        model = AutoModelForSeq2SeqLM.from_pretrained(str(model_dir), local_files_only=True)
    else:
        rows = [ids(text, max_len) for text in examples]
        mask = pad([[1] * len(r) for r in rows], 0)
        input_ids = pad(rows, tok.eos_token_id)
        inputs = {"input_ids": input_ids, "attention_mask": mask, "labels": input_ids.masked_fill(mask == 0, -100)}
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True)
    with torch.no_grad():
        return float(model.eval()(**inputs).loss)


@pytest.mark.multiprocess
def test_a_pretrained_model_of_each_family_fine_tunes_on_its_own_tokenizer(tmp_path, tmp_path_factory) -> None:
    """Each family's saved model fine-tunes with FlexDeMo and with DiLoCo (the Llama with every method) on 2 nodes × 2
    ranks, and every rank's first training loss is the saved model's own loss, by transformers, on that rank's batch
    tokenised by the model's own tokenizer: the data's ids are the ones the weights were trained on."""
    import math

    from lowband.testing.ranks import run_ranks
    from lowband.train.data import batch_indices

    for name, family, _ in _RUNS:
        save_pretrained_model(tmp_path / name, family, tie=name.endswith("tied"), pretrain_steps=30)
    n_train = 24
    write_causal(tmp_path / "train.txt", n_train)
    write_causal(tmp_path / "val.txt", 4, offset=100)
    write_seq2seq(tmp_path / "train.jsonl", n_train)
    write_seq2seq(tmp_path / "val.jsonl", 4, offset=100)
    cache = str(tmp_path_factory.getbasetemp() / "lowband-cache")
    results = run_ranks(_finetune, world_size=_WORLD, ranks_per_node=2, args=(str(tmp_path), cache), timeout_s=300)

    from transformers import AutoTokenizer

    for name, family, methods in _RUNS:
        data = pairs(n_train) if family == "t5" else texts(n_train)
        vocab = len(AutoTokenizer.from_pretrained(str(tmp_path / name), local_files_only=True))
        for rank, by_run in enumerate(results):
            # The first step's batch of this rank (the same for every method: the data order is the seed's).
            examples = [data[i] for i in batch_indices(n_train, step=0, rank=rank, world_size=_WORLD,
                                                       batch_size=_BATCH, seed=0)]
            own = _own_loss(tmp_path / name, family, examples, max_len=_MAX_LEN)
            assert own < 0.6 * math.log(vocab), (name, own)  # the weights know these ids: far below chance
            for method in methods:
                r = by_run[f"{name}/{method}"]
                assert r["pretrained"] and r["vocab"] == vocab, (name, method, r)
                assert r["losses"][0] == pytest.approx(own, rel=1e-5), (name, method, rank, r["losses"], own)
                assert len(r["losses"]) == 2 and all(math.isfinite(v) for v in r["losses"] + r["val"])
