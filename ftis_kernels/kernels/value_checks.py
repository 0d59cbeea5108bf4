"""The value checks of the inputs in Triton, as the per-sample kernel runs them while it reads a
sample (docs/method.md §2, "Errors"): per check a running (count of bad positions, the first one as
a flat index, its value), stored per sample, then reduced over the samples by `sample_reduce.py`
into the value-check record (`validate.CHECKS` rows) that `validate.raise_on_faults` reads.
"""

import triton
import triton.language as tl

from ftis_kernels.kernels.switches import (
    CHECK_ADVANTAGES,
    CHECK_GEN,
    CHECK_LOGITS,
    CHECK_MASK,
    CHECK_OLD,
    CHECK_REF,
    CHECK_TOKENS,
)
from ftis_kernels.validate import CHECKS

# The value checks (`validate.CHECKS`, the record's rows), and the record's columns: count, first
# bad position (flat), its value, a hint flag, the checked tensor's two dimensions (one for
# advantages), and the vocabulary size.
N_CHECKS = tl.constexpr(len(CHECKS))
RECORD_COLUMNS = tl.constexpr(7)
# "No bad position yet": above any flat index, exact in fp64.
BIG = tl.constexpr(2**62)


@triton.jit
def first_bad(count, first, value, bad, j, x):
    """A value check's running (count, first bad position, its value) after one block: bad (BLOCK,)
    bool, j (BLOCK,) int64 positions, x (BLOCK,) fp64 values."""
    count += tl.sum(bad.to(tl.float32), axis=0)
    block_first = tl.min(tl.where(bad, j, BIG), axis=0)
    block_value = tl.sum(tl.where(j == block_first, x, 0.0), axis=0)
    value = tl.where(first < BIG, value, block_value)
    return count, tl.minimum(first, block_first), value


@triton.jit
def check_finite(count, first, value, raw, x, m, flat):
    """`first_bad` of a log-probability block x (raw: as stored): bad where not finite in m."""
    inf = float("inf")
    bad = m & ~((x == x) & (tl.abs(x) < inf))
    return first_bad(count, first, value, bad, flat, raw.to(tl.float64))


@triton.jit
def logit_fault(logp, row_max, log_sum):
    """The code of each row's fault from its statistics (validate.LOGIT_FAULTS; 0: none)."""
    inf = float("inf")
    code = tl.where(~((logp == logp) & (tl.abs(logp) < inf)), 4, 0)
    code = tl.where(log_sum == -inf, 3, code)
    code = tl.where((row_max != row_max) | (log_sum != log_sum), 1, code)
    return tl.where(row_max == inf, 2, code)


@triton.jit
def _store_check(faults, row, count, first, value):
    tl.store(faults + row * 3 + 0, count.to(tl.float64))
    tl.store(faults + row * 3 + 1, first.to(tl.float64))
    tl.store(faults + row * 3 + 2, value.to(tl.float64))


@triton.jit
def store_checks(
    faults, s, adv, adv64,
    c0, f0, v0, c1, f1, v1, c2, f2, v2, c4, f4, v4, c5, f5, v5, c6, f6, v6,
):  # fmt: skip
    """The sample's value checks (the per-sample kernel's), with its advantage's."""
    inf = float("inf")
    bad_adv = ~((adv == adv) & (tl.abs(adv) < inf))
    _store_check(faults, CHECK_TOKENS, c0, f0, v0)
    _store_check(faults, CHECK_MASK, c1, f1, v1)
    _store_check(faults, CHECK_GEN, c2, f2, v2)
    _store_check(faults, CHECK_ADVANTAGES, bad_adv.to(tl.float32), tl.where(bad_adv, s, BIG), adv64)
    _store_check(faults, CHECK_OLD, c4, f4, v4)
    _store_check(faults, CHECK_REF, c5, f5, v5)
    _store_check(faults, CHECK_LOGITS, c6, f6, v6)
