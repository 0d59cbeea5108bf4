"""`ftis_linear_loss` against the float64 reference applied to hidden @ weight.T + bias.

Two kinds of inputs:
- exact: hidden in {0, +-1/2, +-1}, weight and bias multiples of 1/4 in [-1, 1], H <= 12, so that
  every logit is a multiple of 1/8 below 16 in magnitude and exact in bf16 and fp16. The op then
  reads the very logits of the oracle: loss and metrics are held to fp32 accuracy in every dtype.
- random normal: the logits carry the dtype's rounding, as in a model.
Gradients (hidden, weight, bias) follow the rule of numerics.py: no worse than plain PyTorch in
that dtype (the reference through a matmul in the dtype) plus the dtype's margin.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from ftis_kernels import chunks as chunks_module
from ftis_kernels import custom_op, ftis_linear_loss, ftis_loss
from ftis_kernels.kernels import logp_lse, logp_lse_cpu
from ftis_kernels.options import FTISOptions
from ftis_kernels.per_sample import per_sample_loss
from ref import ref_ftis_loss
from tests import cases, numerics
from tests.cases import (
    DTYPES,
    SCALAR_METRICS,
    dtypes,
    gen_spreads,
    implementations,
    linear_module,
    make_case,
    masks,
    options,
    run_linear,
    run_linear_ref,
    seeds,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def small_vocab_blocks(monkeypatch):
    """Small vocabulary blocks so that the tests' small V still exercise the multi-block loops
    (the row kernels and the bf16/fp16 grad_weight accumulation)."""
    monkeypatch.setattr(logp_lse, "MAX_BLOCK_V", 64)
    monkeypatch.setattr(logp_lse_cpu, "CPU_CHUNK_ELEMENTS", 256)
    monkeypatch.setattr(chunks_module, "GRAD_WEIGHT_BLOCK_V", 16)


def check_against_reference(case, dtype, impl, *, exact, chunk_size=None, record=False, **opts):
    loss, metrics, grads = run_linear(case, dtype, impl, chunk_size=chunk_size, **opts)
    o_loss, o_metrics, o_grads = run_linear_ref(case, torch.float64, torch.float64, **opts)
    p_loss, p_metrics, p_grads = run_linear_ref(case, dtype, dtype, **opts)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    check = numerics.assert_no_worse_than_plain
    errors = {}
    if exact:
        # The logits are exact in every dtype: fp32 accuracy, as ftis_loss on those logits.
        f32_loss, f32_metrics, _ = run_linear_ref(case, torch.float64, torch.float32, **opts)
        errors["loss"] = check("loss", loss, o_loss, f32_loss, numerics.FP32)
        for name in ("logp", "entropy", "kl", *SCALAR_METRICS):
            errors[name] = check(
                name, metrics[name], o_metrics[name], f32_metrics[name], numerics.FP32
            )
        assert torch.equal(metrics["filtered"].cpu(), o_metrics["filtered"].cpu())
    else:
        # The logits carry the dtype's rounding: held to plain PyTorch plus the spread of that
        # rounding (`rounding_spread`).
        loss_spread, logp_spread = rounding_spread(case, dtype, **opts)
        for name, got, oracle, plain, spread in (
            ("loss", loss, o_loss, p_loss, loss_spread),
            ("logp", metrics["logp"], o_metrics["logp"], p_metrics["logp"], logp_spread.max()),
        ):
            margin = numerics.Tol(numerics.FP32.rtol, numerics.FP32.atol + SPREADS * float(spread))
            errors[name] = check(name, got, oracle, plain, margin)
    for name, grad in grads.items():
        assert grad.dtype == dtype and grad.shape == o_grads[name].shape
        errors[f"grad_{name}"] = check(
            f"grad_{name}", grad, o_grads[name], p_grads[name], numerics.GRAD_MARGIN[dtype]
        )
    if record:
        numerics.record(dtype, f"linear-{impl}" + ("" if exact else "/random"), errors)


# Random inputs in bf16/fp16 are held to the spread of their rounding, not only to plain PyTorch:
# the op forms the logits in the dtype (hidden, weight and bias rounded to it, the logits rounded
# once more), as the model's lm-head does, and those roundings move the loss whatever the op does
# after. Plain PyTorch in the dtype rounds differently, and by device (CUDA's half-precision
# log_softmax accumulates in fp32, the CPU's does not): on an H200 (2026-12-04) plain fp16 erred by
# 9.2e-4 where the op, with the same fp16 logits on CPU and GPU (0.989720), erred by 9.4e-4, so an
# error bound taken from plain PyTorch alone failed a correct op. To first order each quantity q
# (the loss, a token's log pi) moves by sum_x dq/dx * delta_x over every rounded value x; the
# roundings are independent, each uniform within +-u |x| (u = eps / 2 of the dtype: variance
# u^2 x^2 / 3), so q's error has standard deviation
#     sigma_q = u / sqrt(3) * sqrt(sum_x (dq/dx * x)^2),
# and an error above SPREADS sigma_q has probability < 2e-9 (a normal tail; the cases are seeded,
# so a test that passes once passes always). In fp32 sigma_q is ~1e-8 and changes nothing.
SPREADS = 6.0


def rounding_spread(case, dtype, **opts) -> tuple[float, torch.Tensor]:
    """(sigma of the loss, sigma (B, T) of each token's log pi) from rounding hidden, weight, bias
    and the logits to `dtype`, for a linear case (the comment above `SPREADS`): with z = h W^T + b
    and c = dq/dz, dq/dh = c W, dq/dW = c^T h, dq/db = sum_rows c."""
    u = torch.finfo(dtype).eps / 2
    h, w = case.hidden.double().cpu(), case.weight.double().cpu()
    b = torch.zeros(w.shape[0], dtype=torch.float64) if case.bias is None else case.bias.cpu()
    rows = [x.cpu() if isinstance(x, torch.Tensor) else x for x in case.inputs]
    z = case.logits.double().cpu().requires_grad_()
    loss, _ = ref_ftis_loss(z, *rows, compute_dtype=torch.float64, **opts)
    (g,) = torch.autograd.grad(loss, z)
    z = z.detach()
    terms = [
        (g * z).square().sum(),
        ((g @ w) * h).square().sum(),
        ((g.flatten(0, 1).T @ h.flatten(0, 1)) * w).square().sum(),
        (g.sum((0, 1)) * b).square().sum(),
    ]
    loss_spread = u / math.sqrt(3) * math.sqrt(float(sum(terms)))
    # log pi of token r: c_r = (onehot(token_r) - softmax(z_r / tau)) / tau, 0 at masked rows.
    tau = FTISOptions(**opts).temperature
    c = torch.nn.functional.one_hot(rows[0], w.shape[0]) - torch.softmax(z / tau, dim=-1)
    c = c / tau
    if rows[3] is not None:
        c = c * rows[3][..., None]
    per_row = (
        (c * z).square().sum(-1)
        + ((c @ w) * h).square().sum(-1)
        + (c.square() * (h.square() @ w.square().T)).sum(-1)
        + (c * b).square().sum(-1)
    )
    return loss_spread, u / math.sqrt(3) * per_row.sqrt()


# --- properties against the reference --------------------------------------------------------


@given(
    B=st.integers(1, 3),
    T=st.integers(1, 5),
    H=st.sampled_from([1, 5, 12]),
    V=st.one_of(st.integers(1, 40), st.sampled_from([67, 130])),
    dtype=dtypes,
    chunk_size=st.sampled_from([None, 1, 2, 3, 4, 7, 64]),
    with_bias=st.booleans(),
    mask=masks,
    gen_spread=gen_spreads,
    with_old=st.booleans(),
    seed=seeds,
    opts=options,
)
def test_exact_logits_match_reference_on_loss_metrics_and_grads(
    B, T, H, V, dtype, chunk_size, with_bias, mask, gen_spread, with_old, seed, opts
):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    case = make_case(
        B,
        T,
        V,
        H=H,
        seed=seed,
        with_bias=with_bias,
        mask=mask,
        gen_spread=gen_spread,
        with_old=with_old,
        with_ref=opts["beta"] > 0,
        device=device,
    )
    numerics.count_example()
    for impl in implementations(device):
        check_against_reference(
            case, dtype, impl, exact=True, chunk_size=chunk_size, record=True, **opts
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_size", [5, 8, None])  # 5 does not divide B * T = 16, 8 does
def test_random_hidden_matches_reference_for_each_dtype_and_path(dtype, chunk_size, device):
    case = make_case(
        2, 8, 150, H=32, seed=1, exact=False, mask="none", gen_spread=2.0, device=device
    )
    for impl in implementations(device):
        check_against_reference(
            case,
            dtype,
            impl,
            exact=False,
            chunk_size=chunk_size,
            record=True,
            temperature=0.9,
            loss_type="bnpo",
        )


# --- the op's own contract ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_equals_ftis_loss_on_the_materialised_logits(dtype, device):
    case = make_case(3, 4, 90, H=12, seed=2, with_ref=True, device=device)
    opts = dict(is_level="sequence", beta=0.05, temperature=1.3)
    loss, metrics, grads = run_linear(case, dtype, chunk_size=5, **opts)
    leaves = [x.to(dtype).requires_grad_() for x in (case.hidden, case.weight, case.bias)]
    want, want_metrics = ftis_loss(leaves[0] @ leaves[1].T + leaves[2], *case.inputs, **opts)
    want_grads = torch.autograd.grad(want, leaves)
    # The logits are exact: same loss and metrics to fp32 accuracy (not bitwise: summation order).
    numerics.assert_close("loss", loss, want)
    for name in want_metrics:
        if want_metrics[name].dtype == torch.bool:
            assert torch.equal(metrics[name], want_metrics[name])
        else:
            numerics.assert_close(name, metrics[name], want_metrics[name])
    tol = {
        torch.float32: numerics.Tol(1e-5, 1e-7),
        torch.bfloat16: numerics.Tol(2**-6, 1e-5),
        torch.float16: numerics.Tol(2**-8, 1e-6),
    }[dtype]
    for (name, grad), want_grad in zip(grads.items(), want_grads):
        numerics.assert_close(f"grad_{name}", grad, want_grad, tol)


def _large_logits_case(magnitude, device):
    """Exact hidden, weight and bias scaled by a power of two near magnitude / 16 (the logits stay
    exact), every vocabulary row twice (the maximum always ties) and every token the argmax:
    logp = -log(ties), the digits that max + log(sum) rounds away at large |logits|."""
    case = make_case(2, 4, 30, H=12, seed=14, mask="none")
    scale = 2.0 ** round(math.log2(magnitude / 16))
    weight = case.weight.repeat_interleave(2, dim=0) * scale
    bias = case.bias.repeat_interleave(2) * scale
    logits = case.hidden @ weight.T + bias
    tokens = logits.argmax(dim=-1)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None])[..., 0]
    g = torch.Generator().manual_seed(15)
    gen = (logp - torch.rand(2, 4, generator=g, dtype=torch.float64)).float()
    old = (logp + 0.25 * torch.randn(2, 4, generator=g, dtype=torch.float64)).float()
    ref = (logp - 0.5 * torch.rand(2, 4, generator=g, dtype=torch.float64)).float()
    large = dataclasses.replace(
        case,
        logits=logits,
        tokens=tokens,
        gen_logprobs=gen,
        mask=None,
        old_logprobs=old,
        ref_logprobs=ref,
        weight=weight,
        bias=bias,
    )
    return large.to(device)


@pytest.mark.parametrize("magnitude", [1e4, 1e6, 1e8, 1e30])
def test_large_logits_keep_the_digits_of_log_softmax(magnitude, device):
    case = _large_logits_case(magnitude, device)
    for impl in implementations(device):
        opts = dict(beta=0.04, temperature=0.5)
        check_against_reference(case, torch.float32, impl, exact=True, chunk_size=3, **opts)


def test_chunk_size_changes_nothing_but_memory(device):
    case = make_case(3, 7, 70, H=12, seed=3, exact=False, device=device)
    base_loss, base_metrics, base_grads = run_linear(case, torch.float32, chunk_size=21)
    for chunk_size in (1, 4, 5, 1000, None):
        loss, metrics, grads = run_linear(case, torch.float32, chunk_size=chunk_size)
        numerics.assert_close("loss", loss, base_loss, numerics.Tol(1e-6, 1e-7))
        assert torch.equal(metrics["filtered"], base_metrics["filtered"])
        numerics.assert_close(
            "logp", metrics["logp"], base_metrics["logp"], numerics.Tol(1e-6, 1e-6)
        )
        for name in grads:
            numerics.assert_close(name, grads[name], base_grads[name], numerics.Tol(1e-5, 1e-7))


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), 1e4])
def test_hidden_at_masked_positions_is_never_read(garbage, device):
    case = make_case(3, 6, 50, H=12, seed=4, mask="empty_row", device=device)
    mask = case.mask
    for impl in implementations(device):
        loss, metrics, grads = run_linear(case, torch.float32, impl, chunk_size=4)
        dirty = case.hidden.clone()
        dirty[~mask] = garbage
        loss2, metrics2, grads2 = run_linear(case, torch.float32, impl, hidden=dirty, chunk_size=4)
        assert torch.equal(loss, loss2)
        for name in metrics:
            assert torch.equal(metrics[name], metrics2[name]), name
        for name in grads:
            assert torch.equal(grads[name], grads2[name]), name
        assert torch.count_nonzero(grads2["hidden"][~mask]) == 0


@pytest.mark.parametrize("grad_in_forward", [True, False])
def test_a_mask_makes_no_copy_of_the_hidden_states(grad_in_forward, device):
    # The masked rows' hidden states reach the weight's gradient through one chunk's buffer
    # (zeros at rows without gradient), not through a masked copy of all of them: the only
    # (B * T, H) tensor the op makes is grad_hidden.
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    B, T, V, H = 4, 8, 20, 16  # one chunk's logits (8 x 20) and weight (20 x 16) are smaller
    case = make_case(B, T, V, H=H, seed=4, mask="empty_row", device=device)
    big = B * T * H * 4

    class Storages(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.made: set[int] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() >= big:
                    self.made.add(t.untyped_storage().data_ptr())
            return out

    for impl in implementations(device):
        hidden = case.hidden.float().requires_grad_()
        weight = case.weight.float().requires_grad_()
        with cases.backend(impl), Storages() as seen:
            loss, _ = ftis_linear_loss(
                hidden, weight, *case.inputs, chunk_size=T, grad_in_forward=grad_in_forward
            )
            loss.backward()
        seen.made.discard(hidden.untyped_storage().data_ptr())
        assert seen.made == {hidden.grad.untyped_storage().data_ptr()}, impl


def test_filtered_samples_get_no_hidden_gradient(device):
    case = make_case(3, 5, 40, H=12, seed=5, mask="none", gen_spread=6.0, device=device)
    case = dataclasses.replace(case, advantages=torch.tensor([-1.0, 0.5, -0.3], device=device))
    _, metrics, grads = run_linear(case, torch.float32, chunk_size=3, kl_threshold=1.0)
    assert metrics["filtered"].tolist() == [True, False, True]
    assert (
        torch.count_nonzero(grads["hidden"][0]) == 0
        and torch.count_nonzero(grads["hidden"][2]) == 0
    )
    assert torch.count_nonzero(grads["hidden"][1]) > 0


def test_all_tokens_masked_gives_zero_loss_and_grads(device):
    case = make_case(2, 3, 20, H=5, seed=6, device=device)
    case = dataclasses.replace(case, mask=torch.zeros_like(case.tokens, dtype=torch.bool))
    for impl in implementations(device):
        loss, metrics, grads = run_linear(case, torch.float32, impl)
        assert float(loss.detach()) == 0.0
        assert all(torch.count_nonzero(g) == 0 for g in grads.values())
        assert all(torch.isfinite(metrics[name]).all() for name in SCALAR_METRICS)


@pytest.mark.parametrize("B,T,V", [(1, 1, 1), (1, 1, 7), (4, 1, 3)])
def test_single_token_and_tiny_vocabulary(B, T, V, device):
    case = make_case(B, T, V, H=5, seed=7, mask="none", device=device)
    for impl in implementations(device):
        check_against_reference(case, torch.float32, impl, exact=True, chunk_size=2)


def test_gradients_only_where_requested(device):
    case = make_case(2, 4, 30, H=6, seed=8, device=device)
    hidden = case.hidden.float().requires_grad_()
    weight = case.weight.float()  # frozen, as under LoRA
    loss, _ = ftis_linear_loss(hidden, weight, *case.inputs, bias=case.bias.float(), chunk_size=3)
    loss.backward()
    _, _, want = run_linear(case, torch.float32, chunk_size=3)
    assert weight.grad is None
    numerics.assert_close("grad_hidden", hidden.grad, want["hidden"], numerics.Tol(1e-6, 1e-8))
    weight.requires_grad_()
    hidden2 = case.hidden.float()
    loss, _ = ftis_linear_loss(hidden2, weight, *case.inputs, chunk_size=3)
    (grad_weight,) = torch.autograd.grad(loss * 3.0, [weight])
    case_nb = dataclasses.replace(case, bias=None)
    _, _, want = run_linear(case_nb, torch.float32, chunk_size=3)
    numerics.assert_close(
        "grad_weight", grad_weight, 3.0 * want["weight"], numerics.Tol(1e-6, 1e-8)
    )


def test_strided_hidden_is_read_without_a_copy_of_the_batch(device):
    case = make_case(2, 6, 30, H=8, seed=9, device=device)
    padded = torch.cat([case.hidden, torch.full_like(case.hidden[:, :1], float("nan"))], dim=1)
    strided = padded[
        :, :-1
    ]  # (B, T, H) view of a (B, T + 1, H) buffer, as hidden[:, :-1] in a model
    assert not strided.is_contiguous()
    got = run_linear(case, torch.float32, hidden=strided, chunk_size=5)
    want = run_linear(case, torch.float32, chunk_size=5)
    assert torch.equal(got[0], want[0])
    for name in want[2]:
        assert torch.equal(got[2][name], want[2][name])


# --- the two gradient orders --------------------------------------------------------------------

# Gradients of the two orders (or two chunkings): the same dlogits, matmuls over other row groups.
REORDERED = {
    torch.float32: numerics.Tol(1e-5, 1e-7),
    torch.bfloat16: numerics.Tol(2**-6, 1e-5),
    torch.float16: numerics.Tol(2**-8, 1e-6),
}


def _blocker(case, chunk_size, **opts):
    T = case.tokens.shape[1]
    chunk = (
        chunks_module.auto_chunk_size(case.weight.shape[0], T) if chunk_size is None else chunk_size
    )
    return linear_module.grad_in_forward_blocker(
        FTISOptions(**opts),
        with_old=case.old_logprobs is not None,
        sharded=False,
        longest=T,
        chunk_size=chunk,
    )


@given(
    B=st.integers(1, 3),
    T=st.integers(1, 5),
    H=st.sampled_from([1, 5, 12]),
    V=st.one_of(st.integers(1, 40), st.sampled_from([67])),
    dtype=dtypes,
    extra_rows=st.sampled_from([0, 1, 4, None]),
    mask=masks,
    gen_spread=gen_spreads,
    with_old=st.booleans(),
    seed=seeds,
    opts=options,
)
def test_both_gradient_orders_give_the_same_loss_metrics_and_gradients(
    B, T, H, V, dtype, extra_rows, mask, gen_spread, with_old, seed, opts
):
    """Chunks that hold whole samples (chunk_size >= T): where no option couples samples the
    forward order is taken and equals the backward order (loss and metrics bitwise: the same
    chunks, the same logits); where one does, "auto" is the backward order and True is refused."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    case = make_case(
        B,
        T,
        V,
        H=H,
        seed=seed,
        mask=mask,
        gen_spread=gen_spread,
        with_old=with_old,
        with_ref=opts["beta"] > 0,
        device=device,
    )
    chunk_size = None if extra_rows is None else T + extra_rows
    blocker = _blocker(case, chunk_size, **opts)
    for impl in implementations(device):
        loss, metrics, grads = run_linear(
            case, dtype, impl, chunk_size=chunk_size, grad_in_forward=False, **opts
        )
        if blocker is not None:
            with pytest.raises(ValueError, match="^grad_in_forward: expected 'auto' or False"):
                run_linear(case, dtype, impl, chunk_size=chunk_size, grad_in_forward=True, **opts)
        order = "auto" if blocker is not None else True
        got = run_linear(case, dtype, impl, chunk_size=chunk_size, grad_in_forward=order, **opts)
        assert torch.equal(got[0], loss)
        for name in metrics:
            assert torch.equal(got[1][name], metrics[name]), name
        for name, grad in grads.items():
            numerics.assert_close(f"grad_{name}", got[2][name], grad, REORDERED[dtype])


