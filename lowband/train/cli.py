"""Command-line arguments of ``lowband train``."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
from typing import Any

from lowband.train import jobfile
from lowband.train.loop import TrainConfig, Trainer
from lowband.train.methods import ALIASES, METHODS, canonical_names, hp_flag, parse_hp_value
from lowband.units import parse_bandwidth, parse_duration
from lowband.util import format_value

__all__ = ["add_arguments", "main", "config_from_args", "given_values", "parse_train_args", "train_overrides"]

log = logging.getLogger(__name__)


def _hp_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per hyper-parameter of any method, derived from the method configs (their help, type
    and choices); ``dest`` is ``hp_<field>``, so a hyper-parameter never collides with a run option."""
    g = p.add_argument_group("method hyper-parameters (default: the method's own, see --method; "
                             "each flag applies to the methods named in its help)")
    uses: dict[str, list[tuple[str, dataclasses.Field]]] = {}  # field -> (methods, field) per config
    configs: dict[type, list[str]] = {}
    for method, spec in METHODS.items():
        configs.setdefault(spec.config, []).append(method)
    for config, methods in configs.items():
        for f in dataclasses.fields(config):
            uses.setdefault(f.name, []).append(("/".join(methods), f))
    for name, per_config in uses.items():
        methods, f = per_config[0]
        helps = "; ".join(f"{m}: {fl.metadata['help']} (default {format_value(fl.default)})"
                          for m, fl in per_config).replace("%", "%%")
        choices = list(dict.fromkeys(c for _, fl in per_config for c in (fl.metadata["choices"] or ()))) or None
        flags = [hp_flag(name)]
        alias = f.metadata["alias"]
        if alias and len(alias) > 1:
            flags.append("--" + alias)  # --clip: the flag's old name
        # SUPPRESS: an option not given is absent, so "--max-grad-norm none" can set None.
        g.add_argument(*flags, dest=f"hp_{name}", default=argparse.SUPPRESS, choices=choices, help=helps,
                       type=functools.partial(_hp_value, methods.split("/")[0], name))
    g.add_argument("--hp", default=None, help="hyper-parameters as JSON, field names or aliases "
                   f"({', '.join(f'{a}={n}' for a, n in ALIASES.items())}), e.g. '{{\"beta1\": 0.9}}'")


