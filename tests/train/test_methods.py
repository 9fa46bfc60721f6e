"""lowband/train/methods.py: The typed method configs: one source for defaults, flags, spec keys, checks and labels (no processes)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch

from lowband.bench.methods import method_label, parse_method_spec, shown_params, train_hp_args
from lowband.optim import AdamWFullSync, DetoFull, DiLoCo, FlexDeMo, MuonFullSync, NoLoCo, SparseLoCo
from lowband.optim.muon import MuonAdamW
from lowband.optim.outer.diloco import DILOCO_INNER_DEFAULTS
from lowband.optim.outer.noloco import NOLOCO_INNER_DEFAULTS
from lowband.optim.outer.sparseloco import SPARSELOCO_INNER_DEFAULTS
from lowband.train.args import add_arguments, config_from_args
from lowband.train.methods import (
    ALIASES,
    METHODS,
    TRAINER_DEFAULTS,
    build_optimizer,
    check_hyperparameters,
    demo_method,
    display_name,
    hp_fields,
    hp_flag,
    method_config,
    reference_method,
)

OPTIMIZER = {"AdamWConfig": AdamWFullSync, "MuonConfig": MuonFullSync, "DetoFullConfig": DetoFull, "FlexDeMoConfig": FlexDeMo,
             "DiLoCoConfig": DiLoCo, "NoLoCoConfig": NoLoCo, "SparseLoCoConfig": SparseLoCo}
INNER = {"DiLoCoConfig": DILOCO_INNER_DEFAULTS, "NoLoCoConfig": NOLOCO_INNER_DEFAULTS,
         "SparseLoCoConfig": SPARSELOCO_INNER_DEFAULTS}


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def _optimizer_default(config: type, name: str):
    """The default the optimizer class itself has for ``name`` (inner lr/weight_decay, AdamW's betas)."""
    cls = OPTIMIZER[config.__name__]
    if name in ("lr", "weight_decay") and config.__name__ in INNER:
        return INNER[config.__name__][name]
    if name == "overlap" and config.__name__ in INNER:
        return False  # DiLoCo/NoLoCo: overlap=true is a spelling of delay=1, not an optimizer argument
    if name == "inner" and config.__name__ in INNER:
        return "adamw"  # which factory the config builds, not an optimizer argument; AdamW as before
    if name in ("beta1", "beta2"):
        return inspect.signature(torch.optim.AdamW).parameters["betas"].default[name == "beta2"]
    params = inspect.signature(cls.__init__).parameters
    if name not in params:  # AdamWFullSync passes the rest on to torch.optim.AdamW, MuonFullSync to MuonAdamW
        params = inspect.signature({AdamWFullSync: torch.optim.AdamW, MuonFullSync: MuonAdamW}[cls]).parameters
    return params[name].default


def test_defaults_are_the_optimizers_except_the_documented_trainer_choices():
    differs = set()
    for config in {m.config for m in METHODS.values()}:
        for f in dataclasses.fields(config):
            if f.default != _optimizer_default(config, f.name):
                differs.add((config.__name__, f.name))
    assert differs == set(TRAINER_DEFAULTS)


def test_every_field_is_a_flag_and_reaches_the_config():
    for method, spec in METHODS.items():
        for f in dataclasses.fields(spec.config):
            value = {bool: "false", int: "3", float: "0.25", str: (f.metadata["choices"] or ("x",))[-1]}
            base = {"bool": bool, "int": int, "float": float, "str": str}[f.type.split(" |")[0]]
            args = _parse("--method", method, hp_flag(f.name), value[base])
            try:
                want = method_config(method, {f.name: base(value[base]) if base is not bool else False})
            except ValueError:  # the value breaks a rule between fields (topk > chunk): refused the same way
                with pytest.raises(ValueError):
                    config_from_args(args)
                continue
            assert config_from_args(args).method.hp == want, (method, f.name)
            # the same flag spelled by its table: --method.<field>
            assert config_from_args(_parse("--method", method, f"--method.{f.name}", value[base])).method.hp == want

    def hp(*argv: str):
        return config_from_args(_parse(*argv)).method.hp

    assert hp("--method", "flexdemo", "--nonfinite", "skip") == method_config("flexdemo", {"nonfinite": "skip"})
    # Old flag names stay as aliases; --hp takes field names or aliases, a value given twice is an error.
    assert hp("--method", "diloco", "--clip", "0.5") == method_config("diloco", {"max_grad_norm": 0.5})
    assert hp("--method", "noloco", "--gossip-seed", "3") == method_config("noloco", {"seed": 3})
    assert hp("--method", "diloco", "--max-grad-norm", "none") == method_config("diloco", {"max_grad_norm": None})
    assert hp("--method", "noloco", "--hp", '{"n": 4}') == method_config("noloco", {"group_size": 4})
    with pytest.raises(ValueError, match="sync_every given both"):
        config_from_args(_parse("--method", "diloco", "--sync-every", "4", "--hp", '{"H": 5}'))
    with pytest.raises(SystemExit):
        _parse("--method", "flexdemo", "--nonfinite", "sometimes")


def test_bench_spec_trainer_flags_and_labels_agree():
    spec = parse_method_spec("noloco:H=10,n=4,clip=0.5,seed=2,lr=0.003")
    params = spec.given_values()
    assert params == {"sync_every": 10, "group_size": 4, "max_grad_norm": 0.5, "seed": 2, "lr": 0.003}
    cfg = config_from_args(_parse("--method", "noloco", *train_hp_args(params)))
    assert cfg.method.hp == method_config("noloco", params)
    assert method_label("noloco", params) == "NoLoCo H=10 n=4 clip=0.5 seed=2 lr=0.003"
    assert set(ALIASES) == {"H", "n", "clip"}


@pytest.mark.parametrize("method", list(METHODS))
def test_each_config_builds_its_optimizer_with_its_values(method):
    model = torch.nn.Linear(4, 4)
    hp = check_hyperparameters(method, {"lr": 0.0123})
    opt = build_optimizer(method, model.named_parameters(), link=None, hp={"lr": 0.0123})
    group = opt.param_groups[0]
    assert group["lr"] == 0.0123
    for key in set(hp) & set(group) - {"lr", "gamma"}:  # NoLoCo stores gamma=None as beta
        assert group[key] == hp[key], (method, key)
    if method == "adamw":
        assert group["betas"] == (hp["beta1"], hp["beta2"])
    if method in ("diloco", "noloco"):
        assert opt.sync_every == hp["sync_every"] and opt.max_grad_norm == hp["max_grad_norm"]


@pytest.mark.parametrize(("method", "hp", "words"), [
    ("flexdemo", {"topk": 9, "chunk": 8}, ["topk=9", "chunk=8"]),
    ("flexdemo", {"topk": "8"}, ["topk", "integer"]),
    ("diloco", {"H": 0}, ["sync_every", ">= 1"]),
    ("noloco", {"n": 1}, ["group_size", ">= 2"]),
    ("adamw", {"beta2": 1.0}, ["beta2", "below 1"]),
    ("deto-full", {"nonfinite": "ignore"}, ["raise", "skip"]),
    ("adamw", {"topk": 1}, ["no hyper-parameter 'topk'", "lr"]),
])  # fmt: skip
def test_bad_values_are_refused_naming_the_field(method, hp, words):
    with pytest.raises(ValueError) as err:
        check_hyperparameters(method, hp)
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_registered_optimizer_speaks_the_trainers_protocol(method):
    """The trainer asks every optimizer the same few things (no attribute probes): communicates_next,
    reset_replica_state, flush, stats, state_owners."""
    from lowband.optim import LowbandOptimizer, OptimizerStats

    model = torch.nn.Linear(4, 2)
    opt = method_config(method, {}).build(list(model.named_parameters()), link=None, model=model)
    assert isinstance(opt, LowbandOptimizer)
    stats = opt.stats()
    assert isinstance(stats, OptimizerStats) and stats.dropped_steps == 0 and stats.skipped_steps == 0
    assert (stats.outer_steps is not None) == (METHODS[method].family == "local")
    owners = opt.state_owners()
    assert owners[0] is opt and all(isinstance(o, torch.optim.Optimizer) for o in owners)
    opt.flush()
    assert isinstance(opt.communicates_next(), bool)


def test_method_traits_in_the_registry():
    """One reference method (AdamW, the quality target), unique report names, the shard sweep's members,
    gossip where the config has a group size, and DeMo / FlexDeMo by shard count."""
    assert [m.name for m in METHODS.values() if m.reference] == ["adamw"] and reference_method() == "adamw"
    displays = [m.display for m in METHODS.values()]
    assert len(set(displays)) == len(displays)
    assert display_name("flexdemo") == "FlexDeMo" and display_name("adamw") == "AdamW"
    assert display_name("not-a-method") == "not-a-method"
    assert {m.name for m in METHODS.values() if m.shard_sweep} == {"deto-full", "demo", "flexdemo"}
    assert all(m.gossip == ("group_size" in hp_fields(m.name)) for m in METHODS.values())
    assert demo_method(1) == "demo" and demo_method(2) == demo_method(4) == "flexdemo"


_LOWBAND = Path(__file__).resolve().parents[2] / "lowband"
#: Where a method's name may be tested: the registry itself and the optimizers.
_NAMES_ALLOWED_IN = ("train/methods.py", "optim/")
#: The left side of a comparison with a family: ``spec.family`` or ``family_of(...)``.
_FAMILY = re.compile(r"(\.family|\bfamily_of\([^()]*\))\s*$")


def method_name_tests(root: Path) -> list[str]:
    """``file:line: text`` of every test of a method's name as a literal under ``root`` (a package dir).

    ``== "demo"``, ``"demo" !=``, ``in ("demo", "flexdemo")``, ``NAMES["adamw"]``, ``method_config("noloco")``.
    """
    names = "|".join(re.escape(n) for n in METHODS)
    q = rf"""["'](?:{names})["']"""
    pattern = re.compile("|".join([
        rf"[=!]=\s*{q}", rf"{q}\s*[=!]=",   # comparisons
        rf"\bin\s*[(\[{{][^)\]}}]*{q}",      # membership in a literal tuple, list or set
        rf"(?<=[\w)\]])\[\s*{q}\s*\]",      # a lookup by name
        rf"\w\(\s*{q}\s*\)",                 # a call with the name alone
    ]))  # fmt: skip
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(_NAMES_ALLOWED_IN):
            continue
        text = path.read_text()
        for m in pattern.finditer(text):
            before = text[text.rfind("\n", 0, m.start()) + 1:m.start()]
            if _FAMILY.search(before):  # family == "demo": the family's name, a trait, not the method's
                continue
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"{rel}:{line}: {m.group(0)!r}")
    return found