def _spy(name: str):
    return mock.patch.object(chunks_module, name, wraps=getattr(chunks_module, name))


def _orders_taken(case, **kw) -> tuple[bool, bool]:
    """(gradients computed in the forward, in the backward) of one forward + backward."""
    with _spy("linear_loss_and_grads") as forward, _spy("linear_grads") as backward:
        run_linear(case, torch.float32, "torch", **kw)
    return forward.called, backward.called


def _coef_of_sample_0(case, logp, **opts):
    result = per_sample_loss(logp, *case.inputs[1:], FTISOptions(**opts), entropy=logp.exp())
    return result.coef[0], result.entropy_coef[0]


# Options under which one sample's rejection changes another sample's d loss / d logp.
COUPLINGS = {
    "mask_rejection_with_a_batch_normaliser": dict(
        reject_mode="mask", filter="offpolicy", kl_threshold=0.5, loss_type="dapo"
    ),
    "mask_rejection_with_an_entropy_bonus": dict(
        reject_mode="mask", filter="offpolicy", kl_threshold=0.5, entropy_coef=0.1
    ),
}


@pytest.mark.parametrize("coupling", COUPLINGS)
def test_options_that_couple_samples_take_the_backward_order(coupling):
    opts = COUPLINGS[coupling]
    case = make_case(3, 4, 30, H=6, seed=21, mask="none", gen_spread=0.0)
    # The coupling is real: sample 1 rejected (its logp far from gen) changes sample 0's coef.
    logp = case.gen_logprobs.clone()
    far = logp.clone()
    far[1] -= 3.0
    assert not all(
        torch.equal(a, b)
        for a, b in zip(_coef_of_sample_0(case, logp, **opts), _coef_of_sample_0(case, far, **opts))
    )
    assert _orders_taken(case, chunk_size=4, **opts) == (False, True)
    with pytest.raises(
        ValueError, match="^grad_in_forward: expected 'auto' or False with reject_m"
    ):
        run_linear(case, torch.float32, "torch", chunk_size=4, grad_in_forward=True, **opts)
    # The same rejection with a per-sample normaliser: the forward order. From pi_old, the
    # batch-normalised loss takes it too (its 1 / N' scales the gradients at the end); the
    # entropy bonus's N' is needed before the first chunk's gradient, so it keeps the backward
    # order.
    per_sample = dict(opts, loss_type="grpo", entropy_coef=0.0)
    assert _orders_taken(case, chunk_size=4, **per_sample) == (True, False)
    from_old = (True, False) if opts.get("entropy_coef", 0) == 0 else (False, True)
    assert _orders_taken(case, chunk_size=4, **dict(opts, kl_source="old")) == from_old


