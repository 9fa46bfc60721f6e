"""lowband/compress/check.py: the checks of received messages, on crafted bytes (no optimizer, no processes)."""

from __future__ import annotations

import pytest
import torch

from lowband.compress.check import (
    UNATTRIBUTED,
    BadMessage,
    check_messages,
    dense_problems,
    float_problems,
    mean_flag_problem,
    sparse_problems,
    wire_problems,
)
from lowband.compress.quant import BlockQuant
from lowband.compress.sparse import SparseCodec
from lowband.compress.wire import WireFormat

FLAG0 = torch.zeros(1, dtype=torch.uint8)


def _wire_message(values: str = "fp32", chunk: int = 128) -> tuple[WireFormat, tuple[int, ...], torch.Tensor]:
    wire, rows = WireFormat(chunk, 2, values), (3, 2)
    idx = torch.tensor([[0, 5], [7, 1], [chunk - 1, 3], [2, 4], [6, 9]])
    vals = torch.tensor([[1.0, -2.0], [0.5, 3.0], [-1.0, 1.0], [2.0, -0.25], [4.0, 1.5]])
    payload, _ = wire.encode_many(idx, vals, rows)
    return wire, rows, torch.cat([payload, FLAG0])


def _check_wire(wire, rows, messages, flags=(0, 1)):
    return check_messages(messages, nbytes=wire.payload_nbytes_many(rows) + 1, dtype=torch.uint8,
                          allowed_flags=flags, payload=wire_problems(wire, rows))


@pytest.mark.parametrize("values", ["bf16", "fp32", "sign"])
def test_good_wire_messages_pass(values):
    wire, rows, m = _wire_message(values)
    assert _check_wire(wire, rows, torch.stack([m, m, m])) == []


def test_index_at_or_above_the_chunk_is_named_with_its_sender():
    wire, rows, m = _wire_message("fp32", chunk=128)
    bad = m.clone()
    bad[3] = 255  # a uint8 index byte: 255 >= 128
    (b,) = _check_wire(wire, rows, torch.stack([m, bad, m]))
    assert b.sender == 1 and "index out of range" in b.reason and "chunk 128" in b.reason
    bad[3] = 128  # the first index past the chunk
    assert [x.sender for x in _check_wire(wire, rows, torch.stack([bad, m]))] == [0]


def test_int16_indices_are_checked_against_the_chunk():
    wire = WireFormat(300, 1, "fp32")  # 16-bit indices, stored offset by 32768
    payload, _ = wire.encode_many(torch.tensor([[299]]), torch.tensor([[1.0]]), (1,))
    assert _check_wire(wire, (1,), torch.stack([torch.cat([payload, FLAG0])])) == []
    payload, _ = wire.encode_many(torch.tensor([[300]]), torch.tensor([[1.0]]), (1,))
    (b,) = _check_wire(wire, (1,), torch.stack([torch.cat([payload, FLAG0])]))
    assert "index out of range" in b.reason


@pytest.mark.parametrize("values", ["bf16", "fp32", "sign"])
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_non_finite_value_or_sign_scale_with_a_clean_flag(values, bad_value):
    wire, rows = WireFormat(16, 2, values), (2,)
    vals = torch.tensor([[1.0, bad_value], [0.5, 3.0]])
    payload, _ = wire.encode_many(torch.tensor([[0, 1], [2, 3]]), vals, rows)  # sign: the scale is non-finite
    m = torch.cat([payload, FLAG0])
    (b,) = _check_wire(wire, rows, torch.stack([m]))
    assert b.sender == 0 and "non-finite" in b.reason


def test_flags_are_checked_exactly_and_a_refusal_is_not_looked_into():
    wire, rows, m = _wire_message()
    refusal = torch.zeros_like(m)
    refusal[-1] = 1
    garbage_refusal = m.clone()
    garbage_refusal[3], garbage_refusal[-1] = 255, 1  # flag 1: its payload is never used
    two, minus_one = m.clone(), m.clone()
    two[-1], minus_one[-1] = 2, 255  # −1 as a byte
    bad = _check_wire(wire, rows, torch.stack([m, refusal, garbage_refusal, two, minus_one]))
    assert [(b.sender, "flag" in b.reason) for b in bad] == [(3, True), (4, True)]
    assert _check_wire(wire, rows, torch.stack([two]), flags=(0, 1, 2)) == []  # FlexDeMo's "not counted"


