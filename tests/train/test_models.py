"""Data, tokenizer and model layer of ``lowband train`` (one process, CPU, no network)."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowband.train import data as data_mod
from lowband.train import tokenizer as tok_mod
from lowband.train.data import (
    LABEL_PAD,
    DataConfig,
    batch_indices,
    default_examples,
    epoch_of,
    load_data,
    steps_per_epoch,
    train_batch,
    val_batch_count,
    val_batches,
)
from lowband.train.data.token_cache import encode
from lowband.train.models import MODEL_SIZES, build_model, compute_loss, model_kind, transformer_blocks
from lowband.train.tokenizer import EOS_ID, PAD_ID, UNK_ID, get_tokenizer, special_ids

SRC_LEN, TGT_LEN = 128, 32


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory: pytest.TempPathFactory):
    """Keep every cache of this file in a temporary directory, and stay offline."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOWBAND_CACHE", str(tmp_path_factory.mktemp("lowband-cache")))
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def wiki() -> data_mod.Data:
    """The default corpus, seq2seq, cut to 128/32 tokens (tokenizer trained once per session), its
    validation split the share rule's (val_size=None; the default is 256 examples)."""
    return load_data(DataConfig(max_source_len=SRC_LEN, max_target_len=TGT_LEN, vocab_size=2048, val_size=None))


@pytest.fixture()
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("LOWBAND_CACHE", str(cache))
    return cache


def _corpus(n: int = 60) -> list[str]:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()
    return [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(5 + i % 9)) for i in range(n)]


# --------------------------------------------------------------------------- models


@pytest.mark.slow
def test_t5_small_matches_the_real_architecture_exactly() -> None:
    spec = build_model("t5-small", vocab_size=32128, seed=0)
    assert spec.num_params == 60_506_624
    assert spec.kind == "seq2seq"
    c = spec.config
    shape = (c.d_model, c.d_ff, c.num_layers, c.num_decoder_layers, c.num_heads, c.d_kv)
    assert shape == (512, 2048, 6, 6, 8, 64)
    assert c.feed_forward_proj == "relu" and c.tie_word_embeddings
    assert spec.model.lm_head.weight is spec.model.shared.weight
    assert (c.decoder_start_token_id, c.pad_token_id, c.eos_token_id) == (0, 0, 1)
    assert len(transformer_blocks(spec)) == 12


@pytest.mark.slow
def test_gpt_small_is_the_gpt2_124m_shape() -> None:
    spec = build_model("gpt-small", vocab_size=50257, seed=0)
    assert spec.num_params == 124_439_808  # GPT-2 124M
    assert spec.kind == "causal"
    assert len(transformer_blocks(spec.model)) == 12


def _random_batch(kind: str, vocab: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, vocab, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    ids = ids.masked_fill(mask == 0, PAD_ID)
    if kind == "seq2seq":
        labels = torch.randint(3, vocab, (2, 5), generator=gen)
        labels[0, 3:] = LABEL_PAD
    else:
        labels = ids.masked_fill(mask == 0, LABEL_PAD)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


_FULL_SIZE = ("t5-small", "gpt-small")  # 60M and 124M parameters: seconds to build


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in _FULL_SIZE else n
                                  for n in MODEL_SIZES])
