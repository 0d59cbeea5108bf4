"""Numerics of `ftis_loss` against the float64 reference, the method's invariants, edge cases."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ftis_kernels import ftis_loss
from ftis_kernels.kernels import logp_grad, logp_lse, logp_lse_cpu
from ftis_kernels.options import IS_LEVELS, IS_MODES, LOSS_TYPES, FTISOptions, loss_type
from ref import ref_ftis_loss
from tests import numerics
from tests.cases import (
    DTYPES,
    SCALAR_METRICS,
    Case,
    backend,
    dtypes,
    ftis_loss_module,
    gen_spreads,
    implementations,
    make_case,
    masks,
    options,
    run_op,
    run_ref,
    seeds,
)


@pytest.fixture(autouse=True)
def small_vocab_blocks(monkeypatch):
    """Vocabulary blocks of 64 so that the tests' small V still exercise the multi-block loops."""
    monkeypatch.setattr(logp_lse, "MAX_BLOCK_V", 64)
    monkeypatch.setattr(logp_grad, "MAX_GRAD_BLOCK_V", 64)
    monkeypatch.setattr(logp_lse_cpu, "CPU_CHUNK_ELEMENTS", 256)


def check_against_reference(case, dtype, impl, record=False, op_opts=None, **opts) -> None:
    """Loss, every metric and the gradient of the op against the float64 oracle (numerics.py);
    op_opts: the op's own keywords (not the method's options)."""
    loss, metrics, grad = run_op(case, impl, **opts, **(op_opts or {}))
    o_loss, o_metrics, o_grad = run_ref(case, torch.float64, **opts)
    p_loss, p_metrics, _ = run_ref(case, torch.float32, **opts)
    _, _, p_grad = run_ref(case, dtype, **opts)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert grad.dtype == dtype and grad.shape == case.logits.shape
    check = numerics.assert_no_worse_than_plain
    errors = {"loss": check("loss", loss, o_loss, p_loss, numerics.FP32)}
    for name in ("logp", "entropy", "kl", *SCALAR_METRICS):
        errors[name] = check(name, metrics[name], o_metrics[name], p_metrics[name], numerics.FP32)
    assert torch.equal(metrics["filtered"].cpu(), o_metrics["filtered"].cpu())
    errors["grad"] = check("grad", grad, o_grad, p_grad, numerics.GRAD_MARGIN[dtype])
    if record:
        numerics.record(dtype, impl, errors)


# --- properties against the reference --------------------------------------------------------


@given(
    B=st.integers(1, 4),
    T=st.integers(1, 6),
    V=st.one_of(st.integers(1, 70), st.sampled_from([127, 200, 257])),
    dtype=dtypes,
    mask=masks,
    scale=st.sampled_from([0.5, 3.0]),
    gen_spread=gen_spreads,
    with_old=st.booleans(),
    zero_advantage=st.booleans(),
    seed=seeds,
    opts=options,
)
def test_matches_reference_on_loss_metrics_and_grad(
    B, T, V, dtype, mask, scale, gen_spread, with_old, zero_advantage, seed, opts
):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    case = make_case(
        B,
        T,
        V,
        dtype,
        seed=seed,
        mask=mask,
        scale=scale,
        gen_spread=gen_spread,
        with_old=with_old,
        with_ref=opts["beta"] > 0,
        zero_advantage=zero_advantage,
        device=device,
    )
    numerics.count_example()
    for impl in implementations(device):
        check_against_reference(case, dtype, impl, record=True, **opts)


@pytest.mark.parametrize("dtype", DTYPES)
def test_defaults_match_reference_for_each_dtype_and_path(dtype, device):
    case = make_case(3, 5, 203, dtype, seed=1, gen_spread=3.0, device=device)
    for impl in implementations(device):
        check_against_reference(case, dtype, impl)


# --- the method's invariants -------------------------------------------------------------------


