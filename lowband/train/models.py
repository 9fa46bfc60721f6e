"""Models for ``lowband train``: named sizes from transformers configs, or a user's local model.

Two families, randomly initialised from a seed (the same seed gives the same weights on every
rank and every machine):

* T5 encoder-decoder (``kind="seq2seq"``): ``t5-tiny``, ``t5-mini``, ``t5-medium``, ``t5-small``.
  ``t5-small`` is the real t5-small architecture (d_model 512, d_ff 2048, 6+6 layers, 8 heads,
  d_kv 64, ReLU, tied embeddings, dropout 0.1). Its vocabulary is NOT pinned: like every size
  here it takes the tokenizer's vocabulary, because an embedding table larger than the
  tokenizer only adds rows that are never used (and bytes that every method must ship). With a
  32,128-entry tokenizer (``vocab_size=32128``, the size of the original SentencePiece model) it
  has exactly the original 60,506,624 parameters.
* GPT-2 style causal LM (``kind="causal"``): ``gpt-tiny``, ``gpt-mini``, ``gpt-small`` (the
  GPT-2 124M shape: 768 wide, 12 layers, 12 heads, 1024 positions; 124M with GPT-2's 50,257
  vocabulary, fewer with a smaller tokenizer).

A local directory with a ``config.json`` is also accepted: with weights it is loaded as is,
config-only it is initialised from the seed. Nothing is ever downloaded.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowband.train.tokenizer import EOS_ID, PAD_ID

logger = logging.getLogger(__name__)

KINDS: tuple[str, ...] = ("seq2seq", "causal")
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_BLOCK_LIST_NAMES = ("block", "h", "layers", "layer")
_BATCH_KEYS = ("input_ids", "attention_mask", "labels", "decoder_input_ids", "decoder_attention_mask")


@dataclass(kw_only=True, frozen=True)
class ModelSize:
    """A named model size.

    Args:
        name: the name users pass (``--model``).
        family: ``"t5"`` or ``"gpt2"``: which transformers config and model class.
        kind: ``"seq2seq"`` or ``"causal"``.
        config: keyword arguments of the transformers config (vocabulary excluded).
        vocab_size: a vocabulary size the size pins, or None to take the tokenizer's.
        description: one line for help texts.
    """

    name: str
    family: str
    kind: str
    config: Mapping[str, Any]
    vocab_size: int | None = None
    description: str = ""


_T5_COMMON: dict[str, Any] = {
    "feed_forward_proj": "relu",
    "tie_word_embeddings": True,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "dropout_rate": 0.1,
    "layer_norm_epsilon": 1e-6,
    # transformers 5.x needs these for a randomly initialised T5.
    "decoder_start_token_id": PAD_ID,
    "pad_token_id": PAD_ID,
    "eos_token_id": EOS_ID,
}
_GPT_COMMON: dict[str, Any] = {
    "n_positions": 1024,
    "activation_function": "gelu_new",
    "tie_word_embeddings": True,
    "bos_token_id": EOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}


def _t5(name: str, d_model: int, layers: int, heads: int, d_kv: int, d_ff: int, desc: str) -> ModelSize:
    cfg = dict(_T5_COMMON, d_model=d_model, num_layers=layers, num_decoder_layers=layers)
    cfg.update(num_heads=heads, d_kv=d_kv, d_ff=d_ff)
    return ModelSize(name=name, family="t5", kind="seq2seq", config=cfg, description=desc)


def _gpt(name: str, width: int, layers: int, heads: int, desc: str) -> ModelSize:
    cfg = dict(_GPT_COMMON, n_embd=width, n_layer=layers, n_head=heads)
    return ModelSize(name=name, family="gpt2", kind="causal", config=cfg, description=desc)


MODEL_SIZES: dict[str, ModelSize] = {
    s.name: s
    for s in (
        _t5("t5-tiny", 64, 1, 2, 32, 128, "T5, d_model 64, 1+1 layers: for tests"),
        _t5("t5-mini", 128, 2, 4, 32, 512, "T5, d_model 128, 2+2 layers (~1.9M params at vocab 8k)"),
        _t5("t5-medium", 256, 4, 4, 64, 1024, "T5, d_model 256, 4+4 layers (~9M at vocab 8k); unofficial"),
        _t5("t5-small", 512, 6, 8, 64, 2048, "the real t5-small architecture (60.5M params at vocab 32128)"),
        _gpt("gpt-tiny", 64, 2, 2, "GPT-2 style, 64 wide, 2 layers: for tests"),
        _gpt("gpt-mini", 128, 4, 4, "GPT-2 style, 128 wide, 4 layers (~2M params at vocab 8k)"),
        _gpt("gpt-small", 768, 12, 12, "the GPT-2 124M shape (92M at vocab 8k)"),
    )
}


@dataclass(kw_only=True)
class ModelSpec:
    """A built model and what the training loop needs to know about it.

    Args:
        model: the ``transformers`` model (float32, in train mode).
        kind: ``"seq2seq"`` or ``"causal"``.
        name: the size name, or the local directory it came from.
        num_params: number of distinct parameters (tied weights counted once).
        config: the transformers config.
        pretrained: True when weights were loaded from a local directory.
    """

    model: nn.Module
    kind: str
    name: str
    num_params: int
    config: Any = None
    pretrained: bool = False


def count_params(model: nn.Module) -> int:
    """Number of distinct parameters of ``model`` (a tied weight counts once).

    Args:
        model: any module.

    Returns:
        The count.
    """
    return sum(p.numel() for p in model.parameters())


def _unknown(name: str) -> ValueError:
    return ValueError(
        f"unknown model {name!r}: known sizes are {', '.join(MODEL_SIZES)}; a local model directory "
        "holding a config.json (and optionally weights) is also accepted (nothing is downloaded)"
    )


def _config_for(size: ModelSize, vocab_size: int) -> Any:
    if size.family == "t5":
        from transformers import T5Config

        return T5Config(vocab_size=vocab_size, **size.config)
    if size.family == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(vocab_size=vocab_size, **size.config)
    raise AssertionError(f"unknown family {size.family}")  # pragma: no cover


def _kind_of(config: Any) -> str:
    return "seq2seq" if getattr(config, "is_encoder_decoder", False) else "causal"


def _model_class(kind: str) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM if kind == "seq2seq" else AutoModelForCausalLM


def _finish(model: nn.Module, kind: str) -> nn.Module:
    """float32, train mode, and the causal loss named (transformers warns once when it is not)."""
    model.to(torch.float32)
    model.train()
    if kind == "causal" and getattr(model, "loss_type", "unset") is None:
        model.loss_type = "ForCausalLM"
    return model


def _seeded_init(config: Any, kind: str, seed: int) -> nn.Module:
    """Build a randomly initialised model from ``config``, seeded, leaving the caller's RNG alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _model_class(kind).from_config(config)
    return model


