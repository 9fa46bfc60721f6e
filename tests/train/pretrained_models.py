"""Tiny "pretrained" models, saved as transformers saves a released one: weights, config and a tokenizer of the
family's kind (``save_pretrained`` of the model and of the tokenizer), for the pretrained-model tests.

Each family's tokenizer has special ids unlike lowband's own (pad 0, eos 1): GPT-2's ``<|endoftext|>`` is its
last entry and it has no pad; the Llama one has ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2 and no pad; T5's is a
Unigram with ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2 and an embedding padded past it, as t5-small's. Dropout is
off, so a training step's loss is the model's own loss on the batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FAMILIES = ("gpt2", "llama", "t5")

_WORDS = ("the quick brown fox jumps over a lazy dog while seven wise owls watch from an old oak tree near "
          "the river bank where children play games and sing songs about summer rain").split()


def texts(n: int, *, offset: int = 0) -> list[str]:
    """``n`` short made-up sentences (no two alike)."""
    out = []
    for i in range(offset, offset + n):
        words = [_WORDS[(i * 5 + j * 3) % len(_WORDS)] for j in range(4 + i % 7)]
        out.append(" ".join(words).capitalize() + ".")
    return out


def pairs(n: int, *, offset: int = 0) -> list[dict[str, str]]:
    """``n`` seq2seq rows: a sentence and its first three words."""
    return [{"source": t, "target": " ".join(t.split()[:3])} for t in texts(n, offset=offset)]


def write_causal(path: Path, n: int, *, offset: int = 0) -> Path:
    path.write_text("".join(t + "\n" for t in texts(n, offset=offset)), encoding="utf-8")
    return path


def write_seq2seq(path: Path, n: int, *, offset: int = 0) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in pairs(n, offset=offset)), encoding="utf-8")
    return path


def _tokenizer(family: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Tokenizer, PreTrainedTokenizerFast

    corpus = texts(200)
    if family == "t5":
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=150, special_tokens=["<pad>", "</s>", "<unk>"],
                                          unk_token="<unk>", show_progress=False)
        tok.train_from_iterator(corpus, trainer=trainer)
        return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>"] if family == "llama" else []
    trainer = trainers.BpeTrainer(vocab_size=340, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer=trainer)
    if family == "gpt2":
        tok.add_special_tokens(["<|endoftext|>"])  # the last id, as GPT-2's 50256
        return GPT2Tokenizer(tokenizer_object=tok)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _model(family: str, tokenizer, *, tie: bool):
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        T5Config,
        T5ForConditionalGeneration,
    )

    n = len(tokenizer)
    if family == "gpt2":
        eot = tokenizer.eos_token_id
        cfg = GPT2Config(vocab_size=n, n_embd=32, n_layer=2, n_head=2, n_positions=128, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=eot, eos_token_id=eot)
        return GPT2LMHeadModel(cfg)
    if family == "llama":
        cfg = LlamaConfig(vocab_size=n, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          bos_token_id=1, eos_token_id=2, pad_token_id=None, tie_word_embeddings=tie)
        return LlamaForCausalLM(cfg)
    padded = -(-n // 64) * 64  # more rows than the tokenizer has entries, as t5-small's 32,128 for 32,100
    cfg = T5Config(vocab_size=padded, d_model=32, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2, d_kv=16,
                   dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return T5ForConditionalGeneration(cfg)


def _pretrain(model, tokenizer, family: str, steps: int) -> None:
    """A few AdamW steps on the sentences, tokenised by the model's own tokenizer as lowband cuts data (each text
    followed by eos), so the saved weights know these ids: a wrong pairing would show as a much higher loss."""
    eos = tokenizer.eos_token_id
    rows = [tokenizer(t, add_special_tokens=False).input_ids + [eos] for t in texts(64)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [eos] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = ids.masked_fill(mask == 0, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        if family == "t5":
            loss = model(input_ids=ids, attention_mask=mask, labels=labels[:, :4].contiguous()).loss
        else:
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def save_pretrained_model(directory: Path, family: str, *, tie: bool = False, pretrain_steps: int = 0,
                          seed: int = 0) -> Path:
    """A tiny model of ``family`` with its own tokenizer, saved to ``directory`` (weights as safetensors)."""
    tokenizer = _tokenizer(family)
    torch.manual_seed(seed)
    model = _model(family, tokenizer, tie=tie)
    if pretrain_steps:
        _pretrain(model, tokenizer, family, pretrain_steps)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
