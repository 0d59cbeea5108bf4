"""Gradients scaled in place by a factor that lives on the device: one launch for up to three
tensors, nothing read back, and no pass over the tensors when the factor is 1.

`ftis_linear_loss` computes its gradients in the forward for an incoming gradient of 1; its
backward multiplies them by the incoming gradient (times 1 / N' for a batch-normalised loss).
Done with `grad.mul_(factor)` for a 0-dim CUDA factor, that is one aten kernel per gradient, not
vectorised (a 0-dim CUDA operand has stride 0), on the factor rounded to the gradient's dtype,
and a full read and write of a (V, H) grad_weight even when the factor is 1, as it is after a
plain `loss.backward()`: on an H200 (16k tokens x 151,936, H 1,536, bf16) the two calls took
1.09 ms of the call's 43 ms (`bench/results/h200-2026-12-04-eager/profile.txt`).

Here each program loads the factor once; when it is 1 its loop is empty, else it scales its
blocks in fp32 and rounds once. The grid is a few programs per SM for each tensor (grid axis 1
picks the tensor), each striding over whole blocks without a mask, so that a thread moves 16
bytes at a time (128-bit loads and stores in the sm_90 code), and program 0 takes the partial
block at the end.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ftis_kernels.kernels.tl_utils import launch

# Elements one program scales per step: 16 a thread at 8 warps (32 bytes of a 16-bit gradient).
BLOCK = 4096
WARPS = 8
# Programs per SM for each tensor (on the CPU interpreter: programs in all). 4 are resident
# together at the registers the sm_90 code takes (32 a thread for 16-bit gradients, 38 for fp32:
# 6 programs' worth), and keep 32 KB (16-bit) or 64 KB (fp32) of loads in flight per SM, above
# the ~25 KB the copy bandwidth needs (4.8 TB/s x ~700 ns of latency over 132 SMs). More would
# leave a second, partial wave.
PROGRAMS_PER_SM = 4
INTERPRETED_PROGRAMS = 4


@triton.jit
def _scale_one(x_ptr, n, factor, BLOCK: tl.constexpr):
    """x[:n] *= factor (fp32 product, rounded once): this program's full blocks of the grid
    stride, unmasked (a block's offset is a multiple of BLOCK, so its loads and stores are 16
    bytes a thread), and program 0 the partial block at the end."""
    n_scaled = tl.where(factor != 1.0, n.to(tl.int64), 0)
    n_full = n_scaled // BLOCK
    pid = tl.program_id(0).to(tl.int64)
    for blk in range(pid, n_full, tl.num_programs(0).to(tl.int64)):
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs)
        tl.store(x_ptr + offs, (x.to(tl.float32) * factor).to(x_ptr.dtype.element_ty))
    if pid == 0:
        offs = n_full * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n_scaled)
        y = x.to(tl.float32) * factor
        tl.store(x_ptr + offs, y.to(x_ptr.dtype.element_ty), mask=offs < n_scaled)


@triton.heuristics(
    {
        "HAS_0": lambda args: args["x0_ptr"] is not None,
        "HAS_1": lambda args: args["x1_ptr"] is not None,
        "HAS_2": lambda args: args["x2_ptr"] is not None,
    }
)
@triton.jit(do_not_specialize=["n0", "n1", "n2"])
def _scale_kernel(
    # pointers: up to three contiguous tensors, any float dtype, scaled in place (or None)
    x0_ptr,
    x1_ptr,
    x2_ptr,
    factor_ptr,  # () fp32
    # sizes: their numbers of elements
    n0,
    n1,
    n2,
    # meta-parameters
    HAS_0: tl.constexpr,
    HAS_1: tl.constexpr,
    HAS_2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    factor = tl.load(factor_ptr).to(tl.float32)
    which = tl.program_id(1)
    if HAS_0:
        if which == 0:
            _scale_one(x0_ptr, n0, factor, BLOCK)
    if HAS_1:
        if which == 1:
            _scale_one(x1_ptr, n1, factor, BLOCK)
    if HAS_2:
        if which == 2:
            _scale_one(x2_ptr, n2, factor, BLOCK)


# --- launcher ------------------------------------------------------------------------------------


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _flat(x: torch.Tensor) -> torch.Tensor:
    """x's elements as one contiguous (numel,) view, in memory order: x must be dense and
    non-overlapping (contiguous, or a permutation of a contiguous layout, as `torch.empty_like`
    gives for a permuted input), which an elementwise scaling can take in any order."""
    if x.is_contiguous():
        return x
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(x.stride(), x.shape) if sz != 1):
        if stride != expected:
            raise ValueError(
                f"tensors: expected dense tensors, got sizes {tuple(x.shape)} with strides "
                f"{x.stride()}"
            )
        expected *= size
    return x.as_strided((x.numel(),), (1,))


def scale_(tensors: tuple[Optional[torch.Tensor], ...], factor: torch.Tensor) -> None:
    """Multiplies each tensor (float, dense: contiguous or a permuted contiguous layout; None
    or empty: skipped) by factor (a 0-dim fp32 tensor on their device) in place: one launch, the
    product in fp32 rounded once to the tensor's dtype; when factor is 1 the tensors are neither
    read nor written. At most three tensors. Their version counters are bumped, as an in-place
    op's are (autograd refuses a second backward through tensors it saved)."""
    if len(tensors) > 3:
        raise ValueError(f"tensors: expected at most 3, got {len(tensors)}")
    given = [x if x is not None and x.numel() else None for x in (*tensors, None, None, None)[:3]]
    present = [x for x in given if x is not None]
    if not present:
        return
    xs = [None if x is None else _flat(x) for x in given]
    device = present[0].device
    blocks = triton.cdiv(max(x.numel() for x in present), BLOCK)
    cuda = device.type == "cuda"
    per_tensor = _sm_count(device) * PROGRAMS_PER_SM if cuda else INTERPRETED_PROGRAMS
    grid = (min(blocks, per_tensor), 3)
    sizes = [0 if x is None else x.numel() for x in xs]
    launch(
        _scale_kernel,
        grid,
        x0_ptr=xs[0],
        x1_ptr=xs[1],
        x2_ptr=xs[2],
        factor_ptr=factor,
        n0=sizes[0],
        n1=sizes[1],
        n2=sizes[2],
        BLOCK=BLOCK,
        num_warps=WARPS,
    )
    for x in present:  # one at a time: older torch takes a single tensor only
        torch.autograd.graph.increment_version(x)