def model_kind(name_or_path: str | os.PathLike[str]) -> str:
    """Whether a model is ``"seq2seq"`` or ``"causal"``, without building it.

    The data must be prepared for the model's kind before the model can be built (the model
    takes its vocabulary from the tokenizer), so the CLI asks this first.

    Args:
        name_or_path: a key of :data:`MODEL_SIZES` or a local model directory.

    Returns:
        The kind.

    Raises:
        ValueError: as :func:`build_model` for unknown names and unusable directories.
    """
    name = str(name_or_path)
    if name in MODEL_SIZES:
        return MODEL_SIZES[name].kind
    path = Path(name).expanduser()
    if not path.is_dir():
        raise _unknown(name)
    if not (path / "config.json").is_file():
        raise _no_config(path)
    from transformers import AutoConfig

    try:
        return _kind_of(AutoConfig.from_pretrained(str(path), local_files_only=True))
    except Exception as exc:
        raise ValueError(f"could not read the model config in {path}: {exc}") from exc


def _no_config(path: Path) -> ValueError:
    return ValueError(
        f"{path} is a directory without config.json; a model directory needs one "
        f"(e.g. from save_pretrained), or use a known size: {', '.join(MODEL_SIZES)}"
    )


def _from_directory(path: Path, *, vocab_size: int, seed: int) -> ModelSpec:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise ValueError(f"could not read the model config in {path}: {exc}") from exc
    kind = _kind_of(config)
    has_weights = any((path / f).is_file() for f in _WEIGHT_FILES)
    try:
        if has_weights:
            if vocab_size > config.vocab_size:
                raise ValueError(
                    f"the tokenizer has {vocab_size} entries but the model in {path} has {config.vocab_size}: "
                    "use the model's own tokenizer (pass its directory as the tokenizer)"
                )
            model = _model_class(kind).from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
        else:
            if config.vocab_size != vocab_size:
                logger.info(
                    "%s: config-only model, vocabulary %d -> %d (the tokenizer's)",
                    path,
                    config.vocab_size,
                    vocab_size,
                )
                config.vocab_size = vocab_size
            model = _seeded_init(config, kind, seed)
    except ValueError as exc:
        if "tokenizer has" in str(exc):
            raise
        raise ValueError(
            f"the model in {path} (model_type {getattr(config, 'model_type', '?')!r}) is neither an "
            f"encoder-decoder nor a causal LM that transformers can build: {exc}"
        ) from exc
    _finish(model, kind)
    return ModelSpec(
        model=model,
        kind=kind,
        name=str(path),
        num_params=count_params(model),
        config=model.config,
        pretrained=has_weights,
    )


