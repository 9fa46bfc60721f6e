"""The token store (lowband/train/data/inputs.py, store.py, examples.py and load.py's store path), on tiny files:
every input kind gives the same documents and digest, bad inputs are refused and leave nothing, a damaged store
is reported with its fix, a second start reads no text, shards are invisible, the tokenizer's sample is bounded,
the split and the sampler stay pure functions, and the job's fingerprint takes the store's digest."""

from __future__ import annotations

import csv
import json
import logging
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from lowband.train.data import (
    DataConfig,
    StoreError,
    batch_indices,
    data_digest,
    describe,
    load_data,
    open_stores,
    train_batch,
)
from lowband.train.data import inputs as inputs_mod
from lowband.train.data import store as store_mod
from lowband.train.data.packing import pack
from lowband.train.tokenizer import EOS_ID, get_tokenizer
from tests.train.corpus import corpus, write_jsonl

N_DOCS, MAX_LEN = 80, 16


def _docs() -> list[str]:
    # Distinct documents (the made-up corpus repeats itself every 16): a number in each.
    return [f"{t} number {i}" for i, t in enumerate(corpus(N_DOCS))]


@pytest.fixture()
def tok_path(tmp_path: Path, fresh_cache: Path) -> Path:
    path = tmp_path / "tokenizer.json"
    get_tokenizer(_docs(), 300).save(str(path))
    return path