def test_a_sample_longer_than_a_chunk_takes_the_backward_order():
    case = make_case(3, 4, 30, H=6, seed=22, mask="none")
    assert _orders_taken(case, chunk_size=3) == (False, True)
    assert _orders_taken(case, chunk_size=4) == (True, False)
    with pytest.raises(ValueError, match=r"a sample \(4 rows\) does not fit .* chunk_size=3"):
        run_linear(case, torch.float32, "torch", chunk_size=3, grad_in_forward=True)
    # Packed: the longest segment decides, not the packed length.
    cu_seqlens = torch.tensor([0, 3, 5])
    N = 5
    rows = (case.tokens.reshape(-1)[:N], case.gen_logprobs.reshape(-1)[:N], case.advantages[:2])
    hidden = case.hidden.reshape(-1, 6)[:N].float().requires_grad_()
    with _spy("linear_loss_and_grads") as forward:
        loss, _ = ftis_linear_loss(
            hidden, case.weight.float(), *rows, cu_seqlens=cu_seqlens, chunk_size=3
        )
        loss.backward()
    assert forward.called


@pytest.fixture
def one_rank_group():
    """A gloo process group of this process alone: a vocabulary "sharded" over one rank."""
    if dist.is_initialized():
        pytest.skip("a default process group exists already")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_a_sharded_vocabulary_takes_the_backward_order(one_rank_group):
    case = make_case(2, 4, 30, H=6, seed=26)
    assert _orders_taken(case, chunk_size=4, process_group=one_rank_group) == (False, True)
    with pytest.raises(ValueError, match="^grad_in_forward: expected 'auto' or False with a vocab"):
        run_linear(
            case, torch.float32, chunk_size=4, process_group=one_rank_group, grad_in_forward=True
        )


