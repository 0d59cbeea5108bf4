"""`kernels/grad_scale.py`: gradients scaled in place by a factor on the device, skipped at 1.

Under the interpreter a bfloat16 result is rounded toward zero (numpy has no bfloat16), on a GPU
to nearest: bfloat16 results are compared within one unit in the last place."""

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
# One ulp at 1 of bfloat16, 0 for the others: the product in fp32 rounded once.
ULP = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 0.0}
# More elements than one pass of the interpreter's programs covers (each program strides), and
# not a multiple of the block.
LONG = BLOCK * INTERPRETED_PROGRAMS * 2 + 37


def _want(x: torch.Tensor, factor: float) -> torch.Tensor:
    return (x.float() * torch.tensor(factor, dtype=torch.float32)).to(x.dtype)


def _assert_scaled(got: torch.Tensor, x: torch.Tensor, factor: float) -> None:
    want = _want(x, factor)
    ulp = ULP[x.dtype]
    if ulp == 0:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=ulp, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_three_tensors_of_any_size_are_scaled_in_fp32_and_rounded_once(device, dtype):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, generator=g).to(dtype) for n in (LONG, 1, 5 * 7)]
    xs[2] = xs[2].view(5, 7)
    got = [x.to(device, copy=True) for x in xs]
    factor = -0.3  # not a power of two: its product rounds
    scale_(tuple(got), torch.tensor(factor, device=device))
    for out, x in zip(got, xs):
        _assert_scaled(out.cpu(), x, factor)


def test_at_a_factor_of_one_nothing_is_read_or_written(device):
    # A signalling NaN comes out of any arithmetic quiet: its bits surviving means nothing was
    # multiplied and stored.
    x = torch.randn(LONG, device=device)
    x.view(torch.int32)[3] = 0x7F800001
    bits = x.view(torch.int32).clone()
    version = x._version
    scale_((x,), torch.ones((), device=device))
    assert torch.equal(x.view(torch.int32), bits)
    assert x._version == version + 1  # an in-place op to autograd all the same
    scale_((x,), torch.full((), 2.0, device=device))
    assert x.view(torch.int32)[3] != 0x7F800001


def test_absent_and_empty_tensors_are_skipped_and_others_refused(device):
    x = torch.randn(10, device=device)
    want = x * 0.5
    scale_((None, x.new_empty(0), x), torch.full((), 0.5, device=device))
    assert torch.equal(x, want)
    scale_((None, None), torch.full((), 0.5, device=device))  # nothing to launch
    with pytest.raises(ValueError, match="tensors: expected at most 3"):
        scale_((x, x, x, x), torch.ones((), device=device))
    with pytest.raises(ValueError, match="tensors: expected contiguous"):
        scale_((torch.randn(4, 6, device=device).t(),), torch.ones((), device=device))


@given(
    n=st.integers(1, 3 * BLOCK),
    dtype=st.sampled_from(DTYPES),
    factor=st.sampled_from([0.0, 1.0, -1.0, 1e-3, 3.75, float("inf")]),
)
def test_property_scaled_like_torch_in_fp32(n, dtype, factor):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = torch.linspace(-4, 4, n).to(dtype)
    got = x.to(device, copy=True)
    scale_((got,), torch.tensor(factor, device=device))
    if factor == float("inf"):
        torch.testing.assert_close(got.cpu(), _want(x, factor), equal_nan=True)
    else:
        _assert_scaled(got.cpu(), x, factor)
