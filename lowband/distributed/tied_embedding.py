"""A tied embedding sharded by vocabulary rows over the node's ranks, never gathered whole.

Models such as T5 and GPT-2 use one (V × D) weight twice: the input lookups read its rows and the
output projection multiplies by it. Left to FSDP2 it sits in the root unit, which all-gathers it
for the whole forward and forms its dense (V × D) gradient in backward, two vocabulary-sized
tensors at once on every rank. Here the weight is a DTensor sharded by rows (``Shard(0)``) over
the node's S ranks, as FSDP2 would store it, and excluded from FSDP2 (``ignored_params``); each
rank only ever computes with the V/S rows it holds. Rank r holds rows [lo_r, hi_r).

**Lookups.** The S ranks exchange their token ids (an all-gather of ints); each looks up the ids
that fall in its rows and writes zeros for the rest; a reduce-scatter (sum) of those (S·n × D)
partial embeddings gives every rank its own n tokens' embeddings. Backward all-gathers the
output gradients and adds each owned row into the local gradient shard (``index_add_``).

**Output projection**, two schedules, chosen per call from the largest token count n of the
node's ranks (the same choice on every rank):

* *rows* (n ≤ D): all-gather the hidden states (S·n × D), compute their logits against the local
  rows (S·n × V/S), and trade blocks with an all-to-all so that every rank gets its own n tokens'
  logits over the whole vocabulary. Backward trades the logits' gradient back, multiplies by the
  local rows, and reduce-scatters the hidden-state gradient. The weight never moves; what moves
  is n·V logits, less than the V·D weight when n < D.
* *gather* (n > D, long sequences): the weight is all-gathered for the product and freed, all-
  gathered again in backward, and its dense gradient reduce-scattered at once: FSDP2's own
  schedule for one unit, so large batches cost what they cost before.

The gradient is the mean over the node's ranks, as FSDP2's (sum of every rank's contribution,
divided by S), accumulated in fp32 into ``weight.grad``, a DTensor shard like every other
parameter's. With bf16 (``compute_dtype``) the rows and the hidden states are cast for the
products, and each rank's gradient contribution is cast to fp32 before it is summed, as FSDP2
reduces in fp32. Gradient accumulation needs nothing more: every micro-batch adds into
``weight.grad`` (the exchanges here move activations, so they happen on every micro-batch).

Every rank of the node must run the same sequence of lookups and projections, as for FSDP2's
all-gathers; token counts may differ between ranks (they are exchanged first and padded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

__all__ = ["VocabShard", "ShardedEmbedding", "ShardedTiedProjection", "shard_tied_embedding"]


def _all_gather(*args, **kwargs):
    # torch 2.13 renamed the tensor forms of these collectives (the old names warn); older torch
    # has only those. Looked up at each call, so that wrappers installed on torch.distributed
    # (byte counters) see the calls.
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter(*args, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


@dataclass(eq=False)
class VocabShard:
    """The tied weight's row shard on this rank and the node group it is sharded over."""

    weight: nn.Parameter  # DTensor (V, D), Shard(0) over the node's mesh
    group: dist.ProcessGroup
    size: int  # S
    rank: int  # this rank's index in the node
    bounds: tuple[tuple[int, int], ...]  # (lo, hi) of every rank's rows
    compute_dtype: torch.dtype | None  # bf16 under mixed precision; None: the weight's dtype

    @property
    def vocab(self) -> int:
        return self.weight.shape[0]

    @property
    def rows_max(self) -> int:
        """The most rows any rank holds (torch.chunk's shards: the first ranks' count)."""
        return max(hi - lo for lo, hi in self.bounds)

    @property
    def lo(self) -> int:
        return self.bounds[self.rank][0]

    @property
    def hi(self) -> int:
        return self.bounds[self.rank][1]

    def rows(self) -> torch.Tensor:
        """This rank's (hi − lo, D) rows, fp32, detached (the forward of the functions below)."""
        return self.weight.to_local().detach()

    def dtype(self) -> torch.dtype:
        return self.compute_dtype or self.weight.dtype

    def grad_rows(self) -> torch.Tensor:
        """This rank's rows of ``weight.grad`` (created as zeros when there is none yet), to add into."""
        w = self.weight
        if w.grad is None:
            zeros = torch.zeros_like(w.to_local())
            w.grad = DTensor.from_local(zeros, w.device_mesh, w.placements, run_check=False,
                                        shape=w.shape, stride=w.stride())
        return w.grad.to_local()

    # ------------------------------------------------------------------ collectives
    def max_count(self, n: int, device: torch.device, flag: torch.Tensor | None = None) -> tuple[int, bool]:
        """The largest of the node's ranks' counts n, and whether any rank's ``flag`` (a 0-d bool
        tensor, left on its device) is set: one all-reduce and one read back to the host."""
        t = torch.zeros(2, dtype=torch.int64, device=device)
        t[0] = n
        if flag is not None:
            t[1] = flag
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        m, any_flag = t.tolist()
        return m, bool(any_flag)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(S·m, ...) from every rank's (m, ...), in rank order."""
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        _all_gather(out, x.contiguous(), group=self.group)
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's (m, ...) block of the sum over ranks of every rank's (S·m, ...)."""
        out = x.new_empty((x.shape[0] // self.size, *x.shape[1:]))
        _reduce_scatter(out, x.contiguous(), op=dist.ReduceOp.SUM, group=self.group)
        return out


def _pad_rows(x: torch.Tensor, m: int, value=0) -> torch.Tensor:
    if x.shape[0] == m:
        return x
    pad = x.new_full((m - x.shape[0], *x.shape[1:]), value)
    return torch.cat([x, pad])


class _Lookup(torch.autograd.Function):
    """Embedding rows of ``ids`` from the row-sharded weight; backward adds into the local grad rows."""

    @staticmethod
    def forward(ctx, anchor, ids, shard: VocabShard, padding_idx):
        flat = ids.reshape(-1)
        n = flat.numel()
        low, high = torch.aminmax(flat) if n else (flat.new_zeros(()), flat.new_zeros(()))
        bad = (low < 0) | (high >= shard.vocab)
        m, any_bad = shard.max_count(n, flat.device, bad)  # every rank raises together, none waits
        if any_bad:
            where = f"ids lie in [{int(low)}, {int(high)}]" if bool(bad) else "on another rank of the node"
            raise IndexError(f"token id out of range ({where}): the embedding has {shard.vocab} rows, "
                             f"ids must lie in [0, {shard.vocab - 1}]")
        all_ids = shard.gather(_pad_rows(flat, m, -1))  # -1: padding, owned by nobody
        own = (all_ids >= shard.lo) & (all_ids < shard.hi)
        local_ids = torch.where(own, all_ids - shard.lo, 0)
        part = F.embedding(local_ids, shard.rows()).to(shard.dtype())
        part.masked_fill_(~own.unsqueeze(1), 0)
        out = shard.reduce_scatter(part)[:n]
        keep = own if padding_idx is None else own & (all_ids != padding_idx)  # as nn.Embedding
        ctx.save_for_backward(local_ids, keep)
        ctx.shard, ctx.m = shard, m
        return out.view(*ids.shape, out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        local_ids, keep = ctx.saved_tensors
        shard: VocabShard = ctx.shard
        g = grad_out.reshape(-1, grad_out.shape[-1])
        all_g = shard.gather(_pad_rows(g, ctx.m))  # collective: every rank, even with a frozen weight
        if not shard.weight.requires_grad:
            return None, None, None, None
        grad = shard.grad_rows()
        grad.index_add_(0, local_ids[keep], all_g[keep].to(grad.dtype), alpha=1.0 / shard.size)
        return None, None, None, None


class _Projection(torch.autograd.Function):
    """``h @ weightᵀ`` (logits over the whole vocabulary for this rank's tokens), weight row-sharded."""

    @staticmethod
    def forward(ctx, anchor, h, shard: VocabShard):
        d = h.shape[-1]
        flat = h.reshape(-1, d).to(shard.dtype())
        n = flat.shape[0]
        m, _ = shard.max_count(n, flat.device)
        ctx.shard, ctx.m, ctx.n, ctx.d, ctx.in_dtype = shard, m, n, d, h.dtype
        if m <= d:
            ctx.schedule = "rows"
            all_h = shard.gather(_pad_rows(flat, m))  # (S·m, D)
            ctx.save_for_backward(all_h)
            local = all_h @ shard.rows().to(all_h.dtype).t()  # (S·m, V_r): block j is rank j's tokens
            logits = _trade(local.view(-1), shard, m, to_owner=False)
        else:
            ctx.schedule = "gather"
            ctx.save_for_backward(flat)
            logits = flat @ _gather_weight(shard, flat.dtype).t()
        return logits[:n].view(*h.shape[:-1], shard.vocab)

    @staticmethod
    def backward(ctx, grad_logits):
        shard: VocabShard = ctx.shard
        m, n = ctx.m, ctx.n
        g = grad_logits.reshape(-1, shard.vocab).to(shard.dtype())
        learn = shard.weight.requires_grad
        grad = shard.grad_rows() if learn else None
        scale = 1.0 / shard.size
        if ctx.schedule == "rows":
            (all_h,) = ctx.saved_tensors
            g_local = _trade(_pad_rows(g, m), shard, m, to_owner=True)  # (S·m, V_r)
            # Each owner's partial product, summed over owners in fp32 and rounded once at the end,
            # as one product over the whole vocabulary would be (not S bf16 roundings and a bf16 sum).
            rows = shard.rows().to(g_local.dtype).float()
            grad_h = shard.reduce_scatter(g_local.float() @ rows)[:n]
            for i in range(shard.size if learn else 0):  # each rank's contribution, added in fp32 (FSDP2 reduces in fp32)
                blk = slice(i * m, (i + 1) * m)
                _add_product(grad, g_local[blk].t(), all_h[blk], scale)
        else:
            (flat,) = ctx.saved_tensors
            grad_h = g @ _gather_weight(shard, g.dtype)
            if not learn:
                return None, grad_h.view(*grad_logits.shape[:-1], ctx.d).to(ctx.in_dtype), None
            full = torch.zeros(shard.size * shard.rows_max, flat.shape[-1], dtype=grad.dtype, device=grad.device)
            _add_product(full[:shard.vocab], g.t(), flat, 1.0)
            grad.add_(shard.reduce_scatter(full)[:shard.hi - shard.lo], alpha=scale)
        return None, grad_h.view(*grad_logits.shape[:-1], ctx.d).to(ctx.in_dtype), None


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> None:
    """acc += alpha·(a @ b), the product in a's dtype and the sum in acc's."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b, alpha=alpha)
    else:
        acc.add_(a @ b, alpha=alpha)


def _gather_weight(shard: VocabShard, dtype: torch.dtype) -> torch.Tensor:
    """The whole (V, D) weight in ``dtype`` (the *gather* schedule), shards padded to equal rows."""
    rows = shard.rows().to(dtype)
    full = shard.gather(_pad_rows(rows, shard.rows_max))
    return full[:shard.vocab]  # torch.chunk's shards: only the last ranks are short, so the rows are a prefix


def _trade(flat: torch.Tensor, shard: VocabShard, m: int, *, to_owner: bool) -> torch.Tensor:
    """The all-to-all of the *rows* schedule.

    ``to_owner=False``: ``flat`` is this rank's (S·m, V_r) logits of every rank's tokens against its
    rows; returns this rank's (m, V) logits, the blocks of every owner side by side.
    ``to_owner=True``: ``flat`` is this rank's (m, V) logits' gradient; returns the (S·m, V_r)
    gradient of its rows' logits for every rank's tokens.
    """
    widths = [hi - lo for lo, hi in shard.bounds]
    mine = widths[shard.rank]
    if to_owner:
        send = torch.cat([flat[:, lo:hi].reshape(-1) for lo, hi in shard.bounds])
        recv = send.new_empty(shard.size * m * mine)
        dist.all_to_all_single(recv, send, output_split_sizes=[m * mine] * shard.size,
                               input_split_sizes=[m * w for w in widths], group=shard.group)
        return recv.view(shard.size * m, mine)
    recv = flat.new_empty(m * shard.vocab)
    dist.all_to_all_single(recv, flat, output_split_sizes=[m * w for w in widths],
                           input_split_sizes=[m * mine] * shard.size, group=shard.group)
    out = flat.new_empty(m, shard.vocab)
    offset = 0
    for (lo, hi), w in zip(shard.bounds, widths, strict=True):
        out[:, lo:hi] = recv[offset:offset + m * w].view(m, w)
        offset += m * w
    return out


def _anchor(device: torch.device) -> torch.Tensor:
    # An empty input that requires grad, so that the output does (the weight is not an autograd input).
    return torch.empty(0, device=device, requires_grad=torch.is_grad_enabled())


class ShardedEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose weight is a :class:`VocabShard`'s row-sharded DTensor (``_shard``)."""

    _shard: VocabShard

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _Lookup.apply(_anchor(input.device), input, self._shard, self.padding_idx)


class ShardedTiedProjection(nn.Linear):
    """A bias-free ``nn.Linear`` output projection over a :class:`VocabShard`'s rows (``_shard``)."""

    _shard: VocabShard

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _Projection.apply(_anchor(input.device), input, self._shard)


def shard_tied_embedding(model: nn.Module, embedding: nn.Embedding, head: nn.Linear, mesh,
                         compute_dtype: torch.dtype | None) -> nn.Parameter | None:
    """Replace the weight that ``embedding`` and ``head`` share by a row-sharded DTensor over ``mesh``
    (1-D, the node's ranks) and every module that uses it by its sharded counterpart.

    Returns the new parameter (for ``fully_shard(..., ignored_params=...)``), or None, changing
    nothing, when some use of the weight is not one this module can serve: an embedding with
    ``max_norm``/``scale_grad_by_freq``/``sparse``, a head with a bias or of another type, or any
    other module holding it.
    """
    weight = embedding.weight
    users = [(mod, name) for mod in model.modules() for name, p in mod._parameters.items() if p is weight]
    for mod, name in users:
        if name != "weight":
            return None
        if type(mod) is nn.Embedding:
            if mod.max_norm is not None or mod.scale_grad_by_freq or mod.sparse:
                return None
        elif type(mod) is nn.Linear:
            if mod is not head or mod.bias is not None:
                return None
        else:
            return None
    group = mesh.get_group()
    size, rank = mesh.size(), mesh.get_local_rank()
    vocab = weight.shape[0]
    per = -(-vocab // size)  # torch.chunk's (and DTensor's Shard(0)) split
    bounds = tuple((min(vocab, j * per), min(vocab, (j + 1) * per)) for j in range(size))
    param = nn.Parameter(distribute_tensor(weight.detach(), mesh, [Shard(0)]), requires_grad=weight.requires_grad)
    assert param.to_local().shape[0] == bounds[rank][1] - bounds[rank][0], (param.to_local().shape, bounds)
    shard = VocabShard(param, group, size, rank, bounds, compute_dtype)
    for mod, _ in users:
        mod._parameters["weight"] = param
        mod.__class__ = ShardedEmbedding if type(mod) is nn.Embedding else ShardedTiedProjection
        mod._shard = shard
    return param