def _hp_value(method: str, name: str, text: str) -> Any:
    try:
        return parse_hp_value(method, name, text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", choices=list(METHODS),
                   help="; ".join(f"{m.name}: {m.description}" for m in METHODS.values()))
    _hp_arguments(p)

    m = p.add_argument_group("model and data")
    m.add_argument("--model", help="named size (t5-tiny, t5-mini, t5-small, gpt-mini, ...) "
                   "or a local model directory (config.json, optional weights)")
    m.add_argument("--data", help="local .jsonl/.csv/.txt file (default: embedded Wikipedia "
                   "lead paragraph -> description pairs)")
    m.add_argument("--val-data", help="separate validation file (same format as --data)")
    m.add_argument("--tokenizer", help="a tokenizer.json or its directory (default: train one "
                   "on the data, cached)")
    m.add_argument("--source-column")
    m.add_argument("--target-column")
    m.add_argument("--text-column")
    m.add_argument("--max-source-len", type=int, help="paper: 512")
    m.add_argument("--max-target-len", type=int, help="paper: 150")
    m.add_argument("--max-len", type=int, help="causal LM sequence length")
    m.add_argument("--vocab-size", type=int)
    m.add_argument("--val-size", type=float, help="validation examples (>= 1) or share (< 1)")
    m.add_argument("--max-examples", type=int, help="use at most this many examples")

    s = p.add_argument_group("link shaping (emulated slow links; real links need none)")
    s.add_argument("--link-bandwidth", type=parse_bandwidth, metavar="RATE",
                   help="shape traffic between nodes in-process to this uplink rate per node, e.g. 100mbit "
                        "(default: no shaping)")
    s.add_argument("--link-latency", type=parse_duration, metavar="DURATION",
                   help="add this latency per message between nodes, e.g. 20ms (default: 0)")

    f = p.add_argument_group("fault tolerance (torchft: one torchrun per node, nodes may die and join; "
                             "see docs/fault-tolerance.md)")
    f.add_argument("--ft-lighthouse", metavar="URL", help="the Lighthouse's address "
                   "(http://HOST:PORT, printed by `lowband lighthouse`); turns fault tolerance on")
    f.add_argument("--ft-node", type=int, help="this node's slot, 0 <= N < --ft-max-nodes "
                   "(a restarted node takes its old slot)")
    f.add_argument("--ft-max-nodes", type=int, help="the most nodes at once; each step's "
                   "global batch is laid out for this many (a dead node's slice is skipped)")
    f.add_argument("--ft-quorum", choices=("async", "sync"),
                   help="async (default): form each step's quorum while the step's forward and backward run, "
                        "as torchft does; NoLoCo forms one per outer window while its inner steps run, so a slow "
                        "node outside a node's group holds it up only once it is a whole window behind; DiLoCo and "
                        "SparseLoCo always form theirs before the outer step. sync: before each step that "
                        "communicates, waited for")
    f.add_argument("--ft-start-nodes", type=int, metavar="N",
                   help="a new job trains its first step once N nodes are live (default: --ft-max-nodes), so "
                        "its nodes start together; after 120 s it starts with those there are. A node that joins "
                        "a running job does not wait")
    f.add_argument("--ft-timeout", type=parse_duration, metavar="DURATION",
                   help="a collective between nodes, a commit vote or a state transfer that takes longer fails "
                        "(the step is dropped), e.g. 10s")

    r = p.add_argument_group("run")
    r.add_argument("--steps", type=int)
    r.add_argument("--batch-size", type=int, help="examples per rank per micro-batch")
    r.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step "
                   "(the step equals one on a grad-accum-times larger batch; one intra-node reduce-scatter)")
    r.add_argument("--precision", choices=["fp32", "bf16"], help="bf16: FSDP2 mixed "
                   "precision (bf16 parameters and compute, fp32 gradient reduction, fp32 optimizer state)")
    r.add_argument("--activation-checkpointing", action="store_true", help="recompute each transformer "
                   "block's activations in backward (less memory, about one more forward)")
    r.add_argument("--memory-profile", action="store_true", help="CPU: make glibc return freed memory so the "
                   "summary's per-phase peaks follow live memory (~25%% more CPU time)")
    r.add_argument("--seed", type=int)
    r.add_argument("--shards", type=int, help="ranks sharding one model copy (default: all "
                   "ranks of a node; demo: 1)")
    r.add_argument("--schedule", choices=["constant", "cosine"])
    r.add_argument("--warmup-steps", type=int)
    r.add_argument("--min-lr-ratio", type=float)
    r.add_argument("--val-every", type=int, help="validate every N steps (0: per epoch)")
    r.add_argument("--val-batches", type=int)
    r.add_argument("--ckpt-every", type=int, help="DCP checkpoint every N steps (0: off)")
    r.add_argument("--ckpt-at-end", action="store_true", help="write a checkpoint after the last step")
    r.add_argument("--resume", help="checkpoint directory, 'auto' for the newest in OUT, or "
                   "'if-any': the newest if there is one, else start afresh (a node's first start and restarts)")
    r.add_argument("--out", help="run directory")
    r.add_argument("--tensorboard", action="store_true")
    r.add_argument("--no-progress", action="store_true")
    p.add_argument("--config", metavar="FILE.toml", help="the job as a TOML file (a run writes its own to "
                   "OUT/config.toml); flags given beside it win. See docs/configuration.md")
    _defaults_from_config(p)


#: flag dest -> TrainConfig field, where they differ (every other flag's dest is its field)
_FIELD_OF = {"link_bandwidth": "link_bandwidth_bps", "link_latency": "link_latency_s", "ft_timeout": "ft_timeout_s",
             "no_progress": "progress"}


