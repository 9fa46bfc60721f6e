"""lowband/train/tokenizer.py: the tokenizer's cache, special ids, training (deterministic, unigram), ranks starting together, a user's tokenizer directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lowband.train import tokenizer as tok_mod
from lowband.train.data import (
    DataConfig,
    load_data,
)
from lowband.train.tokenizer import EOS_ID, PAD_ID, UNK_ID, get_tokenizer, special_ids
from tests.train.corpus import corpus, write_jsonl


def test_tokenizer_cache_is_reused_and_special_ids(fresh_cache: Path) -> None:
    texts = corpus()
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
    texts = corpus(200)
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
    tok = tok_mod.train_tokenizer(corpus(), 300)
    tdir = tmp_path / "mytok"
    tdir.mkdir()
    tok.save(str(tdir / "tokenizer.json"))
    assert get_tokenizer(str(tdir)).to_str() == tok.to_str()
    path = tmp_path / "pairs.jsonl"
    write_jsonl(path, [{"source": s, "target": s.split()[0]} for s in corpus(40)])
    data = load_data(DataConfig(path=str(path), tokenizer=str(tdir), val_size=4))
    assert data.tokenizer.to_str() == tok.to_str()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        get_tokenizer(str(tmp_path))
