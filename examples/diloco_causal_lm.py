"""DiLoCo in your own training loop: a small GPT-2 from a transformers config, random init.

Each node's ranks shard one copy of the model with FSDP2 (fast links) and take H local AdamW steps;
every H steps the nodes exchange their pseudo-gradients once (one all-reduce through the Link, which
counts every byte) and take a Nesterov outer step. The data are generated here (no downloads):
sequences that count up from a random token by a random stride.

One machine, 4 ranks as one node (no inter-node traffic then):

    torchrun --nproc-per-node 4 examples/diloco_causal_lm.py --steps 20 --sync-every 5

Two nodes of 2 ranks (run on each machine, NODE = 0 or 1; on one machine, start both with
--master-addr 127.0.0.1 to emulate them):

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank NODE --master-addr HOST0 --master-port 29500 \\
        examples/diloco_causal_lm.py --steps 20 --sync-every 5

Prints each step's loss (rank 0's batch) and the bytes rank 0 sent to other nodes (only at outer
steps); writes a DCP checkpoint to OUT/checkpoints/step_NNNNNN.
"""

import argparse
import functools
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

from lowband import DiLoCo, Link, Topology, save_checkpoint, shard_model, transformer_blocks

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--steps", type=int, default=20, help="inner optimizer steps")
parser.add_argument("--sync-every", type=int, default=5, help="H: inner steps per outer step")
parser.add_argument("--out", default="runs/example-diloco", help="the checkpoint goes to OUT/checkpoints/")
parser.add_argument("--lr", type=float, default=3e-3, help="the inner AdamW's learning rate")
parser.add_argument("--outer-lr", type=float, default=0.7)
parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
parser.add_argument("--seq-len", type=int, default=32)
parser.add_argument("--vocab", type=int, default=512)
args = parser.parse_args()
if args.steps % args.sync_every:
    # The last steps % H inner steps would never be merged: the final weights would be each node's own.
    parser.error(f"--steps {args.steps} is not a multiple of --sync-every {args.sync_every}")


def token_batch(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s (batch, seq_len) token ids at ``step``: start + stride · position (mod vocab)."""
    g = torch.Generator().manual_seed(step * 1_000_003 + rank)
    start = torch.randint(0, args.vocab, (args.batch_size, 1), generator=g)
    stride = torch.randint(1, 9, (args.batch_size, 1), generator=g)
    return (start + stride * torch.arange(args.seq_len)) % args.vocab


device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq_len, n_embd=64, n_layer=2, n_head=2,
                    bos_token_id=None, eos_token_id=None)  # GPT-2's 50256 lies outside this vocabulary
# FSDP2 warns that the model returns a view (its logits), in case an in-place op follows; none does here.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
topo = Topology.from_env()                        # nodes × ranks per node, from torchrun's environment
torch.manual_seed(0)                              # the same initial weights on every rank
model = GPT2LMHeadModel(config).to(device)
model = shard_model(model, topo, blocks=transformer_blocks(model))  # FSDP2 over the node's ranks
link = Link(topo)                                 # the only door between nodes; counts bytes
opt = DiLoCo(
    model.named_parameters(),
    functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=0.1),  # the inner optimizer, per node
    link=link,
    sync_every=args.sync_every,
    outer_lr=args.outer_lr,
    max_grad_norm=1.0,  # DiLoCo clips the inner gradient itself: the norm over the whole model copy
)
for step in range(args.steps):
    ids = token_batch(step, dist.get_rank()).to(device)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    opt.step()                                    # an inner step; every H steps also the outer step
    opt.zero_grad()
    traffic = link.end_step()                     # this step's bytes, operations, comm time
    if dist.get_rank() == 0:
        print(f"step {step + 1} loss {loss.item():.4f} inter-node bytes sent {traffic.inter_node_bytes_sent}",
              flush=True)
save_checkpoint(Path(args.out) / "checkpoints" / f"step_{args.steps:06d}", model=model, optimizer=opt,
                extra={"step": args.steps})       # collective: every rank calls it
dist.destroy_process_group()