@given(
    opts=options,
    with_old=st.booleans(),
    seed=seeds,
)
def test_a_samples_coefficients_ignore_other_samples_wherever_the_forward_order_is_taken(
    opts, with_old, seed
):
    """The premise of the forward order, on the per-sample part itself: where
    `grad_in_forward_blocker` lets it run, another sample's logp and entropy (what the forward
    has not computed yet) change nothing in a sample's d loss / d logp and d loss / d entropy."""
    case = make_case(3, 4, 20, H=4, seed=seed, with_old=with_old, with_ref=opts["beta"] > 0)
    if _blocker(case, 4, **opts) is not None:
        return
    g = torch.Generator().manual_seed(seed)
    logp = case.gen_logprobs - torch.rand(3, 4, generator=g)
    other = logp.clone()
    other[1:] = torch.where(torch.rand(2, 4, generator=g) < 0.5, 0.0, -3 * torch.rand(2, 4))
    for a, b in zip(_coef_of_sample_0(case, logp, **opts), _coef_of_sample_0(case, other, **opts)):
        assert torch.equal(a, b)


def test_no_gradient_work_without_a_gradient():
    case = make_case(2, 4, 30, H=6, seed=23)
    hidden, weight = case.hidden.float(), case.weight.float()
    with _spy("_chunk_grads") as grads, _spy("linear_loss_and_grads") as forward:
        with torch.no_grad():
            ftis_linear_loss(
                hidden.requires_grad_(), weight, *case.inputs, chunk_size=4, grad_in_forward=True
            )
        ftis_linear_loss(hidden.detach(), weight, *case.inputs, chunk_size=4)
        assert not grads.called and not forward.called
        # Only the gradients asked for: a frozen weight (as under LoRA) gets no matmul of its own.
        with _spy("_accumulate_grad_weight") as grad_weight:
            loss, _ = ftis_linear_loss(hidden.requires_grad_(), weight, *case.inputs, chunk_size=4)
            loss.backward()
        assert forward.called and grads.called and not grad_weight.called