@pytest.mark.parametrize("is_mode", IS_MODES)
@pytest.mark.parametrize("is_level", IS_LEVELS)
def test_on_policy_gen_logprobs_reduce_every_is_mode_to_plain_grpo(is_mode, is_level, device):
    case = make_case(3, 6, 90, seed=2, device=device)
    _, metrics, _ = run_op(case)
    on_policy = Case(
        case.logits, case.tokens, metrics["logp"], case.advantages, case.mask, case.old_logprobs
    )
    plain = run_op(on_policy, is_mode="none", filter=None)
    got = run_op(on_policy, is_mode=is_mode, is_level=is_level)
    assert torch.equal(got[0], plain[0])
    assert torch.equal(got[2], plain[2])
    assert float(got[1]["is_weight_mean"]) == 1.0 and float(got[1]["filtered_frac"]) == 0.0


def test_tis_with_infinite_cap_is_vis(device):
    case = make_case(4, 5, 77, seed=3, gen_spread=3.0, device=device)
    tis = run_op(case, is_mode="tis", is_cap=math.inf)
    vis = run_op(case, is_mode="vis")
    assert torch.equal(tis[0], vis[0]) and torch.equal(tis[2], vis[2])
    assert float(tis[1]["is_truncated_frac"]) == 0.0


def test_filtered_sample_contributes_no_gradient(device):
    case = make_case(3, 5, 64, seed=4, mask="none", gen_spread=6.0, device=device)
    adv = torch.tensor([-1.0, 0.5, -0.3], device=device)
    case = Case(case.logits, case.tokens, case.gen_logprobs, adv, None, case.old_logprobs)
    loss, metrics, grad = run_op(case, kl_threshold=1.0)
    assert metrics["filtered"].tolist() == [True, False, True]
    assert torch.count_nonzero(grad[0]) == 0 and torch.count_nonzero(grad[2]) == 0
    assert torch.count_nonzero(grad[1]) > 0
    # The filtered samples' advantage is 0, yet they still count in the grpo mean over B.
    single = Case(
        case.logits[1:2],
        case.tokens[1:2],
        case.gen_logprobs[1:2],
        adv[1:2],
        None,
        case.old_logprobs[1:2],
    )
    alone, _, _ = run_op(single, kl_threshold=1.0)
    numerics.assert_close("loss", loss * 3, alone)


@pytest.mark.parametrize("opts", [{}, {"is_level": "sequence", "beta": 0.1, "temperature": 0.8}])
def test_sample_loss_and_gradient_do_not_depend_on_other_samples(opts, device):
    case = make_case(4, 6, 70, seed=5, with_ref=True, device=device)
    loss, _, grad = run_op(case, **opts)
    per_sample = []
    for b in range(4):
        one = Case(*(t[b : b + 1] if t is not None else None for t in (case.logits, *case.inputs)))
        l_b, _, g_b = run_op(one, **opts)
        per_sample.append(l_b)
        numerics.assert_close(f"grad[{b}]", grad[b] * 4, g_b[0])
    numerics.assert_close("loss", loss, torch.stack(per_sample).mean())


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), -float("inf"), 1e4])
def test_logits_at_masked_positions_change_nothing(garbage, device):
    case = make_case(3, 6, 100, seed=6, mask="empty_row", device=device)
    for impl in implementations(device):
        loss, metrics, grad = run_op(case, impl)
        dirty = case.logits.clone()
        dirty[~case.mask] = garbage
        loss2, metrics2, grad2 = run_op(case, impl, logits=dirty)
        assert torch.equal(loss, loss2)
        for name in metrics:
            assert torch.equal(metrics[name], metrics2[name]), name
        assert torch.equal(grad, grad2)
        assert torch.count_nonzero(grad2[~case.mask]) == 0


# --- edge cases --------------------------------------------------------------------------------


def test_all_tokens_masked_gives_zero_loss_and_grad(device):
    case = make_case(2, 4, 50, seed=7, mask="all_off", device=device)
    for impl in implementations(device):
        loss, metrics, grad = run_op(case, impl, beta=0.0)
        assert float(loss.detach()) == 0.0 and torch.count_nonzero(grad) == 0
        assert all(torch.isfinite(metrics[name]).all() for name in SCALAR_METRICS)


