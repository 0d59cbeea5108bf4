"""`kernels/grad_scale.py`: gradients scaled in place by a factor on the device, skipped at 1.

The product is taken in fp32 and rounded once to the gradient's dtype: to nearest on a GPU, toward
zero for bfloat16 under the interpreter (numpy has no bfloat16; float16 and float32 round to
nearest there too). The tests expect that rounding bit for bit, so a factor rounded to the
gradient's dtype first (as `grad.mul_(factor)` does) fails them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ftis_kernels.kernels import select_backend
from ftis_kernels.kernels.grad_scale import BLOCK, INTERPRETED_PROGRAMS, scale_

pytestmark = pytest.mark.skipif(
    select_backend(torch.device("cpu")) != "triton" and not torch.cuda.is_available(),
    reason="a Triton kernel: compiled on CUDA or interpreted on the CPU",
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# More elements than one pass of the interpreter's programs covers (each program strides), and
# not a multiple of the block.
LONG = BLOCK * INTERPRETED_PROGRAMS * 2 + 37
# Not a power of two, nor a bfloat16 or float16 value: rounded to either, the products differ.
FACTOR = -1.2345678


def _want(x: torch.Tensor, factor: float, on_gpu: bool) -> torch.Tensor:
    """x * factor in fp32, rounded once to x's dtype as the kernel rounds on that platform."""
    product = x.float() * torch.tensor(factor, dtype=torch.float32)
    if x.dtype == torch.bfloat16 and not on_gpu:
        product = (product.view(torch.int32) & -(1 << 16)).view(torch.float32)  # toward zero
    return product.to(x.dtype)


def _scaled(xs: list, factor: float, device: torch.device) -> list:
    got = [x.to(device, copy=True) for x in xs]
    scale_(tuple(got), torch.tensor(factor, device=device))
    return [g.cpu() for g in got]


@pytest.mark.parametrize("dtype", DTYPES)
def test_three_tensors_of_any_size_are_scaled_in_fp32_and_rounded_once(device, dtype):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, generator=g).to(dtype) for n in (LONG, 1, 5 * 7)]
    xs[2] = xs[2].view(5, 7)
    for got, x in zip(_scaled(xs, FACTOR, device), xs):
        assert torch.equal(got, _want(x, FACTOR, device.type == "cuda"))


def test_dense_permuted_layouts_are_scaled_and_others_refused(device):
    # torch.empty_like keeps a permuted input's layout: grad_hidden of a permuted hidden.
    x = torch.randn(4, 3, 5).permute(1, 2, 0)
    got = x.to(device, copy=True).permute(2, 0, 1).contiguous().permute(1, 2, 0)
    assert not got.is_contiguous()
    scale_((got,), torch.tensor(FACTOR, device=device))
    assert torch.equal(got.cpu(), _want(x, FACTOR, device.type == "cuda"))
    with pytest.raises(ValueError, match="tensors: expected dense tensors"):
        scale_((torch.randn(4, 6, device=device)[:, :3],), torch.ones((), device=device))


def test_at_a_factor_of_one_nothing_is_read_or_written(device):
    # A signalling NaN comes out of any arithmetic quiet: its bits surviving means nothing was
    # multiplied and stored, in a full block (index 3) or the partial one at the end (-1).
    x = torch.randn(LONG, device=device)
    bits = x.view(torch.int32)
    bits[3] = bits[-1] = 0x7F800001
    before = bits.clone()
    version = x._version
    scale_((x,), torch.ones((), device=device))
    assert torch.equal(x.view(torch.int32), before)
    assert x._version == version + 1  # an in-place op to autograd all the same
    scale_((x,), torch.full((), 2.0, device=device))
    assert bits[3] != 0x7F800001 and bits[-1] != 0x7F800001


def test_absent_and_empty_tensors_are_skipped(device):
    x = torch.randn(10, device=device)
    want = x * 0.5
    scale_((None, x.new_empty(0), x), torch.full((), 0.5, device=device))
    assert torch.equal(x, want)
    scale_((None, None), torch.full((), 0.5, device=device))  # nothing to launch
    with pytest.raises(ValueError, match="tensors: expected at most 3"):
        scale_((x, x, x, x), torch.ones((), device=device))


@given(
    n=st.integers(1, 3 * BLOCK),
    dtype=st.sampled_from(DTYPES),
    factor=st.sampled_from([0.0, 1.0, -1.0, 1e-3, 3.75, FACTOR, float("inf")]),
)
def test_property_scaled_in_fp32_and_rounded_once(n, dtype, factor):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = torch.linspace(-4, 4, n).to(dtype)
    (got,) = _scaled([x], factor, device)
    torch.testing.assert_close(
        got, _want(x, factor, device.type == "cuda"), rtol=0, atol=0, equal_nan=True
    )