def build_model(name_or_path: str | os.PathLike[str], *, vocab_size: int, seed: int) -> ModelSpec:
    """Build a model: a named size initialised from ``seed``, or a local model directory.

    Args:
        name_or_path: a key of :data:`MODEL_SIZES`, or a local directory with a ``config.json``
            (weights present: loaded; config only: initialised from ``seed``).
        vocab_size: the tokenizer's vocabulary size (``Data.vocab_size``). A named size uses it
            unless the size pins one; a config-only directory adopts it; a directory with weights
            must have at least this many embeddings.
        seed: initialisation seed; the same seed gives bit-identical weights.

    Returns:
        The model spec (float32 model, train mode, on CPU).

    Raises:
        ValueError: an unknown name that is not an existing directory (the message lists the
            known sizes), a directory without a usable config, or a vocabulary mismatch.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    name = str(name_or_path)
    size = MODEL_SIZES.get(name)
    if size is None:
        path = Path(name).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise _no_config(path)
            return _from_directory(path, vocab_size=vocab_size, seed=seed)
        raise _unknown(name)
    vocab = size.vocab_size if size.vocab_size is not None else vocab_size
    if vocab < vocab_size:
        raise ValueError(f"{name} pins a vocabulary of {vocab}, smaller than the tokenizer's {vocab_size}")
    model = _seeded_init(_config_for(size, vocab), size.kind, seed)
    _finish(model, size.kind)
    spec = ModelSpec(
        model=model, kind=size.kind, name=name, num_params=count_params(model), config=model.config
    )
    logger.info("built %s: %s parameters (vocab %d, seed %d)", name, f"{spec.num_params:,}", vocab, seed)
    return spec


def transformer_blocks(model: nn.Module | ModelSpec) -> list[nn.Module]:
    """The repeated transformer blocks, in forward order, for per-block sharding.

    Shard each with FSDP2 ``fully_shard`` and then the root module. T5: ``encoder.block`` then
    ``decoder.block``; GPT-2: ``transformer.h``; Llama-like: ``model.layers``. Other models:
    every ``nn.ModuleList`` named ``block``, ``h``, ``layers`` or ``layer`` that is not inside
    another one.

    Args:
        model: the model, or a :class:`ModelSpec`.

    Returns:
        The blocks.

    Raises:
        ValueError: no block list could be found.
    """
    m = model.model if isinstance(model, ModelSpec) else model
    # Unwrap compiled modules.
    m = getattr(m, "_orig_mod", m)
    known: list[tuple[str, ...]] = [
        ("encoder", "block"),
        ("decoder", "block"),
        ("transformer", "h"),
        ("model", "layers"),
        ("model", "decoder", "layers"),
    ]
    found: list[nn.Module] = []
    for path in known:
        obj: Any = m
        for attr in path:
            obj = getattr(obj, attr, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList):
            found.extend(obj)
    if found:
        return found
    lists: list[tuple[str, nn.ModuleList]] = []
    for qualname, module in m.named_modules():
        if isinstance(module, nn.ModuleList) and qualname.rsplit(".", 1)[-1] in _BLOCK_LIST_NAMES:
            if not any(qualname.startswith(outer + ".") for outer, _ in lists):
                lists.append((qualname, module))
    blocks = [b for _, lst in lists for b in lst]
    if not blocks:
        raise ValueError(f"found no transformer block list in {type(m).__name__}")
    return blocks


def compute_loss(spec_or_model: ModelSpec | nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Mean token cross-entropy of a batch (labels equal to -100 are ignored).

    Args:
        spec_or_model: the model or its spec (FSDP-wrapped models work too).
        batch: ``input_ids``, ``attention_mask`` and ``labels`` (seq2seq: target ids; causal: the
            input ids, shifted inside the model); moved to the model's device if needed. Other
            keys are ignored.

    Returns:
        A scalar loss tensor, fp32 (computed from the logits in fp32 when the model computes in bf16).
    """
    model = spec_or_model.model if isinstance(spec_or_model, ModelSpec) else spec_or_model
    if "labels" not in batch:
        raise ValueError(f"the batch needs labels; it has {', '.join(batch)}")
    device = _device_of(model)
    inputs = {k: (v.to(device) if v.device != device else v) for k, v in batch.items() if k in _BATCH_KEYS}
    labels = inputs.pop("labels")
    inner = getattr(model, "_orig_mod", model)
    if getattr(inner.config, "is_encoder_decoder", False):
        if "decoder_input_ids" not in inputs:
            inputs["decoder_input_ids"] = inner.prepare_decoder_input_ids_from_labels(labels=labels)
        targets = labels
        logits = model(**inputs, use_cache=False).logits
    else:
        logits = model(**inputs, use_cache=False).logits[:, :-1]
        targets = labels[:, 1:]
    # The loss in fp32 whatever the compute precision (bf16 logits give a bf16-rounded loss otherwise);
    # for fp32 models this is the transformers models' own loss, the same operations.
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             ignore_index=-100)


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