def test_every_size_builds_and_trains_one_step(name: str) -> None:
    vocab = 320
    spec = build_model(name, vocab_size=vocab, seed=0)
    size = MODEL_SIZES[name]
    assert spec.kind == size.kind and spec.name == name
    assert spec.model.get_input_embeddings().weight.shape[0] == vocab
    # Counted another way: the state dict names a tied weight under each of its names; count storages.
    tensors = spec.model.state_dict(keep_vars=True)
    params = {t.data_ptr(): t.numel() for t in tensors.values() if isinstance(t, torch.nn.Parameter)}
    assert spec.num_params == sum(params.values())
    # The input embedding and the LM head are one weight (T5 also names it in encoder and decoder):
    # listed under several names, counted once.
    embedding = spec.model.get_input_embeddings().weight
    assert spec.model.get_output_embeddings().weight is embedding
    named = sum(t.numel() for t in tensors.values() if isinstance(t, torch.nn.Parameter))
    extra = named - spec.num_params
    assert extra > 0 and extra % embedding.numel() == 0
    blocks = transformer_blocks(spec)
    expected_blocks = (
        size.config["num_layers"] + size.config["num_decoder_layers"]
        if size.family == "t5"
        else size.config["n_layer"]
    )
    assert len(blocks) == expected_blocks
    assert len({type(b) for b in blocks}) <= 2  # encoder and decoder blocks

    loss = compute_loss(spec, _random_batch(spec.kind, vocab, torch.Generator().manual_seed(1)))
    assert loss.ndim == 0 and math.isfinite(loss.item())
    assert abs(loss.item() - math.log(vocab)) < 2.0  # near chance at init
    loss.backward()
    grads = [p.grad for p in spec.model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("name", ["t5-tiny", "gpt-tiny"])
def test_same_seed_same_weights_and_caller_rng_untouched(name: str) -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = build_model(name, vocab_size=300, seed=7).model.state_dict()
    assert torch.equal(torch.rand(3), expected_next)  # build_model left the global RNG alone
    b = build_model(name, vocab_size=300, seed=7).model.state_dict()
    c = build_model(name, vocab_size=300, seed=8).model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].numel() > 1)


def test_unknown_model_name_lists_sizes() -> None:
    with pytest.raises(ValueError) as err:
        build_model("t5-gigantic", vocab_size=100, seed=0)
    msg = str(err.value)
    assert "t5-gigantic" in msg and "local model directory" in msg
    for name in MODEL_SIZES:
        assert name in msg


def test_model_kind_without_building(tmp_path: Path) -> None:
    from transformers import GPT2Config

    assert model_kind("t5-mini") == "seq2seq" and model_kind("gpt-mini") == "causal"
    GPT2Config(n_embd=32, n_layer=1, n_head=2).save_pretrained(tmp_path)
    assert model_kind(tmp_path) == "causal"
    with pytest.raises(ValueError, match="t5-small"):
        model_kind("bert-base-uncased")


def test_local_directory_config_only_and_with_weights(tmp_path: Path) -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=200, d_model=32, d_ff=64, num_layers=1, num_decoder_layers=2, num_heads=2, d_kv=16,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    cfg_dir = tmp_path / "config-only"
    cfg.save_pretrained(cfg_dir)
    spec = build_model(str(cfg_dir), vocab_size=300, seed=3)
    assert spec.kind == "seq2seq" and not spec.pretrained and spec.name == str(cfg_dir)
    assert spec.config.vocab_size == 300  # a config-only model adopts the tokenizer's vocabulary
    assert spec.config.num_decoder_layers == 2 and len(transformer_blocks(spec)) == 3
    again = build_model(cfg_dir, vocab_size=300, seed=3)
    assert all(
        torch.equal(x, y) for x, y in zip(spec.model.parameters(), again.model.parameters(), strict=True)
    )
    assert math.isfinite(
        compute_loss(spec, _random_batch("seq2seq", 300, torch.Generator().manual_seed(0))).item()
    )

    torch.manual_seed(0)
    saved = T5ForConditionalGeneration(cfg)
    w_dir = tmp_path / "weights"
    saved.save_pretrained(w_dir)
    loaded = build_model(str(w_dir), vocab_size=150, seed=99)
    assert loaded.pretrained and loaded.model.training
    ref = saved.state_dict()
    got = loaded.model.state_dict()
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    with pytest.raises(ValueError, match="use the model's own tokenizer"):
        build_model(str(w_dir), vocab_size=500, seed=0)

    from transformers import GPT2Config

    gdir = tmp_path / "gpt"
    GPT2Config(n_embd=32, n_layer=3, n_head=2, vocab_size=100).save_pretrained(gdir)
    g = build_model(str(gdir), vocab_size=100, seed=0)
    assert g.kind == "causal" and len(transformer_blocks(g)) == 3

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        build_model(str(empty), vocab_size=100, seed=0)


