#!/usr/bin/env python
"""The prepared GPU check: one process, one GPU, a few minutes; every figure next to its CPU twin.

Sections (each prints a table; ``--json OUT`` writes them all):

1. **CUDA against CPU, per optimizer.** The same shards (rank 0's FSDP2 shard over ``--shards``
   ranks of ``--check-model``, the model's initial values) and the same seeded gradients on both
   devices; ``--check-steps`` steps of every optimizer (link None, i.e. one replica: the update
   arithmetic, no exchange); then the largest |difference| of the parameters and the fraction of
   elements that differ by more than 1e-6. Tolerances (stated, checked, printed as PASS/FAIL):

   * smooth updates (AdamW, DiLoCo and NoLoCo with their AdamW inner step, FlexDeMo with
     sign off and fp32 values): max |Δ| ≤ 1e-5 (fp32 rounding of different kernels, lr 1e-3);
   * sign updates (Deto-Full, FlexDeMo/DeMo at their defaults: sign on, bf16 values): an element
     whose update sign or top-k pick flips between kernels moves by 2·lr, so at most 1 % of
     the elements may differ by more than 1e-6, and none by more than 2·lr·steps.

2. **step() cost.** FlexDeMo's step() against AdamW's on ``--step-model`` shards (default
   t5-small at vocab 32128, S = 2, R = 2 decoded replicas): benchmarks/step_cost.py's
   measurement, on the device.
3. **Compression throughput.** GB/s of fp32 momentum encoded (DCT, top-k, wire packing) and
   decoded (unpacking, sparse inverse DCT of R replicas), on the same shards.
4. **bf16 training steps.** ``--train-steps`` steps of every method on ``--train-model`` (the
   reversing task of lowband.testing.ranks, FSDP2 with bf16 parameters and compute, fp32 reduction),
   in a one-rank process group (nccl on CUDA, gloo on CPU); the losses must be finite.
5. **Peak memory per method** during those steps: ``torch.cuda.max_memory_allocated`` (reset
   before the model is built). On CPU there is no such counter; the column says n/a.

Without CUDA the script refuses (exit 2) unless ``--device cpu`` is given; ``--device cpu``
runs every section on the CPU (section 1 then compares the CPU with itself: a smoke test of
the script, not a check). ``--quick`` uses t5-tiny everywhere and fewer repeats.

Run::

    python benchmarks/gpu_check.py --json runs/gpu_check.json     # on a machine with one GPU
    python benchmarks/gpu_check.py --device cpu --quick           # smoke test here
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_cost  # noqa: E402  (the sibling benchmark: shards, optimizers, the step timing)

SMOOTH_ATOL = 1e-5
SIGN_DIFF_ATOL = 1e-6
SIGN_MAX_FRACTION = 0.01
CHECK_LR = 1e-3


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- 1. CUDA against CPU
def _check_configs() -> dict[str, tuple[str, object]]:
    """name -> (kind of tolerance, factory(named_params) -> optimizer)."""
    from lowband.optim import AdamWFullSync, DetoFull, DiLoCo, FlexDeMo, NoLoCo

    return {
        "adamw": ("smooth", lambda ps: AdamWFullSync(ps, lr=CHECK_LR)),
        "deto-full": ("sign", lambda ps: DetoFull(ps, lr=CHECK_LR)),
        "flexdemo (Top-1, bf16, sign)": ("sign", lambda ps: FlexDeMo(ps, lr=CHECK_LR, topk=1)),
        "flexdemo (Top-8, fp32, no sign)": ("smooth", lambda ps: FlexDeMo(ps, lr=CHECK_LR, topk=8, values="fp32",
                                                                          sign=False)),
        "diloco (H=2)": ("smooth", lambda ps: DiLoCo(ps, sync_every=2)),
        "noloco (H=2)": ("smooth", lambda ps: NoLoCo(ps, sync_every=2)),
    }


def check_devices(shards, *, device: str, steps: int) -> list[dict]:
    rows = []
    for name, (kind, factory) in _check_configs().items():
        out = {}
        for dev in ("cpu", device):
            params = step_cost.make_params(shards, device=dev)
            grads = [p.grad.clone() for _, p in params]
            opt = factory(params)
            for s in range(steps):
                for (_, p), g in zip(params, grads, strict=True):
                    p.grad = g * (1.0 + 0.1 * s)  # a different gradient every step, the same on both devices
                opt.step()
            _sync(dev)
            out[dev] = [p.detach().cpu() for _, p in params]
        diffs = [(a - b).abs() for a, b in zip(out["cpu"], out[device], strict=True)]
        max_abs = max(float(d.max()) for d in diffs if d.numel())
        n = sum(d.numel() for d in diffs)
        frac = sum(int((d > SIGN_DIFF_ATOL).sum()) for d in diffs) / n
        if kind == "smooth":
            ok, tol = max_abs <= SMOOTH_ATOL, f"max |Δ| ≤ {SMOOTH_ATOL:g}"
        else:
            ok = frac <= SIGN_MAX_FRACTION and max_abs <= 2 * CHECK_LR * steps * (1 + 1e-6)
            tol = f"≤ {SIGN_MAX_FRACTION:.0%} of elements off by > {SIGN_DIFF_ATOL:g}, none by > 2·lr·steps"
        rows.append(dict(optimizer=name, kind=kind, max_abs_diff=max_abs, fraction_differing=frac, tolerance=tol,
                         ok=bool(ok)))
    return rows


# --------------------------------------------------------------------------- 3. compression throughput
def compression_throughput(shards, *, device: str, replicas: int, topk: int, chunk: int, repeats: int) -> dict:
    """GB/s of fp32 momentum encoded (DCT, top-k, pack) and decoded (unpack, sparse IDCT of R replicas)."""
    from lowband.compress import WireFormat, dct, idct_sparse, to_chunks, topk_per_chunk

    wire = WireFormat(chunk, topk, "bf16")
    g = torch.Generator().manual_seed(2)
    momenta = [torch.randn(t.numel(), generator=g).to(device) for _, t in shards]
    nbytes = sum(m.numel() * 4 for m in momenta)

    def encode():
        return [wire.pack(*topk_per_chunk(dct(to_chunks(m, chunk)), topk)) for m in momenta]

    payloads = encode()
    gathered = [pl.unsqueeze(0).expand(replicas, -1).contiguous() for pl in payloads]

    def decode():
        for m, buf in zip(momenta, gathered, strict=True):
            idx, vals = wire.unpack(buf, -(-m.numel() // chunk))
            idct_sparse(idx, vals, chunk)

    def timed(fn):
        times = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    encode()
    decode()  # warm-up (kernels, caches, the basis)
    enc_s, dec_s = timed(encode), timed(decode)
    return dict(momentum_bytes=nbytes, replicas=replicas, topk=topk, chunk=chunk, encode_s=enc_s, decode_s=dec_s,
                encode_gb_s=nbytes / enc_s / 1e9, decode_gb_s=nbytes / dec_s / 1e9)


# --------------------------------------------------------------------------- 4./5. bf16 training, memory
_ONE_RANK_ENV = dict(WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", GROUP_RANK="0")


def _one_rank_group(device: str) -> bool:
    """A one-rank process group (nccl on CUDA, gloo on the CPU); True if this call created it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def train_bf16(*, methods: list[str], model_name: str, steps: int, device: str, batch_size: int) -> list[dict]:
    """Every method's bf16 steps in a one-rank group (created and destroyed here, the env restored)."""
    import os

    saved = {k: os.environ.get(k) for k in _ONE_RANK_ENV}
    os.environ.update(_ONE_RANK_ENV)
    created = _one_rank_group(device)
    try:
        return _train_each(methods, model_name=model_name, steps=steps, device=device, batch_size=batch_size)
    finally:
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _train_each(methods, *, model_name: str, steps: int, device: str, batch_size: int) -> list[dict]:
    from lowband.comm.link import Link
    from lowband.distributed.sharding import shard_model
    from lowband.distributed.topology import Topology
    from lowband.testing.ranks import REVERSE_VOCAB, reverse_task_batch
    from lowband.train.methods import build_optimizer
    from lowband.train.models import build_model, compute_loss, transformer_blocks

    rows = []
    for method in methods:
        cuda = device.startswith("cuda")
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        topology = Topology.from_env(shards=1)
        net = build_model(model_name, vocab_size=REVERSE_VOCAB, seed=0).model.to(device)
        net = shard_model(net, topology, blocks=transformer_blocks(net), precision="bf16")
        link = Link(topology)
        hp = {"H": 2} if method in ("diloco", "noloco") else {}
        opt = build_optimizer(method, net.named_parameters(), link=link, hp=hp, model=net)
        losses = []
        t0 = time.perf_counter()
        for step in range(steps):
            batch = {k: v.to(device) for k, v in reverse_task_batch(rank=0, step=step, world_size=1,
                                                                     batch_size=batch_size).items()}
            opt.zero_grad(set_to_none=True)
            loss = compute_loss(net, batch)
            loss.backward()
            opt.step()
            link.end_step()
            losses.append(float(loss.detach()))
        if hasattr(opt, "flush"):
            opt.flush()
        _sync(device)
        wall = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() if cuda else None
        rows.append(dict(method=method, losses=losses, finite=all(math.isfinite(x) for x in losses),
                         wall_s=wall, peak_bytes=peak))
        del opt, net, link
    return rows


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default; refused without a GPU), cuda:N, or cpu")
    ap.add_argument("--check-model", default="t5-mini", help="shards of section 1 (default %(default)s)")
    ap.add_argument("--check-steps", type=int, default=3)
    ap.add_argument("--step-model", default="t5-small", help="shards of sections 2 and 3 (default %(default)s)")
    ap.add_argument("--train-model", default="t5-mini", help="model of sections 4 and 5 (default %(default)s)")
    ap.add_argument("--train-steps", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="t5-tiny everywhere, 2 repeats, 3 training steps")
    ap.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write every figure to OUT")
    args = ap.parse_args(argv)
    device = args.device
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device is available (torch.cuda.is_available() is False). Run it on a "
                  "machine with a GPU and a CUDA build of torch, or pass --device cpu for a smoke test of the "
                  "script on the CPU.", file=sys.stderr)
            return 2
    elif device != "cpu":
        ap.error(f"--device must be cuda, cuda:N or cpu, got {device!r}")
    if args.quick:
        args.check_model = args.step_model = args.train_model = "t5-tiny"
        args.repeats, args.train_steps = 2, 3
    for name in ("check_steps", "train_steps", "batch_size", "shards", "replicas", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    t_start = time.perf_counter()
    env = dict(torch=torch.__version__, device=device,
               device_name=torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
               cuda=torch.version.cuda)
    print(f"gpu_check on {env['device_name']} (torch {env['torch']}, CUDA {env['cuda']})")
    if device == "cpu":
        print("  --device cpu: section 1 compares the CPU with itself (a smoke test of the script)")

    def vocab(name):
        return step_cost.DEFAULT_VOCAB.get(name, 8192)

    report: dict = {"env": env, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}

    print(f"\n1. {device} against cpu: {args.check_steps} steps on {args.check_model} shards (S={args.shards})")
    shards = step_cost.shard_tensors(args.check_model, vocab_size=vocab(args.check_model), shards=args.shards)
    rows = check_devices(shards, device=device, steps=args.check_steps)
    print(f"  {'optimizer':34} {'max |Δ|':>10} {'differing':>10}  result  tolerance")
    for r in rows:
        print(f"  {r['optimizer']:34} {r['max_abs_diff']:10.2e} {r['fraction_differing']:10.2%}  "
              f"{'PASS' if r['ok'] else 'FAIL':6}  {r['tolerance']}")
    report["cuda_vs_cpu"] = rows

    print(f"\n2. step() cost on {args.step_model} shards (S={args.shards}, R={args.replicas}, Top-1, chunk 128)")
    big = step_cost.shard_tensors(args.step_model, vocab_size=vocab(args.step_model), shards=args.shards)
    cost = step_cost.time_steps(big, model=args.step_model, vocab_size=vocab(args.step_model), n_shards=args.shards,
                                replicas=args.replicas, repeats=args.repeats, device=device)
    s = cost.summary()
    print(f"  wall s, median of {args.repeats}: FlexDeMo {s['flexdemo_wall_s_median']:.4f}  "
          f"AdamW {s['adamw_wall_s_median']:.4f}  ratio {s['ratio_wall_median']:.2f}")
    report["step_cost"] = {**s, "elements": cost.elements, "tensors": cost.tensors}
    launches = {}
    for blocks in ("group", "cache"):
        n = step_cost.flexdemo_launches(big, blocks=blocks, replicas=args.replicas, device=device,
                                        cuda=device.startswith("cuda"))
        launches[blocks] = n._asdict()
        on_device = f", {n.device_kernels} kernels ran on the device" if n.device_kernels is not None else ""
        print(f"  FlexDeMo step(), blocks={blocks}: {n.kernels} ops launched a kernel, {n.syncs} host sync(s){on_device}")
    if device.startswith("cuda"):  # the layout a GPU does not use by default, timed for the comparison
        other = step_cost.time_steps(big, model=args.step_model, vocab_size=vocab(args.step_model),
                                     n_shards=args.shards, replicas=args.replicas, repeats=args.repeats,
                                     device=device, blocks="cache").summary()
        print(f"  blocks=cache (the CPU's layout) on {device}: FlexDeMo {other['flexdemo_wall_s_median']:.4f} s, "
              f"ratio {other['ratio_wall_median']:.2f}")
        launches["cache_timing"] = other
    report["step_launches"] = launches

    print(f"\n3. compression throughput on the same shards ({cost.elements:,} fp32 momentum elements)")
    tp = compression_throughput(big, device=device, replicas=args.replicas, topk=1, chunk=128, repeats=args.repeats)
    print(f"  encode (DCT, top-1, pack): {tp['encode_gb_s']:.3g} GB/s   "
          f"decode ({args.replicas} replicas, unpack, sparse IDCT): {tp['decode_gb_s']:.3g} GB/s")
    report["compression"] = tp
    del big

    from lowband.train.methods import METHODS

    methods = list(METHODS)
    print(f"\n4./5. bf16 training: {args.train_steps} steps of every method on {args.train_model}, batch "
          f"{args.batch_size}, one-rank group")
    train = train_bf16(methods=methods, model_name=args.train_model, steps=args.train_steps, device=device,
                       batch_size=args.batch_size)
    print(f"  {'method':10} {'first loss':>10} {'last loss':>10} {'finite':>7} {'peak MiB':>9} {'wall s':>7}")
    for r in train:
        peak = f"{r['peak_bytes'] / 2**20:9.1f}" if r["peak_bytes"] is not None else f"{'n/a':>9}"
        print(f"  {r['method']:10} {r['losses'][0]:10.4f} {r['losses'][-1]:10.4f} {str(r['finite']):>7} {peak} "
              f"{r['wall_s']:7.2f}")
    report["bf16_training"] = train

    ok = all(r["ok"] for r in rows) and all(r["finite"] for r in train)
    total = time.perf_counter() - t_start
    report.update(ok=ok, total_s=total)
    print(f"\n{'PASS' if ok else 'FAIL'}: tolerances of section 1 and finite bf16 losses; {total:.0f} s in all")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
