"""The out-of-place CPU gradient's buffer: huge pages advised on Linux, an ordinary tensor."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest
import torch

from ftis_kernels.kernels import host_memory

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of this process's mapping that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_empty_like_keeps_shape_dtype_and_strides_and_gives_an_ordinary_tensor():
    src = torch.empty(64, 3, 65536).permute(2, 0, 1)  # 48 MiB fp32, not contiguous
    out = host_memory.empty_like(src)
    assert out.shape == src.shape and out.dtype == src.dtype and out.stride() == src.stride()
    out.fill_(2.0)
    assert bool((out == 2.0).all())
    out.untyped_storage().resize_(0)  # the allocator's own storage: resizable, freed as usual


def test_small_or_non_cpu_buffers_are_left_alone():
    assert not host_memory.advise_huge_pages(torch.empty(1024))
    assert not host_memory.advise_huge_pages(torch.empty(64 << 20, dtype=torch.uint8, device="meta"))


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
    reason="madvise(MADV_HUGEPAGE) is Linux-only",
)
def test_a_large_buffer_is_advised_and_backed_by_huge_pages_where_the_kernel_allows():
    out = torch.empty(host_memory.HUGE_PAGE_MIN_BYTES + (8 << 20), dtype=torch.uint8)
    advised = host_memory.advise_huge_pages(out)
    if not THP.exists() or "[never]" in THP.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    assert advised
    out.fill_(1)
    assert _anon_huge_kib(out.data_ptr() + out.numel() // 2) > 0
