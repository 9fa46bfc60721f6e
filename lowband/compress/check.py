"""Checks of received messages, before anything in them is decoded into state or summed.

Every exchange between nodes hands each rank the other members' messages: after an all-gather
(FlexDeMo, SparseLoCo, DiLoCo's quantised formats) the same bytes on every rank, after NoLoCo's
point-to-point exchange the bytes each peer sent this rank. Nothing in them is trusted: an index
at or above the chunk makes the decoder's scatter fail, a NaN value or scale sent with a clean flag
makes φ or the parameters NaN, a flag outside its values refuses (or un-refuses) steps.

This module is pure tensor code on the received bytes. Per message (one row of a gather, or one
received tensor) it checks, in this order:

- **size**: the number of elements (bytes) is what the format gives for this step's layout;
- **flag**: the last element is one of the values the method defines (``allowed_flags``) exactly;
  a message whose flag asks for a refusal or for not being counted is not looked into further;
- **payload** (flag 0): what the format's own check says: indices in [0, chunk) (:func:`wire_problems`,
  :func:`sparse_problems`), decoded values finite (a non-finite scale makes its values non-finite,
  so scales are covered) (:func:`dense_problems`, :func:`float_problems`).

It returns a :class:`BadMessage` (sender, reason) per bad message. Since all ranks of an all-gather
hold the same bytes, they reach the same verdict without another round. A sum (an all-reduce)
cannot be attributed: :func:`mean_flag_problem` checks what is left to check of its result.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lowband.compress.quant import BlockQuant
from lowband.compress.sparse import SparseCodec
from lowband.compress.wire import WireFormat

__all__ = ["BadMessage", "UNATTRIBUTED", "check_messages", "dense_problems", "float_problems",
           "index_and_value_problems", "mean_flag_problem", "payload_faults", "sparse_problems", "wire_problems"]

#: The sender of a bad *sum* (an all-reduce's result): no single member can be named.
UNATTRIBUTED = -1
#: The flag of a message that takes part and must not count: its sender's state is stale (a node healing under fault
#: tolerance, or whose heal was refused). Its payload is zeros; it is left out of the mean, never counted as bad.
NOT_COUNTED = 2

#: Per-row payload check: (rows without the flag, (B, n)) -> a reason per row, or None where it passed.
PayloadCheck = Callable[[torch.Tensor], list]


@dataclass(frozen=True)
class BadMessage:
    """A message that failed its check: ``sender`` is the member's replica index in the exchange's
    group (:data:`UNATTRIBUTED` for a sum), ``reason`` says what was wrong."""

    sender: int
    reason: str

    def __str__(self) -> str:
        who = "an unattributable sum" if self.sender == UNATTRIBUTED else f"replica {self.sender}"
        return f"bad message from {who}: {self.reason}"


def check_messages(messages: torch.Tensor | Sequence[torch.Tensor], *, nbytes: int, dtype: torch.dtype,
                   allowed_flags: Sequence[float], payload: PayloadCheck | None,
                   senders: Sequence[int] | None = None, flags: Sequence[float] | None = None) -> list[BadMessage]:
    """Check received messages, each its payload then one flag element; returns the bad ones.

    Args:
        messages: a (B, n) tensor (an all-gather: row r is replica r's) or a list of 1-D tensors.
        nbytes: elements each message must have (flag included).
        dtype: the dtype each message must have.
        allowed_flags: the flag's values (compared exactly: 0.5 or −1 is not 0 or 1).
        payload: the format's check of the payloads (rows of ``nbytes − 1`` elements), run once on all
            rows with flag 0 that have the right size, or None (no payload check).
        senders: the replica index of each message (default 0, 1, ...).
        flags: each message's flag as already read on the host (default: read here, in one host read).
    """
    rows = list(messages.unbind(0)) if isinstance(messages, torch.Tensor) else list(messages)
    senders = list(range(len(rows))) if senders is None else list(senders)
    if len(senders) != len(rows):
        raise ValueError(f"{len(rows)} messages but {len(senders)} senders")
    bad: list[tuple[int, BadMessage]] = []
    sized = [i for i, row in enumerate(rows) if row.dtype == dtype and row.dim() == 1 and row.numel() == nbytes]
    for i in sorted(set(range(len(rows))) - set(sized)):
        row = rows[i]
        bad.append((i, BadMessage(senders[i], f"size: {tuple(row.shape)} {row.dtype}, expected ({nbytes},) {dtype}")))
    # All flags in one host sync (an all-gather's rows are one tensor).
    if flags is not None:
        flags = [flags[i] for i in sized]
    else:
        flags = (messages[:, -1] if isinstance(messages, torch.Tensor) and len(sized) == len(rows)
                 else torch.stack([rows[i][-1] for i in sized]) if sized else torch.zeros(0)).tolist()
    clean: list[int] = []
    for i, flag in zip(sized, flags, strict=True):
        if (isinstance(flag, float) and not math.isfinite(flag)) or flag not in allowed_flags:
            bad.append((i, BadMessage(senders[i], f"flag {flag!r} not in {sorted(allowed_flags)}")))
        elif flag == 0:
            clean.append(i)
    if payload is not None and clean:
        whole = isinstance(messages, torch.Tensor) and len(clean) == len(rows)
        reasons = payload(messages[:, :-1] if whole else torch.stack([rows[i][:-1] for i in clean]))
        bad.extend((i, BadMessage(senders[i], r)) for i, r in zip(clean, reasons, strict=True) if r is not None)
    return [b for _, b in sorted(bad, key=lambda ib: ib[0])]


# ----------------------------------------------------------------------------- payload checks
def payload_faults(idx: torch.Tensor, vals: torch.Tensor, chunk: int) -> torch.Tensor:
    """(B, ..., k) decoded indices and values -> (B,) bool, True where a row has an index outside
    [0, chunk) or a non-finite value: on the device, without reading it back (the caller reads it
    with whatever else the step must read; :func:`index_and_value_problems` then says what is wrong)."""
    b = idx.shape[0]
    if idx.numel() == 0:
        return torch.zeros(b, dtype=torch.bool, device=idx.device)
    out_of_range = ((idx < 0) | (idx >= chunk)).reshape(b, -1).any(1)
    return out_of_range | (~torch.isfinite(vals)).reshape(b, -1).any(1)


def index_and_value_problems(idx: torch.Tensor, vals: torch.Tensor, chunk: int) -> list:
    """(B, ..., k) indices and values -> per row the first problem: an index outside [0, chunk), a
    non-finite value (a non-finite scale gives non-finite values)."""
    b = idx.shape[0]
    idx, vals = idx.reshape(b, -1), vals.reshape(b, -1)
    if idx.shape[1] == 0:
        return [None] * b
    out_of_range = (idx < 0) | (idx >= chunk)
    nonfinite_mask = ~torch.isfinite(vals)
    if not bool(out_of_range.any() | nonfinite_mask.any()):  # one host sync when all is well
        return [None] * b
    out_of_range = out_of_range.any(1).tolist()
    lo, hi = idx.amin(1).tolist(), idx.amax(1).tolist()
    nonfinite = nonfinite_mask.sum(1).tolist()
    reasons = []
    for r in range(b):
        if out_of_range[r]:
            reasons.append(f"index out of range: indices span [{lo[r]}, {hi[r]}], chunk {chunk}")
        elif nonfinite[r]:
            reasons.append(f"{nonfinite[r]} non-finite value(s) (values or scales) with a clean flag")
        else:
            reasons.append(None)
    return reasons


def wire_problems(wire: WireFormat, rows: tuple[int, ...]) -> PayloadCheck:
    """The payload check of :meth:`WireFormat.encode_many`'s bytes for tensors of ``rows`` chunks."""
    def check(payloads: torch.Tensor) -> list:
        idx, vals = wire.unpack_many(payloads, rows)
        return index_and_value_problems(idx, vals, wire.chunk)
    return check


def sparse_problems(codec: SparseCodec, n_chunks: int) -> PayloadCheck:
    """The payload check of :meth:`SparseCodec.encode`'s bytes for ``n_chunks`` chunks."""
    def check(payloads: torch.Tensor) -> list:
        out = []
        for row in payloads:
            idx, vals = codec.decode(row, n_chunks)
            out.extend(index_and_value_problems(idx.unsqueeze(0), vals.unsqueeze(0), codec.chunk))
        return out
    return check


def dense_problems(codec: BlockQuant, n: int) -> PayloadCheck:
    """The payload check of :meth:`BlockQuant.encode`'s bytes for ``n`` values (finite decoded values)."""
    def check(payloads: torch.Tensor) -> list:
        return float_problems(torch.stack([codec.decode(row, n) for row in payloads]))
    return check


def float_problems(values: torch.Tensor) -> list:
    """(B, n) float values -> per row None, or how many are not finite."""
    if values.shape[1] == 0:
        return [None] * values.shape[0]
    counts = (~torch.isfinite(values)).sum(1).tolist()
    return [f"{c} non-finite value(s) with a clean flag" if c else None for c in counts]


def mean_flag_problem(result: torch.Tensor, members: int) -> str | None:
    """What is wrong with an all-reduced mean of messages with a 0/1 flag as last element, or None.

    A mean cannot say who sent what. What it can show: a non-finite value, or a flag that no count of
    0/1 flags over ``members`` gives (a flag of 0.5, −3, NaN). A negative flag that cancels another
    member's refusal (−1 + 1 = 0) leaves a valid-looking result and is *not* caught.
    """
    flag = float(result[-1].item())
    count = flag * members
    if not math.isfinite(flag) or not -1e-3 <= count <= members + 1e-3 or abs(count - round(count)) > 1e-3:
        return f"the all-reduced flag is {flag!r}, which no count of 0/1 flags over {members} members gives"
    if round(count) == 0 and result.numel() > 1 and not bool(torch.isfinite(torch.stack(torch.aminmax(result[:-1]))).all()):
        return "the all-reduced values are not finite although no member flagged its message"
    return None