def _defaults_from_config(p: argparse.ArgumentParser) -> None:
    """Flags carry no defaults of their own: a flag not given is absent from the parsed arguments (so a
    job file's value is not overridden by a default), and TrainConfig's default applies. Their help
    says that default."""
    d = TrainConfig()
    for action in p._actions:
        field = _FIELD_OF.get(action.dest, action.dest)
        if action.dest in ("help", "config", "hp") or action.dest.startswith("hp_"):
            continue
        action.default = argparse.SUPPRESS
        value = getattr(d, field)
        if action.help and "default" not in action.help and value is not None and not isinstance(value, bool):
            action.help += f" (default {format_value(value)})"
        elif action.help is None and value is not None and not isinstance(value, bool):
            action.help = f"(default {format_value(value)})"


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The run's TrainConfig: its defaults, then ``--config``'s file, then the flags given."""
    return TrainConfig(**given_values(args))


def given_values(args: argparse.Namespace) -> dict[str, Any]:
    """The TrainConfig fields that ``--config``'s file and the flags given set (``hp``: the method's
    hyper-parameters they set); the fields neither sets are absent."""
    given = vars(args)
    values: dict[str, Any] = jobfile.load(given["config"]) if given.get("config") else {}
    file_hp = values.pop("hp", {})
    if "method" in given and values.get("method", given["method"]) != given["method"]:
        if file_hp:
            log.warning("--method %s replaces the file's %s: the file's hyper-parameters (%s) are dropped",
                        given["method"], values["method"], ", ".join(file_hp))
        file_hp = {}
    for dest, value in given.items():
        if dest in ("command", "config", "hp") or dest.startswith("hp_"):
            continue
        field = _FIELD_OF.get(dest, dest)
        values[field] = (not value) if dest == "no_progress" else value
    hp = {k.removeprefix("hp_"): v for k, v in given.items() if k.startswith("hp_")}
    if given.get("hp"):
        try:
            extra = json.loads(given["hp"])
        except json.JSONDecodeError as e:
            raise ValueError(f"--hp must be a JSON object, e.g. '{{\"beta1\": 0.9}}': {e}") from e
        if not isinstance(extra, dict):
            raise ValueError("--hp must be a JSON object")
        extra = canonical_names(values.get("method", TrainConfig.method), extra)
        twice = sorted(set(extra) & set(hp))
        if twice:
            raise ValueError(f"{', '.join(twice)} given both as a flag and in --hp; give each once")
        hp.update(extra)
    values["hp"] = {**file_hp, **hp}
    if isinstance(values.get("val_size"), float) and values["val_size"] >= 1:
        values["val_size"] = int(values["val_size"])
    return values


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print and exit
        raise ValueError(message)


def parse_train_args(argv: list[str] | tuple[str, ...], *, known_only: bool = False) -> TrainConfig:
    """``lowband train`` arguments as the TrainConfig they give; a bad one is a ValueError that names it
    (``known_only``: arguments lowband does not know are ignored, as another entry's may be)."""
    return TrainConfig(**train_overrides(argv, known_only=known_only))


def train_overrides(argv: list[str] | tuple[str, ...], *, known_only: bool = False) -> dict[str, Any]:
    """:func:`given_values` of ``lowband train`` arguments: what they set, on top of what else sets it."""
    p = _RaisingParser(prog="lowband train", add_help=False)
    add_arguments(p)
    args = p.parse_known_args(list(argv))[0] if known_only else p.parse_args(list(argv))
    return given_values(args)


def main(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", "1")))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = config_from_args(args)
    summary = Trainer(cfg).run()
    if summary.rank == 0:
        print(json.dumps({k: getattr(summary, k) for k in ("method", "steps", "step_time_s", "comm_time_s",
                                                           "inter_node_bytes_per_step", "val_loss", "peak_rss_mb")}))
    return 0
