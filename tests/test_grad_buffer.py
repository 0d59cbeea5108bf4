"""The CPU backward's reused gradient buffer (grad_buffer.py): reused only when no one else holds
it, never written while a gradient from it is alive, and the gradients are those of a fresh
allocation."""

from __future__ import annotations

import gc

import pytest
import torch

from ftis_kernels import ftis_loss, grad_buffer
from tests.cases import backend, implementations, make_case, run_op
from tests.kernel_rows.test_logp_lse_cpu import _fused_uncompiled

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_buffer():
    grad_buffer.reuse_cpu_grad_buffer(True)
    grad_buffer.release_cpu_grad_buffer()
    yield
    grad_buffer.reuse_cpu_grad_buffer(True)
    grad_buffer.release_cpu_grad_buffer()


def _grad(case, impl):
    """d loss / d logits through autograd, as a trainer's backward gets it: a non-leaf, like
    an lm-head's output."""
    leaf = case.logits.detach().clone().requires_grad_()
    x = leaf * 1.0
    with backend(impl):
        loss, _ = ftis_loss(x, *case.inputs)
        (grad,) = torch.autograd.grad(loss, x)
    return grad


@pytest.mark.parametrize("mask", ["random", "empty_row"])
@pytest.mark.parametrize("impl", [*implementations(CPU), "torch-fused"])
def test_a_dropped_gradient_buffer_is_reused_and_written_whole(impl, mask, monkeypatch):
    """The reused buffer is poisoned with NaN first: every element of the gradient, masked rows
    and filtered samples included, must be written (by Triton, the eager and the fused passes)."""
    if impl == "torch-fused":
        _fused_uncompiled(monkeypatch)
        impl = "torch"
    case = make_case(3, 5, 97, torch.bfloat16, seed=40, mask=mask, device=CPU)
    want = run_op(case, impl)[2].clone()
    first = _grad(case, impl)
    ptr = first.data_ptr()
    assert torch.equal(first, want)
    first.fill_(float("nan"))
    del first
    # Triton's interpreter keeps each launch's tensors in a reference cycle until the collector
    # runs (its copy-back closure refers to itself); on a GPU, and on the CPU path, nothing does.
    gc.collect()
    second = _grad(case, impl)
    assert second.data_ptr() == ptr, "the buffer of the dropped gradient is handed out again"
    assert torch.equal(second, want)


@pytest.mark.parametrize("hold", ["gradient", "view", "storage"])
def test_a_gradient_still_held_is_never_written(hold):
    case = make_case(2, 5, 97, seed=41, device=CPU)
    other = make_case(2, 5, 97, seed=42, device=CPU)
    first = _grad(case, "torch")
    want = first.clone()
    shape, ptr = first.shape, first.data_ptr()
    held = {"gradient": first, "view": first[1, 2:], "storage": first.untyped_storage()}[hold]
    del first
    second = _grad(other, "torch")
    assert second.data_ptr() != ptr
    assert torch.equal(second, run_op(other, "torch")[2])
    if hold == "storage":
        held = torch.empty(0, dtype=want.dtype).set_(held, 0, shape)
    assert torch.equal(held, want[1, 2:] if hold == "view" else want)


@pytest.mark.parametrize("how", ["share_memory_", "resize"])
def test_a_buffer_moved_to_shared_memory_or_resized_is_not_reused(how):
    """A gradient moved to shared memory may be read by another process after it is dropped
    here; one whose storage was resized is no longer the allocation made."""
    case = make_case(2, 5, 97, seed=46, device=CPU)
    want = run_op(case, "torch")[2].clone()
    first = _grad(case, "torch")
    if how == "share_memory_":
        first.share_memory_()
    else:
        first.untyped_storage().resize_(2 * first.untyped_storage().nbytes())
    ptr = first.data_ptr()
    del first
    second = _grad(case, "torch")
    assert second.data_ptr() != ptr and not second.untyped_storage().is_shared()
    assert torch.equal(second, want)


def test_a_leaf_accumulates_its_gradients_over_backward_calls():
    """A kept .grad holds the first buffer: the second call writes another one, which autograd
    adds into .grad."""
    case = make_case(2, 4, 70, seed=43, device=CPU)
    want = run_op(case, "torch")[2]
    x = case.logits.detach().clone().requires_grad_()
    for _ in range(3):
        loss, _ = ftis_loss(x, *case.inputs)
        loss.backward()
    torch.testing.assert_close(x.grad, 3 * want, rtol=1e-6, atol=1e-7)


def test_larger_smaller_and_other_dtype_gradients_share_the_buffer_correctly():
    """A larger gradient replaces the held buffer; a smaller one, of any dtype, takes a prefix."""
    shapes = [(2, 3, 40, torch.float32), (3, 5, 90, torch.float32), (2, 5, 90, torch.bfloat16)]
    sizes = []
    for B, T, V, dtype in shapes:
        case = make_case(B, T, V, dtype, seed=44 + V, device=CPU)
        want = run_op(case, "torch")[2].clone()  # the op's gradient is dropped: the buffer is free
        got = _grad(case, "torch")
        assert got.is_contiguous() and torch.equal(got, want)
        sizes.append(got.untyped_storage().nbytes())
        del got
    assert sizes == [2 * 3 * 40 * 4, 3 * 5 * 90 * 4, 3 * 5 * 90 * 4]
    assert grad_buffer.release_cpu_grad_buffer() == 3 * 5 * 90 * 4
    assert grad_buffer.release_cpu_grad_buffer() == 0


def test_reuse_turned_off_holds_no_buffer_and_gives_the_same_gradient():
    case = make_case(2, 4, 70, seed=45, device=CPU)
    want = _grad(case, "torch")
    grad_buffer.reuse_cpu_grad_buffer(False)
    assert grad_buffer.release_cpu_grad_buffer() == 0, "turning reuse off released the buffer"
    assert torch.equal(_grad(case, "torch"), want)
    assert grad_buffer.release_cpu_grad_buffer() == 0


def test_reuse_takes_a_bool():
    with pytest.raises(TypeError, match="enabled"):
        grad_buffer.reuse_cpu_grad_buffer("no")


def test_a_non_cpu_gradient_is_a_plain_new_tensor():
    like = torch.empty(2, 3, 5, device="meta").transpose(0, 1)
    got = grad_buffer.grad_buffer(like)
    assert got.device.type == "meta" and got.stride() == torch.empty_like(like).stride()
    assert grad_buffer.release_cpu_grad_buffer() == 0
