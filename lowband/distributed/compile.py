"""``torch.compile`` per transformer block (``lowband train --compile``), and the check that it can run here.

Each block is compiled in place (:meth:`torch.nn.Module.compile`), as torchtitan compiles each
TransformerBlock: after activation checkpointing is applied and before FSDP2 shards the block
(:func:`lowband.distributed.sharding.shard_model` keeps that order). The blocks of a model repeat, so
one compiled graph serves every block of a kind (T5: the encoder's and the decoder's, the first of
each with its relative-position bias apart), for any batch length where batches are padded to their
longest example (their shapes change from step to step); the embeddings, the head, the loss and the optimizers
stay eager, so every method trains a compiled model the same way. In place, parameter names are
unchanged: checkpoints load with and without ``--compile``.

Inductor (the default backend) draws dropout masks from its own random stream unless told to fall
back to eager's: ``fallback_random`` keeps eager's masks, so a compiled run follows the uncompiled
run's trajectory within float noise and a run may resume with or without ``--compile``.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["BACKENDS", "RECOMPILE_LIMIT", "check_compile", "compile_blocks"]

log = logging.getLogger(__name__)

#: Backends ``compile_blocks`` accepts: inductor generates kernels (C++ on the CPU, Triton on a GPU);
#: aot_eager traces forward and backward as inductor does but runs them with eager kernels (no compiler
#: needed: for tests of the wiring).
BACKENDS = ("inductor", "aot_eager")
#: TorchDynamo's recompilations allowed per function, at least (see :func:`compile_blocks`).
RECOMPILE_LIMIT = 64


def check_compile(backend: str = "inductor", device_type: str | None = None) -> None:
    """Raise ValueError, naming the problem and the fix, where ``torch.compile`` with ``backend`` cannot
    run on ``device_type`` ("cpu" or "cuda"; default: cuda when available): a Python that TorchDynamo does
    not support, no C++ compiler for inductor's CPU kernels, or no Triton for its GPU kernels.

    Cheap (no compilation, no process): a compiler that is found but fails on inductor's code fails at the
    first step.
    """
    if backend not in BACKENDS:
        raise ValueError(f"compile backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if not hasattr(nn.Module, "compile"):
        raise ValueError(f"--compile needs torch >= 2.2 (nn.Module.compile); this is torch {torch.__version__}: "
                         "upgrade torch, or leave --compile out")
    from torch._dynamo.eval_frame import check_if_dynamo_supported  # heavy: only a run with --compile pays

    try:
        check_if_dynamo_supported()
    except RuntimeError as e:
        raise ValueError(f"--compile: torch.compile cannot run on this Python ({sys.version.split()[0]}, torch "
                         f"{torch.__version__}): {e}; use a Python this torch supports, or leave --compile out") from None
    if backend != "inductor":
        return
    if device_type == "cpu":
        from torch._inductor import config  # heavy: only a run with --compile pays

        # Inductor's own candidates ($CXX, else g++), looked up on the PATH without running one; a None
        # candidate is a compiler inductor downloads itself when TORCH_INDUCTOR_INSTALL_GXX is set.
        cxx = config.cpp.cxx if isinstance(config.cpp.cxx, list | tuple) else (config.cpp.cxx,)
        if os.environ.get("TORCH_INDUCTOR_INSTALL_GXX") and None in cxx:
            return
        tried = [c for c in cxx if c]
        if not any(shutil.which(c) for c in tried):
            raise ValueError(f"--compile on the CPU needs a C++ compiler for inductor's kernels; none found (tried "
                             f"{', '.join(tried)}): install one (apt-get install g++), or point $CXX at one, or "
                             "leave --compile out")
    elif device_type == "cuda":
        from torch.utils._triton import has_triton  # heavy: only a run with --compile pays

        if not has_triton():
            raise ValueError("--compile on a GPU needs Triton for inductor's kernels, and it is not installed or "
                             "finds no supported GPU: pip install triton (the version your torch names), or leave "
                             "--compile out")


def compile_blocks(blocks: Iterable[nn.Module], backend: str = "inductor", *, dynamic: bool | None = True
                   ) -> list[nn.Module]:
    """Compile each block in place with ``torch.compile`` (``backend``: one of :data:`BACKENDS`); return them.

    ``dynamic``: torch.compile's. True (the default) compiles graphs for any batch length from the start:
    batches padded to their longest example change length from step to step, and the static graphs of the
    first shapes would be compiled only to be dropped. None, for data of one shape (packed blocks): static
    graphs, which compile faster, and dynamic ones only where a shape does change (a last, smaller batch).

    Call it after activation checkpointing and before FSDP2 (:func:`lowband.distributed.sharding.shard_model`
    does). Compilation itself happens at each block's first call, and again where its inputs' shapes or
    its mode (training, validation) change.

    Raises:
        ValueError: no blocks (a model without a recognised block list), or an unknown backend.
    """
    blocks = list(blocks)
    if not blocks:
        raise ValueError("--compile compiles each transformer block, but the model has no recognised block list "
                         "(lowband.train.models.transformer_blocks); leave --compile out for this model")
    if backend not in BACKENDS:
        raise ValueError(f"compile backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    # Every block runs the same Python function (the model's block forward), and TorchDynamo counts its
    # recompilations per function: each kind of block (T5: first or later, encoder or decoder), in training
    # and in validation, and the sizes dynamic shapes still specialise on (a batch of one), reach the default
    # limit of 8, beyond which the blocks would silently run eager.
    import torch._dynamo.config as dynamo_config  # heavy: only a run with --compile pays

    limit = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"  # torch < 2.7
    setattr(dynamo_config, limit, max(getattr(dynamo_config, limit), RECOMPILE_LIMIT))
    # fallback_random: eager's dropout masks (see the module docstring); an inductor-only option.
    options = {"fallback_random": True} if backend == "inductor" else None
    for block in blocks:
        block.compile(backend=backend, options=options, dynamic=dynamic)
    log.info("compiling %d transformer blocks with torch.compile (backend %s) at their first call", len(blocks),
             backend)
    return blocks
