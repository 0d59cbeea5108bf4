"""The op's promises on bad input, one test per promise, for both ops and both backends.

- Wrong shapes, dtypes, devices and option values: a ValueError naming the argument, before any
  kernel runs.
- Bad values (token ids, non-finite or positive logprobs, non-finite advantages, a mask that is
  not 0/1): a ValueError naming the argument, from one synchronisation after the row pass, with
  the values judged in float32 (the precision of the math), the number of failing positions, the
  first one and its value, and a hint where the mistake is recognisable.
- Logits at a completion position must give a finite log pi_theta(token): NaN, +inf, an all -inf
  row or -inf at the taken token are refused (naming `logits`, or `hidden` for the fused op);
  -inf at other tokens (vocabulary masking) is legal and exact; masked positions may hold
  anything (`test_ftis_loss.py::test_logits_at_masked_positions_change_nothing`).
- `inplace_backward` on logits that overlap themselves is refused, and on a leaf tensor that
  requires grad unless the caller passes "force".
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ftis_kernels import FTISOptions, ftis_linear_loss, ftis_loss, kernels
from ref import ref_ftis_loss
from tests import numerics
from tests.cases import (
    backend,
    implementations,
    make_case,
    masks,
    options,
    run_op,
    run_ref,
    seeds,
)

B, T, V = 2, 3, 11
ROW_ARGUMENTS = ("tokens", "gen_logprobs", "advantages", "mask", "old_logprobs", "ref_logprobs")
OPS = ("ftis_loss", "ftis_linear_loss")
IMPLS = implementations(torch.device("cpu"))


def good_args():
    case = make_case(B, T, V, seed=0, with_ref=True)
    return dict(logits=case.logits, **dict(zip(ROW_ARGUMENTS, case.inputs)))


def call(op, args, impl=None, **opts):
    """`op` on the arguments of `ftis_loss`; the fused op gets hidden = logits and an identity
    weight, so that hidden @ weight.T is the logits themselves."""
    args = dict(args)
    logits = args.pop("logits")
    with backend(impl):
        if op == "ftis_loss":
            return ftis_loss(logits, **args, **opts)
        weight = torch.eye(logits.shape[-1], dtype=logits.dtype)
        return ftis_linear_loss(logits, weight, **args, **opts)


def with_value(name, index, value, dtype=None):
    def edit(args):
        t = args[name].clone() if dtype is None else args[name].to(dtype)
        t[index] = value
        args[name] = t

    return edit


def replace(name, value):
    def edit(args):
        args[name] = value(args[name]) if callable(value) else value

    return edit


def kernels_must_not_run():
    kernel = mock.Mock(side_effect=AssertionError("a kernel ran before validation"))
    return mock.patch.dict(kernels.FORWARD, {"triton": kernel, "torch": kernel})


BAD_LOGITS = [
    ("logits", "2-d logits", replace("logits", lambda x: x[0])),
    ("logits", "int logits", replace("logits", lambda x: x.long())),
    ("logits", "float64 logits", replace("logits", lambda x: x.double())),
    ("logits", "empty vocabulary", replace("logits", lambda x: x[..., :0])),
    ("logits", "not a tensor", replace("logits", lambda x: x.tolist())),
    ("inplace_backward", "not a bool", replace("inplace_backward", "yes")),
]


@pytest.mark.parametrize(
    "argument,what,edit", BAD_LOGITS, ids=[f"{a}-{w}" for a, w, _ in BAD_LOGITS]
)
def test_bad_logits_raise_value_error_naming_them_before_any_kernel(argument, what, edit):
    args = dict(good_args(), inplace_backward=False)
    edit(args)
    with kernels_must_not_run(), pytest.raises(ValueError, match=rf"^{argument}: expected"):
        ftis_loss(**args)


BAD_ROW_TENSORS = [
    ("tokens", "wrong shape", replace("tokens", lambda x: x[:, :2])),
    ("tokens", "float tokens", replace("tokens", lambda x: x.float())),
    ("tokens", "int16 tokens", replace("tokens", lambda x: x.short())),
    ("gen_logprobs", "wrong shape", replace("gen_logprobs", lambda x: x[:, None])),
    ("gen_logprobs", "integer", replace("gen_logprobs", lambda x: x.long())),
    ("advantages", "wrong shape", replace("advantages", lambda x: x[:, None])),
    ("mask", "wrong shape", replace("mask", lambda x: x[:1])),
    ("old_logprobs", "wrong shape", replace("old_logprobs", lambda x: x.T)),
    ("ref_logprobs", "missing with beta > 0", replace("ref_logprobs", None)),
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "argument,what,edit", BAD_ROW_TENSORS, ids=[f"{a}-{w}" for a, w, _ in BAD_ROW_TENSORS]
)
def test_bad_row_tensor_raises_value_error_naming_it_before_any_kernel(argument, what, edit, op):
    args = good_args()
    edit(args)
    with kernels_must_not_run(), pytest.raises(ValueError, match=rf"^{argument}: expected"):
        call(op, args, beta=0.1)


def linear_args():
    case = make_case(B, T, V, H=4, seed=12, with_ref=True)
    return dict(
        hidden=case.hidden.float(),
        weight=case.weight.float(),
        bias=case.bias.float(),
        **dict(zip(ROW_ARGUMENTS, case.inputs)),
    )


BAD_LINEAR_STRUCTURE = [
    ("hidden", "2-d hidden", replace("hidden", lambda x: x[0])),
    ("hidden", "int hidden", replace("hidden", lambda x: x.long())),
    ("hidden", "empty H", replace("hidden", lambda x: x[:, :0])),
    ("weight", "wrong H", replace("weight", lambda x: x[:, :3])),
    ("weight", "float64 weight", replace("weight", lambda x: x.double())),
    ("weight", "3-d weight", replace("weight", lambda x: x[None])),
    ("bias", "wrong V", replace("bias", lambda x: x[:5])),
    ("bias", "another dtype", replace("bias", lambda x: x.half())),
    ("chunk_size", "0", replace("chunk_size", 0)),
    ("chunk_size", "a float", replace("chunk_size", 2.5)),
    ("chunk_size", "a bool", replace("chunk_size", True)),
]


@pytest.mark.parametrize(
    "argument,what,edit", BAD_LINEAR_STRUCTURE, ids=[f"{a}-{w}" for a, w, _ in BAD_LINEAR_STRUCTURE]
)
def test_bad_linear_structure_raises_value_error_naming_it_before_any_kernel(argument, what, edit):
    args = dict(linear_args(), chunk_size=None)
    edit(args)
    with kernels_must_not_run(), pytest.raises(ValueError, match=rf"^{argument}: expected"):
        ftis_linear_loss(**args)


BAD_VALUES = [
    ("tokens", "id == V", with_value("tokens", (0, 0), V)),
    ("tokens", "negative id", with_value("tokens", (1, 2), -1)),
    ("gen_logprobs", "positive", replace("gen_logprobs", lambda x: x.abs() + 0.1)),
    ("gen_logprobs", "nan", with_value("gen_logprobs", (0, 0), float("nan"))),
    ("gen_logprobs", "-inf", with_value("gen_logprobs", (1, 1), -float("inf"))),
    ("advantages", "nan", with_value("advantages", 0, float("nan"))),
    ("advantages", "inf", with_value("advantages", 1, float("inf"))),
    ("mask", "value 2", replace("mask", lambda x: x.long() * 2)),
    ("old_logprobs", "nan", with_value("old_logprobs", (0, 0), float("nan"))),
    ("ref_logprobs", "inf", with_value("ref_logprobs", (0, 0), float("inf"))),
    # Finite in float64, not in float32, where the math runs.
    ("gen_logprobs", "fp64 -1e300", with_value("gen_logprobs", (0, 1), -1e300, torch.float64)),
    ("advantages", "fp64 1e300", with_value("advantages", 1, 1e300, torch.float64)),
    ("old_logprobs", "fp64 -1e300", with_value("old_logprobs", (1, 0), -1e300, torch.float64)),
    ("ref_logprobs", "fp64 -1e300", with_value("ref_logprobs", (1, 2), -1e300, torch.float64)),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "argument,what,edit", BAD_VALUES, ids=[f"{a}-{w}" for a, w, _ in BAD_VALUES]
)
def test_bad_value_raises_value_error_naming_it(argument, what, edit, op, impl):
    args = good_args()
    if argument in ("gen_logprobs", "old_logprobs", "ref_logprobs"):
        args["mask"] = None  # every position is a completion position
    edit(args)
    with pytest.raises(ValueError, match=rf"^{argument}: expected") as error:
        call(op, args, impl, beta=0.1)
    assert "\n" not in str(error.value)


@pytest.mark.cuda
def test_value_check_is_one_synchronisation():
    args = {k: v.cuda() for k, v in good_args().items()}
    ftis_loss(**args)  # compiles the kernels
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ftis_loss(**args)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]


def test_value_error_counts_the_failures_and_locates_the_first():
    args = dict(good_args(), mask=None)
    args["gen_logprobs"] = args["gen_logprobs"].clone()
    args["gen_logprobs"][0, 2] = 0.5
    args["gen_logprobs"][1, 1] = float("nan")
    with pytest.raises(ValueError) as error:
        ftis_loss(**args)
    assert str(error.value) == (
        "gen_logprobs: expected finite values <= 0 at completion positions, in float32, got 2 of 6 "
        "positions outside that, the first at (0, 2): 0.5; log-probabilities are <= 0"
    )
    args = good_args()
    args["advantages"] = args["advantages"].double()
    args["advantages"][1] = -1e300
    with pytest.raises(ValueError) as error:
        ftis_loss(**args)
    assert str(error.value) == (
        "advantages: expected finite values, in float32, got 1 of 2 positions outside that, the "
        "first at (1,): -1e+300; it does not fit in float32, where the loss is computed"
    )


@pytest.mark.parametrize(
    "argument,edit,hint",
    [
        ("gen_logprobs", replace("gen_logprobs", lambda x: x.exp()), "look like probabilities"),
        (
            "tokens",
            with_value("tokens", (1, 0), V + 3),
            f"vocabulary is larger than the logits' V = {V}",
        ),
        ("tokens", with_value("tokens", (0, 1), -100), "ignore_index"),
    ],
)
def test_value_error_hints_at_a_recognisable_mistake(argument, edit, hint):
    args = good_args()
    edit(args)
    with pytest.raises(ValueError, match=rf"^{argument}: expected .*{hint}"):
        ftis_loss(**args)


def _set_logit(fault):
    """Edit of the logits that puts `fault` into the completion row (b, t) = (1, 2)."""

    def edit(args):
        x, token = args["logits"].clone(), int(args["tokens"][1, 2])
        other = (token + 1) % V
        if fault == "nan":
            x[1, 2, other] = float("nan")
        elif fault == "+inf":
            x[1, 2, other] = float("inf")
        elif fault == "all -inf":
            x[1, 2] = -float("inf")
        elif fault == "-inf at the token":
            x[1, 2, token] = -float("inf")
        elif fault == "+inf after the temperature":
            x[1, 2, other] = 3e38  # / 0.5
        args["logits"] = x

    return edit


# The Triton interpreter computes with numpy, which warns on inf - inf and log(0).
numpy_warnings = pytest.mark.filterwarnings("ignore::RuntimeWarning")

LOGIT_FAULTS = {
    "nan": "a NaN among its logits",
    "+inf": r"\+inf among its logits",
    "all -inf": "every logit -inf",
    "-inf at the token": r"log pi_theta\(token\) = -inf",
    "+inf after the temperature": r"\+inf among its logits / temperature",
}


@numpy_warnings
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fault", list(LOGIT_FAULTS))
def test_non_finite_logits_at_a_completion_row_are_refused(fault, impl):
    args = dict(good_args(), mask=None)
    _set_logit(fault)(args)
    with pytest.raises(
        ValueError, match=rf"^logits: expected .*the first at \(1, 2\): {LOGIT_FAULTS[fault]}"
    ):
        call("ftis_loss", args, impl, temperature=0.5)


@numpy_warnings
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("big", [math.inf, 3e38])  # 3e38 / 0.5 is +inf
def test_a_row_with_nan_and_plus_inf_logits_is_named_alike_by_both_backends(big, impl):
    args = dict(good_args(), mask=None)
    x, token = args["logits"].clone(), int(args["tokens"][1, 2])
    x[1, 2, (token + 1) % V], x[1, 2, (token + 2) % V] = math.nan, big
    args["logits"] = x
    with pytest.raises(ValueError, match=r"the first at \(1, 2\): \+inf among its logits"):
        call("ftis_loss", args, impl, temperature=0.5)


@numpy_warnings
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fault", ["nan", "+inf"])
def test_non_finite_hidden_at_a_completion_row_is_refused(fault, impl):
    args = dict(good_args(), mask=None)
    _set_logit(fault)(args)  # hidden = the logits
    with pytest.raises(ValueError, match=r"^hidden: expected .*the first at \(1, 2\)"):
        call("ftis_linear_loss", args, impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_minus_inf_at_other_tokens_is_exact(impl):
    case = make_case(3, 4, 40, seed=1, with_ref=True)
    banned = torch.ones(40, dtype=torch.bool)
    banned[case.tokens.unique()] = False
    logits = case.logits.masked_fill(banned, -float("inf"))
    opts = dict(beta=0.04, temperature=0.7)
    with backend(impl):
        x = logits.clone().requires_grad_()
        loss, metrics = ftis_loss(x, *case.inputs, **opts)
        (grad,) = torch.autograd.grad(loss, x)
    o_loss, o_metrics, o_grad = run_ref(
        dataclasses.replace(case, logits=logits), torch.float64, **opts
    )
    numerics.assert_close("loss", loss, o_loss)
    numerics.assert_close("logp", metrics["logp"], o_metrics["logp"])
    numerics.assert_close("grad", grad, o_grad)
    assert torch.count_nonzero(grad[..., banned]) == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_minus_inf_bias_of_the_fused_op_is_exact(impl):
    """Vocabulary masking through the lm-head's bias: -inf logits at tokens never taken."""
    case = make_case(2, 3, 30, seed=2)
    bias = torch.zeros(30)
    bias[[t for t in range(30) if t not in case.tokens.unique().tolist()]] = -float("inf")
    weight = torch.eye(30)
    with backend(impl):
        hidden = case.logits.clone().requires_grad_()
        loss, _ = ftis_linear_loss(hidden, weight, *case.inputs, bias=bias, chunk_size=4)
        (grad,) = torch.autograd.grad(loss, hidden)
    want = ftis_loss(case.logits + bias, *case.inputs)[0]
    x = (case.logits + bias).double().requires_grad_()
    o_loss, _ = ref_ftis_loss(x, *case.inputs, compute_dtype=torch.float64)
    (o_grad,) = torch.autograd.grad(o_loss, x)
    numerics.assert_close("loss", loss, o_loss)
    numerics.assert_close("loss", loss, want)
    numerics.assert_close("grad_hidden", grad, o_grad)