@pytest.mark.parametrize("filter", ["negative", "negative_offpolicy", "negative_or_offpolicy"])
def test_every_sample_filtered_gives_finite_zero_loss_and_grad(filter, device):
    case = make_case(3, 5, 60, seed=8, gen_spread=8.0, device=device)
    case = Case(
        case.logits,
        case.tokens,
        case.gen_logprobs,
        -case.advantages.abs() - 0.1,
        case.mask,
        case.old_logprobs,
    )
    for impl in implementations(device):
        loss, metrics, grad = run_op(case, impl, filter=filter, kl_threshold=0.5, is_mode="vis")
        assert bool(metrics["filtered"].all())
        assert float(loss.detach()) == 0.0 and torch.count_nonzero(grad) == 0


@pytest.mark.parametrize("B,T", [(1, 1), (1, 7), (5, 1)])
def test_single_token_and_single_sample_batches(B, T, device):
    case = make_case(B, T, 129, seed=9, mask="none", device=device)
    for impl in implementations(device):
        check_against_reference(case, torch.float32, impl)


def test_vocabulary_of_one_token(device):
    case = make_case(2, 3, 1, seed=10, device=device)
    loss, metrics, grad = run_op(case)
    assert torch.count_nonzero(metrics["logp"]) == 0 and torch.count_nonzero(grad) == 0


@pytest.mark.parametrize("grad_in_forward", [None, False], ids=["default", "three_pass"])
@pytest.mark.parametrize("layout", ["vocab_slice", "tokenizer_slice", "transposed", "time_stride"])
def test_non_contiguous_logits(layout, grad_in_forward, device):
    """Views give the contiguous copy's results bit for bit. tokenizer_slice: a vocabulary cut to
    the tokenizer's size out of a 16-aligned output, whose row loops take their last partial
    block apart (`logp_lse.tail_apart`)."""
    case = make_case(3, 4, 97, seed=11, device=device)
    if layout in ("vocab_slice", "tokenizer_slice"):
        big = torch.randn(3, 4, 130 if layout == "vocab_slice" else 112, device=device)
        big[..., :97] = case.logits
        view = big[..., :97]
        stride = dict(zip(("stride_lb", "stride_lt", "stride_lv"), view.stride()))
        assert logp_lse.tail_apart(dict(V=97, **stride)) == (layout == "tokenizer_slice")
    elif layout == "transposed":
        view = case.logits.transpose(0, 1).contiguous().transpose(0, 1)
    else:
        big = torch.randn(3, 8, 97, device=device)
        big[:, ::2] = case.logits
        view = big[:, ::2]
    assert not view.is_contiguous()
    for impl in implementations(device):
        want = run_op(case, impl, grad_in_forward=grad_in_forward)
        x = view.detach().requires_grad_()
        with backend(impl):
            loss, metrics = ftis_loss(x, *case.inputs, grad_in_forward=grad_in_forward)
            (grad,) = torch.autograd.grad(loss, x)
        assert torch.equal(loss, want[0]) and torch.equal(grad, want[2])
        assert torch.equal(metrics["entropy"], want[1]["entropy"])


def test_int32_tokens_give_the_int64_result(device):
    case = make_case(2, 5, 80, seed=12, device=device)
    want = run_op(case)
    case32 = Case(case.logits, case.tokens.int(), *case.inputs[1:])
    got = run_op(case32)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])


def test_large_logits_do_not_overflow(device):
    case = make_case(2, 4, 150, seed=13, scale=1e4, gen_spread=0.0, device=device)
    for impl in implementations(device):
        loss, metrics, grad = run_op(case, impl)
        assert (
            torch.isfinite(loss)
            and torch.isfinite(grad).all()
            and torch.isfinite(metrics["logp"]).all()
        )
        check_against_reference(case, torch.float32, impl)


