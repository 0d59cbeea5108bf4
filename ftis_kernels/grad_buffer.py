"""The buffer the CPU backward writes d loss / d logits into, reused across calls.

Out of place, the backward returns the gradient in a new (B, T, V) buffer. On CUDA, PyTorch's
caching allocator hands it memory an earlier step freed; on the CPU, glibc maps a large block
afresh and unmaps it on free, so each step would fault the gradient's pages in again, which costs
more than computing it (bench/README.md, "CPU gradient buffer"). So the CPU path keeps the buffer
of its last gradient and hands it out again once nobody else holds it: the caching allocator's
behaviour, for one buffer.

A buffer is handed out only when nothing but this module holds its storage: no tensor or view
(the storage's C++ reference count) and no storage object (its Python reference count). A
gradient still held anywhere (a leaf's `.grad`, a hook's copy, a view, the autograd engine) is
never written, nor is a buffer moved to shared memory (`share_memory_()`: another process may
read it). A weak reference to a dropped gradient's storage stays alive while the buffer is held,
and sees the next gradient. The price is memory between steps: the largest gradient since the
last release stays allocated, as the CUDA allocator keeps its blocks.
`release_cpu_grad_buffer()` frees it; `reuse_cpu_grad_buffer(False)` turns the reuse off (each
gradient is then a new allocation).
"""

from __future__ import annotations

import sys
import threading
from typing import Optional

import torch

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _holders(t: torch.Tensor) -> tuple[int, int]:
    """(C++ references to t's storage, Python references to its storage object). A tensor or view
    holds a C++ reference; a storage object, which PyTorch keeps one of per storage, holds one C++
    reference while alive, whoever holds it in Python: its Python count tells them apart."""
    storage = t.untyped_storage()
    return _use_count(storage._cdata), sys.getrefcount(storage)


_lock = threading.Lock()
_held: Optional[torch.Tensor] = None  # flat, uint8
_held_ptr = 0  # its address when allocated: a storage resized or swapped since is not reused
_enabled = _use_count is not None


def _reusable(held: torch.Tensor, nbytes: int) -> bool:
    """Whether nothing but this module holds `held`, in this process or another (shared memory),
    and it still is the allocation made, of at least nbytes."""
    # The counts of a tensor that nothing else holds, read in this same context: a tracer or
    # debugger that holds frames' locals changes the Python count, so it is never assumed.
    alone = _holders(torch.empty(1, dtype=torch.uint8, device="cpu"))
    if _holders(held) != alone:
        return False
    storage = held.untyped_storage()
    return not storage.is_shared() and held.data_ptr() == _held_ptr and storage.nbytes() >= nbytes


def reuse_cpu_grad_buffer(enabled: bool = True) -> None:
    """Whether the out-of-place CPU backward reuses one gradient buffer across calls (the
    default). Turning it off also releases the buffer held."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {enabled!r}")
    with _lock:
        _enabled = enabled and _use_count is not None
    if not enabled:
        release_cpu_grad_buffer()


def release_cpu_grad_buffer() -> int:
    """Drops the gradient buffer held for reuse; returns its size in bytes (0 if none). Its
    memory is freed once no gradient handed out from it is alive."""
    global _held
    with _lock:
        nbytes = 0 if _held is None else _held.numel()
        _held = None
    return nbytes


def grad_buffer(like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of like's shape and dtype, for a gradient that the caller writes
    whole. On the CPU with reuse on: a contiguous tensor on the held buffer's storage when no one
    else holds it and it is large enough, else a new allocation that becomes the held buffer.
    Otherwise `torch.empty_like(like)`."""
    global _held, _held_ptr
    if like.device.type != "cpu" or not _enabled:
        return torch.empty_like(like)
    nbytes = like.numel() * like.element_size()
    with _lock:
        if _held is None or not _reusable(_held, nbytes):
            _held = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
            _held_ptr = _held.data_ptr()
        # A tensor of its own on the held storage, not a view: nothing points back at _held.
        out = torch.empty(0, dtype=like.dtype, device="cpu")
        return out.set_(_held.untyped_storage(), 0, like.shape)
