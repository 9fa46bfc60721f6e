"""Compressed outer traffic of DiLoCo and NoLoCo: the block formats, exact bytes, error feedback, 2 × 2 runs."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from lowband.compress.quant import BlockQuant
from lowband.link import Link
from lowband.optim import DiLoCo, NoLoCo
from lowband.optim._common import state_view
from lowband.testing import full_params, run_ranks, tiny_model, tiny_sharded, tiny_steps
from lowband.topology import Topology

INNER = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01)


# ----------------------------------------------------------------------------- the formats
@pytest.mark.parametrize("n", [1, 255, 256, 257, 1000, 4097])
def test_block_formats_have_the_stated_sizes_and_rounding(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    blocks = -(-n // 256)
    expected = {"fp32": 4 * n, "bf16": 2 * n, "int8": n + 4 * blocks, "int4": -(-n // 2) + 4 * blocks}
    for values, nbytes in expected.items():
        codec = BlockQuant(values)
        buf = codec.encode(x)
        assert buf.dtype == torch.uint8 and buf.numel() == codec.nbytes(n) == nbytes, values
        y = codec.decode(buf, n)
        assert y.shape == (n,) and y.dtype == torch.float32
        if values == "fp32":
            assert torch.equal(x, y)
            continue
        if values == "bf16":
            assert torch.equal(y, x.to(torch.bfloat16).float())
            continue
        levels = 127 if values == "int8" else 7
        pad = torch.nn.functional.pad(x, (0, blocks * 256 - n)).view(blocks, 256)
        half_step = (pad.abs().amax(1) / levels / 2).repeat_interleave(256)[:n]
        assert ((x - y).abs() <= half_step * (1 + 1e-5) + 1e-7).all(), values
        assert torch.equal(codec.decode(codec.encode(x), n), y)  # decoding is deterministic


def test_int8_is_4x_and_int4_8x_smaller_than_fp32_apart_from_scales():
    n = 256 * 1000
    fp32 = BlockQuant("fp32").nbytes(n)
    scales = 4 * 1000
    assert BlockQuant("int8").nbytes(n) - scales == fp32 // 4
    assert BlockQuant("int4").nbytes(n) - scales == fp32 // 8


def test_block_format_rejects_bad_settings_and_zero_blocks_decode_to_zero():
    with pytest.raises(ValueError, match="values must be one of"):
        BlockQuant("int2")
    with pytest.raises(ValueError, match="block"):
        BlockQuant("int8", block=0)
    with pytest.raises(ValueError, match="bytes"):
        BlockQuant("int8").decode(torch.zeros(3, dtype=torch.uint8), 10)
    z = torch.zeros(300)
    assert torch.equal(BlockQuant("int4").decode(BlockQuant("int4").encode(z), 300), z)


def test_optimizers_reject_unknown_outer_formats():
    with pytest.raises(ValueError, match="values must be one of"):
        DiLoCo(tiny_model().parameters(), INNER, values="sign")


# ----------------------------------------------------------------------------- 2 × 2


def _replicas_equal(model, topo) -> bool:
    for p in model.parameters():
        loc = p.to_local().detach().contiguous()
        bufs = [torch.empty_like(loc) for _ in range(topo.replicas)]
        dist.all_gather(bufs, loc, group=topo.replicate_group())
        if not all(torch.equal(bufs[0], b) for b in bufs[1:]):
            return False
    return True


def _quantised_outer(rank: int) -> dict:
    topo = Topology.from_env()
    out: dict = {}
    H, steps = 2, 8
    for method in ("diloco", "noloco"):
        finals = {}
        for values in ("fp32", "bf16", "int8", "int4"):
            model = tiny_sharded(topo)
            link = Link(topo)
            if method == "diloco":
                opt = DiLoCo(model.parameters(), INNER, link=link, sync_every=H, values=values)
            else:
                opt = NoLoCo(model.parameters(), INNER, link=link, sync_every=H, values=values)
            params = list(model.parameters())
            snaps = []
            if values == "int8" and method == "diloco":  # the pseudo-gradient and error before an outer step
                def before(_o, _a, _k, opt=opt, params=params, snaps=snaps):
                    if (opt.inner_steps + 1) % H == 0:
                        snaps.append([(state_view(opt.state[p]["slow"]) - p.to_local()).reshape(-1).clone()
                                      for p in params]
                                     + [state_view(opt.state[p]["error"]).reshape(-1).clone() for p in params])
                opt.inner_optimizer.register_step_post_hook(before)
            traffic = tiny_steps(model, opt, link, rank, range(steps))
            outer = [t for t in traffic if t.ops]
            n = sum(p.to_local().numel() for p in params)
            out[(method, values)] = {
                "ops": [[(o.kind, o.payload_bytes, o.inter_node_bytes_sent) for o in t.ops] for t in outer],
                "n": n,
                "equal": _replicas_equal(model, topo),
                "error_keys": sorted(k for k in opt.state[params[0]] if k.startswith("error")),
            }
            finals[values] = full_params(model)
            if snaps:
                # After the last outer step: e = v − decode(encode(v)) with v = Δ + e_before.
                k = len(params)
                v = torch.cat(snaps[-1][:k]) + torch.cat(snaps[-1][k:])
                codec = BlockQuant("int8")
                expect = v - codec.decode(codec.encode(v), n)
                err = torch.cat([state_view(opt.state[p]["error"]).reshape(-1) for p in params])
                out[(method, "ef_maxdiff")] = (err - expect).abs().max().item()
                out[(method, "ef_norm")] = err.abs().max().item()
        out[(method, "vs_fp32")] = {
            v: max((a - b).abs().max().item() for a, b in zip(finals[v], finals["fp32"], strict=True))
            for v in ("bf16", "int8", "int4")
        }
        out[(method, "moved")] = max((a - b).abs().max().item()
                                     for a, b in zip(finals["fp32"], full_params(tiny_model()), strict=True))
    return out


@pytest.mark.multiprocess
def test_quantised_outer_steps_on_2x2():
    results = run_ranks(_quantised_outer, world_size=4, ranks_per_node=2, timeout_s=240)
    for rank, r in enumerate(results):
        for method in ("diloco", "noloco"):
            for values in ("fp32", "bf16", "int8", "int4"):
                rec = r[(method, values)]
                n = rec["n"]
                assert len(rec["ops"]) == 4, rec["ops"]  # 8 steps, H = 2
                for ops in rec["ops"]:
                    assert len(ops) == 1, ops  # one inter-node operation per outer step, flag inside
                    kind, payload, inter = ops[0]
                    if method == "diloco" and values == "fp32":
                        assert (kind, payload, inter) == ("all_reduce", 4 * (n + 1), 4 * (n + 1))  # R = 2 ring
                    elif method == "diloco":
                        nbytes = BlockQuant(values).nbytes(n) + 1
                        assert (kind, payload, inter) == ("all_gather", nbytes, nbytes)
                    elif values == "fp32":
                        assert (kind, payload, inter) == ("exchange", 4 * (2 * n + 1), 4 * (2 * n + 1))
                    else:
                        nbytes = BlockQuant(values).nbytes(2 * n) + 1
                        assert (kind, payload, inter) == ("exchange", nbytes, nbytes)
                # R = 2: every replica averages the same decoded messages: identical after an outer step.
                assert rec["equal"], (rank, method, values)
                expected_keys = [] if values == "fp32" else (
                    ["error"] if method == "diloco" else ["error_delta", "error_phi"])
                assert rec["error_keys"] == expected_keys
            # Training stays close to the fp32 run: differences well below the distance moved.
            diffs = r[(method, "vs_fp32")]
            assert diffs["bf16"] < 0.05 * r[(method, "moved")], (method, diffs)
            assert diffs["int8"] < 0.1 * r[(method, "moved")], (method, diffs)
            assert diffs["int4"] < 0.5 * r[(method, "moved")], (method, diffs)
        assert r[("diloco", "ef_maxdiff")] < 1e-7 and r[("diloco", "ef_norm")] > 0