@pytest.mark.parametrize("level", ["sequence", "sequence_product"])
def test_an_overflowing_sequence_ratio_is_inf_in_the_metrics_not_nan(level, device):
    """A sequence-level ratio past fp32's range (log r ~ 99) is inf on every token of its sample,
    the padding too: the metrics average it over the completion tokens only (inf, not inf * 0)."""
    logits = torch.zeros(1, 2, 3, device=device)  # log pi_theta = -log 3
    tokens = torch.zeros(1, 2, dtype=torch.long, device=device)
    gen = torch.tensor([[-100.0, -0.5]], device=device)
    adv, mask = torch.ones(1, device=device), torch.tensor([[True, False]], device=device)
    opts = dict(is_level=level, is_mode="tis", filter=None)
    results = [ref_ftis_loss(logits.cpu(), tokens.cpu(), gen.cpu(), adv.cpu(), mask.cpu(), **opts)]
    for impl in implementations(device):
        with backend(impl):
            results.append(ftis_loss(logits, tokens, gen, adv, mask, **opts))
    for _, metrics in results:
        assert metrics["is_ratio_mean"].item() == math.inf
        assert metrics["is_weight_mean"].item() == 2.0  # truncated at C = 2


@pytest.mark.parametrize(
    "opts",
    [{}, dict(temperature=0.5, beta=0.04, entropy_coef=0.05)],
    ids=["plain", "tau-beta-entropy"],
)
@pytest.mark.parametrize("magnitude", [1e4, 1e6, 1e8, 1e30])
def test_large_logits_keep_the_digits_of_log_softmax(magnitude, opts, device):
    """Rows at +-|x| with small differences: logp = (x_t - max) - log sum exp(x - max) loses no
    digit that log_softmax keeps (x_t - (max + log sum) would: 0.016 at 1e6, 0 for -log V at
    1e30)."""
    case = make_case(2, 4, 150, seed=13, offset=magnitude, with_ref=True, device=device)
    for impl in implementations(device):
        check_against_reference(case, torch.float32, impl, **opts)


def test_inplace_backward_writes_the_same_gradient_into_the_logits(device):
    case = make_case(3, 4, 101, torch.bfloat16, seed=14, device=device)
    for impl in implementations(device):
        _, _, want = run_op(case, impl)
        leaf = case.logits.clone().requires_grad_()
        logits = leaf * 1.0  # a non-leaf, like the output of an lm-head
        with backend(impl):
            loss, _ = ftis_loss(logits, *case.inputs, inplace_backward=True)
            (grad,) = torch.autograd.grad(loss, logits)
        assert torch.equal(grad, want)
        assert grad.data_ptr() == logits.data_ptr(), "no new (B, T, V) buffer"


@pytest.mark.parametrize("grad_in_forward", [False, None])
def test_gradient_scales_with_the_incoming_gradient(grad_in_forward, device):
    case = make_case(2, 3, 40, seed=15, device=device)
    grads = []
    for scale in (1.0, 3.0):
        x = case.logits.clone().requires_grad_()
        loss, _ = ftis_loss(x, *case.inputs, grad_in_forward=grad_in_forward)
        grads.append(torch.autograd.grad(loss * scale, x)[0])
    numerics.assert_close("grad", grads[1], 3.0 * grads[0])


def test_three_pass_backward_runs_again_with_retain_graph(device):
    case = make_case(2, 3, 40, seed=15, device=device)
    x = case.logits.clone().requires_grad_()
    loss, _ = ftis_loss(x, *case.inputs, grad_in_forward=False)
    (g1,) = torch.autograd.grad(loss, x, retain_graph=True)
    (g3,) = torch.autograd.grad(loss * 3.0, x)
    numerics.assert_close("grad", g3, 3.0 * g1)


# --- the gradient written in the forward (kernels/logp_grad.py) -------------------------------

# Options under which a row's gradient is its own row's: each reduction, surrogate, IS mode and
# filter that the gradient-in-forward path takes, with filters that reject samples.
GRAD_IN_FORWARD_OPTIONS = [
    {},
    {"kl_threshold": 0.5},
    {"kl_threshold": 0.5, "kl_reduction": "mean", "kl_estimator": "k2"},
    {"filter": "negative"},
    {"filter": "negative_or_offpolicy", "kl_threshold": 2.0, "temperature": 0.7},
    {"filter": "offpolicy", "kl_threshold": 1.0, "kl_threshold_low": 0.1},
    {"loss_type": "dapo", "kl_threshold": 0.5},
    {"loss_type": "bnpo", "filter": None, "beta": 0.1},
    {"loss_type": "dr_grpo", "max_completion_length": 9},
    {"loss_type": "cispo", "is_mode": "vis"},
    {"loss_type": "sapo", "is_mode": "mask", "is_cap_min": 0.5},
    {"loss_type": "luspo", "is_mode": "none", "reject_mode": "mask", "kl_threshold": 0.5},
    {"is_source": "old", "kl_source": "old", "epsilon_high": 0.28, "delta": 1.5},
]