def _outcome(impl, case, logits, opts):
    """("error", argument, count, first position) or ("ok", loss, metrics, grad)."""
    try:
        return ("ok", *run_op(case, impl, logits=logits, **opts))
    except ValueError as error:
        located = re.match(
            r"^(\w+): .* got (\d+) of \d+ \w+ outside that, the first at (\(.*?\))", str(error)
        )
        assert located, str(error)
        return ("error", *located.groups())


FAULTS = [math.nan, math.inf, -math.inf, 1e30, -1e30]


@numpy_warnings
@given(
    B=st.integers(1, 3),
    T=st.integers(1, 4),
    V=st.integers(1, 40),
    mask=masks,
    seed=seeds,
    faults=st.lists(st.tuples(st.integers(0, 2**10), st.sampled_from(FAULTS)), max_size=4),
    opts=options,
)
def test_backends_agree_on_logits_with_non_finite_and_huge_values(
    B, T, V, mask, seed, faults, opts
):
    """Either both backends refuse the same argument at the same first position, or both give
    the same loss, metrics and gradient."""
    if len(IMPLS) < 2:
        pytest.skip("Triton is neither compiled (CUDA) nor interpreted here")
    case = make_case(B, T, V, seed=seed, mask=mask, with_ref=opts["beta"] > 0)
    logits = case.logits.clone()
    for position, value in faults:
        logits.view(-1)[position % logits.numel()] = value
    triton, torch_path = (_outcome(impl, case, logits, opts) for impl in IMPLS)
    assert triton[0] == torch_path[0], (triton, torch_path)
    if triton[0] == "error":
        assert triton == torch_path
        return
    numerics.assert_close("loss", triton[1], torch_path[1])
    for name in ("logp", "kl"):
        numerics.assert_close(name, triton[2][name], torch_path[2][name])
    numerics.assert_close("grad", triton[3], torch_path[3], numerics.Tol(1e-5, 1e-7))


