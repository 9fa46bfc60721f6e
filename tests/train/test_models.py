"""lowband/train/models.py: the model sizes (T5 and GPT shapes), building, seeds, local directories, the loss (one process, CPU, no network)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lowband.train.data import (
    LABEL_PAD,
)
from lowband.train.models import MODEL_SIZES, build_model, compute_loss, model_kind, transformer_blocks
from lowband.train.tokenizer import PAD_ID

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


@pytest.mark.slow
def test_llama_small_is_the_smollm2_135m_shape() -> None:
    spec = build_model("llama-small", vocab_size=49152, seed=0)
    assert spec.num_params == 134_515_008  # SmolLM2-135M
    c = spec.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (576, 30, 9, 3)
    assert c.intermediate_size == 1536 and c.tie_word_embeddings and c.hidden_act == "silu"
    assert len(transformer_blocks(spec)) == 30


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


_FULL_SIZE = ("t5-small", "gpt-small", "llama-small")  # 60M to 135M parameters: seconds to build


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
    # A tied input embedding and LM head are one weight (T5 also names it in encoder and decoder): listed
    # under several names, counted once. Llama's head is a weight of its own (llama-small ties, as SmolLM2).
    embedding = spec.model.get_input_embeddings().weight
    tied = size.config["tie_word_embeddings"]
    assert (spec.model.get_output_embeddings().weight is embedding) == tied
    named = sum(t.numel() for t in tensors.values() if isinstance(t, torch.nn.Parameter))
    extra = named - spec.num_params
    assert extra % embedding.numel() == 0 and (extra > 0) == tied
    blocks = transformer_blocks(spec)
    layers_key = {"t5": "num_layers", "gpt2": "n_layer", "llama": "num_hidden_layers"}[size.family]
    expected_blocks = size.config[layers_key] + size.config.get("num_decoder_layers", 0)
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


def test_a_built_model_takes_the_tokenizers_special_ids() -> None:
    from lowband.train.tokenizer import SpecialIds

    ids = SpecialIds(pad=5, eos=7, unk=None, bos=6)
    t5 = build_model("t5-tiny", vocab_size=300, seed=0, special=ids).config
    assert (t5.pad_token_id, t5.eos_token_id, t5.decoder_start_token_id) == (5, 7, 5)  # T5 decodes from its pad
    gpt = build_model("gpt-tiny", vocab_size=300, seed=0, special=ids).config
    assert (gpt.bos_token_id, gpt.eos_token_id, gpt.pad_token_id) == (6, 7, 5)
    # A tokenizer that pads with its eos: no pad id, or Llama's embedding would freeze the eos row (padding_idx).
    llama = build_model("llama-tiny", vocab_size=300, seed=0, special=SpecialIds(pad=7, eos=7, unk=None))
    assert (llama.config.bos_token_id, llama.config.eos_token_id, llama.config.pad_token_id) == (7, 7, None)
    assert llama.model.get_input_embeddings().padding_idx is None
    # Without a tokenizer's ids: lowband's own (pad 0, eos 1).
    default = build_model("llama-tiny", vocab_size=300, seed=0).config
    assert (default.pad_token_id, default.eos_token_id) == (PAD_ID, 1)