def test_compute_loss_is_mean_over_non_padded_labels() -> None:
    spec = build_model("t5-tiny", vocab_size=300, seed=0)
    spec.model.eval()
    batch = _random_batch("seq2seq", 300, torch.Generator().manual_seed(5))
    loss = compute_loss(spec, batch)
    with torch.no_grad():
        logits = spec.model(**batch, use_cache=False).logits
    keep = batch["labels"] != LABEL_PAD
    manual = torch.nn.functional.cross_entropy(logits[keep], batch["labels"][keep])
    assert torch.allclose(loss, manual, atol=1e-5)
    assert keep.sum() == 8  # 3 + 5 target tokens


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_cache_is_reused_and_special_ids(fresh_cache: Path) -> None:
    texts = _corpus()
    before = tok_mod.train_count
    tok = get_tokenizer(texts, 300)
    assert tok_mod.train_count == before + 1
    files = list((fresh_cache / "tokenizers").glob("*.json"))
    assert len(files) == 1
    mtime = files[0].stat().st_mtime_ns
    again = get_tokenizer(list(texts), 300)
    assert tok_mod.train_count == before + 1  # not retrained
    assert files[0].stat().st_mtime_ns == mtime
    assert again.to_str() == tok.to_str()
    for t in (tok, again):
        assert (t.token_to_id("<pad>"), t.token_to_id("</s>"), t.token_to_id("<unk>")) == (0, 1, 2)
        assert special_ids(t).pad == PAD_ID and special_ids(t).eos == EOS_ID and special_ids(t).unk == UNK_ID
    assert tok.decode(tok.encode("alpha beta gamma").ids).strip() == "alpha beta gamma"
    # A different size or corpus is a different cache entry.
    get_tokenizer(texts, 310)
    get_tokenizer(texts[:-1], 300)
    assert tok_mod.train_count == before + 3
    assert len(list((fresh_cache / "tokenizers").glob("*.json"))) == 3


def test_tokenizer_training_is_deterministic_and_unigram_works(fresh_cache: Path) -> None:
    texts = _corpus(200)
    a = tok_mod.train_tokenizer(texts, 300)
    b = tok_mod.train_tokenizer(texts, 300)
    assert a.to_str() == b.to_str()
    uni = get_tokenizer(texts, 40, kind="unigram")
    assert [uni.id_to_token(i) for i in range(3)] == ["<pad>", "</s>", "<unk>"]
    with pytest.raises(ValueError, match="bpe, unigram"):
        get_tokenizer(texts, 300, kind="wordpiece")
    with pytest.raises(ValueError, match="not an existing tokenizer.json"):
        get_tokenizer("no/such/tokenizer", 300)


_RACE = """
import hashlib, sys, time
from lowband.train import tokenizer as t
from lowband.train.data import default_corpus_texts
start = time.time()
tok = t.get_tokenizer(default_corpus_texts(), 300)  # ~1 s of training: long enough to overlap
print(t.train_count, hashlib.sha256(tok.to_str().encode()).hexdigest(), start, time.time())
"""


