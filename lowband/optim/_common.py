"""Pieces every lowband optimizer shares: local shards, replica-distinct state, the finite check."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from lowband.comm.link import Link
from lowband.compress.check import UNATTRIBUTED, BadMessage
from lowband.distributed.topology import Topology

if TYPE_CHECKING:
    from lowband.optim.robust import ClipTally

log = logging.getLogger(__name__)

__all__ = [
    "NonFiniteGradientError",
    "check_lr",
    "run_closure",
    "local",
    "replica_state_like",
    "check_sharded",
    "grads_nonfinite",
    "all_finite",
    "nonfinite_flag",
    "param_label",
    "NONFINITE_POLICIES",
    "committed",
    "BadMessageTally",
]

NONFINITE_POLICIES = ("raise", "skip")


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN or Inf; the step was refused and nothing was sent or changed."""


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def param_label(group: dict, i: int, p: torch.Tensor) -> str:
    names = group.get("param_names")
    if names is not None and i < len(names):
        return f"'{names[i]}'"
    return f"#{i} of shape {tuple(p.shape)}"


def check_sharded(param_groups: list[dict], topology: Topology | None) -> None:
    """With S > 1 every parameter must be an FSDP2 shard (a DTensor sharded over the node)."""
    if topology is None or topology.shards == 1 or not dist.is_initialized():
        return
    for group in param_groups:
        for i, p in enumerate(group["params"]):
            if not isinstance(p, DTensor) or not any(isinstance(pl, Shard) for pl in p.placements):
                raise ValueError(
                    f"parameter {param_label(group, i, p)} is not sharded by FSDP2, but the topology shards "
                    f"each model copy over {topology.shards} ranks. Call lowband.distributed.sharding.shard_model(model, "
                    "topology) before building the optimizer (or use shards=1)."
                )


