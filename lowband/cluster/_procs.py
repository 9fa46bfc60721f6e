"""Process-tree helpers: find every descendant of a process and stop them all; children that die with us.

torchrun starts its workers with ``start_new_session=True``, so killing the agent's process
group does not reach them; these helpers walk ``/proc`` instead and signal the whole tree.

A process killed outright (SIGKILL, the OOM killer) runs no cleanup at all. So that its children
end with it anyway, they are started with :func:`die_with_parent` as ``preexec_fn``: the kernel
then sends them SIGTERM when their parent dies (Linux ``PR_SET_PDEATHSIG``), and torchrun's
agent, on SIGTERM, stops its own workers.

:func:`signals_as_exit` is the one place where SIGTERM and SIGHUP become an exception
(``SystemExit``), so that ``finally`` blocks and ``with`` blocks (the launcher's, an emulated
network's, the bench's) run their cleanup on the way out.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


def _read_stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state, ppid, ...), or None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name is in parentheses and may contain spaces: split after the last ')'.
    rest = data[data.rfind(")") + 2 :].split()
    return rest if len(rest) >= 20 else None


def _read_stat(pid: int) -> tuple[int, str] | None:
    """Return (parent pid, state letter) of ``pid``, or None when it is gone."""
    fields = _read_stat_fields(pid)
    return None if fields is None else (int(fields[1]), fields[0])


def start_time(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (identifies it across pid reuse)."""
    fields = _read_stat_fields(pid)
    return None if fields is None else int(fields[19])


def is_alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    stat = _read_stat(pid)
    return stat is not None and stat[1] not in ("Z", "X")


def descendants(root_pids: Iterable[int]) -> list[int]:
    """All live descendants of ``root_pids`` (not including the roots), parents first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _read_stat(int(entry))
        if stat is not None:
            children.setdefault(stat[0], []).append(int(entry))
    found: list[int] = []
    queue = list(root_pids)
    seen = set(queue)
    while queue:
        pid = queue.pop(0)
        for child in children.get(pid, []):
            if child not in seen:
                seen.add(child)
                found.append(child)
                queue.append(child)
    return found


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def kill_trees(root_pids: Iterable[int], *, grace_s: float = 5.0) -> None:
    """SIGTERM every process in the trees under ``root_pids``; SIGKILL what is left after ``grace_s``.

    The trees are snapshotted before any signal is sent (a killed parent would orphan its
    children to init and hide them), and re-scanned before the SIGKILL round so that children
    started in between are caught too.
    """
    roots = [pid for pid in root_pids if is_alive(pid)]
    if not roots:
        return
    targets = roots + descendants(roots)
    for pid in roots:
        try:
            os.killpg(pid, signal.SIGTERM)  # the root's own process group (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in targets:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not any(is_alive(pid) for pid in targets):
            return
        time.sleep(0.05)
    targets = [pid for pid in targets if is_alive(pid)]
    targets += [pid for pid in descendants(targets) if pid not in targets]
    if targets:
        log.warning("processes %s ignored SIGTERM for %.1f s: sending SIGKILL", targets, grace_s)
    for pid in targets:
        _signal(pid, signal.SIGKILL)


def kill_pids(pids: Iterable[int], *, grace_s: float = 2.0) -> None:
    """Stop a flat list of processes: SIGTERM, then SIGKILL after ``grace_s``."""
    pids = [pid for pid in pids if pid != os.getpid() and is_alive(pid)]
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(is_alive(pid) for pid in pids):
        time.sleep(0.05)
    for pid in pids:
        if is_alive(pid):
            _signal(pid, signal.SIGKILL)


class ProcessTracker:
    """Remembers every descendant seen under some roots, to stop any that outlive their parent.

    An orphan is re-parented to init and can no longer be found from the roots; the tracker
    keeps (pid, start time) pairs, so a pid reused by an unrelated process is never signalled.
    """

    def __init__(self) -> None:
        self._seen: dict[int, int] = {}

    def update(self, root_pids: Iterable[int]) -> None:
        """Record the roots and their current descendants."""
        roots = list(root_pids)
        for pid in roots + descendants(roots):
            t = start_time(pid)
            if t is not None:
                self._seen.setdefault(pid, t)

    def survivors(self) -> list[int]:
        """Recorded processes that are still alive (same pid, same start time)."""
        return [pid for pid, t in self._seen.items() if is_alive(pid) and start_time(pid) == t]

    def kill_survivors(self, *, grace_s: float = 5.0) -> list[int]:
        """Stop every recorded process still alive; return their pids."""
        alive = self.survivors()
        if alive:
            log.warning("stopping %d process(es) left behind by the launch: %s", len(alive), alive)
            kill_trees(alive, grace_s=grace_s)
        return alive


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(signum: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen`: the child gets ``signum`` when this process dies.

    However this process ends (SIGKILL and OOM kills included), the kernel signals the child
    (``prctl(PR_SET_PDEATHSIG)``, kept across ``exec``). If this process died between the fork and
    the ``prctl``, the child signals itself. Linux only: elsewhere returns None (no ``preexec_fn``).

    The signal is tied to the *thread* that starts the child: start children from a thread that
    lives as long as they should (the main thread, as ``launch_nodes`` does).
    """
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    prctl = libc.prctl  # resolved here: the child, between fork and exec, should do as little as it can
    parent = os.getpid()

    def preexec() -> None:
        if prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent is already gone
            os.kill(os.getpid(), signum)

    return preexec


#: The signals that end a run: turned into SystemExit(128 + signum) while cleanup is pending.
EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_exit_lock = threading.Lock()
_exit_holders = [0]
_exit_installed: dict[int, object] = {}  # signum -> the handler it had before


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def hold_signals_as_exit() -> None:
    """Start turning :data:`EXIT_SIGNALS` into ``SystemExit(128 + signum)``; pair with :func:`release_signals_as_exit`.

    Holders are counted: the handlers go in with the first and come out with the last, whatever
    the order of release. Only signals at their default action are changed (a caller's own
    handler, or SIG_IGN under nohup, stays), and only from the main thread (the only one Python
    lets install handlers); elsewhere this only counts.
    """
    with _exit_lock:
        _exit_holders[0] += 1
        if _exit_holders[0] > 1 or threading.current_thread() is not threading.main_thread():
            return
        for signum in EXIT_SIGNALS:
            if signal.getsignal(signum) == signal.SIG_DFL:
                _exit_installed[signum] = signal.signal(signum, _raise_system_exit)


def release_signals_as_exit() -> None:
    """End one :func:`hold_signals_as_exit`; the last one restores the handlers it replaced."""
    with _exit_lock:
        _exit_holders[0] = max(0, _exit_holders[0] - 1)
        if _exit_holders[0] or threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in list(_exit_installed.items()):
            if signal.getsignal(signum) is _raise_system_exit:
                signal.signal(signum, previous)  # type: ignore[arg-type]
            del _exit_installed[signum]


@contextmanager
def signals_as_exit() -> Iterator[None]:
    """SIGTERM and SIGHUP raise ``SystemExit(128 + signum)`` inside the block (see :func:`hold_signals_as_exit`)."""
    hold_signals_as_exit()
    try:
        yield
    finally:
        release_signals_as_exit()
