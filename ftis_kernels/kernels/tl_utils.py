"""Triton helpers shared by the kernels of ftis-kernels."""

import triton
import triton.language as tl

# Start value of a running maximum: the lowest finite fp32. Finite on purpose: with -inf, a row
# whose first block is all -inf would compute exp(-inf - -inf) = nan when it rescales its running
# sum. The lowest finite value rather than a round -3e38, so that every finite logit exceeds it.
NEG_BIG = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def online_lse_update(m, s, x):
    """One block of a streaming log-sum-exp.

    m, s: scalars, the running maximum and sum of exp(value - m) so far; x: (BLOCK,) fp32 values,
    -inf for padding. Returns the updated (m, s); lse = m + log(s) at the end. One exp per element
    (plus one per block): at bf16 on Hopper, two per element would make the op bound by the
    special-function units instead of memory.
    """
    m_new = tl.maximum(m, tl.max(x, axis=0))
    s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
    return m_new, s


@triton.jit
def online_lse_entropy_update(m, s, u, x):
    """`online_lse_update` plus the entropy's running sum u = sum exp(value - m) * (value - m).

    At the end, lse = m + log(s) and the entropy is H = log(s) - u / s: both relative to the
    running max, so no digit of H is lost at large |logits|. A -inf value adds 0 * 0 to u: its
    shift is replaced before the product, so no lane forms 0 * -inf = nan (even one discarded
    afterwards, which Triton's interpreter reports as a RuntimeWarning).
    """
    m_new = tl.maximum(m, tl.max(x, axis=0))
    alpha = tl.exp(m - m_new)
    e = tl.exp(x - m_new)
    u = alpha * (u + (m - m_new) * s) + tl.sum(e * tl.where(e > 0, x - m_new, 0.0), axis=0)
    s = s * alpha + tl.sum(e, axis=0)
    return m_new, s, u


# Below this |x|, e^x - 1 and e^x - 1 - x come from their Taylor series: exp(x) - 1 would lose
# the digits of a small x to cancellation (and a GPU's exp is an approximation with an absolute
# error near 1). At 0.35 the series' first dropped term, x^8 / 8!, is below fp32's epsilon of x.
SERIES_BELOW = tl.constexpr(0.35)


@triton.jit
def expm1(x):
    """e^x - 1, accurate for small |x| (torch.expm1's role)."""
    series = x * (1 + x / 2 * (1 + x / 3 * (1 + x / 4 * (1 + x / 5 * (1 + x / 6 * (1 + x / 7))))))
    return tl.where(tl.abs(x) < SERIES_BELOW, series, tl.exp(x) - 1.0)


@triton.jit
def exp_m1_mx(x):
    """e^x - 1 - x >= 0, accurate for small |x|: the k3 estimator's and the k3 penalty's form."""
    series = x * x / 2 * (1 + x / 3 * (1 + x / 4 * (1 + x / 5 * (1 + x / 6 * (1 + x / 7)))))
    return tl.where(tl.abs(x) < SERIES_BELOW, series, (tl.exp(x) - 1.0) - x)