# --- inplace_backward ----------------------------------------------------------------------------


def _overlapping(kind):
    """Non-leaf logits (B, T, V) whose elements share memory."""
    case = make_case(B, T, V, seed=3)
    source = case.logits.clone().requires_grad_() * 1.0
    if kind == "expanded":
        return source[:, :1].expand(B, T, V)
    return source.as_strided((B, T, V), (T * 2, 2, 1))  # rows overlap: stride 2 < V


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["expanded", "overlapping rows"])
def test_inplace_backward_into_logits_that_overlap_themselves_is_refused(kind, impl):
    args = good_args()
    args["logits"] = _overlapping(kind)
    with kernels_must_not_run():
        for inplace in (True, "force"):
            with pytest.raises(
                ValueError, match=r"^inplace_backward: expected logits whose elements"
            ):
                call("ftis_loss", args, impl, inplace_backward=inplace)
    loss, _ = call("ftis_loss", args, impl)  # out of place, overlapping logits are fine
    (grad,) = torch.autograd.grad(loss, args["logits"])
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_inplace_backward_into_a_leaf_needs_force(impl):
    args = good_args()
    leaf = args["logits"].clone().requires_grad_()
    later = {
        k: (v[:, 1:] if isinstance(v, torch.Tensor) and v.dim() == 2 else v)
        for k, v in args.items()
    }
    for refused in (
        dict(args, logits=leaf),
        dict(later, logits=leaf[:, 1:]),
    ):  # a leaf, a view of one
        with pytest.raises(ValueError, match=r'^inplace_backward: expected .*"force"'):
            call("ftis_loss", refused, impl, inplace_backward=True)
    x_ref = args["logits"].clone().requires_grad_()
    (grad_ref,) = torch.autograd.grad(call("ftis_loss", dict(args, logits=x_ref), impl)[0], x_ref)
    x = args["logits"].clone().requires_grad_()
    loss, _ = call("ftis_loss", dict(args, logits=x), impl, inplace_backward="force")
    loss.backward()
    assert torch.equal(x.grad, grad_ref)
    assert torch.equal(x.detach(), grad_ref), "the leaf's values became its gradient"