def test_no_method_name_is_tested_outside_the_registry():
    """Code outside lowband/train/methods.py and lowband/optim/ asks a method's traits (MethodSpec), never its
    name: a new method then needs no edit elsewhere. Configuration (defaults, examples) may name methods."""
    assert method_name_tests(_LOWBAND) == [], "test a MethodSpec trait instead of the name"


def test_tile_is_a_method_hyperparameter():
    spec = parse_method_spec("flexdemo:tile=16,topk=8")
    assert spec.given_values() == {"tile": 16, "topk": 8} and spec.hp.tile == 16
    assert method_label("flexdemo", shown_params(spec.hp, spec.given)) == "FlexDeMo Top8 tile=16"
    assert hp_flag("tile") == "--tile"
    assert check_hyperparameters("flexdemo", {"tile": 16, "topk": 200})["tile"] == 16  # topk counts per tile
    with pytest.raises(ValueError, match="tile"):
        check_hyperparameters("flexdemo", {"tile": 4, "topk": 17})
    with pytest.raises(ValueError, match="tile"):
        check_hyperparameters("flexdemo", {"tile": -1})


def test_flexdemo_blocks_reach_the_optimizer_and_leave_the_fingerprint_alone():
    # How a step is cut into blocks changes the kernels, not the bytes: a GPU node and a CPU node (each with its
    # own "auto") train one job, and a run resumes whichever layout it takes.
    from lowband.train.config import TrainConfig

    def config(**hp):
        return TrainConfig.from_tables({"method": {"name": "flexdemo", **hp}, "model": {"name": "t5-tiny"}})

    opt = config(blocks="group").method.hp.build([torch.nn.Parameter(torch.zeros(4))], link=None)
    assert opt.blocks == "group"
    assert config(blocks="cache").fingerprint(ranks_per_node=1) == config().fingerprint(ranks_per_node=1)
    assert config(topk=2).fingerprint(ranks_per_node=1) != config().fingerprint(ranks_per_node=1)
    with pytest.raises(ValueError, match="blocks"):
        config(blocks="whole")
