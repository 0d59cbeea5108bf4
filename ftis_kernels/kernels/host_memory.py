"""Large out-of-place CPU buffers backed by transparent huge pages (Linux).

An out-of-place gradient of the logits is a new (B, T, V) buffer that the backward writes once.
glibc serves an allocation this large with a fresh mapping of 4 KiB pages, and the first write to
each page faults: at 512 x 151,936 bf16 logits (155 MB) the faults took longer than the backward's
arithmetic (a fill of a fresh buffer 47 ms against 7 ms for a preallocated one, 10 ms with huge
pages; bench/README.md, CPU path). `empty_like` asks the kernel for 2 MiB pages on such a buffer
before anything touches it (madvise(MADV_HUGEPAGE)), as PyTorch's THP_MEM_ALLOC_ENABLE=1 does for
every allocation, here for this buffer alone.

Only buffers of at least HUGE_PAGE_MIN_BYTES are advised: glibc maps those apart and unmaps them
when freed, so the advice dies with the buffer and no heap memory of the process is touched. The
advice is a hint: where the kernel's THP setting is "never", or off Linux, nothing changes.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

# glibc's largest dynamic mmap threshold on 64-bit: an allocation of this size or more always gets
# its own mapping.
HUGE_PAGE_MIN_BYTES = 32 << 20
_HUGE_PAGE = 2 << 20
_MADVISE: dict = {}


def _madvise():
    """libc's madvise with its argument types, or None off Linux or where it cannot be loaded."""
    if "fn" not in _MADVISE:
        fn = None
        if sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).madvise
                fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
                fn.restype = ctypes.c_int
            except (OSError, AttributeError):
                fn = None
        _MADVISE["fn"] = fn
    return _MADVISE["fn"]


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Asks for huge pages on the 2 MiB-aligned part of t's storage (a CPU tensor not yet written);
    True where the advice was given and taken."""
    madvise = _madvise()
    if madvise is None or t.device.type != "cpu":
        return False
    storage = t.untyped_storage()
    if storage.nbytes() < HUGE_PAGE_MIN_BYTES:
        return False
    start = storage.data_ptr()
    lo = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    hi = (start + storage.nbytes()) // _HUGE_PAGE * _HUGE_PAGE
    return hi > lo and madvise(lo, hi - lo, mmap.MADV_HUGEPAGE) == 0


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """torch.empty_like(t) (same shape, dtype, device and strides), on a CPU buffer of at least
    HUGE_PAGE_MIN_BYTES with huge pages advised."""
    out = torch.empty_like(t)
    advise_huge_pages(out)
    return out
