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

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ftis_kernels import ftis_linear_loss, ftis_loss
from ftis_kernels.kernels import logp_lse
from ftis_kernels.options import FTISOptions, option_args
from ftis_kernels.per_sample import METRIC_NAMES
from tests import numerics
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


@pytest.fixture(autouse=True)
def small_vocab_blocks(monkeypatch):
    """Small vocabulary blocks so that the tests' small V still exercise the multi-block loops
    (the row kernels and the bf16/fp16 grad_weight accumulation)."""
    monkeypatch.setattr(logp_lse, "MAX_BLOCK_V", 64)
    monkeypatch.setattr(logp_lse, "CPU_CHUNK_ELEMENTS", 256)
    monkeypatch.setattr(linear_module, "GRAD_WEIGHT_BLOCK_V", 16)


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
            errors[name] = check(name, metrics[name], o_metrics[name], f32_metrics[name], numerics.FP32)
        assert torch.equal(metrics["filtered"].cpu(), o_metrics["filtered"].cpu())
    else:
        errors["loss"] = check("loss", loss, o_loss, p_loss, numerics.FP32)
        errors["logp"] = check("logp", metrics["logp"], o_metrics["logp"], p_metrics["logp"], numerics.FP32)
    for name, grad in grads.items():
        assert grad.dtype == dtype and grad.shape == o_grads[name].shape
        errors[f"grad_{name}"] = check(f"grad_{name}", grad, o_grads[name], p_grads[name],
                                       numerics.GRAD_MARGIN[dtype])  # fmt: skip
    if record:
        numerics.record(dtype, f"linear-{impl}" + ("" if exact else "/random"), errors)


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
    case = make_case(B, T, V, H=H, seed=seed, with_bias=with_bias, mask=mask, gen_spread=gen_spread,
                     with_old=with_old, with_ref=opts["beta"] > 0, device=device)  # fmt: skip
    numerics.count_example()
    for impl in implementations(device):
        check_against_reference(case, dtype, impl, exact=True, chunk_size=chunk_size, record=True, **opts)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_size", [5, 8, None])  # 5 does not divide B * T = 16, 8 does
def test_random_hidden_matches_reference_for_each_dtype_and_path(dtype, chunk_size, device):
    case = make_case(2, 8, 150, H=32, seed=1, exact=False, mask="none", gen_spread=2.0, device=device)
    for impl in implementations(device):
        check_against_reference(case, dtype, impl, exact=False, chunk_size=chunk_size, record=True,
                                temperature=0.9, loss_type="bnpo")  # fmt: skip


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
    tol = {torch.float32: numerics.Tol(1e-5, 1e-7), torch.bfloat16: numerics.Tol(2**-6, 1e-5),
           torch.float16: numerics.Tol(2**-8, 1e-6)}[dtype]  # fmt: skip
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
    large = dataclasses.replace(case, logits=logits, tokens=tokens, gen_logprobs=gen, mask=None,
                                old_logprobs=old, ref_logprobs=ref, weight=weight, bias=bias)  # fmt: skip
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
        numerics.assert_close("logp", metrics["logp"], base_metrics["logp"], numerics.Tol(1e-6, 1e-6))
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


def test_filtered_samples_get_no_hidden_gradient(device):
    case = make_case(3, 5, 40, H=12, seed=5, mask="none", gen_spread=6.0, device=device)
    case = dataclasses.replace(case, advantages=torch.tensor([-1.0, 0.5, -0.3], device=device))
    _, metrics, grads = run_linear(case, torch.float32, chunk_size=3, kl_threshold=1.0)
    assert metrics["filtered"].tolist() == [True, False, True]
    assert torch.count_nonzero(grads["hidden"][0]) == 0 and torch.count_nonzero(grads["hidden"][2]) == 0
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
    numerics.assert_close("grad_weight", grad_weight, 3.0 * want["weight"], numerics.Tol(1e-6, 1e-8))


def test_strided_hidden_is_read_without_a_copy_of_the_batch(device):
    case = make_case(2, 6, 30, H=8, seed=9, device=device)
    padded = torch.cat([case.hidden, torch.full_like(case.hidden[:, :1], float("nan"))], dim=1)
    strided = padded[:, :-1]  # (B, T, H) view of a (B, T + 1, H) buffer, as hidden[:, :-1] in a model
    assert not strided.is_contiguous()
    got = run_linear(case, torch.float32, hidden=strided, chunk_size=5)
    want = run_linear(case, torch.float32, chunk_size=5)
    assert torch.equal(got[0], want[0])
    for name in want[2]:
        assert torch.equal(got[2][name], want[2][name])


# --- torch.library registration ---------------------------------------------------------------


def test_torch_compile_fullgraph_matches_eager(device):
    case = make_case(2, 5, 33, H=8, seed=10, device=device)
    hidden, weight, bias = (x.float().requires_grad_() for x in (case.hidden, case.weight, case.bias))

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


def test_custom_ops_pass_opcheck(device):
    case = make_case(2, 3, 17, H=4, seed=11, device=device)
    tokens, gen, adv, mask, old, ref = case.inputs
    hidden, weight, bias = (x.float() for x in (case.hidden, case.weight, case.bias))
    options = option_args(FTISOptions(entropy_coef=0.01))
    unpacked_unsharded = (None, 0, 0, None)  # cu_seqlens, max_seqlen, vocab_start, group_name
    fwd_args = (hidden, weight, bias, tokens, gen, adv, mask, old, ref, *options,
                *unpacked_unsharded, 2, "torch")  # fmt: skip
    torch.library.opcheck(torch.ops.ftis_kernels.ftis_linear_loss_fwd.default, fwd_args)
    outputs = torch.ops.ftis_kernels.ftis_linear_loss_fwd(*fwd_args)
    *_, row_max, log_sum, coef, entropy_coef = outputs
    entropy = outputs[1 + METRIC_NAMES.index("entropy")]
    stats = (row_max, log_sum, coef, entropy, entropy_coef)
    bwd_args = (hidden, weight, bias, tokens, *stats, 1.0, 2, "torch", True, True, True)
    torch.library.opcheck(torch.ops.ftis_kernels.ftis_linear_loss_bwd.default, bwd_args)


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
