"""Models for ``lowband train``: named sizes from transformers configs, or a user's (pretrained) model.

Three families of named sizes, randomly initialised from a seed (the same seed gives the same
weights on every rank and every machine):

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
* Llama-style causal LM (``kind="causal"``, transformers' ``LlamaConfig``: RMSNorm, rotary
  positions, SwiGLU MLP, grouped-query attention, untied output head): ``llama-tiny``,
  ``llama-mini``, and ``llama-small``, the SmolLM2-135M shape (576 wide, 30 layers, 9 heads, 3 KV
  heads, tied embeddings; 134.5M with its 49,152 vocabulary). A directory of another decoder-only
  family (Qwen2, Mistral, ...) is built by transformers' own class for it.

The special ids of a named size's config (pad, eos, bos; T5's decoder start) are the tokenizer's
(:class:`~lowband.train.tokenizer.SpecialIds`), so the model and the data agree on them.

Besides a named size, ``--model`` takes (:func:`resolve_model`) a local directory with a
``config.json`` (with weights it is loaded as is; config-only it is initialised from the seed), or a
Hugging Face hub id (``org/name``) that is already in the local Hugging Face cache. Nothing is ever
downloaded. A model with weights trains with its own tokenizer (:mod:`lowband.train.pretrained`).
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

from lowband.train.tokenizer import EOS_ID, PAD_ID, UNK_ID, SpecialIds, holds_tokenizer

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
        family: ``"t5"``, ``"gpt2"`` or ``"llama"``: which transformers config and model class.
        kind: ``"seq2seq"`` or ``"causal"``.
        config: keyword arguments of the transformers config (vocabulary and special ids excluded).
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
}
_GPT_COMMON: dict[str, Any] = {
    "n_positions": 1024,
    "activation_function": "gelu_new",
    "tie_word_embeddings": True,
}
_LLAMA_COMMON: dict[str, Any] = {
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}
#: lowband's own tokenizers' ids (:mod:`lowband.train.tokenizer`): a size built without a tokenizer gets these.
_DEFAULT_IDS = SpecialIds(pad=PAD_ID, eos=EOS_ID, unk=UNK_ID)


def _t5(name: str, d_model: int, layers: int, heads: int, d_kv: int, d_ff: int, desc: str) -> ModelSize:
    cfg = dict(_T5_COMMON, d_model=d_model, num_layers=layers, num_decoder_layers=layers)
    cfg.update(num_heads=heads, d_kv=d_kv, d_ff=d_ff)
    return ModelSize(name=name, family="t5", kind="seq2seq", config=cfg, description=desc)


def _gpt(name: str, width: int, layers: int, heads: int, desc: str) -> ModelSize:
    cfg = dict(_GPT_COMMON, n_embd=width, n_layer=layers, n_head=heads)
    return ModelSize(name=name, family="gpt2", kind="causal", config=cfg, description=desc)


def _llama(name: str, width: int, layers: int, heads: int, kv_heads: int, ffn: int, desc: str,
           **extra: Any) -> ModelSize:
    cfg = dict(_LLAMA_COMMON, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=kv_heads, intermediate_size=ffn, **extra)
    return ModelSize(name=name, family="llama", kind="causal", config=cfg, description=desc)


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
        _llama("llama-tiny", 64, 2, 4, 2, 172, "Llama-style (RMSNorm, RoPE, SwiGLU, GQA), 64 wide, 2 layers: for tests"),
        _llama("llama-mini", 128, 4, 4, 2, 344, "Llama-style, 128 wide, 4 layers, untied head (~2.8M params at vocab 8k)"),
        _llama("llama-small", 576, 30, 9, 3, 1536, "the SmolLM2-135M shape, tied embeddings (134.5M at vocab 49152)",
               tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=100000.0),
    )
}


@dataclass(kw_only=True)
class ModelSpec:
    """A built model and what the training loop needs to know about it.

    Args:
        model: the ``transformers`` model (float32, in train mode).
        kind: ``"seq2seq"`` or ``"causal"``.
        name: the size name, the local directory or the hub id it came from.
        num_params: number of distinct parameters (tied weights counted once).
        config: the transformers config.
        pretrained: True when weights were loaded (a directory or a cached hub id with weights).
    """

    model: nn.Module
    kind: str
    name: str
    num_params: int
    config: Any = None
    pretrained: bool = False


@dataclass(kw_only=True, frozen=True)
class ModelSource:
    """Where ``--model`` points: a named size, or a directory (a local one, or a hub id's snapshot in the
    local Hugging Face cache). :func:`resolve_model` makes one; nothing is read but file names.

    Args:
        name: what was given (a size name, a path, a hub id).
        size: the named size, or None.
        path: the model's directory (a hub id's cached snapshot), or None for a named size.
        hub_id: the hub id it was found under in the local cache, or None.
    """

    name: str
    size: ModelSize | None = None
    path: Path | None = None
    hub_id: str | None = None

    @property
    def has_weights(self) -> bool:
        """Whether the directory holds weights (which are then loaded, not initialised)."""
        return self.path is not None and any((self.path / f).is_file() for f in _WEIGHT_FILES)

    @property
    def has_tokenizer(self) -> bool:
        """Whether the directory holds a saved tokenizer (:func:`lowband.train.tokenizer.holds_tokenizer`)."""
        return self.path is not None and holds_tokenizer(self.path)

    def describe(self) -> str:
        """The model in words, for messages: its name, and the directory a hub id was found in."""
        if self.hub_id is not None:
            return f"{self.hub_id} (cached at {self.path})"
        return self.name


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
        f"unknown model {name!r}; named sizes: {', '.join(MODEL_SIZES)}; also accepted: a local model "
        "directory holding a config.json (and optionally weights), or a Hugging Face hub id (org/name) that is "
        "already in the local Hugging Face cache (nothing is downloaded)"
    )


def _not_cached(name: str, cache_dir: str, what: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"model {name!r} is not a named size or a local directory, and {what} in the local Hugging Face cache "
        f"({cache_dir}); lowband downloads nothing. Fetch it on a machine with internet (`hf download {name}`), "
        "then copy that cache here (or point HF_HOME / HF_HUB_CACHE at it), or pass the model's local directory "
        f"(config.json, weights, tokenizer). Named sizes: {', '.join(MODEL_SIZES)}"
    )


def _hub_snapshot(name: str) -> Path | None:
    """The cached snapshot of hub id ``name`` (offline, as with HF_HUB_OFFLINE=1), or None when ``name``
    is not a hub id at all.

    Raises:
        FileNotFoundError: a hub id with no snapshot in the cache, or one cached without weights.
    """
    from huggingface_hub import constants, snapshot_download  # heavy: only when a hub id is resolved
    from huggingface_hub.errors import (  # heavy: only when a hub id is resolved
        HFValidationError,
        LocalEntryNotFoundError,
    )

    try:
        snapshot = Path(snapshot_download(name, local_files_only=True))
    except HFValidationError:
        return None
    except LocalEntryNotFoundError:
        if "/" not in name:  # a bare word is more likely a mistyped size than a legacy hub id
            return None
        raise _not_cached(name, constants.HF_HUB_CACHE, "it is not") from None
    if not (snapshot / "config.json").is_file() or not any((snapshot / f).is_file() for f in _WEIGHT_FILES):
        raise _not_cached(name, constants.HF_HUB_CACHE, "its config.json and weights are not (only part of it is)")
    return snapshot


def resolve_model(name_or_path: str | os.PathLike[str]) -> ModelSource:
    """Where a model comes from, checked, without loading it.

    In order: a named size (:data:`MODEL_SIZES`); an existing local directory, which must hold a
    ``config.json``; a Hugging Face hub id (``org/name``; a bare ``name`` too, where the cache has
    it) whose snapshot is in the local Hugging Face cache (``HF_HUB_CACHE``, ``HF_HOME``), with its
    weights. Nothing is downloaded.

    Args:
        name_or_path: a size name, a directory, or a hub id.

    Returns:
        The :class:`ModelSource`.

    Raises:
        ValueError: an unknown name, a file, or a directory without ``config.json``.
        FileNotFoundError: a hub id that is not in the local cache (or is without its weights).
    """
    name = str(name_or_path)
    if name in MODEL_SIZES:
        return ModelSource(name=name, size=MODEL_SIZES[name])
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"--model {name} is a file; give a model directory (config.json and weights, as "
                             f"save_pretrained writes them), a hub id in the local cache, or a named size")
        if not (path / "config.json").is_file():
            raise _no_config(path)
        return ModelSource(name=name, path=path)
    snapshot = _hub_snapshot(name)
    if snapshot is None:
        raise _unknown(name)
    return ModelSource(name=name, path=snapshot, hub_id=name)


def _config_for(size: ModelSize, vocab_size: int, special: SpecialIds) -> Any:
    bos = special.bos if special.bos is not None else special.eos
    if size.family == "t5":
        from transformers import T5Config  # heavy: imported when a model is built

        # T5's decoder starts from its pad id.
        return T5Config(vocab_size=vocab_size, decoder_start_token_id=special.pad, pad_token_id=special.pad,
                        eos_token_id=special.eos, **size.config)
    if size.family == "gpt2":
        from transformers import GPT2Config  # heavy: imported when a model is built

        return GPT2Config(vocab_size=vocab_size, bos_token_id=bos, eos_token_id=special.eos,
                          pad_token_id=special.pad, **size.config)
    if size.family == "llama":
        from transformers import LlamaConfig  # heavy: imported when a model is built

        # Llama's embedding freezes its pad row (padding_idx): a tokenizer that pads with its eos has no pad
        # row, and the eos must train.
        pad = None if special.pad == special.eos else special.pad
        return LlamaConfig(vocab_size=vocab_size, bos_token_id=bos, eos_token_id=special.eos, pad_token_id=pad,
                           **size.config)
    raise AssertionError(f"unknown family {size.family}")  # pragma: no cover


def _kind_of(config: Any) -> str:
    return "seq2seq" if getattr(config, "is_encoder_decoder", False) else "causal"


def _model_class(kind: str) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM  # heavy: only when a model is built

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


def read_config(source: ModelSource) -> Any:
    """The transformers config of a directory model (offline).

    Raises:
        ValueError: transformers cannot read it (the message keeps the cause).
    """
    from transformers import AutoConfig  # heavy: only when a model is built

    assert source.path is not None, "a named size has no directory"
    try:
        return AutoConfig.from_pretrained(str(source.path), local_files_only=True)
    except Exception as exc:  # transformers raises many kinds; say which model, keep the cause
        raise ValueError(f"could not read the model config of {source.describe()}: {exc}") from exc


def model_kind(name_or_path: str | os.PathLike[str] | ModelSource) -> str:
    """Whether a model is ``"seq2seq"`` or ``"causal"``, without building it.

    The data must be prepared for the model's kind before the model can be built (the model
    takes its vocabulary from the tokenizer), so the CLI asks this first.

    Args:
        name_or_path: a key of :data:`MODEL_SIZES`, a local model directory, a cached hub id, or
            a resolved :class:`ModelSource`.

    Returns:
        The kind.

    Raises:
        ValueError, FileNotFoundError: as :func:`resolve_model`, or an unreadable config.
    """
    source = name_or_path if isinstance(name_or_path, ModelSource) else resolve_model(name_or_path)
    if source.size is not None:
        return source.size.kind
    return _kind_of(read_config(source))


def _no_config(path: Path) -> ValueError:
    return ValueError(
        f"{path} is a directory without config.json; a model directory needs one "
        f"(e.g. from save_pretrained), or use a known size: {', '.join(MODEL_SIZES)}"
    )


def _set_special_ids(config: Any, special: SpecialIds) -> None:
    """A config-only model is trained from scratch with the run's tokenizer: its special ids are the tokenizer's."""
    config.eos_token_id = special.eos
    config.bos_token_id = special.bos if special.bos is not None else special.eos
    # As for the named sizes: no pad row where the tokenizer pads with its eos (Llama-style padding_idx).
    config.pad_token_id = None if special.pad == special.eos else special.pad
    if getattr(config, "is_encoder_decoder", False):
        config.pad_token_id = special.pad
        config.decoder_start_token_id = special.pad


def _from_directory(source: ModelSource, *, vocab_size: int, seed: int, special: SpecialIds | None) -> ModelSpec:
    config = read_config(source)
    kind = _kind_of(config)
    has_weights = source.has_weights
    try:
        if has_weights:
            if vocab_size > config.vocab_size:
                raise _VocabMismatch(
                    f"the tokenizer has {vocab_size} entries but the model {source.describe()} has "
                    f"{config.vocab_size} embedding rows: use the model's own tokenizer (leave --tokenizer out)"
                )
            model = _model_class(kind).from_pretrained(str(source.path), local_files_only=True, dtype=torch.float32)
        else:
            if config.vocab_size != vocab_size:
                logger.info(
                    "%s: config-only model, vocabulary %d -> %d (the tokenizer's)",
                    source.path,
                    config.vocab_size,
                    vocab_size,
                )
                config.vocab_size = vocab_size
            if special is not None:
                _set_special_ids(config, special)
            model = _seeded_init(config, kind, seed)
    except _VocabMismatch as exc:
        raise ValueError(str(exc)) from None
    except ValueError as exc:
        raise ValueError(
            f"the model {source.describe()} (model_type {getattr(config, 'model_type', '?')!r}) is neither an "
            f"encoder-decoder nor a causal LM that transformers can build: {exc}"
        ) from exc
    _finish(model, kind)
    spec = ModelSpec(
        model=model,
        kind=kind,
        name=source.name,
        num_params=count_params(model),
        config=model.config,
        pretrained=has_weights,
    )
    logger.info("%s %s: %s parameters (%s)", "loaded" if has_weights else "built", source.describe(),
                f"{spec.num_params:,}", f"pretrained, vocab {config.vocab_size}" if has_weights
                else f"initialised from seed {seed}, vocab {vocab_size}")
    return spec


class _VocabMismatch(ValueError):
    """A tokenizer larger than a pretrained model's embedding (kept apart from transformers' ValueErrors)."""


def build_model(name_or_path: str | os.PathLike[str] | ModelSource, *, vocab_size: int, seed: int,
                special: SpecialIds | None = None) -> ModelSpec:
    """Build a model: a named size initialised from ``seed``, or a directory (local or a cached hub id).

    Args:
        name_or_path: a key of :data:`MODEL_SIZES`, a local directory with a ``config.json``
            (weights present: loaded; config only: initialised from ``seed``), a hub id in the
            local Hugging Face cache (:func:`resolve_model`), or a resolved :class:`ModelSource`.
        vocab_size: the tokenizer's vocabulary size (``Data.vocab_size``). A named size uses it
            unless the size pins one; a config-only directory adopts it; a directory with weights
            must have at least this many embeddings.
        seed: initialisation seed; the same seed gives bit-identical weights.
        special: the tokenizer's special ids (``Data.special``), which a model built here (a named
            size, a config-only directory) takes for its pad / eos / bos (T5: decoder start) ids;
            default lowband's own tokenizers' (pad 0, eos 1). A model with weights keeps its own.

    Returns:
        The model spec (float32 model, train mode, on CPU).

    Raises:
        ValueError: an unknown name that is not an existing directory (the message lists the
            known sizes), a directory without a usable config, or a vocabulary mismatch.
        FileNotFoundError: a hub id that is not in the local cache.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    source = name_or_path if isinstance(name_or_path, ModelSource) else resolve_model(name_or_path)
    size = source.size
    if size is None:
        return _from_directory(source, vocab_size=vocab_size, seed=seed, special=special)
    name = source.name
    vocab = size.vocab_size if size.vocab_size is not None else vocab_size
    if vocab < vocab_size:
        raise ValueError(f"{name} pins a vocabulary of {vocab}, smaller than the tokenizer's {vocab_size}")
    model = _seeded_init(_config_for(size, vocab, special or _DEFAULT_IDS), size.kind, seed)
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