# --- options -------------------------------------------------------------------------------------

BAD_OPTIONS = [
    ("is_mode", "cis"),
    ("is_level", "batch"),
    ("filter", "positive"),
    ("kl_estimator", "k4"),
    ("kl_reduction", "median"),
    ("is_source", "gen"),
    ("kl_source", "ref"),
    ("reject_mode", "drop"),
    ("ratio_level", "batch"),
    ("is_cap_min", -0.5),
    ("kl_threshold_low", math.inf),
    ("delta", 0.0),
    ("max_completion_length", 0),
    ("max_completion_length", 2.5),
    ("sapo_temperature_pos", 0.0),
    ("vespo_k_neg", math.nan),
    ("use_bias_correction_kl", 1),
    ("entropy_coef", -0.01),
    ("loss_type", "ppo"),
    ("temperature", 0.0),
    ("temperature", -1.0),
    ("temperature", math.inf),
    ("is_cap", 0.0),
    ("is_cap", -2.0),
    ("is_cap", math.nan),
    ("kl_threshold", -0.1),
    ("epsilon", 0.0),
    ("epsilon", 1.0),
    ("epsilon", 1.5),
    ("epsilon_high", 0.0),
    ("epsilon_high", math.inf),
    ("beta", -0.1),
]


@pytest.mark.parametrize("name,value", BAD_OPTIONS, ids=[f"{n}={v}" for n, v in BAD_OPTIONS])
def test_bad_option_raises_value_error_naming_it(name, value):
    with pytest.raises(ValueError, match=rf"^{name}: expected"):
        ftis_loss(**good_args(), **{name: value})
    with pytest.raises(ValueError, match=rf"^{name}: expected"):
        ftis_linear_loss(**linear_args(), **{name: value})
    with pytest.raises(ValueError, match=rf"^{name}: expected"):
        FTISOptions(**{name: value})