@pytest.mark.parametrize("opts", GRAD_IN_FORWARD_OPTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_in_forward_matches_reference_and_three_passes(opts, dtype, device):
    case = make_case(
        4, 5, 203, dtype, seed=21, gen_spread=3.0, with_old=True, with_ref=True, device=device
    )
    for impl in implementations(device):
        if impl == "torch":  # the PyTorch path has no gradient-in-forward
            continue
        check_against_reference(case, dtype, impl, op_opts={"grad_in_forward": True}, **opts)
        _, _, three = run_op(case, impl, grad_in_forward=False, **opts)
        _, m, one = run_op(case, impl, grad_in_forward=True, **opts)
        if opts.get("loss_type") not in ("dapo", "bnpo"):  # the 1 / N' folds in another order
            assert torch.equal(one, three)
        else:
            numerics.assert_close("grad", one.float(), three.float())


@pytest.mark.parametrize(
    "mask_dtype", [torch.uint8, torch.int64, torch.float16, torch.bfloat16, torch.float32]
)
def test_gradient_in_forward_takes_a_0_1_mask_of_any_dtype(mask_dtype, device):
    """The forward's count of each sample's tokens (batch- and sample-normalised loss types)
    reads a 0/1 mask in its own dtype: the result of the bool mask (a bf16 mask failed there
    under Triton's interpreter)."""
    case = make_case(3, 5, 70, seed=24, mask="empty_row", device=device)
    zero_one = replace(case, mask=case.mask.to(mask_dtype))
    for name in ("grpo", "bnpo"):
        want = run_op(case, None, loss_type=name)
        got = run_op(zero_one, None, loss_type=name)
        assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2]), name


def test_gradient_in_forward_zeroes_rejected_samples_and_scales(device):
    # Samples 1 and 2 negative and far off-policy: rejected after the forward wrote their rows.
    case = make_case(3, 4, 70, seed=22, gen_spread=3.0, device=device)
    case = replace(case, advantages=torch.tensor([1.0, -1.0, -0.5], device=device))
    x = case.logits.clone().requires_grad_()
    loss, metrics = ftis_loss(x, *case.inputs, grad_in_forward=True, kl_threshold=0.5)
    assert metrics["filtered"].tolist() == [False, True, True]
    (loss * -2.5).backward()
    assert torch.count_nonzero(x.grad[1:]) == 0
    _, _, want = run_op(case, None, grad_in_forward=False, kl_threshold=0.5)
    numerics.assert_close("grad", x.grad, -2.5 * want)


@pytest.mark.parametrize("announced", [1.0, 0.3, -2.5])
def test_announced_incoming_gradient_is_folded_in_and_any_other_stays_exact(announced, device):
    case = make_case(3, 4, 70, seed=23, gen_spread=3.0, device=device)
    _, _, unit = run_op(case, None, grad_in_forward=False)
    for incoming in (0.3, 1.0, -2.5):
        x = case.logits.clone().requires_grad_()
        loss, _ = ftis_loss(x, *case.inputs, grad_in_forward=True, grad_scale=announced)
        (loss * incoming).backward()
        numerics.assert_close("grad", x.grad, incoming * unit)


def test_announced_gradient_leaves_nothing_to_rescale_in_the_backward(device, monkeypatch):
    # The fix-up kernel reads no row of a kept sample when the announced gradient arrives.
    from ftis_kernels.kernels import logp_grad

    case = make_case(2, 3, 40, seed=24, device=device)
    x = case.logits.clone().requires_grad_()
    loss, _ = ftis_loss(x, *case.inputs, grad_in_forward=True, grad_scale=0.25, filter=None)
    before = None

    def spy(dlogits, *args):
        nonlocal before
        before = dlogits.clone()
        return real(dlogits, *args)

    real = logp_grad.grad_finish
    monkeypatch.setattr(ftis_loss_module, "grad_finish", spy)
    (loss * 0.25).backward()
    assert torch.equal(x.grad, before), "the backward rewrote nothing"


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan"), 1e39, 1e-46, True, "1"])
def test_grad_scale_must_be_finite_nonzero_and_a_normal_fp32(bad):
    case = make_case(1, 2, 5, seed=1)
    with pytest.raises(ValueError, match="grad_scale: expected None or a finite, nonzero float"):
        ftis_loss(case.logits.clone().requires_grad_(), *case.inputs, grad_scale=bad)


