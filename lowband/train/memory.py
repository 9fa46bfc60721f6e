"""Peak memory per phase of a training step (forward, backward, optimizer step).

On GPUs the measure is the caching allocator's ``torch.cuda.max_memory_allocated`` (live tensor
bytes, reset before each phase). On CPU there is no such counter, so the measure is the
process's resident set: its high-water mark (``VmHWM``) is reset through ``/proc/self/clear_refs``
before each phase and read after it. glibc keeps freed heap memory by default, so RSS lags what is
live; :func:`malloc_return_freed` (``return_freed=True``) fixes glibc's mmap threshold at 64 KiB so
that every freed tensor leaves RSS at once, and RSS then follows live memory (allocator
independent, at about 25 % more CPU time in page faults). Without it the CPU figures are glibc's
RSS as it comes and say so (``"measure"`` in the summary).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Iterator

import torch

__all__ = ["PhaseMemory", "malloc_return_freed", "PHASES"]

log = logging.getLogger(__name__)

PHASES = ("forward", "backward", "step")
MIB = 2**20


def malloc_return_freed(threshold_bytes: int = 64 * 1024) -> bool:
    """Make glibc serve allocations ≥ ``threshold_bytes`` with mmap and give them back on free.

    Returns False where it cannot be set (not glibc).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, threshold_bytes) == 1
        return libc.mallopt(m_trim_threshold, threshold_bytes) == 1 and ok
    except (OSError, AttributeError):
        return False


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


class PhaseMemory:
    """Peak bytes of each phase, the largest over all steps (and micro-batches) measured.

    Usage: ``with profile.phase("forward"): ...`` around each phase; :meth:`summary` for the run
    summary. Each phase's peak is measured from a reset right before it, so it is the memory held
    at the phase's start plus the phase's own transients.

    Args:
        device: where the model runs (CUDA: allocator counters; otherwise RSS).
        return_freed: on CPU, call :func:`malloc_return_freed` (RSS follows live memory).
    """

    def __init__(self, device: torch.device, *, return_freed: bool = False) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.return_freed = (malloc_return_freed() if return_freed else False) if not self.cuda else None
        self.peaks: dict[str, int] = {}
        self.starts: dict[str, int] = {}
        self._resettable = True
        self._process_peak = 0  # the high-water mark as it stood before each reset

    def _peak(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device)
        return _status_bytes("VmHWM") or 0

    def process_peak_mb(self) -> float:
        """The whole run's peak, which the per-phase resets would otherwise hide (ru_maxrss follows them)."""
        return max(self._process_peak, self._peak()) / MIB

    @property
    def measure(self) -> str:
        if self.cuda:
            return "torch.cuda.max_memory_allocated"
        if not self._resettable:
            return "rss_lifetime_peak (clear_refs unavailable: each phase's figure is the process's peak)"
        return "rss_peak, glibc returns freed memory" if self.return_freed else "rss_peak, glibc default"

    def _now(self) -> int:
        if self.cuda:
            return torch.cuda.memory_allocated(self.device)
        return _status_bytes("VmRSS") or 0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._process_peak = max(self._process_peak, self._peak())
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._resettable = _reset_rss_peak() and self._resettable
        start = self._now()
        yield
        if self.cuda:
            torch.cuda.synchronize(self.device)
        peak = self._peak()
        self.peaks[name] = max(self.peaks.get(name, 0), peak)
        self.starts[name] = max(self.starts.get(name, 0), start)

    def summary(self) -> dict:
        """``{"measure", "<phase>_peak_mb", "<phase>_start_mb", "peak_mb"}`` for the phases measured."""
        out: dict = {"measure": self.measure}
        for name in self.peaks:
            out[f"{name}_peak_mb"] = self.peaks[name] / MIB
            out[f"{name}_start_mb"] = self.starts[name] / MIB
        out["peak_mb"] = max(self.peaks.values()) / MIB if self.peaks else None
        return out