BAD_COMBINATIONS = [
    ("delta", dict(delta=1.5, loss_type="sapo")),
    ("is_level", dict(loss_type="vespo", is_level="sequence")),
    ("is_cap_min", dict(is_cap_min=3.0, is_cap=2.0)),
    ("kl_threshold_low", dict(kl_threshold_low=1.0, kl_threshold=0.5)),
]


@pytest.mark.parametrize("name,combo", BAD_COMBINATIONS, ids=[str(c) for _, c in BAD_COMBINATIONS])
def test_bad_combination_raises_value_error_naming_both_options_before_any_kernel(name, combo):
    other = next(k for k in combo if k != name)
    with kernels_must_not_run():
        for op in ("ftis_loss", "ftis_linear_loss"):
            with pytest.raises(ValueError, match=rf"^{name}: expected .*{other}"):
                call(op, good_args(), **combo)


def test_unknown_option_name_raises_value_error_naming_it():
    with pytest.raises(ValueError, match=r"^is_cap_max: expected a keyword option"):
        ftis_loss(**good_args(), is_cap_max=3.0)
    with pytest.raises(ValueError, match=r"^preset: expected one of"):
        FTISOptions.preset("ppo2")


def test_garbage_at_masked_positions_of_logprob_inputs_is_accepted():
    args = good_args()
    off = ~args["mask"]
    for name in ("gen_logprobs", "old_logprobs", "ref_logprobs"):
        args[name] = args[name].masked_fill(off, float("nan"))
    loss, _ = ftis_loss(**args, beta=0.1)
    assert torch.isfinite(loss)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", OPS)