def test_fp16_logits_keep_three_passes_unless_the_loss_scale_is_announced(device):
    # An AMP loss scale applied to an fp16 gradient written in the forward would meet entries
    # already underflowed: by default fp16 takes the three-pass design, announced it is exact.
    case = make_case(3, 4, 70, torch.float16, seed=25, gen_spread=3.0, device=device)
    grads = {}
    for name, kw in {"default": {}, "announced": {"grad_scale": 1024.0}}.items():
        x = case.logits.clone().requires_grad_()
        loss, _ = ftis_loss(x, *case.inputs, **kw)
        (loss * 1024.0).backward()
        grads[name] = x.grad
    x = case.logits.clone().requires_grad_()
    loss, _ = ftis_loss(x, *case.inputs, grad_in_forward=False)
    (loss * 1024.0).backward()
    assert torch.equal(grads["default"], x.grad)
    assert torch.equal(grads["announced"], x.grad)


def test_gradient_in_forward_refuses_a_second_backward(device):
    case = make_case(2, 3, 40, seed=15, device=device)
    x = case.logits.clone().requires_grad_()
    loss, _ = ftis_loss(x, *case.inputs, grad_in_forward=True)
    torch.autograd.grad(loss, x, retain_graph=True)
    with pytest.raises(RuntimeError, match="grad_in_forward=False"):
        torch.autograd.grad(loss, x)


@pytest.mark.parametrize(
    "opts,reason",
    [
        ({"is_level": "sequence"}, "is_level"),
        ({"ratio_level": "sequence"}, "ratio_level"),
        ({"loss_type": "vespo"}, "vespo"),
        ({"entropy_coef": 0.01}, "entropy_coef"),
        ({"beta": 0.1}, "beta"),
        ({"reject_mode": "mask", "loss_type": "dapo"}, "reject_mode"),
    ],
)
def test_gradient_in_forward_required_where_it_cannot_apply_names_the_reason(opts, reason):
    case = make_case(2, 3, 40, seed=15, with_ref=True)
    x = case.logits.clone().requires_grad_() * 1.0
    with pytest.raises(ValueError, match=f"grad_in_forward: .*{reason}"):
        ftis_loss(x, *case.inputs, grad_in_forward=True, **opts)
    # Left to choose, the op takes the three-pass design and gives the gradient.
    loss, _ = ftis_loss(x, *case.inputs, **opts)
    loss.backward()


@pytest.mark.parametrize("layout", ["non_leaf", "causal_view"])
def test_gradient_in_forward_in_place_writes_the_three_pass_gradient_over_the_logits(
    layout, device
):
    # Requested with inplace_backward: the forward writes the gradient over the logits (here
    # with rejected samples and an unannounced incoming gradient).
    case = make_case(3, 4, 70, torch.bfloat16, seed=22, gen_spread=3.0, device=device)
    case = replace(case, advantages=torch.tensor([1.0, -1.0, -0.5], device=device))
    opts = {"kl_threshold": 0.5}
    _, _, want = run_op(case, None, grad_in_forward=False, **opts)
    if layout == "non_leaf":
        leaf = case.logits.clone().requires_grad_()
        logits, grad_of = leaf * 1.0, lambda: leaf.grad
    else:  # the causal-LM slice logits[:, :-1] of a longer output
        leaf = torch.cat([case.logits, case.logits[:, :1]], dim=1).requires_grad_()
        logits, grad_of = (leaf * 1.0)[:, :-1], lambda: leaf.grad[:, :-1]
    ptr = logits.data_ptr()
    loss, metrics = ftis_loss(
        logits, *case.inputs, inplace_backward=True, grad_in_forward=True, **opts
    )
    assert metrics["filtered"].tolist() == [False, True, True]
    (loss * 2.0).backward()
    assert torch.equal(grad_of(), 2.0 * want)
    assert logits.data_ptr() == ptr and torch.equal(logits.detach(), 2.0 * want)


