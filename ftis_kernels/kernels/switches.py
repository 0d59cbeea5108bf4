"""The kernels' compile-time switches: a named `tl.constexpr` code for every value of an option
the kernels branch on, and the host's choice of those codes for a call, in one place.

The codes are derived from the one definition of each option's values in `options.py` (and of
the value checks in `validate.py`), so they are internal: a kernel compares a switch with a name
(`SURROGATE == VESPO`), which Triton resolves at compile time, never with a number. Every value
of an option has a name, and a chain of comparisons names each one (no `else:` stands for a
value), so a new value fails to compile until a kernel handles it.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton.language as tl

from ftis_kernels import options as O
from ftis_kernels.options import FTISOptions, loss_type
from ftis_kernels.validate import CHECKS


def _codes(values: tuple, names: tuple) -> tuple:
    """The code of each of `names` (its index in `values`) as a tl.constexpr; every value named."""
    if len(names) != len(values) or set(names) != set(values):
        raise AssertionError(f"codes: {names!r} must name each of {values!r} once")
    return tuple(tl.constexpr(values.index(name)) for name in names)


K1, K2, K3 = _codes(O.KL_ESTIMATORS, ("k1", "k2", "k3"))
KL_SUM, KL_MEAN, KL_MAX = _codes(O.KL_REDUCTIONS, ("sum", "mean", "max"))
(NO_FILTER, NEGATIVE_OFFPOLICY, NEGATIVE_OR_OFFPOLICY, NEGATIVE, OFFPOLICY) = _codes(
    O.FILTERS, (None, "negative_offpolicy", "negative_or_offpolicy", "negative", "offpolicy")
)
IS_NONE, IS_VIS, IS_TIS, IS_MASK = _codes(O.IS_MODES, ("none", "vis", "tis", "mask"))
IS_TOKEN, IS_SEQUENCE, IS_SEQUENCE_PRODUCT = _codes(
    O.IS_LEVELS, ("token", "sequence", "sequence_product")
)
CLIPPED, CISPO, SAPO, VESPO = _codes(O.SURROGATES, (O.CLIPPED, O.CISPO, O.SAPO, O.VESPO))
SAMPLE_MEAN, BATCH_MEAN, CONSTANT, SAMPLE_SUM = _codes(
    O.REDUCTIONS, ("sample_mean", "batch_mean", "constant", "sample_sum")
)
# The value-check record's rows (`validate.CHECKS`).
(
    CHECK_TOKENS,
    CHECK_MASK,
    CHECK_GEN,
    CHECK_ADVANTAGES,
    CHECK_OLD,
    CHECK_REF,
    CHECK_LOGITS,
) = _codes(
    CHECKS,
    ("tokens", "mask", "gen_logprobs", "advantages", "old_logprobs", "ref_logprobs", "logits"),
)


def _code(values: tuple, value) -> int:
    return values.index(value)


def token_switches(opt: FTISOptions, has_old: bool) -> dict:
    """The switches of a token's loss terms (`loss_terms.token_coef`): the gradient-in-forward
    row kernel's, a subset of the per-sample kernel's. ZERO_NEGATIVE: the filter rejects every
    sample with A <= 0 whatever its KL, which the row kernel can apply before the decision."""
    kind = loss_type(opt.loss_type)
    return dict(
        IS_MODE=_code(O.IS_MODES, opt.is_mode),
        IS_FROM_OLD=opt.is_source == "old" and has_old,
        SURROGATE=_code(O.SURROGATES, kind.surrogate),
        REDUCTION=_code(O.REDUCTIONS, kind.reduction),
        ZERO_NEGATIVE=opt.filter in ("negative", "negative_or_offpolicy"),
    )


def sample_switches(opt: FTISOptions, has_old: bool, mask: Optional[torch.Tensor]) -> dict:
    """The per-sample kernel's switches for these options (`kernels/per_sample.py`)."""
    kind = loss_type(opt.loss_type)
    return dict(
        KL_ESTIMATOR=_code(O.KL_ESTIMATORS, opt.kl_estimator),
        KL_REDUCTION=_code(O.KL_REDUCTIONS, opt.kl_reduction),
        FILTER=_code(O.FILTERS, opt.filter),
        REJECT_MASK=opt.reject_mode == "mask",
        KL_FROM_OLD=opt.kl_source == "old" and has_old,
        IS_MODE=_code(O.IS_MODES, opt.is_mode),
        IS_LEVEL=_code(O.IS_LEVELS, opt.is_level),
        IS_FROM_OLD=opt.is_source == "old" and has_old,
        SURROGATE=_code(O.SURROGATES, kind.surrogate),
        REDUCTION=_code(O.REDUCTIONS, kind.reduction),
        RATIO_SEQ=opt.ratio_level == "sequence",
        BIAS_KL=bool(opt.use_bias_correction_kl),
        MASK_IS_BOOL=mask is None or mask.dtype == torch.bool,
    )
