"""What the cluster tests share: this run's namespaces (prefix ``lbtest``, so that other runs on the
machine are untouched), processes found by their command line, waiting for a condition, and the
environment a child needs to import this checkout."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from lowband.cluster import list_namespaces
from lowband.cluster._procs import is_alive

PREFIX = "lbtest"
needs_netns = pytest.mark.netns

REPO = Path(__file__).resolve().parents[2]


def our_namespaces(pid: int | None = None) -> list[str]:
    head = f"{PREFIX}-{pid}-" if pid is not None else f"{PREFIX}-"
    return [n for n in list_namespaces() if n.startswith(head)]


def processes_mentioning(marker: str) -> list[int]:
    """Pids (other than this one) whose command line contains ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = (
                Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
        except OSError:
            continue
        if marker in cmdline and is_alive(int(entry)):
            found.append(int(entry))
    return found


def wait_until(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env
