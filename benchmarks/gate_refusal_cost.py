"""What a refused call costs the Lighthouse's gate (issue 44 item 2): its CPU time and memory for outsiders' calls.

A gate (lowband.ft.gateway.LighthouseGateway) runs in this process in front of a stand-in Lighthouse; a client in
another process sends it, one after another, calls that it must refuse:

- ``big-fields``: a 3.9 MB Quorum request of 2-byte fields (what made the gate spend 2.3 s a call);
- ``big-field``: a 3.9 MB request of one field;
- ``outsider``: a well-formed Quorum request with an id that does not prove the secret (a few hundred bytes),
  each with another replica id (the ids that grew the refusal counter).

It prints, per kind, the gate process's CPU time per refused call (``time.process_time`` over the calls: the
gate's threads only, the client is another process), the client's wall time per call, how the process's
resident memory grew, and the size of the gate's tables after the calls (refusal kinds, named hosts, the
limiter's hosts).

    python benchmarks/gate_refusal_cost.py                 # 20 big calls, 2,000 outsiders
    python benchmarks/gate_refusal_cost.py --big 5 --outsiders 50000
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CLIENT = r'''
import json, sys, time
import grpc
sys.path.insert(0, sys.argv[3])
from lowband.ft.gateway import QUORUM, admission_request, string_field
address, kind, n = sys.argv[1], sys.argv[2], int(sys.argv[4])
big = 3_900_000
if kind == "big-fields":
    bodies = [bytes([4 << 3, 1]) * (big // 2)] * n
elif kind == "big-field":
    bodies = [string_field(1, b"x" * big)] * n
else:
    bodies = [admission_request(f"lowband_f00d_a00_t{i:032x}_node{i % 7}:u{i}", "http://10.0.0.9:1", "10.0.0.9:2")
              for i in range(n)]
codes = {}
opts = [("grpc.max_send_message_length", 8 << 20)]
with grpc.insecure_channel(address, options=opts) as ch:
    call = ch.unary_unary(QUORUM)
    t0 = time.perf_counter()
    for body in bodies:
        try:
            call(body, timeout=60)
            codes["OK"] = codes.get("OK", 0) + 1
        except grpc.RpcError as e:
            codes[e.code().name] = codes.get(e.code().name, 0) + 1
    wall = time.perf_counter() - t0
print(json.dumps({"wall_s": wall, "codes": codes}))
'''


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--big", type=int, default=20, help="3.9 MB calls of each big kind")
    ap.add_argument("--outsiders", type=int, default=2000, help="well-formed outsiders' calls")
    ap.add_argument("--root", default=str(ROOT), help="the lowband tree to measure (another commit's, to compare)")
    args = ap.parse_args()
    sys.path.insert(0, args.root)
    import grpc

    from lowband.ft.gateway import HEARTBEAT, QUORUM, SERVICE, LighthouseGateway

    def handler(request, context):
        return b""

    backend = grpc.server(ThreadPoolExecutor(max_workers=2), handlers=[grpc.method_handlers_generic_handler(
        SERVICE, {"Quorum": grpc.unary_unary_rpc_method_handler(handler),
                  "Heartbeat": grpc.unary_unary_rpc_method_handler(handler)})])
    port = backend.add_insecure_port("127.0.0.1:0")
    backend.start()
    gate = LighthouseGateway(bind="127.0.0.1:0", backend=f"127.0.0.1:{port}", secret=b"s" * 32, workers=16)
    address = gate.address().split("://", 1)[1]
    print(f"lowband at {args.root}; gate at {address}; {QUORUM}, {HEARTBEAT}")
    print("| kind | calls | gate CPU per call | client wall per call | RSS growth | answers |")
    print("|---|---:|---:|---:|---:|---|")
    for kind, n in (("big-fields", args.big), ("big-field", args.big), ("outsider", args.outsiders)):
        if not n:
            continue
        rss0, cpu0 = _rss_mb(), time.process_time()
        out = subprocess.run([sys.executable, "-c", CLIENT, address, kind, args.root, str(n)], capture_output=True,
                             text=True, timeout=3600)
        cpu = time.process_time() - cpu0
        if out.returncode:
            print(out.stderr[-2000:])
            return 1
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {kind} | {n} | {1e3 * cpu / n:.3f} ms | {1e3 * r['wall_s'] / n:.3f} ms | "
              f"{_rss_mb() - rss0:+.0f} MB | {r['codes']} |")
    tables = {"refusal kinds": len(gate.refused), "named hosts": len(gate._named)}
    if hasattr(gate, "limiter"):
        tables["limiter hosts"] = len(gate.limiter)
    print(f"tables after the calls: {tables}; peak RSS {_rss_mb():.0f} MB")
    gate.shutdown()
    backend.stop(grace=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