def test_size_of_each_received_message():
    wire, rows, m = _wire_message()
    bad = _check_wire(wire, rows, [m, m[:-2], torch.cat([m, FLAG0]), m.float()])
    assert [b.sender for b in bad] == [1, 2, 3] and all("size" in b.reason for b in bad)


def test_senders_are_named_by_replica_index():
    wire, rows, m = _wire_message()
    bad = m.clone()
    bad[-1] = 7
    out = check_messages([m, bad], nbytes=m.numel(), dtype=torch.uint8, allowed_flags=(0, 1),
                         payload=wire_problems(wire, rows), senders=[4, 9])
    assert out == [BadMessage(9, "flag 7 not in [0, 1]")]
    assert "replica 9" in str(out[0])


@pytest.mark.parametrize("values", ["2bit", "1bit", "bf16", "fp32"])
def test_sparse_codec_indices_values_and_scales(values):
    codec = SparseCodec(128, 2, values, block=4)
    idx = torch.tensor([[0, 127], [5, 6], [1, 2]])
    vals = torch.tensor([[1.0, -2.0], [0.5, 3.0], [-1.0, 1.0]])
    m = torch.cat([codec.encode(idx, vals), FLAG0])

    def check(*msgs):
        return check_messages(torch.stack(msgs), nbytes=m.numel(), dtype=torch.uint8, allowed_flags=(0, 1),
                              payload=sparse_problems(codec, 3))

    assert check(m, m) == []
    high = m.clone()
    high[1] = 200  # uint8 index 200 >= 128
    nan = torch.cat([codec.encode(idx, vals.index_put((torch.tensor([1]), torch.tensor([0])),
                                                      torch.tensor(float("nan")))), FLAG0])
    bad = check(m, high, nan)
    assert [b.sender for b in bad] == [1, 2]
    assert "index" in bad[0].reason and "non-finite" in bad[1].reason  # 2bit/1bit: the block's scale is NaN


@pytest.mark.parametrize("values", ["fp32", "bf16", "int8", "int4"])
def test_dense_formats_values_and_scales(values):
    codec = BlockQuant(values, block=4)
    x = torch.linspace(-1, 1, 10)
    m = torch.cat([codec.encode(x), FLAG0])
    y = x.clone()
    y[3] = float("nan")
    bad_m = torch.cat([codec.encode(y), FLAG0])  # int8/int4: the NaN goes into its block's scale
    out = check_messages(torch.stack([m, bad_m]), nbytes=m.numel(), dtype=torch.uint8, allowed_flags=(0, 1),
                         payload=dense_problems(codec, 10))
    assert [b.sender for b in out] == [1] and "non-finite" in out[0].reason


def test_float_messages_flag_must_be_exactly_zero_or_one():
    good = torch.tensor([1.0, 2.0, 0.0])
    refusal = torch.tensor([0.0, 0.0, 1.0])
    nan_value, half, minus, nan_flag = (torch.tensor(v) for v in
                                        ([float("nan"), 2.0, 0.0], [1.0, 2.0, 0.5], [1.0, 2.0, -1.0],
                                         [1.0, 2.0, float("nan")]))
    out = check_messages([good, refusal, nan_value, half, minus, nan_flag], nbytes=3, dtype=torch.float32,
                         allowed_flags=(0, 1), payload=float_problems)
    assert [b.sender for b in out] == [2, 3, 4, 5]


def test_an_all_reduced_mean_cannot_be_attributed_but_is_checked():
    assert mean_flag_problem(torch.tensor([1.0, 2.0, 0.0]), 2) is None
    assert mean_flag_problem(torch.tensor([0.0, 0.0, 0.5]), 2) is None  # one of two refused
    assert mean_flag_problem(torch.tensor([0.0, 0.0, 1 / 3]), 3) is None
    assert "flag" in mean_flag_problem(torch.tensor([1.0, 0.0, 0.25]), 2)
    assert "flag" in mean_flag_problem(torch.tensor([1.0, 0.0, -0.5]), 2)  # a −1 with nobody refusing
    assert "flag" in mean_flag_problem(torch.tensor([1.0, 0.0, float("nan")]), 2)
    assert "not finite" in mean_flag_problem(torch.tensor([float("nan"), 0.0, 0.0]), 2)
    assert mean_flag_problem(torch.tensor([float("nan"), 0.0, 0.5]), 2) is None  # refused anyway
    # −1 + 1 = 0: a negative flag that cancels another member's refusal looks like a clean sum.
    assert mean_flag_problem(torch.tensor([0.0, 0.0, 0.0]), 2) is None
    assert UNATTRIBUTED == -1