def replica_state_like(p: torch.Tensor, topology: Topology | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A zero state tensor shaped like ``p`` that may differ between replicas.

    Momentum and error feedback are per replica: each replica has its own. To save and load them
    with torch.distributed.checkpoint (which keeps one copy of replicated data), the state is a
    DTensor over the 2-D mesh whose global shape is (R, *p.shape): replica r holds row r.
    Single-process: a plain tensor.
    """
    lp = local(p)
    dtype = dtype or lp.dtype
    if topology is None or not dist.is_initialized() or topology.world_size == 1:
        return torch.zeros_like(lp, dtype=dtype)
    mesh = topology.mesh()
    local_state = torch.zeros((1, *lp.shape), dtype=dtype, device=lp.device)
    if isinstance(p, DTensor):
        (pl,) = p.placements
        inner = Shard(pl.dim + 1) if isinstance(pl, Shard) else Replicate()
        gshape = (topology.replicas, *p.shape)
    else:
        inner = Replicate()
        gshape = (topology.replicas, *lp.shape)
    stride = torch.empty(gshape, device="meta").stride()
    return DTensor.from_local(local_state, mesh, [Shard(0), inner], run_check=False, shape=gshape, stride=stride)


def state_view(t: torch.Tensor) -> torch.Tensor:
    """This replica's row of a :func:`replica_state_like` tensor, as a plain tensor (shares storage)."""
    if isinstance(t, DTensor):
        return t.to_local()[0]
    return t


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """True if no tensor holds NaN or Inf: :func:`nonfinite_flag`, read once. Empty tensors are finite."""
    device = tensors[0].device if tensors else torch.device("cpu")
    return not bool(nonfinite_flag(tensors, device).item())


def nonfinite_flag(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Whether some tensor holds NaN or Inf, left on the device: a one-element uint8 tensor (1: some does), read
    by nobody here (it travels in a message and is read with the exchange, or by :func:`all_finite`).

    On the CPU each tensor's min and max (``torch.aminmax``: both are finite exactly when every element is; it
    reads each element once without a temporary, much cheaper there than the infinity norm); elsewhere one
    multi-tensor infinity norm for all (NaN and ±Inf make a tensor's largest |x| NaN or Inf), which launches
    one kernel instead of one per tensor. Ends of several dtypes are compared in float64, which holds every
    float's value.
    """
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros(1, dtype=torch.uint8, device=device)
    if device.type == "cpu":
        ends = [end for t in tensors for end in torch.aminmax(t)]
    else:
        ends = list(torch._foreach_norm(tensors, float("inf")))
    if len({e.dtype for e in ends}) > 1:
        ends = [e.double() for e in ends]
    return (~torch.isfinite(torch.stack(ends)).all()).to(torch.uint8).reshape(1)


def grads_nonfinite(grads: list[torch.Tensor], link: Link | None, *, shard_group=None) -> bool:
    """True if any rank of the job holds a NaN/Inf gradient. Collective: every rank must call it.

    The flag is reduced inside the node (shard group, fast links) and then between nodes through
    the link (one byte), so that all ranks agree before anything is sent or changed; it is read on
    the host once (:func:`nonfinite_flag`: one reduction per gradient, no read per gradient).
    """
    device = grads[0].device if grads else torch.device("cpu")
    flag = nonfinite_flag(grads, device)
    if shard_group is not None and dist.get_world_size(shard_group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=shard_group)
    if link is not None and link.group_size > 1:
        link.all_reduce(flag, op="max")
    return bool(flag.item())


def run_closure(closure) -> Any:
    """The torch.optim closure contract: re-evaluate the loss with gradients on; None without a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def check_lr(lr: Any) -> None:
    """ValueError unless ``lr`` > 0 (a tensor lr, as torch's optimizers accept, is not checked)."""
    if not isinstance(lr, torch.Tensor) and not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")


def committed(link: Link | None) -> bool:
    """Whether the step's exchanges may be applied (:meth:`lowband.comm.link.Link.commit`); True without a link.

    Every optimizer asks once per communicating step, after its last collective and before it
    changes any state: under fault tolerance a step whose exchange failed anywhere in the node is
    dropped whole, on every rank of the node.
    """
    if link is None or link.commit():
        return True
    log.warning("a collective between nodes failed: step dropped (state unchanged); the next step runs on the "
                "nodes that are left")
    return False


def membership_key(link: Link | None) -> Any:
    """Who the exchange's replica indices name: under fault tolerance the quorum's replica ids, else None."""
    ft = getattr(link, "ft", None)
    ids = getattr(ft, "replica_ids", None) if ft is not None else None
    return tuple(ids) if ids else None


#: A member whose messages failed their check this many exchanges in a row is evicted from the exchange.
EVICT_AFTER = 3
_UNSET = object()


class BadMessageTally:
    """Received messages that failed their check, per sender: totals, bad exchanges in a row, and evictions.

    ``total[s]`` counts sender s's bad messages over the run; ``in_a_row[s]`` its current run of
    consecutive checked exchanges with a bad message (reset by a good one). After :data:`EVICT_AFTER`
    in a row the sender is *evicted* from the exchange: whatever it sends later, well-formed or not, is
    left out (:meth:`evicted_among`), until the membership changes (:meth:`membership`). An honest node
    never sends a malformed message (its own check flags the step instead), so the count needs no
    patience. Under fault tolerance with the job's secret each rank reports the members it evicted to the
    Lighthouse's gate, which removes one from the quorum once most of the other members reported it
    (:meth:`lowband.ft.node.FaultTolerance.report_bad`, docs/trust.md).
    """

    def __init__(self) -> None:
        self.total: dict[int, int] = {}
        self.in_a_row: dict[int, int] = {}
        self.evicted: set[int] = set()  # under the current membership
        self.ever_evicted: set[int] = set()  # over the run (each sender's place then)
        self.reason: dict[int, str] = {}  # each sender's last bad message: what was wrong
        self._members: Any = _UNSET

    def membership(self, key: Any) -> None:
        """The exchange's members as a comparable ``key`` (under fault tolerance, the quorum's replica ids; None
        without). When it changes the replica indices name other members: runs in a row and evictions restart."""
        if key != self._members:
            if self._members is not _UNSET:
                self.in_a_row.clear()
                self.evicted.clear()
            self._members = key

    def evicted_members(self) -> dict[str, str]:
        """Under fault tolerance, the evicted senders by the replica id they had in the exchange that evicted them
        (the membership key then; the quorum may have changed since), each with what was wrong with its last bad
        message; {} without fault tolerance."""
        ids = self._members if isinstance(self._members, tuple) else ()
        return {ids[s]: self.reason.get(s, "bad messages") for s in sorted(self.evicted) if 0 <= s < len(ids)}

    def evicted_among(self, senders: Iterable[int], known: Iterable[BadMessage] = ()) -> list[BadMessage]:
        """The evicted ``senders`` not already in ``known``, as bad messages (left out like them)."""
        named = {b.sender for b in known}
        return [BadMessage(s, f"evicted after {EVICT_AFTER} bad messages in a row")
                for s in senders if s in self.evicted and s not in named]

    def record(self, bad: list[BadMessage], checked: Iterable[int], what: str, outcome: str) -> None:
        """Count ``bad`` among the senders ``checked`` in one exchange and warn, naming each sender (an evicted one
        only when it is evicted).

        ``what``: the exchange (e.g. "FlexDeMo step 12"); ``outcome``: what the step does about it."""
        senders = {b.sender for b in bad}
        for s in checked:
            if s not in senders:
                self.in_a_row.pop(s, None)
        for s in senders:
            self.total[s] = self.total.get(s, 0) + 1
            self.in_a_row[s] = self.in_a_row.get(s, 0) + 1
        for b in bad:
            if b.sender in self.evicted:
                continue
            self.reason[b.sender] = b.reason
            log.warning("%s: %s; %s (%d bad from this sender, %d in a row)", what, b, outcome,
                        self.total[b.sender], self.in_a_row[b.sender])
            if b.sender != UNATTRIBUTED and self.in_a_row[b.sender] >= EVICT_AFTER:
                self.evicted.add(b.sender)
                self.ever_evicted.add(b.sender)
                log.warning("%s: replica %d is evicted from the exchange after %d bad messages in a row: nothing it "
                            "sends is used until the membership changes (under fault tolerance with a secret it is "
                            "reported to the Lighthouse's gate, which removes it from the quorum once most members "
                            "report it)", what, b.sender, self.in_a_row[b.sender])


def screening_counts(bad: BadMessageTally, clip: ClipTally | None = None) -> dict[str, Any]:
    """What an exchange refused or weakened, as :class:`lowband.optim.protocol.OptimizerStats` fields: the bad
    messages by sender (total and in a row), the evicted senders and, with robust aggregation's ``clip`` tally,
    the updates clipped or left out per member and how often the rule decided."""
    counts: dict[str, Any] = {"bad_messages": dict(bad.total), "bad_in_a_row": dict(bad.in_a_row),
                              "evicted": sorted(bad.ever_evicted)}
    if clip is not None:
        counts.update(clipped=dict(clip.clipped), left_out=dict(clip.left_out), aggregations=clip.decisions)
    return counts


def outvoted_refusals(flags: dict[int, float], aggregate: str, *, own: int | None) -> tuple[list[BadMessage], bool]:
    """The refusals (flag 1) of a minority of an exchange's members, under a robust ``aggregate``.

    ``flags``: the flag of each sender whose message passed its check. A member may send a flag of 1
    whenever it likes, and under the papers' rule (``"mean"``) any refusal stops every replica's step;
    under ``"clip"``, ``"trimmed"`` or ``"agree"`` the refusals of fewer than half of these members are
    left out instead, like messages that failed their check (named, counted, evicted after 3 in a row),
    and the others step. Returns those senders, less this replica's (``own``), as bad messages, and
    whether this replica's own refusal is among them (its own policy then decides).
    """
    refusing = [s for s, f in flags.items() if f == 1]
    if aggregate == "mean" or not refusing or 2 * len(refusing) >= len(flags):
        return [], False
    reason = f"refused its step (flag 1) while most members did not: left out (aggregate={aggregate!r})"
    return [BadMessage(s, reason) for s in refusing if s != own], own in refusing
