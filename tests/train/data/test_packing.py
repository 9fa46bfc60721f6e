"""Packing causal text into blocks (lowband/train/data/packing.py, load.py, token_cache.py), the real-token
count of a batch, and the data-size guard (the passes a run makes over its data), on small made-up files."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from lowband.train.data import (
    LABEL_PAD,
    DataConfig,
    collate,
    describe,
    load_data,
    passes_note,
    passes_over_data,
    real_tokens,
    train_batch,
    training_examples,
    val_batches,
)
from lowband.train.data.packing import pack
from lowband.train.data.token_cache import encode
from lowband.train.tokenizer import EOS_ID, PAD_ID
from tests.train.corpus import corpus, write_jsonl

MAX_LEN = 16


def _txt(tmp_path: Path, n: int = 60) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(corpus(n)) + "\n", encoding="utf-8")
    return path


def test_pack_joins_documents_with_eos_and_drops_the_remainder() -> None:
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]  # 3+1 + 2+1 + 4+1 + 1+1 = 14 tokens
    flat, offsets = pack(docs, 4, eos=0)
    assert offsets.tolist() == [0, 4, 8, 12]  # 3 full blocks; the last 2 tokens ([10, eos]) dropped
    assert flat.reshape(3, 4).tolist() == [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]]
    assert flat.dtype == np.int32 and offsets.dtype == np.int64
    assert pack([[1]], 4, eos=0)[0].size == 0  # too little for one block: none
    with pytest.raises(ValueError, match="at least 2"):
        pack(docs, 1, eos=0)


def test_packed_text_is_full_blocks_split_before_packing(tmp_path: Path, fresh_cache: Path) -> None:
    path = _txt(tmp_path)
    lines = DataConfig(path=str(path), kind="causal", val_size=10, max_len=64, vocab_size=300, packing="lines")
    packed = load_data(DataConfig(path=str(path), kind="causal", val_size=10, max_len=MAX_LEN, vocab_size=300))
    assert packed.config.packing == "blocks" and packed.packed  # the default for causal text
    by_line = load_data(lines)
    assert not by_line.packed and len(by_line.train) == 50 and len(by_line.val) == 10  # line mode as before
    # The same documents on each side (split first), packed each on its own: no block straddles.
    assert list(packed.train.source_text) == list(by_line.train.source_text)
    assert list(packed.val.source_text) == list(by_line.val.source_text)
    for split, line_split in ((packed.train, by_line.train), (packed.val, by_line.val)):
        assert len(split) >= 1 and all(len(b) == MAX_LEN for b in split.input_ids)
        stream = np.concatenate(split.input_ids)
        assert PAD_ID not in stream
        # The stream is the documents whole (untruncated: none reaches 64 tokens), each ended by
        # </s>, in order, cut after the last full block.
        assert max(len(x) for x in line_split.input_ids) < 64
        whole = np.concatenate(line_split.input_ids)
        assert len(whole) - MAX_LEN < len(stream) <= len(whole) and (stream == whole[: len(stream)]).all()
    # Batches: no padding at all, labels are the inputs.
    b = train_batch(packed, step=0, rank=0, world_size=2, batch_size=3, seed=0)
    assert b["input_ids"].shape == (3, MAX_LEN) and bool(b["attention_mask"].all())
    assert torch.equal(b["labels"], b["input_ids"])
    v = next(val_batches(packed, batch_size=4))
    assert v["input_ids"].shape[1] == MAX_LEN and bool(v["attention_mask"].all())
    d = describe(packed)
    assert d["packing"] == "blocks" and d["train_documents"] == 50 and d["mean_input_tokens"] == MAX_LEN
    assert max(len(x) for x in by_line.train.input_ids) > MAX_LEN  # documents longer than a block, too
    assert training_examples(lines) == 50 and training_examples(packed.config) == len(packed.train)


def test_documents_longer_than_a_block_span_blocks(tmp_path: Path, fresh_cache: Path) -> None:
    path = tmp_path / "long.jsonl"
    texts = [" ".join(corpus(30)[i:i + 6]) for i in range(20)]  # ~40 words each: several blocks
    write_jsonl(path, [{"body": t} for t in texts])
    d = load_data(DataConfig(path=str(path), kind="causal", text_column="body", val_size=4, max_len=8, vocab_size=300))
    ids = d.tokenizer.encode(d.train.source_text[0], add_special_tokens=False).ids
    assert len(ids) > 8
    first = np.concatenate(d.train.input_ids)[: len(ids) + 1]
    assert first[:-1].tolist() == ids and first[-1] == EOS_ID  # untruncated, then </s>


def test_seq2seq_pairs_are_not_packed(tmp_path: Path, fresh_cache: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    write_jsonl(path, [{"source": t, "target": t.split()[0]} for t in corpus(30)])
    d = load_data(DataConfig(path=str(path), val_size=5, vocab_size=300, packing="blocks"))
    assert not d.packed and len(d.train) == 25 and describe(d)["packing"] is None


def test_too_little_text_for_one_block_says_what_to_do(tmp_path: Path, fresh_cache: Path) -> None:
    path = _txt(tmp_path, 12)
    with pytest.raises(ValueError, match="validation document.*--packing lines"):
        load_data(DataConfig(path=str(path), kind="causal", val_size=1, max_len=64, vocab_size=300))
    with pytest.raises(ValueError, match="packing"):
        DataConfig(kind="causal", packing="documents")


def test_token_cache_key_differs_by_packing(tmp_path: Path, fresh_cache: Path) -> None:
    d = load_data(DataConfig(path=str(_txt(tmp_path)), kind="causal", val_size=10, max_len=MAX_LEN, vocab_size=300,
                             packing="lines"))
    texts = d.train.source_text
    cache = fresh_cache / "tokens"
    before = set(cache.glob("*.npz"))
    by_line = encode(d.tokenizer, texts, MAX_LEN, EOS_ID)
    assert len(set(cache.glob("*.npz")) - before) <= 1  # (loading may have written it already)
    n_files = len(list(cache.glob("*.npz")))
    blocks = encode(d.tokenizer, texts, MAX_LEN, EOS_ID, packed=True)
    assert len(list(cache.glob("*.npz"))) == n_files + 1  # same texts and length, another mode: another entry
    again = encode(d.tokenizer, texts, MAX_LEN, EOS_ID, packed=True)  # read back from the cache
    fresh = encode(d.tokenizer, texts, MAX_LEN, EOS_ID, packed=True, use_cache=False)
    assert [a.tolist() for a in again] == [a.tolist() for a in blocks] == [a.tolist() for a in fresh]
    assert len(by_line) == len(texts) and len(blocks) >= 1 and all(len(b) == MAX_LEN for b in blocks)


def test_real_tokens_exclude_padding(tmp_path: Path, fresh_cache: Path) -> None:
    path = _txt(tmp_path)
    by_line = load_data(DataConfig(path=str(path), kind="causal", val_size=10, max_len=MAX_LEN, vocab_size=300,
                                   packing="lines"))
    lengths = [len(x) for x in by_line.train.input_ids]
    batch = [int(np.argmin(lengths)), int(np.argmax(lengths)), 0, 1]  # the shortest beside the longest: padded
    b = collate(by_line, by_line.train, batch)
    real = sum(lengths[i] for i in batch)
    assert b["input_ids"].numel() > real  # this batch is padded ...
    assert real_tokens(b, kind="causal") == real  # ... and padding is not counted
    packed = load_data(DataConfig(path=str(path), kind="causal", val_size=10, max_len=MAX_LEN, vocab_size=300))
    pb = collate(packed, packed.train, [0, 1, 2, 3])
    assert real_tokens(pb, kind="causal") == pb["input_ids"].numel() == 4 * MAX_LEN
    s2s = {"input_ids": torch.tensor([[5, 6, 1], [7, 1, 0]]), "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
           "labels": torch.tensor([[8, 1], [1, LABEL_PAD]])}
    assert real_tokens(s2s, kind="seq2seq") == 5 + 3  # inputs and targets, padding of each left out


def test_passes_note_states_the_passes_before_training() -> None:
    # The case: 300 steps of a global batch of 32 on 5,443 training pairs.
    assert passes_over_data(5443, steps=300, world_size=4, batch_size=8) == pytest.approx(1.7637, abs=1e-4)
    note = passes_note(5443, steps=300, world_size=4, batch_size=8, name="pairs.jsonl")
    assert note is not None
    assert "1.76 passes (epochs)" in note and "read 1.76 times" in note
    assert "300 steps × a global batch of 32 (4 rank(s) × batch size 8) = 9,600 examples" in note
    assert "over 5,443 training examples of pairs.jsonl" in note and "every 170 steps" in note
    accum = passes_note(5443, steps=300, world_size=4, batch_size=4, grad_accum=2)
    assert accum is not None and "× grad accum 2" in accum and "1.76 passes" in accum
    assert passes_note(9600, steps=300, world_size=4, batch_size=8) is None  # exactly one pass: nothing to say
    assert passes_note(20_000, steps=300, world_size=4, batch_size=8) is None


def test_passes_note_counts_packed_blocks(tmp_path: Path, fresh_cache: Path) -> None:
    d = load_data(DataConfig(path=str(_txt(tmp_path)), kind="causal", val_size=10, max_len=MAX_LEN, vocab_size=300))
    note = passes_note(d, steps=40, world_size=2, batch_size=2)
    n = len(d.train)
    assert note is not None and f"{160 / n:.2f} passes" in note
    assert f"over {n:,} training examples (blocks of {MAX_LEN} packed tokens) of {d.name}" in note


def test_trainer_warns_of_the_passes_before_step_0(tmp_path: Path, fresh_cache: Path, caplog) -> None:
    from lowband.train.config import TrainConfig
    from lowband.train.loop import Trainer

    cfg = TrainConfig.from_tables({
        "model": {"name": "gpt-tiny"}, "schedule": {"steps": 40, "batch_size": 4},
        "data": {"path": str(_txt(tmp_path)), "val_size": 10, "max_len": MAX_LEN, "vocab_size": 300},
        "run": {"out": str(tmp_path / "out"), "progress": False},
    })
    trainer = Trainer(cfg)
    with caplog.at_level(logging.WARNING, logger="lowband.train.loop"):
        trainer._start_processes()
        trainer._build_model()
        trainer._build_optimizer()
        trainer._open_outputs()  # what build() does before the first step
    trainer.metrics.close()
    n = len(trainer.data.train)
    assert any(f"{40 * 4 / n:.2f} passes (epochs)" in r.getMessage() for r in caplog.records), caplog.text