def test_gradient_in_forward_in_place_is_refused_where_autograd_saved_the_logits(device):
    case = make_case(2, 3, 40, seed=26, device=device)
    leaf = case.logits.clone().requires_grad_()
    logits = leaf.exp()  # exp's backward reads its output
    loss, _ = ftis_loss(logits, *case.inputs, inplace_backward=True, grad_in_forward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_gradient_in_forward_in_place_only_on_request_and_never_on_a_leaf(device):
    case = make_case(2, 3, 40, seed=27, device=device)
    leaf = case.logits.clone().requires_grad_()
    with pytest.raises(ValueError, match="grad_in_forward: .*leaf"):
        ftis_loss(leaf, *case.inputs, inplace_backward="force", grad_in_forward=True)
    # Not requested: the three-pass in-place design, the logits intact until the backward.
    logits = leaf * 1.0
    loss, _ = ftis_loss(logits, *case.inputs, inplace_backward=True)
    assert torch.equal(logits.detach(), case.logits)
    loss.backward()


@pytest.mark.parametrize("bad", [1, "yes"])
def test_grad_in_forward_must_be_none_or_a_bool(bad):
    case = make_case(1, 2, 5, seed=1)
    with pytest.raises(ValueError, match="grad_in_forward: expected None, True or False"):
        ftis_loss(case.logits.clone().requires_grad_(), *case.inputs, grad_in_forward=bad)


def test_gradient_in_forward_skipped_without_a_gradient(device):
    case = make_case(2, 3, 40, seed=15, device=device)
    with torch.no_grad():
        loss_ng, _ = ftis_loss(case.logits.clone().requires_grad_(), *case.inputs)
    want, _ = ftis_loss(case.logits.clone(), *case.inputs, grad_in_forward=False)
    assert torch.equal(loss_ng, want)


def test_no_gradient_flows_to_logprob_inputs(device):
    case = make_case(2, 3, 40, seed=16, with_ref=True, device=device)
    gen = case.gen_logprobs.clone().requires_grad_()
    x = case.logits.clone().requires_grad_()
    loss, metrics = ftis_loss(
        x,
        case.tokens,
        gen,
        case.advantages,
        case.mask,
        case.old_logprobs,
        case.ref_logprobs,
        beta=0.1,
    )
    loss.backward()
    assert gen.grad is None and x.grad is not None
    assert all(not m.requires_grad for m in metrics.values())


# --- dispatch ----------------------------------------------------------------------------------


def test_cpu_dispatch_follows_the_interpreter():
    want = "triton" if logp_lse.triton_is_interpreted() else "torch"
    assert ftis_loss_module.select_backend(torch.device("cpu")) == want
    assert ftis_loss_module.select_backend(torch.device("cuda")) == "triton"
    with pytest.raises(ValueError, match="logits"):
        ftis_loss_module.select_backend(torch.device("meta"))


def test_triton_and_torch_paths_agree(device):
    paths = implementations(device)
    if len(paths) < 2:
        pytest.skip("Triton is neither compiled (CUDA) nor interpreted here")
    case = make_case(3, 5, 150, torch.bfloat16, seed=17, device=device)
    tri, tor = run_op(case, "triton"), run_op(case, "torch")
    numerics.assert_close("loss", tri[0], tor[0])
    numerics.assert_close("grad", tri[2], tor[2], numerics.GRAD_MARGIN[torch.bfloat16])


@pytest.mark.cuda
def test_cuda_tensors_use_the_compiled_kernels():
    case = make_case(4, 16, 1000, torch.bfloat16, seed=18, device="cuda")
    assert ftis_loss_module.select_backend(case.logits.device) == "triton"
    check_against_reference(case, torch.bfloat16, "triton")


def test_entropy_and_its_gradient_are_exact_with_minus_inf_logits(device):
    # Vocabulary masking: -inf logits have p = 0 and add 0 to the entropy's running sum and to
    # its gradient (not 0 * -inf = nan), on every path.
    case = make_case(2, 3, 50, seed=21, device=device)
    logits = case.logits.clone()
    logits[..., ::3] = -math.inf
    tokens = case.tokens // 3 * 3 + 1
    case = Case(logits, tokens, *case.inputs[1:])
    for impl in implementations(device):
        _, metrics, grad = run_op(case, impl, entropy_coef=0.1, is_mode="none")
        assert torch.isfinite(metrics["entropy"]).all() and torch.isfinite(grad).all()
        check_against_reference(case, torch.float32, impl, entropy_coef=0.1, is_mode="none")


def test_both_sequence_weights_are_offered_the_product_is_the_mean_to_the_power_T(device):
    # Ours: exp(mean_t log ratio); TRL's sequence_* and verl's: exp(sum_t), the product of the
    # token ratios. They agree at T = 1 only.
    for T in (1, 5):
        case = make_case(1, T, 40, seed=22, mask="none", device=device)
        opts = dict(is_mode="vis", filter=None)
        _, mean_w, _ = run_op(case, is_level="sequence", **opts)
        _, prod_w, _ = run_op(case, is_level="sequence_product", **opts)
        geometric, product = mean_w["is_ratio_max"], prod_w["is_ratio_max"]
        numerics.assert_close("product", product, geometric**T)
        assert (T == 1) == bool(torch.isclose(product, geometric))


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(is_level="sequence"),
        dict(is_level="sequence_product", is_cap=1.5),
        dict(is_cap_min=0.7),
        dict(is_mode="vis"),
    ],
    ids=["token", "sequence", "sequence_product", "cap_min", "vis"],
)
def test_is_truncated_is_is_truncated_frac_sample_by_sample(options):
    g = torch.Generator().manual_seed(0)
    B, T, V = 5, 7, 11
    logits = torch.randn(B, T, V, generator=g) * 2
    tokens = torch.randint(0, V, (B, T), generator=g)
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    shift = torch.tensor([0.0, -2.0, 1.0, -1.5, 0.5])[:, None]  # some samples far off-policy
    gen = (logp + 0.5 * torch.randn(B, T, generator=g) + shift).clamp(max=0)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[0] = False  # a sample without completion tokens
    adv = torch.randn(B, generator=g)
    opt = FTISOptions.preset("f-tis", **options)
    share = ftis_loss(logits, tokens, gen, adv, mask, options=opt)[1]["is_truncated"]
    for b in range(B):
        _, m = ftis_loss(
            logits[b : b + 1],
            tokens[b : b + 1],
            gen[b : b + 1],
            adv[b : b + 1],
            mask[b : b + 1],
            options=opt,
        )
        assert float(share[b]) == pytest.approx(float(m["is_truncated_frac"]), abs=1e-6), b
    assert share[0] == 0 and (options.get("is_mode") == "vis") == bool((share == 0).all())


@pytest.mark.parametrize("name", LOSS_TYPES)
def test_micro_batches_weighted_as_the_loss_type_table_says_add_up_to_the_batch_loss(name):
    # What the driver's micro-batches rely on (grpo/train.py): a batch-normalised loss type of
    # options.LOSS_TYPE_TABLE is a mean over the batch's tokens, the others over its samples.
    g = torch.Generator().manual_seed(3)
    B, T, V = 4, 6, 13
    logits = torch.randn(B, T, V, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[:, 0] = True
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    gen = (logp - 0.3 * torch.rand(B, T, generator=g)).clamp(max=0)
    old = gen + 0.05 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    opt = FTISOptions(loss_type=name, max_completion_length=T)
    whole = ftis_loss(logits, tokens, gen, adv, mask, old, options=opt)[0]
    by_tokens = loss_type(name).batch_normalised
    total = torch.zeros(())
    for part in (slice(0, 1), slice(1, B)):
        share = mask[part].sum() / mask.sum() if by_tokens else (part.stop - part.start) / B
        rows = (tokens[part], gen[part], adv[part], mask[part], old[part])
        total = total + ftis_loss(logits[part], *rows, options=opt)[0] * share
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-6)