@pytest.fixture()
def reset_opened(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each open checks the files again, as in a new process."""
    monkeypatch.setattr(store_mod, "_OPEN", {})


def _cfg(path: Path, **kw) -> DataConfig:
    return DataConfig(**{"path": str(path), "kind": "causal", "val_size": 8, "max_len": MAX_LEN, "vocab_size": 300,
                         **kw})


def _write_inputs(root: Path, docs: list[str]) -> dict[str, Path]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir()
    half = len(docs) // 2
    out = {}
    out["txt"] = root / "c.txt"
    # (a byte-order mark on the .txt and the .csv: not text)
    out["txt"].write_text("\n".join(docs[:10]) + "\n\n" + "\n".join(docs[10:]) + "\n", encoding="utf-8-sig")
    out["jsonl"] = root / "c.jsonl"
    write_jsonl(out["jsonl"], [{"body": d, "n": i} for i, d in enumerate(docs)])
    out["json"] = root / "array.json"
    out["json"].write_text(json.dumps([{"body": d} for d in docs]), encoding="utf-8")
    for name, sep in (("csv", ","), ("tsv", "\t")):
        out[name] = root / f"c.{name}"
        with out[name].open("w", newline="", encoding="utf-8-sig" if name == "csv" else "utf-8") as f:
            w = csv.writer(f, delimiter=sep)
            w.writerow(["id", "body"])
            w.writerows([i, d] for i, d in enumerate(docs))
    table = pa.table({"body": docs, "id": list(range(len(docs)))})
    out["parquet"] = root / "c.parquet"
    pq.write_table(table, out["parquet"], row_group_size=16)
    out["arrow"] = root / "file.arrow"
    with pa.ipc.new_file(str(out["arrow"]), table.schema) as w:
        for batch in table.to_batches(max_chunksize=20):
            w.write_batch(batch)
    out["arrow-stream"] = root / "stream.arrow"
    with pa.ipc.new_stream(str(out["arrow-stream"]), table.schema) as w:
        w.write_table(table)
    shards = root / "shards"
    (shards / "z").mkdir(parents=True)  # read in sorted order: part-0, then z/part-1
    pq.write_table(table.slice(0, half), shards / "part-0.parquet")
    pq.write_table(table.slice(half), shards / "z" / "part-1.parquet")
    (shards / "README.md").write_text("not data")
    out["glob"] = Path(str(shards) + "/**/*.parquet")
    out["dir"] = root / "jsonl-dir"
    out["dir"].mkdir()
    write_jsonl(out["dir"] / "00.jsonl", [{"body": d} for d in docs[:half]])
    write_jsonl(out["dir"] / "01.jsonl", [{"body": d} for d in docs[half:]])
    out["saved"] = root / "saved"
    datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(out["saved"]))
    return out


def test_every_input_kind_gives_the_same_blocks_and_digest(tmp_path: Path, tok_path: Path) -> None:
    docs = _docs()
    paths = _write_inputs(tmp_path / "in", docs)
    blocks, digests = {}, {}
    for kind, path in paths.items():
        cfg = _cfg(path, text_column="body", tokenizer=str(tok_path))
        d = load_data(cfg)
        assert d.packed and len(d.val.source_text) == 8, kind
        blocks[kind] = [b.tolist() for b in d.train.input_ids]
        digests[kind] = data_digest(cfg)
    assert all(b == blocks["txt"] for b in blocks.values()), [k for k, b in blocks.items() if b != blocks["txt"]]
    assert len(set(digests.values())) == 1  # by content: not the path, not the format
    # The blocks are the training documents, each ended by </s>, packed as pack() packs them.
    d = load_data(_cfg(paths["txt"], tokenizer=str(tok_path)))
    train_docs = list(d.train.source_text)
    assert len(train_docs) == N_DOCS - 8 and set(train_docs) | set(d.val.source_text) == set(docs)
    ids = [d.tokenizer.encode(t, add_special_tokens=False).ids for t in train_docs]
    flat, _ = pack(ids, MAX_LEN, EOS_ID)
    assert np.concatenate(d.train.input_ids).tolist() == flat.tolist()
    assert describe(d)["train_documents"] == N_DOCS - 8 and describe(d)["mean_input_tokens"] == MAX_LEN
    # One document per example ("lines"), truncated to MAX_LEN with </s> last, as the in-memory path cuts them.
    lines = load_data(_cfg(paths["txt"], tokenizer=str(tok_path), packing="lines"))
    assert [x.tolist() for x in lines.train.input_ids] == [(i[: MAX_LEN - 1] + [EOS_ID]) for i in ids]
    assert describe(lines)["mean_input_tokens"] == pytest.approx(np.mean([min(len(i) + 1, MAX_LEN) for i in ids]))
    # Seq2seq pairs from a parquet: sources and targets truncated, a row with an empty target skipped.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pairs = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({"src": docs, "tgt": [t.split()[0] for t in docs[:-1]] + [""]}), pairs)
    s2s = load_data(DataConfig(path=str(pairs), source_column="src", target_column="tgt", val_size=5,
                               max_source_len=6, tokenizer=str(tok_path)))
    assert len(s2s.train) + len(s2s.val) == N_DOCS - 1
    assert all(len(x) <= 6 and x[-1] == EOS_ID for x in s2s.train.input_ids)
    assert [s2s.tokenizer.decode(x[:-1].tolist()).strip() for x in s2s.val.target_ids] == list(s2s.val.target_text)
    assert all(src.split()[0] == tgt for src, tgt in zip(s2s.val.source_text, s2s.val.target_text, strict=True))


def test_bad_inputs_are_refused_and_leave_nothing_half_written(tmp_path: Path, tok_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    stores = tmp_path / "stores"
    with pytest.raises(FileNotFoundError, match=r"'.*nothing-\*\.parquet' matches no data file.*quote it"):
        load_data(_cfg(tmp_path / "nothing-*.parquet", store_dir=str(stores)))
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(FileNotFoundError, match="matches 1 path"):
        load_data(_cfg(tmp_path / "*.md", store_dir=str(stores)))
    pq.write_table(pa.table({"title": ["a"], "body": ["b c"]}), tmp_path / "no-text.parquet")
    with pytest.raises(ValueError, match="no text column 'text'; columns present: title, body.*--text-column"):
        load_data(_cfg(tmp_path / "no-text.parquet", store_dir=str(stores)))
    (tmp_path / "empty-dir").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no data file"):
        load_data(_cfg(tmp_path / "empty-dir", store_dir=str(stores)))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match="DatasetDict.*splits: train.*dd/train"):
        load_data(_cfg(tmp_path / "dd", store_dir=str(stores)))
    blank = tmp_path / "blank.jsonl"
    write_jsonl(blank, [{"text": " "}, {"text": ""}])
    with pytest.raises(ValueError, match="holds no usable example"):
        load_data(_cfg(blank, store_dir=str(stores), tokenizer=str(tok_path)))
    broken = tmp_path / "broken.jsonl"
    broken.write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs()) + "{oops\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"broken.jsonl line 81 is not JSON"):
        load_data(_cfg(broken, store_dir=str(stores), tokenizer=str(tok_path)))  # fails while writing the store
    bad_utf8 = tmp_path / "latin1.txt"
    bad_utf8.write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8 text.*offset 3"):
        load_data(_cfg(bad_utf8, store_dir=str(stores), tokenizer=str(tok_path)))
    left = [p.name for p in stores.iterdir() if not p.name.endswith(".lock")] if stores.exists() else []
    assert left == []  # no store, no temporary folder


def test_a_damaged_store_is_reported_with_its_fix(tmp_path: Path, tok_path: Path, reset_opened) -> None:
    path = tmp_path / "c.txt"
    path.write_text("\n".join(_docs()) + "\n", encoding="utf-8")
    cfg = _cfg(path, tokenizer=str(tok_path), store_dir=str(tmp_path / "stores"))
    store, _ = open_stores(cfg)
    tokens = store.path / "text-00000.tokens"
    data = tokens.read_bytes()
    tokens.write_bytes(data[:-6])
    store_mod._OPEN.clear()
    with pytest.raises(StoreError, match=r"corrupt or truncated \(text-00000.tokens has .* bytes, the index says "
                                         r".*\); delete it \(rm -r '.*'\) and start again"):
        load_data(cfg, use_cache=False)
    tokens.write_bytes(data)
    index = json.loads((store.path / "index.json").read_text())
    (store.path / "index.json").write_text(json.dumps({**index, "version": 99}))
    store_mod._OPEN.clear()
    with pytest.raises(StoreError, match="format version 99; this lowband reads version 1"):
        load_data(cfg, use_cache=False)
    (store.path / "index.json").write_text('{"format": "lowband-tok')
    store_mod._OPEN.clear()
    with pytest.raises(StoreError, match="index.json is unreadable"):
        load_data(cfg, use_cache=False)


def test_a_second_start_opens_the_store_without_reading_the_text(tmp_path: Path, tok_path: Path, reset_opened,
                                                                 monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    path = tmp_path / "c.txt"
    path.write_text("\n".join(_docs()) + "\n", encoding="utf-8")
    cfg = _cfg(path, store_dir=str(tmp_path / "stores"))  # a tokenizer trained on the data
    monkeypatch.setattr(store_mod, "_LOG_EVERY_S", 0.0)  # not a terminal: progress as log lines
    before = store_mod.build_count
    with caplog.at_level(logging.INFO, logger="lowband.train.data.store"):
        first = load_data(cfg, use_cache=False)
    assert store_mod.build_count == before + 1
    assert any("tokenizing" in r.getMessage() and "MB/s" in r.getMessage() for r in caplog.records), caplog.text

    def no_reading(*args, **kwargs):
        raise AssertionError("the text was read again")

    monkeypatch.setattr(store_mod, "iter_documents", no_reading)
    monkeypatch.setattr(inputs_mod, "iter_documents", no_reading)
    store_mod._OPEN.clear()
    again = load_data(cfg, use_cache=False)
    assert store_mod.build_count == before + 1
    assert again.tokenizer.to_str() == first.tokenizer.to_str()
    for step in (0, 3):
        a = train_batch(first, step=step, rank=1, world_size=2, batch_size=4, seed=5)
        b = train_batch(again, step=step, rank=1, world_size=2, batch_size=4, seed=5)
        assert torch.equal(a["input_ids"], b["input_ids"])
    monkeypatch.undo()
    path.write_text("\n".join(_docs()[:-1]) + "\n", encoding="utf-8")  # the file changed: a new store
    assert data_digest(cfg) != first.stats["store_digest"]
    assert store_mod.build_count == before + 2


def test_shards_are_invisible_and_ranks_of_a_host_tokenise_once(tmp_path: Path, tok_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.txt"
    path.write_text("\n".join(_docs()) + "\n", encoding="utf-8")
    one = load_data(_cfg(path, tokenizer=str(tok_path), store_dir=str(tmp_path / "one")))
    monkeypatch.setattr(store_mod, "SHARD_TOKENS", 50)
    monkeypatch.setattr(store_mod, "_OPEN_FILES_MAX", 3)  # fewer open files than shards: reopened as read
    monkeypatch.setattr(inputs_mod, "_CHUNK_BYTES", 200)  # many small batches: many shards
    before = store_mod.build_count
    results: list = []
    cfg = _cfg(path, tokenizer=str(tok_path), store_dir=str(tmp_path / "many"))
    threads = [threading.Thread(target=lambda: results.append(load_data(cfg, use_cache=False))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and store_mod.build_count == before + 1  # one wrote it, the others waited
    many = results[0]
    store, _ = open_stores(cfg)
    assert store.num_shards > 3 and store.digest == one.stats["store_digest"]
    assert [b.tolist() for b in many.train.input_ids] == [b.tolist() for b in one.train.input_ids]
    assert [b.tolist() for b in many.val.input_ids] == [b.tolist() for b in one.val.input_ids]
    lines_one = load_data(_cfg(path, tokenizer=str(tok_path), store_dir=str(tmp_path / "one"), packing="lines"))
    lines_many = load_data(_cfg(path, tokenizer=str(tok_path), store_dir=str(tmp_path / "many"), packing="lines"))
    assert [x.tolist() for x in lines_many.train.input_ids] == [x.tolist() for x in lines_one.train.input_ids]


def test_a_trained_tokenizer_learns_from_a_bounded_sample(tmp_path: Path, fresh_cache: Path) -> None:
    docs = _docs()
    path = tmp_path / "c.txt"
    path.write_text("\n".join(docs) + "\n", encoding="utf-8")
    d = load_data(_cfg(path, tokenizer_sample_bytes=600))
    store, _ = open_stores(d.config)
    sampled = store.index["tokenizer_trained"]["documents"]
    assert 0 < sampled < 30 and store.documents == N_DOCS
    # The first documents, in order, up to the first that reaches the bound.
    first = docs[:sampled]
    assert sum(len(t) for t in first[:-1]) < 600 <= sum(len(t) for t in first)
    assert d.tokenizer.to_str() == get_tokenizer(first, 300).to_str()
    assert load_data(_cfg(path, tokenizer_sample_bytes="1MB")).tokenizer.to_str() == get_tokenizer(docs, 300).to_str()


def test_the_split_and_the_sampler_stay_pure_functions(tmp_path: Path, tok_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.txt"
    path.write_text("\n".join(_docs()) + "\n", encoding="utf-8")
    d = load_data(_cfg(path, tokenizer=str(tok_path), packing="lines"))
    again = load_data(_cfg(path, tokenizer=str(tok_path), packing="lines"), use_cache=False)
    assert list(d.val.source_text) == list(again.val.source_text)
    other_seed = load_data(_cfg(path, tokenizer=str(tok_path), packing="lines", seed=1))
    assert set(other_seed.val.source_text) != set(d.val.source_text)
    assert not set(d.train.source_text) & set(d.val.source_text)
    capped = load_data(_cfg(path, tokenizer=str(tok_path), packing="lines", max_examples=30, val_size=0.2))
    assert len(capped.train) == 24 and len(capped.val) == 6
    assert set(capped.train.source_text) | set(capped.val.source_text) == set(_docs()[:30])
    # (step, rank) -> the same examples in any process; ranks disjoint; the next epoch reshuffled.
    world, bs = 3, 4
    idx = [batch_indices(d, step=2, rank=r, world_size=world, batch_size=bs, seed=7) for r in range(world)]
    assert len({i for part in idx for i in part}) == world * bs
    for r in range(world):
        a = train_batch(d, step=2, rank=r, world_size=world, batch_size=bs, seed=7)
        b = train_batch(again, step=2, rank=r, world_size=world, batch_size=bs, seed=7)
        assert all(torch.equal(a[k], b[k]) for k in a)
        rows = [tuple(t[: int(m.sum())].tolist()) for t, m in zip(a["input_ids"], a["attention_mask"], strict=True)]
        assert rows == [tuple(d.train.input_ids[i].tolist()) for i in idx[r]]
    # An epoch's order: the same permutation as numpy's (the goldens' batches), or past TABLE_PERMUTATION_MAX
    # examples one computed per position, not stored: a bijection all the same.
    from lowband.train.data import batching

    assert batching._epoch_permutation(1000, 7, 2).tolist() == np.random.default_rng([7, 2]).permutation(1000).tolist()
    monkeypatch.setattr(batching, "TABLE_PERMUTATION_MAX", 50)
    monkeypatch.setattr(batching, "_PERM_CACHE", {})
    seen = [i for s in range(6) for r in range(2) for i in batch_indices(97, step=s, rank=r, world_size=2,
                                                                          batch_size=8, seed=3)]
    assert len(seen) == len(set(seen)) == 96 and max(seen) < 97
    assert seen[:8] == batch_indices(97, step=0, rank=0, world_size=2, batch_size=8, seed=3)
    assert seen[:8] != batch_indices(97, step=6, rank=0, world_size=2, batch_size=8, seed=3)  # the next epoch
    val_file = tmp_path / "val.txt"
    val_file.write_text("alpha beta\ngamma delta epsilon\n", encoding="utf-8")
    sep = load_data(_cfg(path, tokenizer=str(tok_path), packing="lines", val_path=str(val_file)))
    assert len(sep.train) == N_DOCS and list(sep.val.source_text) == ["alpha beta", "gamma delta epsilon"]


def test_the_fingerprint_takes_the_store_digest_not_the_text(tmp_path: Path, tok_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import lowband.util
    from lowband.train.config import TrainConfig

    text = "\n".join(_docs()) + "\n"
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "c.txt").write_text(text, encoding="utf-8")
    (tmp_path / "c" ).mkdir()
    (tmp_path / "c" / "c.txt").write_text(text.replace("number 3\n", "number 33\n"), encoding="utf-8")

    def fingerprint(folder: str) -> str:
        return TrainConfig.from_tables({"model": {"name": "gpt-tiny"}, "data": {
            "path": str(tmp_path / folder / "c.txt"), "tokenizer": str(tok_path)}}).fingerprint(ranks_per_node=2)

    real = lowband.util.file_digest

    def digest_of_small_files_only(path):
        assert not str(path).endswith("c.txt"), "the data file was hashed again"
        return real(path)

    monkeypatch.setattr(lowband.util, "file_digest", digest_of_small_files_only)
    assert fingerprint("a") == fingerprint("b")  # the same data under another path
    assert fingerprint("a") != fingerprint("c")
