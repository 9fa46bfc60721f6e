"""lowband/bench/methods.py: method specs (name:key=value) parse to the trainer's typed config; the registry is in the bench's help."""

from __future__ import annotations

import argparse

import pytest

import lowband.commands.bench as bench
from lowband.bench.methods import METHODS, parse_method_list, parse_method_spec

pytestmark = pytest.mark.timeout(120)


def test_method_spec_parsing() -> None:
    from lowband.train.methods import method_config

    spec = parse_method_spec("flexdemo:topk=8,chunk=64")
    assert spec.name == "flexdemo" and spec.given_values() == {"topk": 8, "chunk": 64}
    assert spec.hp == method_config("flexdemo", {"topk": 8, "chunk": 64})  # typed, checked: the trainer's config
    assert str(spec) == "flexdemo:topk=8,chunk=64"
    assert parse_method_spec(" AdamW ").name == "adamw"
    noloco = parse_method_spec("noloco:H=10,n=2,alpha=0.5")
    # Aliases resolve to the config's field names; the spec prints with the aliases.
    assert noloco.given_values() == {"sync_every": 10, "group_size": 2, "alpha": 0.5}
    assert str(noloco) == "noloco:H=10,n=2,alpha=0.5"
    assert parse_method_spec("diloco:sync_every=10,clip=none").given_values() == {"sync_every": 10,
                                                                               "max_grad_norm": None}
    assert parse_method_spec("deto-full:sign=false").given_values() == {"sign": False}
    # Commas separate specs and a spec's keys alike: key=value pieces belong to the spec before them.
    specs = parse_method_list("adamw,flexdemo:topk=8,chunk=64,demo")
    assert [str(s) for s in specs] == ["adamw", "flexdemo:topk=8,chunk=64", "demo"]
    assert [str(s) for s in parse_method_list(["adamw", "noloco:H=10,n=2"])] == ["adamw", "noloco:H=10,n=2"]
    for bad, words in [
        ("flexdemo:topk=eight", ["topk", "integer"]),
        ("flexdemo:topk=256", ["topk=256", "chunk=128"]),
        ("flexdemo:topk=8,topk=1", ["twice"]),
        ("flexdemo:topk", ["key=value", "chunk"]),
        ("flexdemo:values=int4", ["bf16", "fp32", "sign"]),
        ("demo:shards=2", ["shards", "flexdemo:shards"]),
        ("diloco:lr=0", ["lr", "> 0"]),
        ("diloco:H=5,sync_every=6", ["twice"]),
        ("adamw:nonfinite=maybe", ["raise", "skip"]),
    ]:
        with pytest.raises(ValueError) as err:
            parse_method_spec(bad)
        assert all(w in str(err.value) for w in words), (bad, str(err.value))


def test_methods_registry_is_listed_in_help() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    text = parser.format_help()
    assert all(name in text for name in METHODS)
