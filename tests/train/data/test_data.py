"""lowband/train/data/ (load, batching, token_cache, sources): the default corpus and its splits, the token cache, truncation, batches (pure, disjoint ranks, padding, validation once), a user's files, and a tiny T5 that learns on the default data.

The tests share one loaded corpus (the module-scoped ``wiki`` fixture), hence one file for the package."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from lowband.train import data as data_mod
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
from lowband.train.models import build_model, compute_loss
from lowband.train.tokenizer import EOS_ID, PAD_ID, special_ids
from tests.train.corpus import corpus, write_jsonl

SRC_LEN, TGT_LEN = 128, 32


@pytest.fixture(scope="module")
def wiki() -> data_mod.Data:
    """The default corpus, seq2seq, cut to 128/32 tokens (tokenizer trained once per session), its
    validation split the share rule's (val_size=None; the default is 256 examples)."""
    return load_data(DataConfig(max_source_len=SRC_LEN, max_target_len=TGT_LEN, vocab_size=2048, val_size=None))


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
    causal = load_data(DataConfig(kind="causal", max_len=64, vocab_size=2048, val_size=0.05, packing="lines"))
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


def test_user_jsonl_csv_tsv_and_text(tmp_path: Path, fresh_cache: Path) -> None:
    texts = corpus(40)
    rows = [{"doc": t, "summary": t.split()[0], "text": t} for t in texts]
    rows.append({"doc": "", "summary": "dropped: empty source", "text": ""})
    jl = tmp_path / "train.jsonl"
    write_jsonl(jl, rows)
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
    t = load_data(DataConfig(path=str(tx), kind="causal", val_size=4, max_len=8, vocab_size=300, packing="lines"))
    assert len(t.train) + len(t.val) == 40 and t.kind == "causal"
    assert all(len(s) <= 8 and s[-1] == EOS_ID for s in t.train.input_ids)
    jc = load_data(DataConfig(path=str(jl), kind="causal", val_size=4, vocab_size=300, packing="lines"))
    assert len(jc.train) + len(jc.val) == 40

    vpath = tmp_path / "val.jsonl"
    write_jsonl(vpath, [{"source": "a b c", "target": "a"}, {"source": "d e", "target": "d"}])
    tv = tmp_path / "t.jsonl"
    write_jsonl(tv, [{"source": s, "target": s.split()[0]} for s in texts])
    sep = load_data(DataConfig(path=str(tv), val_path=str(vpath), vocab_size=300))
    assert len(sep.train) == 40 and list(sep.val.source_text) == ["a b c", "d e"]


def test_user_file_errors_say_what_to_do(tmp_path: Path, fresh_cache: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_data(DataConfig(path=str(missing)))

    jl = tmp_path / "d.jsonl"
    write_jsonl(jl, [{"article": t, "summary": t[:5]} for t in corpus(10)])
    with pytest.raises(ValueError) as err:
        load_data(DataConfig(path=str(jl)))
    msg = str(err.value)
    assert "'source'" in msg and "article" in msg and "summary" in msg and "source_column" in msg
    with pytest.raises(ValueError, match="target column 'tgt'.*article, summary"):
        load_data(DataConfig(path=str(jl), source_column="article", target_column="tgt"))
    with pytest.raises(ValueError, match="text column 'text'"):
        load_data(DataConfig(path=str(jl), kind="causal"))

    bad = tmp_path / "d.xlsx"
    bad.write_bytes(b"x")
    with pytest.raises(ValueError) as err:
        load_data(DataConfig(path=str(bad)))
    assert ".xlsx" in str(err.value) and ".jsonl" in str(err.value) and ".parquet" in str(err.value)
    broken = tmp_path / "d.parquet"
    broken.write_bytes(b"x")
    with pytest.raises(ValueError, match="could not read .*d.parquet as Parquet"):
        load_data(DataConfig(path=str(broken)))

    txt = tmp_path / "d.txt"
    txt.write_text("one line\n", encoding="utf-8")
    with pytest.raises(ValueError, match="causal"):
        load_data(DataConfig(path=str(txt)))

    small = tmp_path / "small.jsonl"
    write_jsonl(small, [{"source": "a", "target": "b"}] * 3)
    with pytest.raises(ValueError, match="val_size"):
        load_data(DataConfig(path=str(small), val_size=3))
    with pytest.raises(ValueError, match="seq2seq, causal"):
        DataConfig(kind="classification")


def test_every_seed_of_a_run_is_validated_on_the_same_split(monkeypatch):
    """The run's seed draws the init, the data order and dropout, not the validation documents: a bench's
    seed spread is the training's noise (a spread over validation sets once hid a method's gap)."""
    import lowband.train.loop as loop_mod
    from lowband.train.config import TrainConfig
    from lowband.train.loop import Trainer

    seen = []

    class Loaded(Exception):
        pass

    def load(cfg):
        seen.append(cfg)
        raise Loaded

    monkeypatch.setattr(loop_mod, "load_data", load)  # the name the trainer calls
    for seed in (0, 3):
        t = Trainer.__new__(Trainer)
        t.cfg = TrainConfig.from_tables({"run": {"seed": seed}, "model": {"name": "t5-tiny"}})
        with pytest.raises(Loaded):
            t._build_model()
    assert seen[0] == seen[1] and seen[0].seed == 0