def test_forward_order_scales_by_the_incoming_gradient():
    case = make_case(2, 4, 30, H=6, seed=24, exact=False)
    leaves = [x.float().requires_grad_() for x in (case.hidden, case.weight, case.bias)]

    def grads(order, scale, **kw):
        loss, _ = ftis_linear_loss(
            *leaves[:2], *case.inputs, bias=leaves[2], chunk_size=4, grad_in_forward=order
        )
        return torch.autograd.grad(loss * scale, leaves, **kw), loss

    for scale in (1.0, -0.375):
        want, _ = grads(False, scale)
        got, _ = grads(True, scale)
        for name, g, w in zip(("hidden", "weight", "bias"), got, want):
            numerics.assert_close(name, g, w, REORDERED[torch.float32])
    # The forward's gradients are scaled in place: a second backward through a retained graph is
    # refused rather than scaled twice (at an incoming gradient of 1 nothing is scaled).
    loss, _ = ftis_linear_loss(*leaves[:2], *case.inputs, bias=leaves[2], chunk_size=4)
    torch.autograd.grad(loss * 2.0, leaves, retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss * 2.0, leaves)


@pytest.mark.parametrize("graded", ["weight", "bias"])
def test_the_default_value_check_waits_for_the_backward_when_only_bias_has_a_gradient(graded):
    """value_check="backward": the call reads nothing when a backward can follow, whichever of
    hidden, weight and bias records a gradient; the backward raises the named error."""
    case = make_case(1, 2, 5, H=4, seed=26, exact=False)
    tokens, _, adv, *rest = case.inputs
    bad_gen = torch.full(tokens.shape, 0.5)  # log-probabilities > 0
    weight = case.weight.float().requires_grad_(graded == "weight")
    bias = torch.zeros(5, requires_grad=graded == "bias")
    for impl in implementations(torch.device("cpu")):
        with cases.backend(impl):
            loss, _ = ftis_linear_loss(case.hidden.float(), weight, tokens, bad_gen, adv, bias=bias)
            with pytest.raises(ValueError, match="gen_logprobs: expected finite values <= 0"):
                loss.backward()


