"""Test helpers and fault injection: real gloo ranks for tests, and a poisoning member on purpose.

Names are imported when first used: the rank helpers build models (transformers).
"""

from __future__ import annotations

from lowband.util import lazy_exports

_EXPORTS: dict[str, str] = {
    "LoopbackLink": "lowband.testing.ranks",
    "default_sigint": "lowband.testing.ranks",
    "free_port": "lowband.testing.ranks",
    "full_params": "lowband.testing.ranks",
    "reverse_task_batch": "lowband.testing.ranks",
    "run_ranks": "lowband.testing.ranks",
    "tiny_batch": "lowband.testing.ranks",
    "tiny_loss": "lowband.testing.ranks",
    "tiny_model": "lowband.testing.ranks",
    "tiny_sharded": "lowband.testing.ranks",
    "train_reverse_task": "lowband.testing.ranks",
    "count_launches": "lowband.testing.launches",
    "POISON_KINDS": "lowband.testing.poison",
    "Poison": "lowband.testing.poison",
    "arm_poison": "lowband.testing.poison",
    "lying_message": "lowband.testing.poison",
    "parse_poison": "lowband.testing.poison",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
