"""Muon on the hidden layers' weight matrices, AdamW on everything else: MuLoCo's inner optimizer.

:class:`MuonAdamW` is the inner optimizer that ``inner=muon`` gives DiLoCo, NoLoCo and SparseLoCo
(:mod:`lowband.train.methods`). It is one ``torch.optim.Optimizer`` over the param groups it is
given, as the outer-step optimizers need (they share those groups with their inner optimizer, see
:class:`~lowband.optim.outer.base.OuterStepOptimizer`), and it delegates both updates to torch:
``torch.optim.Muon`` for the hidden weight matrices, ``torch.optim.AdamW`` for the rest.

Sources: MuLoCo (Thérien et al. 2025, "MuLoCo: Muon is a practical inner optimizer for DiLoCo",
https://arxiv.org/abs/2505.23725); Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/);
Moonlight's learning-rate matching (Liu et al. 2025, "Muon is Scalable for LLM Training",
https://arxiv.org/abs/2502.16982), which scales Muon's step by 0.2·sqrt(max(A, B)) for an A × B
matrix so that its update has AdamW's RMS and one ``lr`` and ``weight_decay`` serve both.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.optim import AdamW, Optimizer

from lowband.optim._common import local

try:  # torch's own Newton–Schulz and lr rule, for FSDP2 shards (MuonAdamW._sharded_muon_step)
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
except ImportError:  # a torch without Muon
    _adjust_lr = _zeropower_via_newtonschulz = None  # type: ignore[assignment]

__all__ = ["INNER_OPTIMIZERS", "MuonAdamW", "has_torch_muon", "hidden_matrices", "muon_missing_message"]

#: The inner optimizers of the outer-step methods by name (``inner=...``): AdamW, or Muon on the
#: hidden weight matrices with AdamW on the rest.
INNER_OPTIMIZERS: tuple[str, ...] = ("adamw", "muon")

#: A parameter name whose module is an embedding or an output layer (for a group given with names
#: and no explicit ``muon_params``): such a 2-D parameter is AdamW's.
_NOT_HIDDEN = re.compile(r"(^|\.)(\w*emb\w*|wte|wpe|shared|lm_head|head|classifier|relative_attention_bias)(\.|$)")


def has_torch_muon() -> bool:
    """Whether this torch has ``torch.optim.Muon`` (and the Newton–Schulz function it steps with)."""
    return hasattr(torch.optim, "Muon") and _zeropower_via_newtonschulz is not None


def muon_missing_message(what: str = "inner=muon", instead: str = "inner=adamw") -> str:
    return (f"{what} needs torch.optim.Muon, which this torch ({torch.__version__}) lacks; upgrade torch or "
            f"use {instead}")


def hidden_matrices(model: nn.Module) -> list[torch.Tensor]:
    """``model``'s 2-D parameters that are neither an embedding's nor the output layer's: Muon's share.

    Excluded: every ``nn.Embedding``'s weight (token and position embeddings, T5's relative
    attention bias, a tied embedding that is also the output projection), and the output layer's
    parameters: ``model.get_output_embeddings()`` where the model has one (transformers models),
    else the last ``nn.Linear`` the model registers (the output of an ``nn.Sequential`` stack).
    Works on an FSDP2-sharded model too: its parameters are the DTensors the optimizer holds.
    """
    skip: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            skip.update(id(p) for p in module.parameters(recurse=False))
    head = None
    get_head = getattr(model, "get_output_embeddings", None)
    if callable(get_head):
        try:
            head = get_head()
        except NotImplementedError:
            head = None
    if not isinstance(head, nn.Module):
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        head = linears[-1] if linears else None
    if head is not None:
        skip.update(id(p) for p in head.parameters(recurse=False))
    return [p for p in model.parameters() if p.ndim == 2 and id(p) not in skip]


class MuonAdamW(Optimizer):
    """torch's Muon on the hidden layers' 2-D weights, torch's AdamW on the rest, over one set of param groups.

    Which parameter gets Muon: those in ``muon_params`` when it is given (each must be 2-D;
    :func:`hidden_matrices` picks them from a model, as ``inner=muon`` does); otherwise every 2-D
    parameter whose name (groups given as ``(name, tensor)`` pairs) does not say embedding or
    output layer (``wte``, ``shared``, ``lm_head``, ``*emb*``, ...). Everything else, embeddings,
    the output head or tied embedding, norms, biases and any tensor that is not 2-D, gets AdamW:
    the split of Moonlight and MuLoCo.

    Both parts are torch's own optimizers, held inside (``muon``, ``adamw``). Before every step
    their param groups are rebuilt from this optimizer's groups, which are the source: ``lr``
    and ``weight_decay`` (both parts; an LR scheduler, or the outer optimizer that shares these
    groups, drives them), ``betas`` and ``eps`` (AdamW), ``muon_momentum``, ``muon_nesterov``,
    ``muon_ns_steps``, ``muon_adjust_lr_fn`` (Muon; prefixed, since an outer optimizer's groups
    hold their own ``nesterov`` and ``momentum``). Their ``state`` is this optimizer's ``state``,
    keyed by parameter as torch's optimizers keep it (Muon's ``momentum_buffer``, AdamW's
    ``step``, ``exp_avg``, ``exp_avg_sq``; the two sets of parameters are disjoint), so
    ``state_dict``/``load_state_dict``, the outer optimizers' per-replica checkpoints and the
    fault-tolerance heal (:mod:`lowband.ft.state`) see one ordinary optimizer.

    ``muon_adjust_lr_fn="match_rms_adamw"`` (the default here; torch's own default is
    ``"original"``) scales Muon's lr by 0.2·sqrt(max(A, B)) for an A × B matrix, so the method's
    one ``lr`` serves both parts (Moonlight).

    FSDP2 shards (DTensor, ``Shard(0)`` over a node's ranks): Newton–Schulz needs the whole
    matrix. torch's Muon does run on DTensor shards (DTensor operations mean the whole matrix), but
    it then exchanges partial products at every iteration: on 2 ranks with gloo, Newton–Schulz over
    32 matrices of t5-mini's shapes took 0.56 s per step that way against 0.075 s gathered, and
    each rank's partial product is rounded to bf16 before the sum (on a 37 × 13 matrix the
    result differed from the unsharded one by 3 % of its largest entry). So a sharded
    matrix takes :meth:`_sharded_muon_step` instead: momentum and the Nesterov blend on the local
    rows (elementwise, as torch's step does them), one all-gather of the blended momentum inside
    the node (``full_tensor()``), torch's own Newton–Schulz (``_zeropower_via_newtonschulz``)
    and lr rule (``_adjust_lr``, with the full shape) on the full matrix on every rank, then this
    rank's rows of the result, decay and step on the local rows. That is torch's Muon step on the
    full matrix, bit for bit (tests/optim/test_muon.py), for one collective per matrix and S-fold
    repeated Newton–Schulz work. Plain tensors (one rank per node) take ``torch.optim.Muon``
    itself.

    Args:
        params: parameters, ``(name, parameter)`` pairs or param groups.
        lr: learning rate of both parts (Muon's scaled as above).
        weight_decay: decoupled weight decay of both parts (θ ← θ·(1 − lr·wd)).
        betas, eps: AdamW's.
        muon_momentum, muon_nesterov, muon_ns_steps, muon_adjust_lr_fn: Muon's ``momentum``,
            ``nesterov``, ``ns_steps`` and ``adjust_lr_fn``.
        muon_params: the parameters to give Muon (2-D, among ``params``), or None: by name as above.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        muon_momentum: float = 0.95,
        muon_nesterov: bool = True,
        muon_ns_steps: int = 5,
        muon_adjust_lr_fn: str | None = "match_rms_adamw",
        muon_params: Iterable[torch.Tensor] | None = None,
    ) -> None:
        if not has_torch_muon():
            raise RuntimeError(muon_missing_message())
        self._chosen = None if muon_params is None else {id(p): p for p in muon_params}
        for p in (self._chosen or {}).values():
            if p.ndim != 2:
                raise ValueError(f"muon_params must be 2-D weight matrices, got a parameter of shape {tuple(p.shape)}")
        self._muon_ids: set[int] = set()
        defaults = dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, muon_momentum=muon_momentum,
                        muon_nesterov=muon_nesterov, muon_ns_steps=muon_ns_steps,
                        muon_adjust_lr_fn=muon_adjust_lr_fn)
        super().__init__(params, defaults)
        if self._chosen is not None:
            mine = {id(p) for g in self.param_groups for p in g["params"]}
            if not set(self._chosen) <= mine:
                raise ValueError("muon_params holds a tensor this optimizer was not given")
        # The parts are made with these hyper-parameters, so they validate them; _sync_parts sets their groups.
        self.muon = torch.optim.Muon([{"params": []}], lr=lr, weight_decay=weight_decay, momentum=muon_momentum,
                                     nesterov=muon_nesterov, ns_steps=muon_ns_steps, adjust_lr_fn=muon_adjust_lr_fn)
        self.adamw = AdamW([{"params": []}], lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        names = group.get("param_names") or [None] * len(group["params"])
        for name, p in zip(names, group["params"], strict=True):
            if self._wants_muon(name, p):
                self._muon_ids.add(id(p))

    def _wants_muon(self, name: str | None, p: torch.Tensor) -> bool:
        if self._chosen is not None:
            return id(p) in self._chosen
        return p.ndim == 2 and not (name is not None and _NOT_HIDDEN.search(name))

    def uses_muon(self, p: torch.Tensor) -> bool:
        """Whether parameter ``p`` takes Muon's step (else AdamW's)."""
        return id(p) in self._muon_ids

    def _sync_parts(self) -> None:
        """The parts' groups from this optimizer's (parameters split, hyper-parameters copied); one state."""
        muon_groups, adamw_groups = [], []
        for i, group in enumerate(self.param_groups):
            mg = self._part_group(self.muon, i)
            ag = self._part_group(self.adamw, i)
            mg["params"] = [p for p in group["params"] if self.uses_muon(p) and not isinstance(p, DTensor)]
            ag["params"] = [p for p in group["params"] if not self.uses_muon(p)]
            mg.update(lr=group["lr"], weight_decay=group["weight_decay"], momentum=group["muon_momentum"],
                      nesterov=group["muon_nesterov"], ns_steps=group["muon_ns_steps"],
                      adjust_lr_fn=group["muon_adjust_lr_fn"])
            ag.update(lr=group["lr"], weight_decay=group["weight_decay"], betas=group["betas"], eps=group["eps"])
            muon_groups.append(mg)
            adamw_groups.append(ag)
        self.muon.param_groups, self.adamw.param_groups = muon_groups, adamw_groups
        self.muon.state = self.adamw.state = self.state

    @staticmethod
    def _part_group(part: Optimizer, index: int) -> dict[str, Any]:
        """The part's group ``index``, with the part's defaults (``foreach``, ``ns_coefficients`` ...)."""
        while len(part.param_groups) <= index:
            part.param_groups.append({**part.defaults, "params": []})
        return part.param_groups[index]

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """One Muon step on the hidden matrices and one AdamW step on the rest."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_parts()
        self.muon.step()
        for group, mg in zip(self.param_groups, self.muon.param_groups, strict=True):
            for p in group["params"]:
                if p.grad is not None and self.uses_muon(p) and isinstance(p, DTensor):
                    self._sharded_muon_step(p, mg)
        self.adamw.step()
        return loss

    def _sharded_muon_step(self, p: DTensor, hp: dict[str, Any]) -> None:
        """torch's Muon step on the full matrix of FSDP2 shard ``p`` (``hp``: the Muon part's group)."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        grad, buf = local(p.grad), local(state["momentum_buffer"])
        buf.lerp_(grad, 1 - hp["momentum"])
        update = grad.lerp(buf, hp["momentum"]) if hp["nesterov"] else buf
        full = DTensor.from_local(update, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride()).full_tensor()
        ortho = _zeropower_via_newtonschulz(full, hp["ns_coefficients"], hp["ns_steps"], hp["eps"])
        mine = DTensor.from_local(ortho, p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False)
        mine = mine.redistribute(p.device_mesh, p.placements).to_local()  # this rank's rows: no exchange
        lr, weight_decay = hp["lr"], hp["weight_decay"]
        x = local(p)
        x.mul_(1 - lr * weight_decay)
        x.add_(mine, alpha=-_adjust_lr(lr, hp["adjust_lr_fn"], p.shape))
