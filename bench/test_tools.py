"""Checks of the bench's measurement tools that need neither a GPU nor a benchmark run: the
issue model of `bench.hopper_asm`, the threads of `bench.entropy_cost`, the host waits of
`bench.launch_counts`, the environment listing of `bench/gpu_check.sh`."""

from __future__ import annotations

import pytest
import torch


def test_gradient_in_forward_passes_share_the_kernels_issue_budget():
    """The gradient-in-forward kernel moves a read and a write a logit (its second read comes
    from L2) in two loops: their "issue needed at roofline" figures are shares of that time and
    add up to the kernel's (pass 1 was given the forward's read-only budget, twice its share)."""
    from bench import hopper_asm

    def need(kernel: str, per_logit: float, size: int = 2) -> float:
        stats = hopper_asm.LoopStats(
            kernel, "bfloat16", 16384, 32, 32, 1024, 0, 0, round(5 * per_logit), 5, 0, 0, 2, 0, 0
        )
        return stats.issue_bound_fraction(hopper_asm.roofline_bytes_per_logit(kernel, size))

    whole = need("bwd", 11.4 + 12.4)  # one read and one write a logit, both loops' instructions
    assert need("grad_fwd_pass1", 11.4) + need("grad_fwd_pass2", 12.4) == pytest.approx(whole)
    assert hopper_asm.roofline_bytes_per_logit("fwd", 2) == 2


def test_entropy_cost_times_on_the_threads_it_reports():
    """`bench.entropy_cost` names torch's thread count in its report: its calls run on them
    (`torch.utils.benchmark.Timer` alone runs on 1)."""
    from bench import entropy_cost

    before, seen = torch.get_num_threads(), []
    torch.set_num_threads(2)
    try:
        entropy_cost._measure({"probe": lambda: seen.append(torch.get_num_threads())}, 1)
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {2}


def test_host_syncs_counts_a_read_of_a_value_once():
    """torch.profiler's events for one `.item()` on CUDA (names as in
    bench/results/h200-2026-12-04/profile.txt): the runtime's copy call, the device's copy and
    the stream synchronize are one wait; a copy the host does not wait for is none."""
    from types import SimpleNamespace

    from bench.launch_counts import host_syncs

    def events(*names):
        return [SimpleNamespace(name=name, input_shapes=[]) for name in names]

    read = ("cudaMemcpyAsync", "Memcpy DtoH (Device -> Pinned)", "cudaStreamSynchronize")
    assert host_syncs(events(*read)) == ["cudaStreamSynchronize"]
    pageable = ("cudaMemcpyAsync", "Memcpy DtoH (Device -> Pageable)", "cudaStreamSynchronize")
    assert host_syncs(events(*read, *pageable, "cudaDeviceSynchronize")) == [
        "cudaDeviceSynchronize",
        "cudaStreamSynchronize",
        "cudaStreamSynchronize",
    ]
    assert host_syncs(events("cudaMemcpyAsync", "Memcpy DtoH (Device -> Pinned)")) == []


def test_gpu_check_lists_liger_kernel_as_pip_spells_it():
    """`bench/gpu_check.sh`'s environment step greps `pip list`, which names the package
    `liger_kernel` (its metadata's spelling) where it is installed as `liger-kernel`."""
    import re
    import subprocess
    from pathlib import Path

    script = (Path(__file__).parent / "gpu_check.sh").read_text()
    pattern = re.search(r"pip list 2>/dev/null \| grep -iE '([^']+)'", script).group(1)
    listing = "liger_kernel 0.8.5\nliger-kernel 0.8.5\nliger-kernel-nightly 0.9\n"
    found = subprocess.run(
        ["grep", "-iE", pattern], input=listing, capture_output=True, text=True
    ).stdout
    assert found.splitlines() == ["liger_kernel 0.8.5", "liger-kernel 0.8.5"]
