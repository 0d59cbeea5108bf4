"""Every bad input of the contract raises a ValueError that names the argument, before any kernel."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch

from ftis_kernels import FTISOptions, ftis_loss
from tests.cases import ftis_loss_module, make_case

B, T, V = 2, 3, 11


def good_args():
    case = make_case(B, T, V, seed=0, with_ref=True)
    return dict(
        logits=case.logits, tokens=case.tokens, gen_logprobs=case.gen_logprobs,
        advantages=case.advantages, mask=case.mask, old_logprobs=case.old_logprobs,
        ref_logprobs=case.ref_logprobs,
    )  # fmt: skip


def with_value(name, index, value):
    def edit(args):
        t = args[name].clone()
        t[index] = value
        args[name] = t

    return edit


def replace(name, value):
    def edit(args):
        args[name] = value(args[name]) if callable(value) else value

    return edit


BAD_INPUTS = [
    ("logits", "2-d logits", replace("logits", lambda x: x[0])),
    ("logits", "int logits", replace("logits", lambda x: x.long())),
    ("logits", "float64 logits", replace("logits", lambda x: x.double())),
    ("logits", "empty vocabulary", replace("logits", lambda x: x[..., :0])),
    ("logits", "not a tensor", replace("logits", lambda x: x.tolist())),
    ("tokens", "wrong shape", replace("tokens", lambda x: x[:, :2])),
    ("tokens", "float tokens", replace("tokens", lambda x: x.float())),
    ("tokens", "int16 tokens", replace("tokens", lambda x: x.short())),
    ("tokens", "id == V", with_value("tokens", (0, 0), V)),
    ("tokens", "negative id", with_value("tokens", (1, 2), -1)),
    ("gen_logprobs", "wrong shape", replace("gen_logprobs", lambda x: x[:, None])),
    ("gen_logprobs", "integer", replace("gen_logprobs", lambda x: x.long())),
    ("gen_logprobs", "positive", replace("gen_logprobs", lambda x: x.abs() + 0.1)),
    ("gen_logprobs", "nan", with_value("gen_logprobs", (0, 0), float("nan"))),
    ("gen_logprobs", "-inf", with_value("gen_logprobs", (1, 1), -float("inf"))),
    ("advantages", "wrong shape", replace("advantages", lambda x: x[:, None])),
    ("advantages", "nan", with_value("advantages", 0, float("nan"))),
    ("advantages", "inf", with_value("advantages", 1, float("inf"))),
    ("mask", "wrong shape", replace("mask", lambda x: x[:1])),
    ("mask", "value 2", replace("mask", lambda x: x.long() * 2)),
    ("old_logprobs", "wrong shape", replace("old_logprobs", lambda x: x.T)),
    ("old_logprobs", "nan", with_value("old_logprobs", (0, 0), float("nan"))),
    ("ref_logprobs", "inf", with_value("ref_logprobs", (0, 0), float("inf"))),
]


@pytest.mark.parametrize("argument,what,edit", BAD_INPUTS, ids=[f"{a}-{w}" for a, w, _ in BAD_INPUTS])
def test_bad_tensor_input_raises_value_error_naming_it(argument, what, edit):
    args = good_args()
    args["mask"] = None if argument in ("gen_logprobs", "old_logprobs", "ref_logprobs") else args["mask"]
    edit(args)
    kernel_ran = mock.Mock(side_effect=AssertionError("a kernel ran before validation"))
    with mock.patch.dict(ftis_loss_module._FORWARD, {"triton": kernel_ran, "torch": kernel_ran}):
        with pytest.raises(ValueError, match=rf"^{argument}: expected"):
            ftis_loss(**args, beta=0.1)


BAD_OPTIONS = [
    ("is_mode", "cis"),
    ("is_level", "batch"),
    ("filter", "positive"),
    ("kl_estimator", "k4"),
    ("kl_reduction", "max"),
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
    ("epsilon_high", 1.2),
    ("beta", -0.1),
]


@pytest.mark.parametrize("name,value", BAD_OPTIONS, ids=[f"{n}={v}" for n, v in BAD_OPTIONS])
def test_bad_option_raises_value_error_naming_it(name, value):
    with pytest.raises(ValueError, match=rf"^{name}: expected"):
        ftis_loss(**good_args(), **{name: value})
    with pytest.raises(ValueError, match=rf"^{name}: expected"):
        FTISOptions(**{name: value})


def test_beta_without_ref_logprobs_raises():
    args = good_args()
    args["ref_logprobs"] = None
    with pytest.raises(ValueError, match=r"^ref_logprobs: expected .* beta > 0"):
        ftis_loss(**args, beta=0.05)


def test_garbage_at_masked_positions_of_logprob_inputs_is_accepted():
    args = good_args()
    off = ~args["mask"]
    for name in ("gen_logprobs", "old_logprobs", "ref_logprobs"):
        args[name] = args[name].masked_fill(off, float("nan"))
    loss, _ = ftis_loss(**args, beta=0.1)
    assert torch.isfinite(loss)


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