def test_forward_order_scales_the_gradient_of_a_permuted_hidden():
    # hidden (B, T, H) seen through a permutation of an (H, B, T) tensor: its (B * T, H) rows,
    # and grad_hidden allocated like them, are dense but not contiguous.
    case = make_case(2, 4, 30, H=6, seed=25, exact=False)
    base = case.hidden.float().permute(2, 0, 1).contiguous()
    leaves = [base.permute(1, 2, 0).requires_grad_(), case.weight.float().requires_grad_()]
    assert not leaves[0].is_contiguous()

    def grads(order):
        loss, _ = ftis_linear_loss(*leaves, *case.inputs, chunk_size=4, grad_in_forward=order)
        return torch.autograd.grad(loss * -0.375, leaves)

    want, got = grads(False), grads(True)
    for name, g, w in zip(("hidden", "weight"), got, want):
        numerics.assert_close(name, g, w, REORDERED[torch.float32])


_BACKWARD_PEAK = """
import torch
from ftis_kernels import ftis_linear_loss


def kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


g = torch.Generator().manual_seed(0)
hidden = torch.randn(2, 8, 512, generator=g).requires_grad_()
weight = torch.randn(8192, 512, generator=g).requires_grad_()  # 16 MiB
rows = (torch.randint(0, 8192, (2, 8), generator=g), -torch.rand(2, 8, generator=g), torch.ones(2))
for _ in range(2):
    hidden.grad = weight.grad = None
    loss, _ = ftis_linear_loss(hidden, weight, *rows, grad_in_forward=True)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = kib("VmRSS")
    loss.backward()
print(kib("VmHWM") - before)
"""


def test_forward_order_backward_allocates_nothing_of_the_gradients_size():
    """The backward of the forward order only scales the saved gradients: no zero gradient is
    materialised for the op's other outputs (that was a zeroed (V, H) tensor per backward).
    Measured as the resident-set high-water mark of a fresh process whose allocator maps every
    block of 64 KiB or more (so that freed memory leaves the resident set)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", _BACKWARD_PEAK], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    grad_weight_kib = 8192 * 512 * 4 // 1024
    assert int(proc.stdout.split()[-1]) < grad_weight_kib // 4


_ACCUMULATOR_PEAK = """
import sys
import torch
from ftis_kernels import ftis_linear_loss


def kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


g = torch.Generator().manual_seed(0)
bf16 = torch.bfloat16
hidden = torch.randn(2, 8, 512, generator=g).to(bf16).requires_grad_()
weight = (torch.randn(32768, 512, generator=g) * 0.05).to(bf16).requires_grad_()  # 32 MiB
rows = (torch.randint(0, 32768, (2, 8), generator=g), -torch.rand(2, 8, generator=g), torch.ones(2))
for _ in range(2):
    hidden.grad = weight.grad = None
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = kib("VmRSS")
    loss, _ = ftis_linear_loss(hidden, weight, *rows, grad_weight_accumulation=sys.argv[1])
    loss.backward()
