"""``lowband train``: one rank of a training job (launch it with torchrun; ``lowband bench`` does)."""

from __future__ import annotations

import argparse
import json
import os

from lowband.testing.poison import arm_poison
from lowband.train.args import add_arguments, config_from_args
from lowband.train.loop import Trainer
from lowband.train.ranklog import configure_rank_logging, rank_identity

__all__ = ["add_arguments", "main"]


def main(args: argparse.Namespace) -> int:
    import torch  # here, not at the top: `lowband train --help` should not pay for it

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # Local rank 0 of each node logs INFO, the other ranks warnings and errors; every line names its node and
    # rank. Set before the config is read (it may warn); a fault-tolerant node is its --ft-node slot.
    configure_rank_logging(rank_identity())
    cfg = config_from_args(args)
    if cfg.fault_tolerance.lighthouse is not None:
        configure_rank_logging(rank_identity(node=cfg.fault_tolerance.node))
    trainer = Trainer(cfg)
    if cfg.run.poison:  # fault injection (lowband bench --faults nodeN:poison-KIND@S): on the optimizer's outgoing hook
        trainer.after_build.append(lambda t: arm_poison(t.optimizer, cfg, ft=t.membership.config, topology=t.topology,
                                                        rank=t.rank))
    summary = trainer.run()
    if summary.rank == 0:
        print(json.dumps({k: getattr(summary, k) for k in ("method", "steps", "step_time_s", "comm_time_s",
                                                           "inter_node_bytes_per_step", "val_loss", "peak_rss_mb")}))
    return 0
