"""lowband.units: numbers with units and comma-separated lists, from text and back."""

from __future__ import annotations

import re

import pytest

from lowband.units import (
    format_bandwidth,
    format_bytes,
    format_count,
    format_rate,
    parse_bandwidth,
    parse_count,
    parse_duration,
    parse_int_list,
    parse_size,
    split_list,
)

# ---------------------------------------------------------------- bandwidth


@pytest.mark.parametrize("text, bps", [("100mbit", 100e6), ("1gbit", 1e9), ("500Mbps", 500e6), ("2.5e8", 2.5e8),
                                       ("1.5 Gbit/s", 1.5e9), (250_000_000, 2.5e8), ("10k", 1e4), ("3g", 3e9),
                                       ("64kbit", 64e3), ("7bps", 7.0), (" 100 MBIT ", 100e6), (1.5e9, 1.5e9)])
def test_parse_bandwidth(text, bps):
    assert parse_bandwidth(text) == pytest.approx(bps)


@pytest.mark.parametrize("text", ["fast", "100mbitz", "", "-5mbit", "0", "mbit", "1.2.3mbit", "0gbit"])
def test_parse_bandwidth_rejects_nonsense(text):
    with pytest.raises(ValueError, match="bandwidth"):
        parse_bandwidth(text)


def test_parse_bandwidth_errors_name_the_value_and_the_units():
    with pytest.raises(ValueError, match=re.escape("cannot parse bandwidth '100parsec': use a number with a unit, "
                                                   "e.g. 100mbit")) as e:
        parse_bandwidth("100parsec")
    assert "units: bit, bps, k, kbit, m, mbit, mbps, g, gbit, gbps" in str(e.value)
    with pytest.raises(ValueError, match=re.escape("cannot parse bandwidth '1.2.3mbit': '1.2.3' is not a number")):
        parse_bandwidth("1.2.3mbit")
    with pytest.raises(ValueError, match=re.escape("bandwidth must be > 0 bit/s, got '-5mbit'")):
        parse_bandwidth("-5mbit")
    with pytest.raises(ValueError, match=re.escape("bandwidth must be > 0 bit/s, got 0")):
        parse_bandwidth(0)


# ---------------------------------------------------------------- duration