print(kib("VmHWM") - before)
"""


def test_grad_weight_accumulated_in_the_weights_dtype_needs_no_fp32_copy_of_it():
    """bf16 fp32-accumulated: a (V, H) fp32 accumulator (64 MiB here) beside the bf16 gradient
    (32 MiB); accumulated in bf16: the gradient and one vocabulary block's GEMM scratch (the CPU's
    half-precision GEMM sums through an fp32 copy of its output: 16 MiB a block of 8192 rows).
    Resident-set high-water marks of fresh processes, as above."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    peaks = {}
    for accumulation in chunks_module.GRAD_WEIGHT_ACCUMULATIONS:
        proc = subprocess.run(
            [sys.executable, "-c", _ACCUMULATOR_PEAK, accumulation],
            env=env,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        peaks[accumulation] = int(proc.stdout.split()[-1]) / 1024  # MiB
    grad_weight_mib, accumulator_mib, block_mib = 32, 64, 16
    # fp32: the accumulator and the gradient converted from it, alive together at the end.
    assert peaks["fp32"] >= accumulator_mib + 0.75 * grad_weight_mib, peaks
    assert peaks["weight"] <= grad_weight_mib + 1.5 * block_mib, peaks


@pytest.mark.parametrize("value", ["yes", 1, None, "Auto"])
def test_bad_grad_in_forward_is_refused_naming_it(value):
    case = make_case(2, 3, 20, H=4, seed=25)
    with pytest.raises(ValueError, match="^grad_in_forward: expected 'auto', True or False"):
        run_linear(case, torch.float32, "torch", grad_in_forward=value)


def _abs_chunk_products(case) -> torch.Tensor:
    """(V, H) sum over rows of |dloss/dlogits[r, v] * hidden[r, h]| in float64: a bound on every
    partial sum of grad_weight over chunks of rows."""
    h, w = case.hidden.double().cpu(), case.weight.double().cpu()
    z = h @ w.T + (0.0 if case.bias is None else case.bias.double().cpu())
    z.requires_grad_()
    rows = [x.cpu() if isinstance(x, torch.Tensor) else x for x in case.inputs]
    loss, _ = ref_ftis_loss(z, *rows, compute_dtype=torch.float64)
    (g,) = torch.autograd.grad(loss, z)
    return g.abs().flatten(0, 1).T @ h.abs().flatten(0, 1)


@pytest.mark.parametrize("grad_in_forward", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_weight_accumulated_in_the_weights_dtype_rounds_once_per_chunk(
    dtype, grad_in_forward, device
):
    """grad_weight_accumulation="weight": no fp32 (V, H) accumulator; the loss, the metrics,
    grad_hidden and grad_bias are those of "fp32" bit for bit, and grad_weight differs from it by
    at most one rounding per chunk (and one at the end) of the sum of the chunks' |products|."""
    B, T, V, H = 4, 3, 40, 8
    case = make_case(B, T, V, H=H, seed=31, exact=False, device=device)
    n_chunks = B  # chunk_size = T: one sample a chunk
    # One rounding (unit roundoff eps / 2) of each partial sum, one of the fp32 sum; 10% for the
    # op's dlogits being those of the dtype's logits, not the float64 oracle's.
    unit = torch.finfo(dtype).eps / 2
    bound = 1.1 * (n_chunks + 1) * unit * _abs_chunk_products(case)
    original = chunks_module.new_grads

    def new_grads(*args, **kwargs):
        grads = original(*args, **kwargs)
        made.append(grads[1].dtype)
        return grads

    for impl in implementations(device):
        made: list[torch.dtype] = []

        kw = dict(chunk_size=T, grad_in_forward=grad_in_forward)
        loss, metrics, grads = run_linear(case, dtype, impl, **kw)
        with mock.patch.object(chunks_module, "new_grads", new_grads):
            got = run_linear(case, dtype, impl, grad_weight_accumulation="weight", **kw)
        assert made == [dtype]  # the accumulator is the gradient's own dtype
        assert torch.equal(got[0], loss)
        for name in metrics:
            assert torch.equal(got[1][name], metrics[name]), name
        assert torch.equal(got[2]["hidden"], grads["hidden"])
        assert torch.equal(got[2]["bias"], grads["bias"])
        assert got[2]["weight"].dtype == dtype
        if dtype == torch.float32:
            assert torch.equal(got[2]["weight"], grads["weight"])
        diff = (got[2]["weight"].double().cpu() - grads["weight"].double().cpu()).abs()
        assert bool((diff <= bound + 1e-12).all()), float((diff - bound).max())


@pytest.mark.parametrize("value", ["bf16", None, "Weight", 32])
def test_bad_grad_weight_accumulation_is_refused_naming_it(value):
    case = make_case(2, 3, 20, H=4, seed=25)
    with pytest.raises(ValueError, match="^grad_weight_accumulation: expected one of"):
        run_linear(case, torch.float32, "torch", grad_weight_accumulation=value)


# --- torch.library registration ---------------------------------------------------------------


def test_torch_compile_fullgraph_matches_eager(device):
    case = make_case(2, 5, 33, H=8, seed=10, device=device)
    hidden, weight, bias = (
        x.float().requires_grad_() for x in (case.hidden, case.weight, case.bias)
    )

    def step(h, w, b):
        loss, metrics = ftis_linear_loss(h, w, *case.inputs, bias=b, chunk_size=3)
        return loss * 2.0, metrics["kl"]

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    want, want_kl = step(hidden, weight, bias)
    got, got_kl = compiled(hidden, weight, bias)
    assert torch.equal(got, want) and torch.equal(got_kl, want_kl)
    leaves = [hidden, weight, bias]
    for g, w in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, leaves)):
        assert torch.equal(g, w)