def test_ref_logprobs_are_not_read_without_a_penalty(op, impl):
    """With beta = 0 the penalty is off and ref_logprobs are never read, on every backend: any
    values they hold change nothing and raise nothing."""
    args = good_args()
    want, _ = call(op, args, impl, value_check="call")
    args["ref_logprobs"] = torch.full_like(args["ref_logprobs"], float("nan"))
    got, _ = call(op, args, impl, value_check="call")
    assert torch.equal(got, want)


def test_float_and_integer_masks_are_accepted():
    args = good_args()
    want, _ = ftis_loss(**args)
    for dtype in (torch.float32, torch.int64, torch.uint8):
        got, _ = ftis_loss(**{**args, "mask": args["mask"].to(dtype)})
        assert torch.equal(got, want)


def test_variant_names_map_to_the_paper_options():
    assert FTISOptions.for_variant("F-TIS") == FTISOptions()
    assert FTISOptions.for_variant("nois") == FTISOptions(is_mode="none", filter=None)
    with pytest.raises(ValueError, match="^variant: expected"):
        FTISOptions.for_variant("f-xis")


@pytest.mark.parametrize("metrics", [None, {"loss": 1.0}, ("value_faults",)])
def test_raise_on_bad_values_refuses_what_is_not_a_deferred_calls_metrics(metrics):
    from ftis_kernels import raise_on_bad_values

    with pytest.raises(
        ValueError, match=r'^metrics: expected the metrics of a call with value_check="deferred"'
    ):
        raise_on_bad_values(metrics)


@pytest.mark.parametrize("shape", [(0, 3), (2, 0)])
def test_an_empty_batch_is_refused_naming_the_input(shape):
    """docs/method.md, "Errors": B, T and V (H) at least 1, on both ops, before any kernel."""
    B, T = shape
    rows = (torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T), torch.zeros(B))
    with pytest.raises(
        ValueError, match=r"^logits: expected a \(B, T, V\) tensor with B, T, V >= 1"
    ):
        ftis_loss(torch.randn(B, T, 5), *rows)
    with pytest.raises(
        ValueError, match=r"^hidden: expected a \(B, T, H\) tensor with B, T, H >= 1"
    ):
        ftis_linear_loss(torch.randn(B, T, 3), torch.randn(5, 3), *rows)
