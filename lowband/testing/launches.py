"""Kernels launched and host synchronisations of a call, counted by torch.profiler (for benchmarks and tests).

A step that launches thousands of small kernels is bound by the host on a GPU, whatever its
arithmetic costs; :func:`count_launches` counts what one call launches and how often it makes the
host wait for the device, the same on the CPU as on a GPU (it counts dispatched ops, not device time).
"""

from __future__ import annotations

from typing import NamedTuple

from torch.autograd import DeviceType
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile

__all__ = ["HOST_READS", "NO_KERNEL_OPS", "PASS_THROUGH_OPS", "SIZED_BY_VALUES", "Launches", "count_launches"]

# Aten ops that make a view, read metadata or only allocate: no kernel runs for them on any device.
NO_KERNEL_OPS = frozenset({
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::view", "aten::as_strided", "aten::slice",
    "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::t", "aten::transpose",
    "aten::permute", "aten::alias", "aten::detach", "aten::detach_", "aten::_reshape_alias", "aten::lift_fresh",
    "aten::unfold", "aten::split", "aten::split_with_sizes", "aten::narrow", "aten::_unsafe_view",
    "aten::unbind", "aten::view_as", "aten::chunk", "aten::result_type", "aten::resolve_conj", "aten::resolve_neg",
    "aten::numpy_T", "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense", "aten::new_empty",
    "aten::new_empty_strided",
})
# Ops that run a kernel or none, as their arguments ask (``.to`` of a tensor already of that dtype
# returns it): what they launch is what they call.
PASS_THROUGH_OPS = frozenset({"aten::to", "aten::_to_copy", "aten::contiguous", "aten::reshape", "aten::flatten",
                              "aten::clone", "aten::type_as"})
# Tensor methods that read a tensor's values on the host: on a GPU each waits for the device.
HOST_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"})
# Ops whose result's size depends on the values: the host must wait for the device to size them.
SIZED_BY_VALUES = frozenset({"aten::nonzero", "aten::masked_select", "aten::unique", "aten::_unique2",
                             "aten::unique_consecutive", "aten::unique_dim"})


class _HostReads(TorchFunctionMode):
    """Counts the calls that read a tensor's values on the host (:data:`HOST_READS`)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


class Launches(NamedTuple):
    """What one call launched: dispatched ops that run a kernel, host synchronisations, and (profiled
    with ``cuda=True``) the CUDA kernels the device ran, None otherwise."""

    kernels: int
    syncs: int
    device_kernels: int | None = None


def count_launches(step, *, cuda: bool = False) -> Launches:
    """What one call of ``step`` launches, counted by torch.profiler (:class:`Launches`).

    Kernels: the outermost aten ops the call dispatches (an op called inside another op is part of
    that op's kernel), less those that launch none (:data:`NO_KERNEL_OPS`: views, allocations). On
    a GPU each is one kernel launch (a few for some, e.g. a multi-tensor ``_foreach`` op over many
    tensors, which the count takes as one), so the count is the same on the CPU as on a GPU.
    Synchronisations: host reads of tensor values (``.item()``, ``.tolist()``, ``bool()``, ...) and
    ops sized by values (``nonzero``). On the CPU nothing waits; on a GPU each of these would.
    ``cuda``: also profile the device and count the kernels it ran (memory copies and sets included).
    """
    reads = _HostReads()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof, reads:
        step()
    kernels = sized = 0

    def visit(event) -> None:
        nonlocal kernels, sized
        name = event.name
        if not name.startswith("aten::") or name in PASS_THROUGH_OPS:
            for child in event.cpu_children:
                visit(child)
        else:
            kernels += name not in NO_KERNEL_OPS
            sized += name in SIZED_BY_VALUES

    events = prof.events()
    for event in events:
        if event.cpu_parent is None and event.device_type == DeviceType.CPU:
            visit(event)
    device_kernels = sum(e.device_type == DeviceType.CUDA for e in events) if cuda else None
    return Launches(kernels, reads.count + sized, device_kernels)
