"""Training layer: data, tokenizer, models, the lr schedule (and the training loop, evaluation, checkpoints).

Names are imported lazily, so ``import lowband.train.<module>`` does not pull in transformers
or datasets until a name that needs them is used.
"""

from __future__ import annotations

from lowband.util import lazy_exports

_EXPORTS: dict[str, str] = {
    # the job configuration
    "TrainConfig": "lowband.train.config",
    # data
    "DataConfig": "lowband.train.data",
    "Data": "lowband.train.data",
    "Split": "lowband.train.data",
    "load_data": "lowband.train.data",
    "train_batch": "lowband.train.data",
    "val_batches": "lowband.train.data",
    "val_batch_count": "lowband.train.data",
    "batch_indices": "lowband.train.data",
    "collate": "lowband.train.data",
    "steps_per_epoch": "lowband.train.data",
    "epoch_of": "lowband.train.data",
    "default_corpus_path": "lowband.train.data",
    "describe": "lowband.train.data",
    # tokenizer
    "get_tokenizer": "lowband.train.tokenizer",
    "load_tokenizer": "lowband.train.tokenizer",
    "train_tokenizer": "lowband.train.tokenizer",
    "special_ids": "lowband.train.tokenizer",
    "SpecialIds": "lowband.train.tokenizer",
    "cache_root": "lowband.train.tokenizer",
    "DEFAULT_DATASET_ID": "lowband.train.tokenizer",
    # models
    "MODEL_SIZES": "lowband.train.models",
    "ModelSize": "lowband.train.models",
    "ModelSpec": "lowband.train.models",
    "build_model": "lowband.train.models",
    "model_kind": "lowband.train.models",
    "transformer_blocks": "lowband.train.models",
    "compute_loss": "lowband.train.models",
    "count_params": "lowband.train.models",
    # lr schedule
    "warmup_cosine": "lowband.train.schedule",
    "warmup_cosine_factor": "lowband.train.schedule",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
