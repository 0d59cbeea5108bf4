"""What one call costs a GPU besides its bytes, counted: kernel launches and host reads.

On the CPU (`counting`), every Triton launch (interpreted) and every aten op that would be a
kernel on a GPU is visible: the profiler sees the aten ops (views, allocations and metadata are
free on a GPU and are not counted), a wrapper counts the Triton launches, and a host read is an
aten op that returns a Python scalar (`.item()`, `bool()`) or a `.tolist()`. On CUDA
(`cuda_profile`, `host_syncs`), the profiler's device kernels and the host's waits.
`tests/test_launches.py` holds the ops to their budgets with these counts; `bench.host_time`
reports them beside its times.
"""

from __future__ import annotations

import contextlib

import torch

# Free on a GPU: no kernel runs (views, allocations, metadata).
FREE = {
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::view",
    "aten::_unsafe_view",
    "aten::reshape",
    "aten::select",
    "aten::slice",
    "aten::expand",
    "aten::as_strided",
    "aten::t",
    "aten::transpose",
    "aten::unsqueeze",
    "aten::unbind",
    "aten::squeeze",
    "aten::detach",
    "aten::detach_",
    "aten::alias",
    "aten::permute",
    "aten::lift_fresh",
    "aten::result_type",
    "aten::contiguous",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::set_",
}
MATMULS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::matmul", "aten::linear"}
HOST_READS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal"}


class Work:
    """What ran in a block: "kernels" (outermost aten ops that launch on a GPU), "matmuls" (of
    them), "triton" (Triton launches), "reads" (host reads), and the kernels' names."""

    def __init__(self):
        self.counts = {"kernels": 0, "matmuls": 0, "reads": 0, "triton": 0}
        self.ops: list[str] = []

    def add(self, events) -> None:
        for event in events:
            if event.name in HOST_READS:
                self.counts["reads"] += 1
                continue
            parent, nested = event.cpu_parent, False
            while parent is not None:
                # Inside an aten op, or the interpreter's own copies around a Triton launch.
                nested |= parent.name.startswith("aten::") or parent.name == "triton launch"
                parent = parent.cpu_parent
            # A conversion to the dtype and device a tensor has returns it: no copy under it.
            alias = event.name == "aten::to" and not event.cpu_children
            if event.name.startswith("aten::") and not (nested or alias or event.name in FREE):
                self.counts["kernels"] += 1
                self.ops.append(event.name)
                self.counts["matmuls"] += event.name in MATMULS


@contextlib.contextmanager
def counting():
    """A Work whose counts cover the block, from the profiler's aten events (those inside the
    custom ops too), a wrapper of the interpreted Triton kernels and of `.tolist()`."""
    from triton.runtime.interpreter import InterpretedFunction

    work = Work()
    run, tolist = InterpretedFunction.run, torch.Tensor.tolist

    def counted_run(self, *args, **kwargs):
        work.counts["triton"] += 1
        with torch.autograd.profiler.record_function("triton launch"):
            return run(self, *args, **kwargs)

    def counted_tolist(self):
        work.counts["reads"] += 1
        return tolist(self)

    InterpretedFunction.run = counted_run
    torch.Tensor.tolist = counted_tolist
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            yield work
    finally:
        InterpretedFunction.run, torch.Tensor.tolist = run, tolist
    work.add(prof.events())


def launches(work: Work) -> int:
    return work.counts["triton"] + work.counts["kernels"]


def cuda_profile(fn):
    """torch.profiler's events of fn() followed by a device synchronize."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof.events()


def cuda_kernels(events) -> list:
    """The kernels among the profiler's events (device events other than copies and fills)."""
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    return [e for e in kernels if "Memcpy" not in e.name and "Memset" not in e.name]


def host_syncs(events) -> list[str]:
    """The events that make the host wait for the device: the runtime's stream or device
    synchronizes. A blocking device-to-host copy (`.item()`, `.tolist()`, `.cpu()`) is one wait,
    counted through the synchronize that follows its copy."""
    # Under torch.profiler a read of a value is three events (bench/results/h200-2026-12-04/
    # profile.txt, torch 2.11: 12 aten::item, 12 "Memcpy DtoH (Device -> Pinned)" and 3 "Memcpy
    # DtoH (Device -> Pageable)" device events, 15 cudaStreamSynchronize): the runtime call
    # cudaMemcpyAsync, the device's "Memcpy DtoH (...)" and cudaStreamSynchronize. Counting the
    # copies too would count each read twice. (A test for "DtoH" in a copy's input_shapes matched
    # nothing: `cuda_profile` records no shapes, and shapes are lists of sizes.) Not counted: waits
    # without a synchronize call, e.g. a non_blocking copy into pageable memory, which the CUDA
    # runtime makes synchronous, or cudaEventSynchronize (none in that profile).
    return sorted(
        e.name for e in events if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize")
    )
