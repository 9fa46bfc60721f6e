"""``lowband export RUN_OR_CHECKPOINT --out DIR``: a run's model as a transformers directory (from_pretrained loads it)."""

from __future__ import annotations

import argparse
import json
import logging

from lowband.train.export import EXPORT_RECORD, export_checkpoint, parse_replica
from lowband.trust.secret import load_secret

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``lowband export`` options to ``parser``."""
    parser.add_argument("source", metavar="RUN_OR_CHECKPOINT",
                        help="a run's directory (its --out: its newest checkpoint under checkpoints/ is exported) "
                             "or one checkpoint directory (RUN/checkpoints/step_NNNNNN)")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="the transformers directory to write (config.json, model.safetensors, the tokenizer's "
                             "files, generation_config.json); it must not exist or be empty, unless --force")
    parser.add_argument("--force", action="store_true",
                        help="replace a non-empty --out (only once the new directory is complete)")
    parser.add_argument("--replica", default=None, metavar="N|mean",
                        help="DiLoCo, NoLoCo, SparseLoCo: whose outer (slow) parameters to export: replica N's "
                             "(default 0, the one rank 0 validates; DiLoCo's replicas hold the same) or 'mean', "
                             "their average (NoLoCo's differ between replicas)")
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="the tokenizer.json (or its directory) the run used (default: the run's OUT/tokenizer)")
    parser.add_argument("--secret-file", default=None, metavar="PATH",
                        help="the job's secret, which signed its checkpoints (default: LOWBAND_SECRET_FILE or "
                             "LOWBAND_SECRET); a checkpoint it cannot vouch for is refused")
    parser.add_argument("--trust-checkpoint", action="store_true",
                        help="export a checkpoint this job cannot vouch for (no lowband manifest, unsigned while a "
                             "secret is set, or signed with another secret); it is still read without running code "
                             "from it")


def main(args: argparse.Namespace) -> int:
    """``lowband export``: write the transformers directory; print what it holds."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = export_checkpoint(args.source, args.out, force=args.force, replica=parse_replica(args.replica),
                            tokenizer=args.tokenizer, secret=load_secret(args.secret_file),
                            trust=args.trust_checkpoint)
    record = json.loads((out / EXPORT_RECORD).read_text())
    print(f"wrote {out}: {record['model']} trained by {record['method']}, step {record['step']} "
          f"({record['parameters']}); load it with AutoModel*.from_pretrained({str(out)!r}) and "
          f"AutoTokenizer.from_pretrained({str(out)!r})")
    return 0
