"""A pretrained model and its tokenizer: which tokenizer a run's data is cut with.

A model with weights learned its embeddings for one tokenizer's ids; cut the data with another
and every id means another token to it, and fine-tuning trains on noise. So
(:func:`data_config_for`):

* **By default** a model with weights (a local directory, or a hub id in the local Hugging Face
  cache) uses its own tokenizer: the one saved beside it (``tokenizer.json`` /
  ``tokenizer_config.json``), loaded with transformers' ``AutoTokenizer``, with the special ids its
  configuration names (:func:`lowband.train.tokenizer.load_tokenizer_and_ids`). A model with weights
  and no tokenizer is refused unless ``--tokenizer`` names one.
* **A** ``--tokenizer`` **given with a model with weights** is checked first
  (:func:`check_tokenizer`) and refused, with both named and the fix, unless it fits the model:

  - where the model has its own tokenizer, the same vocabulary (every token at the same id);
    where it has none, a size the embedding can hold: ``size <= rows < size + 1024`` (released
    models pad their embedding past the tokenizer, e.g. T5 32,100 -> 32,128, Qwen2.5
    151,665 -> 151,936; a tokenizer far smaller than the embedding is another tokenizer);
  - and the special ids of the model's config: its eos (one of them where the config lists
    several), its bos, and its pad where the tokenizer has a pad token of its own (one that pads
    with its eos pads masked positions only).

* A named size, or a directory with only a config (trained from scratch), takes the tokenizer the
  data gives (``--tokenizer``, or one trained on the data) and its special ids
  (:func:`lowband.train.models.build_model`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from lowband.train.data.config import DataConfig
from lowband.train.models import ModelSource, model_kind, read_config, resolve_model
from lowband.train.tokenizer import SpecialIds, load_tokenizer_and_ids, tokenizer_size

__all__ = ["PADDING_ROWS", "check_tokenizer", "data_config_for"]

logger = logging.getLogger(__name__)

#: How many more embedding rows than tokenizer entries a model without a tokenizer of its own may have
#: for a ``--tokenizer`` to be taken as its (the padding of released models' vocabularies).
PADDING_ROWS = 1024


def _source(model: str | os.PathLike[str] | ModelSource) -> ModelSource:
    return model if isinstance(model, ModelSource) else resolve_model(model)


def _ids_text(ids: SpecialIds) -> str:
    pad = "none (pads with eos)" if ids.pad == ids.eos else ids.pad
    return f"eos {ids.eos}, bos {ids.bos}, pad {pad}"


def _config_ids(config: Any) -> tuple[list[int], int | None, int | None]:
    """(eos ids, bos id, pad id) of a model config; an empty list / None where it names none."""
    eos = getattr(config, "eos_token_id", None)
    eos_ids = [e for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if isinstance(e, int)]
    return eos_ids, getattr(config, "bos_token_id", None), getattr(config, "pad_token_id", None)


def _id_problems(ids: SpecialIds, config: Any, own: SpecialIds | None) -> list[str]:
    """Where a tokenizer's special ids differ from the model's config (or, where the config names none,
    from the model's own tokenizer)."""
    eos_ids, bos, pad = _config_ids(config)
    if not eos_ids and own is not None:
        eos_ids = [own.eos]
    if bos is None and own is not None:
        bos = own.bos
    if pad is None and own is not None and own.pad != own.eos:
        pad = own.pad
    problems = []
    if eos_ids and ids.eos not in eos_ids:
        problems.append(f"its eos is {ids.eos}, the model's {' or '.join(map(str, eos_ids))}")
    if bos is not None and ids.bos is not None and ids.bos != bos:
        problems.append(f"its bos is {ids.bos}, the model's {bos}")
    if pad is not None and ids.pad != ids.eos and ids.pad != pad:
        problems.append(f"its pad is {ids.pad}, the model's {pad}")
    return problems


def check_tokenizer(tokenizer: str | os.PathLike[str], model: str | os.PathLike[str] | ModelSource) -> None:
    """Refuse a tokenizer that does not fit a model with weights (see the module's docstring for the rule).

    Args:
        tokenizer: a tokenizer directory or ``tokenizer.json`` (``--tokenizer``).
        model: the model (``--model``, or a resolved source); a model without weights takes any tokenizer.

    Raises:
        ValueError: the tokenizer does not fit; the message names the tokenizer (path, size, special
            ids), the model (name, embedding rows, special ids) and the fix.
        FileNotFoundError: no tokenizer at ``tokenizer``.
    """
    source = _source(model)
    if not source.has_weights:
        return
    config = read_config(source)
    rows = int(config.vocab_size)
    tok, ids = load_tokenizer_and_ids(tokenizer)
    size = tokenizer_size(tok)
    problems: list[str] = []
    own_ids: SpecialIds | None = None
    if source.has_tokenizer:
        own, own_ids = load_tokenizer_and_ids(source.path)
        if tok.get_vocab(with_added_tokens=True) != own.get_vocab(with_added_tokens=True):
            problems.append(f"its vocabulary is not the model's own tokenizer's ({tokenizer_size(own)} entries, "
                            f"in {source.path}): the same ids would mean other tokens")
    elif not size <= rows < size + PADDING_ROWS:
        problems.append(f"its {size} entries do not fit the model's {rows} embedding rows (at most {rows}, and "
                        f"fewer than {PADDING_ROWS} rows of padding)")
    problems += _id_problems(ids, config, own_ids)
    if not problems:
        return
    fix = (f"leave --tokenizer out to train with the model's own tokenizer (in {source.path})" if source.has_tokenizer
           else "pass the tokenizer this model was trained with")
    raise ValueError(
        f"--tokenizer {tokenizer} ({size} entries; {_ids_text(ids)}) does not fit the pretrained model "
        f"{source.describe()} ({rows} embedding rows; config: eos {config.eos_token_id}, bos "
        f"{getattr(config, 'bos_token_id', None)}, pad {getattr(config, 'pad_token_id', None)}): "
        f"{'; '.join(problems)}. Fine-tuning on its ids would train the weights on tokens they never saw; {fix}"
    )


def data_config_for(model: str | os.PathLike[str] | ModelSource, data: DataConfig) -> DataConfig:
    """The data configuration a run of ``model`` loads: ``data`` with the model's kind and, for a model
    with weights, the tokenizer it pairs with (its own by default; a ``--tokenizer`` checked by
    :func:`check_tokenizer`).

    Args:
        model: ``--model`` (a named size, a directory, a cached hub id) or a resolved source.
        data: the run's ``[data]`` table.

    Returns:
        The configuration to pass to :func:`lowband.train.data.load_data`.

    Raises:
        ValueError: a model with weights and no tokenizer of its own nor ``--tokenizer``; a tokenizer that
            does not fit it; and as :func:`lowband.train.models.resolve_model`.
        FileNotFoundError: as :func:`lowband.train.models.resolve_model`.
    """
    source = _source(model)
    kind = model_kind(source)
    if not source.has_weights:
        if data.tokenizer is None and source.has_tokenizer:
            logger.info("%s has a tokenizer but no weights: the model is trained from scratch with a tokenizer "
                        "trained on the data (--tokenizer %s takes the directory's)", source.describe(), source.path)
        return dataclasses.replace(data, kind=kind)
    if data.tokenizer is not None:
        check_tokenizer(data.tokenizer, source)
        return dataclasses.replace(data, kind=kind)
    if not source.has_tokenizer:
        raise ValueError(
            f"the pretrained model {source.describe()} has weights but no tokenizer (tokenizer.json / "
            "tokenizer_config.json) beside them, and lowband will not train a new one for pretrained weights (its ids "
            "would mean other tokens to them): pass the tokenizer the model was trained with, --tokenizer PATH"
        )
    own, ids = load_tokenizer_and_ids(source.path)
    config = read_config(source)
    if tokenizer_size(own) > config.vocab_size:
        raise ValueError(f"the tokenizer in {source.path} has {tokenizer_size(own)} entries, more than the model's "
                         f"{config.vocab_size} embedding rows: the model directory is inconsistent; pass the tokenizer "
                         "the model was trained with, --tokenizer PATH")
    mismatch = _id_problems(ids, config, None)
    if mismatch:  # the model's own pairing, as released: say so, and use the tokenizer's ids as transformers would
        logger.warning("%s: its own tokenizer's special ids differ from its config's (%s); the data uses the "
                       "tokenizer's", source.describe(), "; ".join(mismatch))
    logger.info("pretrained model %s: using its own tokenizer (%d entries; %s)", source.describe(),
                tokenizer_size(own), _ids_text(ids))
    return dataclasses.replace(data, kind=kind, tokenizer=str(source.path))
