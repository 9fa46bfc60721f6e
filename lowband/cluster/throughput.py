"""Measure a link's real TCP throughput between two emulated nodes.

A plain TCP receiver runs in the destination node's namespace and a sender in the source
node's; the receiver time-stamps what arrives and reports the rate over the steady part
(after a warm-up that covers TCP slow start and the shaper's initial burst).

This file doubles as the script both ends run (``python throughput.py --serve|--send``). It is
run by path, with the standard library only, so that measuring never imports torch or the rest
of lowband inside the namespaces.
"""

from __future__ import annotations

import argparse
import json
import logging
import select
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lowband.cluster.netns import EmulatedNetwork

log = logging.getLogger(__name__)

_CHUNK_BYTES = 1 << 20


def _serve(bind_ip: str, seconds: float, warmup_s: float, timeout_s: float) -> dict[str, float]:
    """Accept one connection, read until EOF; return bytes, duration and steady/total bits/s."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.bind((bind_ip, 0))
        srv.listen(1)
        print(json.dumps({"port": srv.getsockname()[1]}), flush=True)
        srv.settimeout(timeout_s)
        conn, _ = srv.accept()
    with conn:
        conn.settimeout(timeout_s)
        buf = bytearray(_CHUNK_BYTES)
        total = 0
        t_first: float | None = None
        t_last = 0.0
        mark_t: float | None = None
        mark_bytes = 0
        while True:
            n = conn.recv_into(buf)
            if not n:
                break
            now = time.monotonic()
            if t_first is None:
                t_first = now
            total += n
            t_last = now
            if mark_t is None and now - t_first >= warmup_s:
                mark_t, mark_bytes = now, total
    if t_first is None:
        raise RuntimeError("the sender connected but sent nothing")
    duration = t_last - t_first
    if mark_t is None or t_last - mark_t < 0.1:
        steady = total * 8 / duration if duration > 0 else 0.0
    else:
        steady = (total - mark_bytes) * 8 / (t_last - mark_t)
    return {
        "bytes": total,
        "seconds": duration,
        "steady_bps": steady,
        "total_bps": total * 8 / duration if duration > 0 else 0.0,
    }


def _send(dst_ip: str, port: int, seconds: float, timeout_s: float) -> int:
    """Send as fast as the link allows for ``seconds``; return the bytes sent."""
    payload = b"\0" * _CHUNK_BYTES
    sent = 0
    with socket.create_connection((dst_ip, port), timeout=timeout_s) as conn:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            conn.sendall(payload)
            sent += len(payload)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # wait for the receiver to close: all bytes were read
    return sent


def measure_throughput(
    net: EmulatedNetwork,
    src_node: int,
    dst_node: int,
    seconds: float = 1.5,
    *,
    warmup_s: float | None = None,
    details: dict[str, float] | None = None,
) -> float:
    """Real TCP goodput from ``src_node`` to ``dst_node`` in bits/s, measured at the receiver.

    Sends for ``seconds`` and averages over the part after ``warmup_s`` (default: a fifth of
    ``seconds``, at most 0.3 s). Payload bytes are counted, so a tbf limit of R gives about
    0.956 R (1448 payload bytes per 1514-byte frame). Pass a dict as ``details`` to receive
    the receiver's full report (bytes, seconds, steady_bps, total_bps, sent_bytes).
    """
    if src_node == dst_node:
        raise ValueError(f"src_node and dst_node are both {src_node}: measure between two different nodes")
    if not seconds > 0:
        raise ValueError(f"seconds={seconds}: the measurement needs a positive duration, e.g. 1.5")
    warmup = min(0.3, seconds / 5) if warmup_s is None else warmup_s
    timeout_s = seconds + 30.0
    script = __file__
    python = sys.executable
    dst = net.node(dst_node)
    serve_argv = net.exec_argv(dst_node, [python, "-I", script, "--serve", "--bind", dst.ip,
                                          "--seconds", str(seconds), "--warmup-s", str(warmup)])  # fmt: skip
    # Imported here: run as a script (--serve / --send), this file needs the standard library only.
    from lowband.cluster._procs import die_with_parent

    server = subprocess.Popen(serve_argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=die_with_parent())
    try:
        assert server.stdout is not None
        ready, _, _ = select.select([server.stdout], [], [], 20.0)
        line = server.stdout.readline() if ready else ""
        if not line:
            server.kill()
            _, err = server.communicate(timeout=10)
            raise RuntimeError(f"throughput receiver in {dst.namespace} did not start: {err.strip()}")
        port = json.loads(line)["port"]
        send_argv = net.exec_argv(src_node, [python, "-I", script, "--send", "--dst", dst.ip,
                                             "--port", str(port), "--seconds", str(seconds)])  # fmt: skip
        sender = subprocess.run(send_argv, capture_output=True, text=True, timeout=timeout_s,
                                preexec_fn=die_with_parent())
        if sender.returncode != 0:
            raise RuntimeError(
                f"throughput sender {src_node}->{dst_node} failed ({sender.returncode}): {sender.stderr.strip()}"
            )
        out, err = server.communicate(timeout=timeout_s)
        if server.returncode != 0:
            raise RuntimeError(f"throughput receiver failed ({server.returncode}): {err.strip()}")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=10)
    report = json.loads(out.strip().splitlines()[-1])
    report["sent_bytes"] = int(json.loads(sender.stdout.strip().splitlines()[-1])["sent_bytes"])
    if details is not None:
        details.update(report)
    log.info(
        "throughput node %d -> node %d: %.1f Mbit/s steady (%.1f overall, %d bytes in %.2f s)",
        src_node, dst_node, report["steady_bps"] / 1e6, report["total_bps"] / 1e6,
        report["bytes"], report["seconds"],
    )  # fmt: skip
    return float(report["steady_bps"])


def main(argv: list[str] | None = None) -> int:
    """Entry point of the two ends: ``--serve --bind IP`` or ``--send --dst IP --port P``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--serve", action="store_true")
    mode.add_argument("--send", action="store_true")
    parser.add_argument("--bind", default="0.0.0.0")
    parser.add_argument("--dst")
    parser.add_argument("--port", type=int)
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--warmup-s", type=float, default=0.3)
    args = parser.parse_args(argv)
    timeout_s = args.seconds + 20.0
    if args.serve:
        print(json.dumps(_serve(args.bind, args.seconds, args.warmup_s, timeout_s)), flush=True)
    else:
        if args.dst is None or args.port is None:
            parser.error("--send needs --dst and --port")
        print(json.dumps({"sent_bytes": _send(args.dst, args.port, args.seconds, timeout_s)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