@pytest.mark.parametrize("text, seconds", [("50ms", 0.05), ("0.05", 0.05), ("500us", 5e-4), ("2s", 2.0), ("2 S", 2.0),
                                           (".5", 0.5), ("1e-3", 1e-3), ("0", 0.0), (3, 3.0), (0.25, 0.25)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


def test_parse_duration_errors_name_what_and_the_accepted_form():
    with pytest.raises(ValueError, match=re.escape("cannot parse latency '5 parsecs': give seconds or a number with "
                                                   "a unit, e.g. 0.02, 20ms, 500us (units: s, ms, us)")):
        parse_duration("5 parsecs")
    with pytest.raises(ValueError, match=re.escape("cannot parse --ft-timeout 'soon'")):
        parse_duration("soon", what="--ft-timeout")
    for bad in ("-1s", "1m", "", "ms"):
        with pytest.raises(ValueError, match="cannot parse latency"):
            parse_duration(bad)
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="latency must be >= 0 s"):
            parse_duration(bad)


# ---------------------------------------------------------------- size and count


@pytest.mark.parametrize("text, nbytes", [("4MiB", 4 * 2**20), ("4MB", 4_000_000), ("4096", 4096), ("1 KiB", 1024),
                                          ("2gib", 2 * 2**30), ("1.5kB", 1500), ("3b", 3), (7, 7), ("1.9", 1)])
def test_parse_size(text, nbytes):
    assert parse_size(text) == nbytes


def test_parse_size_errors():
    with pytest.raises(ValueError, match=re.escape("cannot parse size 'lots': give a number with an optional unit, "
                                                   "e.g. 4MiB, 4MB, 4194304")):
        parse_size("lots")
    with pytest.raises(ValueError, match=re.escape("cannot parse size '4TB': units are B, kB, MB, GB, KiB, MiB, GiB")):
        parse_size("4TB")
    for bad in ("0", "0.5", 0):
        with pytest.raises(ValueError, match="size must be at least 1 byte"):
            parse_size(bad)


@pytest.mark.parametrize("text, count", [("125M", 125e6), ("1.3B", 1.3e9), ("125e6", 125e6), ("350k", 350e3),
                                         ("2g", 2e9), ("17", 17.0), (2.5, 2.5)])
def test_parse_count(text, count):
    assert parse_count(text) == pytest.approx(count)


def test_parse_count_errors():
    with pytest.raises(ValueError, match=re.escape("cannot parse parameter count 'big': give a number with an "
                                                   "optional unit, e.g. 125e6, 125M, 1.3B")):
        parse_count("big")
    with pytest.raises(ValueError, match=re.escape("cannot parse parameter count '3T': suffixes are k, M, B")):
        parse_count("3T")
    for bad in ("0", 0, float("inf")):
        with pytest.raises(ValueError, match="the model must have > 0 parameters"):
            parse_count(bad)


# ---------------------------------------------------------------- lists


@pytest.mark.parametrize("value, items", [("a,b", ["a", "b"]), (" a , ,b,", ["a", "b"]), ("", []),
                                          (["a,b", "c"], ["a", "b", "c"]), (("x",), ["x"]), ([], [])])
def test_split_list(value, items):
    assert split_list(value) == items


@pytest.mark.parametrize("value, ints", [("0,1,2", [0, 1, 2]), (" 3 ", [3]), (5, [5]), (["1,2", "3"], [1, 2, 3]),
                                         ([4, "5"], [4, 5]), ("-1", [-1])])
def test_parse_int_list(value, ints):
    assert parse_int_list(value, what="--seeds", example="0,1,2") == ints


def test_parse_int_list_errors_name_the_flag_and_an_example():
    with pytest.raises(ValueError, match=re.escape("--seeds: 'x' is not an integer; give a comma-separated list "
                                                   "of integers, e.g. --seeds 0,1,2")):
        parse_int_list("0,x", what="--seeds", example="0,1,2")
    with pytest.raises(ValueError, match=re.escape("--shards is empty; e.g. --shards 1,2")):
        parse_int_list(" , ", what="--shards", example="1,2")
    assert parse_int_list("", what="--replicas", example="4,8", allow_empty=True) == []
    with pytest.raises(ValueError, match=re.escape("--replicas: 1 is out of range; each must be in [2, 64]")):
        parse_int_list("4,1", what="--replicas", example="4,8", minimum=2, maximum=64)
    with pytest.raises(ValueError, match=re.escape("--nodes: 70 is out of range; each must be in [2, 64]")):
        parse_int_list("70", what="--nodes", example="4,8", minimum=2, maximum=64)


# ---------------------------------------------------------------- formatting


@pytest.mark.parametrize("bps, text", [(1e8, "100 Mbit/s"), (1e9, "1 Gbit/s"), (2.5e9, "2.5 Gbit/s"),
                                       (1.2345e8, "123.5 Mbit/s"), (64e3, "64 kbit/s"), (512, "512 bit/s")])
def test_format_bandwidth(bps, text):
    assert format_bandwidth(bps) == text


@pytest.mark.parametrize("bps, text", [(1e9, "1 Gbit/s"), (9.564e7, "95.6 Mbit/s"), (1.2345e8, "123 Mbit/s"),
                                       (512, "512 bit/s")])
def test_format_rate(bps, text):
    assert format_rate(bps) == text


@pytest.mark.parametrize("nbytes, text", [(5e8, "500 MB"), (4194304, "4.19 MB"), (2e9, "2 GB"), (1500, "1.5 kB"),
                                          (999, "999 B"), (0, "0 B")])
def test_format_bytes(nbytes, text):
    assert format_bytes(nbytes) == text


@pytest.mark.parametrize("count, text", [(125e6, "125M"), (1.3e9, "1.3B"), (350e3, "350k"), (17, "17")])
def test_format_count(count, text):
    assert format_count(count) == text


@pytest.mark.parametrize("bps", [64e3, 1e8, 2.5e9, 1e9, 123e6])
def test_format_bandwidth_parses_back(bps):
    assert parse_bandwidth(format_bandwidth(bps)) == pytest.approx(bps)
