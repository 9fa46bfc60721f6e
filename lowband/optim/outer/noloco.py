"""NoLoCo: local steps, then an outer step that averages only inside small random groups.

The outer-step template is :class:`~lowband.optim.outer.base.OuterStepOptimizer`; the groups are drawn
by :func:`~lowband.optim.outer.groups.noloco_groups`.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim import Adam

from lowband.comm.link import Link, LinkHandle, PeerTimeoutError
from lowband.compress.check import dense_problems, float_problems
from lowband.optim._common import local, replica_state_like, state_view
from lowband.optim.outer.base import (
    DROP,
    InnerOptimizer,
    OuterFlight,
    OuterStepOptimizer,
    check_unit_interval,
)
from lowband.optim.outer.groups import noloco_group_size, noloco_groups
from lowband.optim.robust import member_weights, robust_pull, trimmed_mean, weighted_sum

__all__ = ["NOLOCO_INNER_DEFAULTS", "NoLoCo"]

log = logging.getLogger(__name__)

#: The inner optimizer NoLoCo builds when given none (Adam), also the defaults of ``lowband train``'s
#: inner lr and weight decay.
NOLOCO_INNER_DEFAULTS: dict[str, float] = {"lr": 4e-4, "weight_decay": 0.0}


class NoLoCo(OuterStepOptimizer):
    r"""NoLoCo: local steps, then an outer step that averages only inside small random groups.

    Paper: Kolehmainen et al., "NoLoCo: No-all-reduce Low Communication Training Method for Large
    Models", 2025, https://arxiv.org/abs/2506.10911. Sign and γ as in the authors' code (see
    docs/algorithms.md, "NoLoCo": +β, γ = β by default).

    On replica i, with φ the slow (outer) weights, θ the fast (inner) weights::

        θ_i ← InnerOpt(θ_i, g)                   # every step (Adam, gradients clipped to 1.0)
        every H steps (outer step k):
            G ← the group of i in noloco_groups(R, n, seed, k)     # same on every rank
            exchange (φ_i, θ_i − φ_i) with the other members of G  # point-to-point, one message
            δ_i ← α·δ_i + β·mean_{j∈G}(θ_j − φ_j) − γ·(φ_i − mean_{j∈G} φ_j)
            φ_i ← φ_i + δ_i ;  θ_i ← φ_i

    No collective spans all replicas: each rank sends one flat buffer (φ and θ − φ of all its
    parameters, and a flag element) to its n − 1 peers with ``Link.exchange`` (batch_isend_irecv).
    With G = all replicas the γ term vanishes and this is DiLoCo with heavy-ball outer momentum
    (η = β, μ = α). When n does not divide R the replicas left over join groups (groups of n + 1).
    A peer that does not answer within ``timeout_s`` raises :class:`~lowband.comm.link.PeerTimeoutError`
    naming it and the group (the process group is then unusable: stop, restart from a checkpoint). A non-finite payload is replaced by zeros and the flag: the whole group raises
    :class:`NonFiniteGradientError` (other groups go on, and meet it at a later outer step).

    Checkpointing is as for :class:`DiLoCo` (φ and δ differ between replicas for good; θ and the
    inner state are stored per replica as well); the seed, group size and counters come back with
    the checkpoint, so a resumed run draws the same groups.

    **Overlap** (``delay=τ``, 1 ≤ τ < H) as for :class:`DiLoCo`: the exchange of (φ_i, θ_sent − φ_i)
    starts after inner step kH (``Link.exchange(..., async_op=True)``, the same bytes), τ inner
    steps run while it travels, then δ_i and φ_i are updated as above from the same messages and
    θ_i ← φ_i + (θ_i − θ_sent). Still point-to-point inside the group only; a refused group raises
    at step kH + τ; checkpoints in flight resume bit for bit; a peer's timeout is raised by the wait.

    **Fault tolerance** (a link with ``ft``, blocking outer step only): the replicas are the live nodes
    of each outer step's torchft quorum, R = ``link.group_size`` and i = ``link.group_rank`` (its
    place in the quorum, the same order on every node); the groups are drawn from them as above, n
    clipped to the live count (:func:`noloco_group_size`: n is checked against the node slots,
    ``--ft-max-nodes``, when NoLoCo is built; alone, a node exchanges nothing). A peer lost during
    the exchange is not raised: the outer step is dropped on this node (φ, δ, θ unchanged, asked
    through ``Link.commit()`` before any change), and at the next quorum torchft heals the node
    from a peer that committed it, if any did (see :meth:`reset_replica_state`). The wait for a
    peer is bounded by ``--ft-timeout``, not ``timeout_s``.

    Param groups are shared with the inner optimizer (``lr`` is the inner lr); ``alpha``, ``beta``,
    ``gamma`` are per group, ``group_size`` and ``seed`` must be the same in all groups.

    Args:
        params: parameters (FSDP2 shards when S > 1), (name, parameter) pairs or param groups.
        inner_optimizer: a factory called with the param groups, an optimizer over the same
            parameters, or None: Adam(lr=4e-4).
        link: the inter-node link; None for a single process.
        sync_every: H, inner steps per outer step (>= 1; paper 50).
        alpha: momentum α of δ, in [0, 1) (paper 0.5).
        beta: weight β of the mean pseudo-gradient, in [0, 1) (paper 0.7); the paper's analysis needs β > α.
        gamma: weight γ ≥ 0 of the pull towards the group's mean φ; None: γ = β.
        group_size: n, replicas per group, 2 ≤ n ≤ R (paper 2).
        seed: seed of the group draws (the same on every rank).
        timeout_s: how long to wait for a peer (> 0); None: the link's ``timeout_s``.
        max_grad_norm: clip the inner gradient's norm to this (paper 1.0); None: no clipping.
        values: wire format of the exchanged φ and θ − φ: ``"fp32"`` (default), ``"bf16"``,
            ``"int8"`` or ``"int4"`` (:mod:`lowband.compress.quant`), each half with its own error
            feedback (``error_phi``, ``error_delta``, per replica); the group mean is taken over the
            decoded messages, the sender's own included, so all members compute the same mean.
            Bytes per peer: 8n + 4 (fp32) or nbytes(2n) + 1.
        quant_block: elements per scale for int8/int4 (default 256).
        delay: τ, as for :class:`DiLoCo` (0 ≤ τ < H; 0: blocking).
        aggregate: how the group's messages are combined (:mod:`lowband.optim.robust`): ``"mean"``
            (default, the paper's), ``"clip"`` (each θ − φ bounded by the group's median norm; in a group
            of 2 the larger brought to the smaller's), ``"trimmed"`` or ``"agree"`` (groups of 3 or more;
            else clip). The φ halves are weights, not updates: under a rule each peer's φ counts by its
            deviation from this replica's own, bounded by the other peers' (the larger of two brought to
            the smaller's), and a peer ``agree`` leaves out of θ − φ is left out of φ too
            (:func:`~lowband.optim.robust.robust_pull`); ``trimmed`` takes both halves' trimmed mean. In
            a group of 2 a peer's φ is averaged as under ``mean`` (nothing to compare it with).

    Attributes:
        last_group: global ranks of this rank's group in the last outer step (under fault tolerance:
            replica ranks in that step's quorum).
        ``last_sync_time_s``, ``inner_steps``, ``outer_steps``: as :class:`DiLoCo`.
    """

    _OUTER_KEYS = ("alpha", "beta", "gamma", "group_size", "seed")
    _ERROR_KEYS = ("error_phi", "error_delta")

    def __init__(
        self,
        params: Iterable,
        inner_optimizer: InnerOptimizer = None,
        *,
        link: Link | None = None,
        sync_every: int = 50,
        alpha: float = 0.5,
        beta: float = 0.7,
        gamma: float | None = None,
        group_size: int = 2,
        seed: int = 0,
        timeout_s: float | None = None,
        max_grad_norm: float | None = 1.0,
        values: str = "fp32",
        quant_block: int = 256,
        delay: int = 0,
        aggregate: str = "mean",
    ) -> None:
        gamma = beta if gamma is None else gamma
        # Under fault tolerance the live replicas are known only at each outer step's quorum: n is
        # checked against the node slots here and clipped to the live nodes at the outer step.
        replicas = link.max_group_size if link is not None else 1
        self._validate(alpha, beta, gamma, group_size, replicas)
        if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds (or None: the link's timeout), got {timeout_s}")
        if replicas == 1:
            log.warning("NoLoCo with a single replica: group_size=%d is ignored and nothing is exchanged",
                        group_size)
        if timeout_s is not None and link is not None and link.ft is not None:
            log.warning("NoLoCo timeout_s=%g is not used under fault tolerance: --ft-timeout bounds the wait "
                        "for a peer", timeout_s)
        super().__init__(
            params,
            inner_optimizer,
            default_inner=lambda groups: Adam(groups, **NOLOCO_INNER_DEFAULTS),
            outer_defaults=dict(alpha=alpha, beta=beta, gamma=gamma, group_size=group_size, seed=seed),
            link=link,
            sync_every=sync_every,
            max_grad_norm=max_grad_norm,
            values=values,
            quant_block=quant_block,
            delay=delay,
            aggregate=aggregate,
        )
        self.timeout_s = timeout_s
        self.last_group: list[int] = []
        self._clipped_for: int | None = None  # the live count n was last clipped to (one warning per change)
        for group in self.param_groups:
            self._validate(group["alpha"], group["beta"], group["gamma"], group["group_size"], replicas)
        if len({(g["group_size"], g["seed"]) for g in self.param_groups}) != 1:
            raise ValueError("group_size and seed must be the same in all param groups (one exchange per outer step)")

    @staticmethod
    def _validate(alpha: float, beta: float, gamma: float, group_size: int, replicas: int) -> None:
        check_unit_interval("alpha", alpha)
        check_unit_interval("beta", beta)
        if not gamma >= 0:
            raise ValueError(f"gamma must be >= 0, got {gamma}")
        if not isinstance(group_size, numbers.Integral) or isinstance(group_size, bool) or group_size < 2:
            raise ValueError(f"group_size (n) must be an integer >= 2, got {group_size!r}")
        if replicas > 1 and group_size > replicas:
            raise ValueError(f"group_size (n) must be in [2, R={replicas}] (the replicas), got {group_size}")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint; its group size n (kept with the state) must fit this run's replicas.

        A run resumed on fewer replicas than n (e.g. after losing nodes) is refused here, before any
        step, rather than at its first outer step.
        """
        replicas = self.link.max_group_size if self.link is not None else 1
        for group in state_dict.get("param_groups", []):
            n = group.get("group_size")
            if n is not None and replicas > 1 and n > replicas:
                raise ValueError(
                    f"the checkpoint's NoLoCo group size n={n} is larger than this run's {replicas} replicas "
                    f"(a checkpoint keeps its hyper-parameters). Resume on at least {n} replicas (nodes × ranks "
                    "per node / --shards), or on a single replica, which exchanges nothing"
                )
        super().load_state_dict(state_dict)

    def _init_outer_state(self, p: torch.Tensor, state: dict) -> None:
        state["delta"] = replica_state_like(p, self._topology)

    @torch.no_grad()
    def reset_replica_state(self) -> None:
        """After this replica copied a live peer's state (fault tolerance): θ ← φ, error feedback 0, δ kept.

        As for :class:`DiLoCo`: the inner weights restart from φ (the peer's inner steps since the last
        outer step would otherwise count twice in the next group mean) and the error feedback
        (``error_phi``, ``error_delta``: what this replica's messages have not sent yet) is zero.
        φ is the peer's, and so is δ, NoLoCo's outer momentum, on purpose: δ is per replica, but it
        is never sent (the messages carry φ and θ − φ), so a copy counts nothing twice; it is the
        momentum of the φ just copied, and (φ, δ) together are where the peer's outer trajectory
        is. Zero would make this replica's next outer step differ from its twin's for no reason
        other than the restart. The replica is then a copy of the peer until the groups and the data
        (each node reads its own slice) make them differ again. (torchft picks the peer per rank: a
        node sharded over several ranks may copy its shards from different peers at the same step.)
        """
        super().reset_replica_state()

    @contextlib.contextmanager
    def _group_timeout(self, outer_index: int, me: int, members: list[int], peers: list[int]):
        """The optimizer's ``timeout_s`` on the link while it waits for the group; a timeout names the group."""
        link = self.link
        saved_timeout = link.timeout_s  # type: ignore[union-attr]
        if self.timeout_s is not None:
            link.timeout_s = self.timeout_s  # type: ignore[union-attr]
        try:
            yield
        except PeerTimeoutError as e:
            raise PeerTimeoutError(
                f"NoLoCo outer step {outer_index}: rank {link.rank} (replica {me}) waited in vain for "  # type: ignore[union-attr]
                f"peer rank(s) {peers} of its group (replicas {members}). {e}"
            ) from e
        finally:
            link.timeout_s = saved_timeout  # type: ignore[union-attr]

    def _wait_outer(self, flight: OuterFlight) -> Any:
        if not isinstance(flight.result, LinkHandle):
            return flight.result
        with self._group_timeout(flight.outer_index, **flight.extra):
            return flight.result.wait()

    def _begin_outer(self, outer_index: int, *, async_op: bool) -> OuterFlight:
        params = self._params()
        link = self.link
        group0 = self.param_groups[0]
        if link is not None:
            # The live replicas (under fault tolerance: the nodes of this outer step's quorum).
            replicas, me, ranks = link.group_size, link.group_rank, link.group_ranks
        else:
            replicas, me, ranks = 1, 0, [0]
        n = self._live_group_size(group0["group_size"], replicas)
        members = next(g for g in noloco_groups(replicas, n, seed=group0["seed"], outer_index=outer_index)
                       if me in g)
        peers = [ranks[j] for j in members if j != me]
        self.last_group = [ranks[j] for j in members]

        # One message: φ of all parameters, then θ − φ, then the flag.
        numel = sum(local(p).numel() for p in params)
        device = local(params[0]).device
        flat = torch.empty(2 * numel + 1, dtype=self._message_dtype(params), device=device)
        offset = 0
        for p in params:
            x, phi = local(p).reshape(-1), state_view(self.state[p]["slow"]).reshape(-1)
            flat[offset:offset + x.numel()].copy_(phi)
            flat[numel + offset:numel + offset + x.numel()].copy_(x).sub_(phi)
            offset += x.numel()
        self._seal(flat, 2 * numel)
        fp_flat = flat
        v = None
        if self.codec.lossy:
            flat, v = self._encode_outer(fp_flat, 2 * numel)
        received: Any = []
        extra = dict(me=me, members=members, peers=peers)
        if peers:
            # Through the outgoing hook, if one is installed (fault injection): else flat itself.
            sent = self._hook_dense(self._hooked(flat, fp_flat, v, 2 * numel), numel, 2 * numel, numel=2 * numel,
                                    codec=self.codec)
            with self._group_timeout(outer_index, **extra):
                received = link.exchange(self._counting(sent), peers, async_op=async_op)  # type: ignore[union-attr]
        return OuterFlight(outer_index, received, flat, fp_flat, v, 2 * numel, extra)

    def _hooked(self, flat: torch.Tensor, fp_flat: torch.Tensor, v: torch.Tensor | None, n: int) -> torch.Tensor:
        """The whole payload, φ and θ − φ, through the outgoing hook's update (a new tensor: the node's own step,
        its error feedback included, goes on from the honest message). ``flat`` itself when nothing changed it."""
        hook = self.outgoing_hook
        if hook is None or fp_flat[-1].item() > 0:
            return flat
        sent = flat.clone()
        if self.codec.lossy:
            changed = v.clone()
            if not hook.update_([changed], self.inner_steps):
                return flat
            sent[:-1] = self.codec.encode(changed)
        elif not hook.update_([sent[:n]], self.inner_steps):
            return flat
        return sent

    def _robust_group_mean(self, messages: list[torch.Tensor], members: list[int], numel: int,
                           me: int) -> torch.Tensor:
        """The group's mean of (φ, θ − φ) under ``aggregate``: the θ − φ halves as updates
        (:func:`~lowband.optim.robust.member_weights`), the φ halves as weights this replica pulls towards
        (:func:`~lowband.optim.robust.robust_pull`, with the members ``agree`` kept for θ − φ)."""
        vectors = [self.codec.decode(m[:-1], 2 * numel) if self.codec.lossy else m[:-1] for m in messages]
        deltas, phis = [v[numel:] for v in vectors], [v[:numel] for v in vectors]
        own = members.index(me)
        if self.aggregate == "trimmed" and len(vectors) >= 3:
            return torch.cat([trimmed_mean(phis), trimmed_mean(deltas)])
        keep, scales = member_weights(deltas, self.aggregate, members=members, tally=self.clip_tally,
                                      where=f"{type(self).__name__} outer step {self.outer_steps}")
        delta = weighted_sum(deltas, scales).div_(int(keep.sum()))
        return torch.cat([robust_pull(phis, own, self.aggregate, keep), delta])

    def _live_group_size(self, n: int, replicas: int) -> int:
        """n for this outer step: :func:`noloco_group_size`, with a warning each time the clip changes."""
        live_n = noloco_group_size(n, replicas)
        if live_n != n and replicas > 1 and replicas != self._clipped_for:
            log.warning("NoLoCo: %d live replicas, fewer than group_size n=%d: this outer step averages over all "
                        "of them (one group)", replicas, n)
        self._clipped_for = replicas if live_n != n else None
        return live_n

    def _end_outer(self, flight: OuterFlight, result: Any) -> str | None:
        flat, fp_flat, numel = flight.message, flight.fp_flat, flight.numel // 2
        me, members = flight.extra["me"], flight.extra["members"]
        others = [j for j in members if j != me]
        received = list(result)
        if len(received) != len(others):
            raise RuntimeError(f"NoLoCo: {len(received)} messages received from {len(others)} peers")
        # Each peer's message is checked (size, flag in {0, 1}, finite values and scales); a bad one is
        # left out: the mean is over this replica and the peers whose messages passed.
        payload = dense_problems(self.codec, 2 * numel) if self.codec.lossy else float_problems
        bad = self._screen(received, others, nbytes=flat.numel(), dtype=flat.dtype, payload=payload)
        by_replica = {me: flat, **{j: m for j, m in zip(others, received, strict=True) if j not in bad}}
        members = [j for j in members if j in by_replica]
        if any(by_replica[j][-1].item() > 0 for j in members):
            return "slow weights or pseudo-gradient of a group member"
        # The same summation order on every member: identical means.
        if self.aggregate != "mean":
            mean = self._robust_group_mean([by_replica[j] for j in members], members, numel, me).to(fp_flat.dtype)
        elif self.codec.lossy:
            mean = self._decoded_mean([by_replica[j] for j in members], 2 * numel, members).to(fp_flat.dtype)
        else:
            mean = by_replica[members[0]][:-1].clone()
            for j in members[1:]:
                mean.add_(by_replica[j][:-1])
            mean.div_(len(members))
        if not self._mean_finite(mean):
            return DROP
        if self.codec.lossy:
            self._commit_error(flat, flight.v, 2 * numel)

        offset = 0
        for group in self.param_groups:
            alpha, beta, gamma = group["alpha"], group["beta"], group["gamma"]
            for p in group["params"]:
                state = self.state[p]
                phi, d = state_view(state["slow"]), state_view(state["delta"])
                n = phi.numel()
                mean_phi = mean[offset:offset + n].view_as(phi)
                mean_delta = mean[numel + offset:numel + offset + n].view_as(phi)
                offset += n
                d.mul_(alpha).add_(mean_delta, alpha=beta)
                if gamma != 0:
                    d.sub_(phi - mean_phi, alpha=gamma)
                phi.add_(d)
                if not self.delay:
                    local(p).copy_(phi)
        return None