@pytest.mark.multiprocess
def test_tokenizer_cache_is_safe_for_ranks_starting_together(tmp_path: Path) -> None:
    env = dict(os.environ, LOWBAND_CACHE=str(tmp_path))
    procs = [
        subprocess.Popen([sys.executable, "-c", _RACE], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=300)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(int(out[0]) for out in outs) == 1  # one process trained, the others waited
    assert len({out[1] for out in outs}) == 1
    starts, ends = [float(o[2]) for o in outs], [float(o[3]) for o in outs]
    assert max(starts) < min(ends)  # they really ran at the same time
    assert len(list((tmp_path / "tokenizers").glob("*.json"))) == 1
    assert not list((tmp_path / "tokenizers").glob("*.tmp"))


@pytest.mark.slow
def test_user_tokenizer_directory(tmp_path: Path, fresh_cache: Path) -> None:
    tok = tok_mod.train_tokenizer(_corpus(), 300)
    tdir = tmp_path / "mytok"
    tdir.mkdir()
    tok.save(str(tdir / "tokenizer.json"))
    assert get_tokenizer(str(tdir)).to_str() == tok.to_str()
    path = tmp_path / "pairs.jsonl"
    _write_jsonl(path, [{"source": s, "target": s.split()[0]} for s in _corpus(40)])
    data = load_data(DataConfig(path=str(path), tokenizer=str(tdir), val_size=4))
    assert data.tokenizer.to_str() == tok.to_str()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        get_tokenizer(str(tmp_path))


# --------------------------------------------------------------------------- default data


@pytest.mark.slow
def test_default_data_loads_and_splits_deterministically(wiki: data_mod.Data) -> None:
    assert wiki.kind == "seq2seq" and wiki.name == "wiki-vital-en"
    n = len(wiki.train) + len(wiki.val)
    assert 9_500 < n <= 10_033
    assert n == len(default_examples("seq2seq")[0])
    assert len(wiki.val) == 493  # val_size=None: 5 % capped at 500
    assert not set(wiki.train.source_text) & set(wiki.val.source_text)
    assert wiki.vocab_size == 2048
    again = load_data(
        DataConfig(max_source_len=SRC_LEN, max_target_len=TGT_LEN, vocab_size=2048, val_size=None), use_cache=False
    )
    assert again.val.source_text == wiki.val.source_text
    assert [a.tolist() for a in again.train.input_ids] == [a.tolist() for a in wiki.train.input_ids]
    other = load_data(
        DataConfig(max_source_len=SRC_LEN, max_target_len=TGT_LEN, vocab_size=2048, seed=1, val_size=0.1),
        use_cache=False,
    )
    assert len(other.val) == round(0.1 * n)
    assert set(other.val.source_text) != set(wiki.val.source_text)
    assert other.tokenizer.to_str() == wiki.tokenizer.to_str()  # one tokenizer whatever the split
    causal = load_data(DataConfig(kind="causal", max_len=64, vocab_size=2048, val_size=0.05))
    assert len(causal.train) + len(causal.val) == 10_033 and causal.train.target_ids is None


@pytest.mark.slow
def test_token_cache_on_disk_matches_fresh_encoding(wiki: data_mod.Data, fresh_cache: Path) -> None:
    texts = wiki.val.source_text[:50]
    fresh = encode(wiki.tokenizer, texts, 16, EOS_ID, use_cache=False)
    first = encode(wiki.tokenizer, texts, 16, EOS_ID)
    files = list((fresh_cache / "tokens").glob("*.npz"))
    assert len(files) == 1
    mtime = files[0].stat().st_mtime_ns
    second = encode(wiki.tokenizer, texts, 16, EOS_ID)
    assert files[0].stat().st_mtime_ns == mtime and not list((fresh_cache / "tokens").glob("*.tmp"))
    assert [a.tolist() for a in fresh] == [a.tolist() for a in first] == [a.tolist() for a in second]
    assert all(len(a) <= 16 and a[-1] == EOS_ID and not a.flags.writeable for a in second)
    encode(wiki.tokenizer, texts, 17, EOS_ID)  # another length: another entry
    assert len(list((fresh_cache / "tokens").glob("*.npz"))) == 2


@pytest.mark.slow
def test_truncation_and_eos(wiki: data_mod.Data) -> None:
    for split in (wiki.train, wiki.val):
        assert split.target_ids is not None
        assert max(len(s) for s in split.input_ids) == SRC_LEN
        assert max(len(t) for t in split.target_ids) <= TGT_LEN
        assert all(s[-1] == EOS_ID for s in split.input_ids)
        assert all(t[-1] == EOS_ID for t in split.target_ids)
        assert all(EOS_ID not in s[:-1] and PAD_ID not in s for s in split.input_ids[:200])
    # Untruncated text is kept for evaluation.
    assert wiki.val.target_text is not None and len(wiki.val.target_text) == len(wiki.val)


@pytest.mark.slow
def test_train_batch_is_pure_and_ranks_are_disjoint(wiki: data_mod.Data) -> None:
    world, bs = 4, 3
    per_rank = [
        train_batch(wiki, step=5, rank=r, world_size=world, batch_size=bs, seed=11) for r in range(world)
    ]
    idx = [
        batch_indices(wiki, step=5, rank=r, world_size=world, batch_size=bs, seed=11) for r in range(world)
    ]
    assert len({i for part in idx for i in part}) == world * bs
    for r in range(world):
        again = train_batch(wiki, step=5, rank=r, world_size=world, batch_size=bs, seed=11)
        assert all(torch.equal(per_rank[r][k], again[k]) for k in again)
        firsts = {
            tuple(t[: int(m.sum())].tolist())
            for t, m in zip(per_rank[r]["input_ids"], per_rank[r]["attention_mask"], strict=True)
        }
        assert firsts == {tuple(wiki.train.input_ids[i].tolist()) for i in idx[r]}
    other_seed = batch_indices(wiki, step=5, rank=0, world_size=world, batch_size=bs, seed=12)
    assert other_seed != idx[0]
    # One epoch visits every example at most once; the next epoch is a new permutation.
    n, spe = 50, steps_per_epoch(50, world_size=2, batch_size=4)
    assert spe == 6
    seen = [
        i
        for s in range(spe)
        for r in range(2)
        for i in batch_indices(n, step=s, rank=r, world_size=2, batch_size=4, seed=0)
    ]
    assert len(seen) == len(set(seen)) == 48
    assert epoch_of(spe - 1, data=n, world_size=2, batch_size=4) == 0
    assert epoch_of(spe, data=n, world_size=2, batch_size=4) == 1
    assert batch_indices(n, step=spe, rank=0, world_size=2, batch_size=4, seed=0) != batch_indices(
        n, step=0, rank=0, world_size=2, batch_size=4, seed=0
    )
    assert steps_per_epoch(wiki, world_size=1, batch_size=8) == len(wiki.train) // 8
    with pytest.raises(ValueError, match="fewer than one global batch"):
        steps_per_epoch(5, world_size=2, batch_size=4)
    with pytest.raises(ValueError, match="rank"):
        train_batch(wiki, step=0, rank=4, world_size=4, batch_size=2, seed=0)


@pytest.mark.slow
def test_padding_masks_and_labels(wiki: data_mod.Data) -> None:
    b = train_batch(wiki, step=0, rank=0, world_size=1, batch_size=16, seed=0)
    ids, mask, labels = b["input_ids"], b["attention_mask"], b["labels"]
    assert ids.dtype == mask.dtype == labels.dtype == torch.long
    lengths = mask.sum(1)
    assert ids.shape[1] == int(lengths.max())  # dynamic padding to the longest
    assert (ids[mask == 0] == PAD_ID).all()
    assert (mask[:, :-1] >= mask[:, 1:]).all()  # right padding
    label_lengths = (labels != LABEL_PAD).sum(1)
    assert labels.shape[1] == int(label_lengths.max()) <= TGT_LEN
    for row, n in zip(labels, label_lengths, strict=True):
        assert (row[:n] >= 0).all() and (row[n:] == LABEL_PAD).all() and row[n - 1] == EOS_ID
    assert (label_lengths < labels.shape[1]).any()  # some padding was checked

    causal = load_data(DataConfig(kind="causal", max_len=48, vocab_size=2048))
    c = train_batch(causal, step=0, rank=0, world_size=1, batch_size=16, seed=0)
    assert c["input_ids"].shape[1] <= 48
    assert torch.equal(c["labels"], c["input_ids"].masked_fill(c["attention_mask"] == 0, LABEL_PAD))


@pytest.mark.slow
def test_val_batches_cover_validation_once(wiki: data_mod.Data) -> None:
    batches = list(val_batches(wiki, batch_size=64))
    assert len(batches) == val_batch_count(wiki, batch_size=64) == 8
    assert sum(b["input_ids"].shape[0] for b in batches) == len(wiki.val)
    assert batches[-1]["input_ids"].shape[0] == 493 - 7 * 64
    for b in batches:
        assert b["input_ids"].shape[1] == int(b["attention_mask"].sum(1).max())
    assert len(list(val_batches(wiki, batch_size=64, max_batches=3))) == 3
    sharded = [list(val_batches(wiki, batch_size=64, rank=r, world_size=3)) for r in range(3)]
    assert [len(s) for s in sharded] == [3, 3, 2]
    assert torch.equal(sharded[1][0]["input_ids"], batches[1]["input_ids"])


@pytest.mark.slow
def test_tiny_t5_learns_on_default_data(wiki: data_mod.Data) -> None:
    torch.manual_seed(0)
    spec = build_model("t5-tiny", vocab_size=wiki.vocab_size, seed=0)
    opt = torch.optim.AdamW(spec.model.parameters(), lr=3e-3)
    batch = train_batch(wiki, step=0, rank=0, world_size=1, batch_size=4, seed=0)
    losses = []
    for _ in range(25):
        loss = compute_loss(spec, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


# --------------------------------------------------------------------------- user files


def _write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_user_jsonl_csv_tsv_and_text(tmp_path: Path, fresh_cache: Path) -> None:
    texts = _corpus(40)
    rows = [{"doc": t, "summary": t.split()[0], "text": t} for t in texts]
    rows.append({"doc": "", "summary": "dropped: empty source", "text": ""})
    jl = tmp_path / "train.jsonl"
    _write_jsonl(jl, rows)
    d = load_data(
        DataConfig(path=str(jl), source_column="doc", target_column="summary", val_size=5, vocab_size=300)
    )
    assert len(d.train) == 35 and len(d.val) == 5
    assert set(d.val.source_text) | set(d.train.source_text) == set(texts)
    assert d.vocab_size <= 300 and special_ids(d.tokenizer).eos == EOS_ID
    assert d.tokenizer.decode(d.val.target_ids[0][:-1]).strip() == d.val.target_text[0]

    cs = tmp_path / "train.csv"
    with cs.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["source", "target"])
        for t in texts:
            w.writerow([t + ", with a comma", t.split()[-1]])
    c = load_data(DataConfig(path=str(cs), val_size=0.25, vocab_size=300, max_source_len=6))
    assert len(c.train) == 30 and len(c.val) == 10
    assert max(len(s) for s in c.train.input_ids) == 6
    assert c.train.source_text[0].endswith(", with a comma")

    ts = tmp_path / "train.tsv"
    ts.write_text("source\ttarget\n" + "".join(f"{t}\t{t.split()[1]}\n" for t in texts), encoding="utf-8")
    assert len(load_data(DataConfig(path=str(ts), val_size=4, vocab_size=300)).train) == 36

    tx = tmp_path / "corpus.txt"
    tx.write_text("\n".join(texts[:20]) + "\n\n" + "\n".join(texts[20:]) + "\n", encoding="utf-8")
    t = load_data(DataConfig(path=str(tx), kind="causal", val_size=4, max_len=8, vocab_size=300))
    assert len(t.train) + len(t.val) == 40 and t.kind == "causal"
    assert all(len(s) <= 8 and s[-1] == EOS_ID for s in t.train.input_ids)
    jc = load_data(DataConfig(path=str(jl), kind="causal", val_size=4, vocab_size=300))
    assert len(jc.train) + len(jc.val) == 40

    vpath = tmp_path / "val.jsonl"
    _write_jsonl(vpath, [{"source": "a b c", "target": "a"}, {"source": "d e", "target": "d"}])
    tv = tmp_path / "t.jsonl"
    _write_jsonl(tv, [{"source": s, "target": s.split()[0]} for s in texts])
    sep = load_data(DataConfig(path=str(tv), val_path=str(vpath), vocab_size=300))
    assert len(sep.train) == 40 and sep.val.source_text == ["a b c", "d e"]


def test_user_file_errors_say_what_to_do(tmp_path: Path, fresh_cache: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_data(DataConfig(path=str(missing)))

    jl = tmp_path / "d.jsonl"
    _write_jsonl(jl, [{"article": t, "summary": t[:5]} for t in _corpus(10)])
    with pytest.raises(ValueError) as err:
        load_data(DataConfig(path=str(jl)))
    msg = str(err.value)
    assert "'source'" in msg and "article" in msg and "summary" in msg and "source_column" in msg
    with pytest.raises(ValueError, match="target column 'tgt'.*article, summary"):
        load_data(DataConfig(path=str(jl), source_column="article", target_column="tgt"))
    with pytest.raises(ValueError, match="text column 'text'"):
        load_data(DataConfig(path=str(jl), kind="causal"))

    bad = tmp_path / "d.parquet"
    bad.write_bytes(b"x")
    with pytest.raises(ValueError) as err:
        load_data(DataConfig(path=str(bad)))
    assert ".parquet" in str(err.value) and ".jsonl" in str(err.value) and ".csv" in str(err.value)

    txt = tmp_path / "d.txt"
    txt.write_text("one line\n", encoding="utf-8")
    with pytest.raises(ValueError, match="causal"):
        load_data(DataConfig(path=str(txt)))

    small = tmp_path / "small.jsonl"
    _write_jsonl(small, [{"source": "a", "target": "b"}] * 3)
    with pytest.raises(ValueError, match="val_size"):
        load_data(DataConfig(path=str(small), val_size=3))
    with pytest.raises(ValueError, match="seq2seq, causal"):
        DataConfig(kind="classification")