def test_torch_compile_keeps_the_grad_weight_accumulation(device):
    """The option crosses the traced custom ops: compiled bf16 calls summing in the weight's
    dtype give the eager call's gradients bit for bit, which differ from the fp32 sum's."""
    case = make_case(2, 5, 33, H=8, seed=10, exact=False, device=device)
    leaves = [x.to(torch.bfloat16).requires_grad_() for x in (case.hidden, case.weight, case.bias)]

    def step(h, w, b, accumulation="weight"):
        loss, _ = ftis_linear_loss(
            h, w, *case.inputs, bias=b, chunk_size=3, grad_weight_accumulation=accumulation
        )
        return loss

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    want = torch.autograd.grad(step(*leaves), leaves)
    got = torch.autograd.grad(compiled(*leaves), leaves)
    fp32_sum = torch.autograd.grad(step(*leaves, accumulation="fp32"), leaves)
    assert not torch.equal(want[1], fp32_sum[1])  # the two sums are told apart here
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16 and torch.equal(g, w)


def test_custom_ops_pass_opcheck(device):
    case = make_case(2, 3, 17, H=4, seed=11, device=device)
    tokens, gen, adv, mask, old, ref = case.inputs
    hidden, weight, bias = (x.float() for x in (case.hidden, case.weight, case.bias))
    options = custom_op.option_args(FTISOptions(entropy_coef=0.01))
    # cu_seqlens, max_seqlen, vocab_start, group_name, value_check, check_now
    unpacked_unsharded = (None, 0, 0, None, "backward", False)
    needs = (True, True, True)
    fwd = torch.ops.ftis_kernels.ftis_linear_loss_fwd.default
    for backend in implementations(device):
        fwd_args = (
            hidden, weight, bias, tokens, gen, adv, mask, old, ref, *options,
            *unpacked_unsharded,
            [],  # sample_offsets: padded
            3,  # chunk_size: whole samples
            backend,
        )  # fmt: skip
        for grad_in_forward, accumulation in ((False, "fp32"), (True, "fp32"), (True, "weight")):
            torch.library.opcheck(fwd, (*fwd_args, grad_in_forward, *needs, accumulation))
        outputs = dict(zip(custom_op.OUTPUT_NAMES, fwd(*fwd_args, False, *needs, "fp32")))
        names = ("row_max", "log_sum", "coef", "entropy", "entropy_coef")
        stats = tuple(outputs[name].reshape(-1) for name in names)
        scales = outputs["scalars"][-2:] if backend == "triton" else None
        if backend != "triton":
            stats = stats[:2] + (stats[2] * 1.0, stats[3], stats[4] * -0.01 / mask.sum())
        grad = torch.ones((), device=device) if backend == "triton" else None
        bwd_args = (
            hidden, mask, weight, bias, tokens.reshape(-1), *stats, scales, grad,
            outputs["record"], [], 1.0, 2, backend, True, True, True,
        )  # fmt: skip
        bwd = torch.ops.ftis_kernels.ftis_linear_loss_bwd.default
        torch.library.opcheck(bwd, bwd_args)
        torch.library.opcheck(bwd, (*bwd_args, None, "weight"))
        grads = fwd(*fwd_args, True, *needs, "fp32")[-3:]
        scale = torch.ops.ftis_kernels.ftis_linear_loss_scale_.default
        for factor in (1.0, 0.5):
            args = (*(g.clone() for g in grads), torch.tensor(factor, device=device), None)
            torch.library.opcheck(scale, args)


@pytest.mark.cuda
def test_cuda_matches_cpu_torch_path():
    case = make_case(3, 9, 1000, H=64, seed=13, exact=False, mask="random")
    want = run_linear(case, torch.float32, "torch", chunk_size=7)
    gpu = case.to("cuda")
    for dtype in DTYPES:
        check_against_reference(gpu, dtype, "triton", exact=False, chunk_size=7)
    got = run_linear(gpu, torch.float32, chunk_size=7)
    numerics.assert_close("loss", got[0], want[0], numerics.Tol(1e-4, 1e-6))
    for name in want[2]:
        numerics.assert_close(name, got[2][name], want[2][name], numerics.Tol(1e-3, 1e-5))


@pytest.mark.parametrize("grad_in_forward", [True, False])
def test_a_0_1_integer_mask_gives_the_bool_masks_result(grad_in_forward, device):
    case = make_case(2, 5, 30, H=6, seed=31, device=device)
    for impl in implementations(device):
        want = run_linear(case, torch.float32, impl, grad_in_forward=grad_in_forward)
        ints = dataclasses.replace(case, mask=case.mask.int())
        got = run_linear(ints, torch.float32, impl, grad_in_forward=grad_in_forward)
        assert torch.equal(got[0], want[0]), impl
        for name in want[2]:
            assert torch.equal(got[2][name], want[2][name]), (impl, name)
