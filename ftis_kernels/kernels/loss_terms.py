"""The formulas of the loss as Triton functions, each written once and used by every kernel that
needs it (the per-sample kernel of `per_sample.py` and the gradient-in-forward row kernel of
`logp_grad.py`): the KL estimate, the IS weight of each `is_mode`, each loss type's policy term
with its derivatives, VESPO's sequence weight, the k3 penalty and the reduction's normalisers.
`ftis_kernels/per_sample.py` states the same in PyTorch.

d/dR of PPO's clipped min follows torch.minimum's convention (half to each side at a tie, as at
R = 1 on-policy) and clamp's (inclusive edges), so that the hand-written derivative is autograd's.
"""

import triton
import triton.language as tl

from ftis_kernels.kernels.switches import (
    BATCH_MEAN,
    CISPO,
    CLIPPED,
    CONSTANT,
    IS_MASK,
    IS_NONE,
    IS_TIS,
    IS_VIS,
    K1,
    K2,
    K3,
    SAMPLE_MEAN,
    SAMPLE_SUM,
    SAPO,
    VESPO,
)
from ftis_kernels.kernels.tl_utils import exp_m1_mx, expm1

VESPO_LOG_MIN = tl.constexpr(-18.420680743952367)  # log(1e-8), TRL's get_gamma_weights
VESPO_LOG_MAX = tl.constexpr(20.0)


@triton.jit
def kl_estimate(d, KL_ESTIMATOR: tl.constexpr):
    """The per-token KL estimate from d = log pi_gen - log pi_src: k1 d, k2 d^2 / 2, k3
    exp(-d) - 1 + d."""
    if KL_ESTIMATOR == K1:
        k = d
    elif KL_ESTIMATOR == K2:
        k = 0.5 * d * d
    elif KL_ESTIMATOR == K3:
        k = exp_m1_mx(-d)
    return k


@triton.jit
def is_log_ratio(logp, gen, old, IS_FROM_OLD: tl.constexpr):
    """The IS log ratio of a token: log pi_old - log pi_gen (is_source "old", with old_logprobs)
    or log pi_theta - log pi_gen."""
    if IS_FROM_OLD:
        log_ratio = old - gen
    else:
        log_ratio = logp - gen
    return log_ratio


@triton.jit
def is_weight(log_ratio, is_cap, is_cap_min, IS_MODE: tl.constexpr):
    """w of docs/method.md §2 from the log ratio: 1 | r | clamp(r, C_min, C) | r in band else 0."""
    raw = tl.exp(log_ratio)
    if IS_MODE == IS_NONE:
        w = tl.zeros_like(raw) + 1.0
    elif IS_MODE == IS_VIS:
        w = raw
    elif IS_MODE == IS_TIS:
        w = tl.minimum(tl.maximum(raw, is_cap_min), is_cap)
    elif IS_MODE == IS_MASK:
        w = tl.where((raw >= is_cap_min) & (raw <= is_cap), raw, 0.0)
    return w


@triton.jit
def surrogate_and_grad(
    R, adv, lo, hi, eps_high, delta, logp, tau_pos, tau_neg, phi, SURROGATE: tl.constexpr
):
    """The policy term P of the loss type (a loss: to minimise), d P / d R (through the PPO
    ratio), d P / d logp (directly), and whether the clip acts (clip_frac). R, adv and logp are
    blocks of a sample's tokens."""
    zero = tl.zeros_like(R)
    inf = float("inf")
    if SURROGATE == CLIPPED:  # PPO's clipped min, R' = min(R, delta) in the unclipped branch
        a = tl.minimum(R, delta) * adv
        clipped_r = tl.minimum(tl.maximum(R, lo), hi)
        b = clipped_r * adv
        P = -tl.minimum(a, b)
        da = tl.where(R <= delta, adv, 0.0)
        db = tl.where((R >= lo) & (R <= hi), adv, 0.0)
        dP_dR = -tl.where(a < b, da, tl.where(a > b, db, 0.5 * (da + db)))
        dP_dlogp = zero
        clip = ((adv > 0) & (R > hi)) | ((adv < 0) & (R < lo))
    elif SURROGATE == CISPO:  # -sg(min(R, eps_high)) A logp
        c = tl.minimum(R, eps_high) * adv
        P = -c * logp
        dP_dR = zero
        dP_dlogp = -c
        clip = (adv > 0) & (R > eps_high)
    elif SURROGATE == SAPO:  # -sigmoid(tau (R - 1)) 4 / tau A
        tau = tl.where(adv > 0, tau_pos, tau_neg)
        sig = tl.sigmoid(tau * (R - 1.0))
        P = -sig * (4.0 / tau) * adv
        dP_dR = -4.0 * adv * sig * (1.0 - sig)
        dP_dlogp = zero
        clip = R > inf  # never
    elif SURROGATE == VESPO:  # -phi A logp, phi the sample's weight (`vespo_phi`)
        P = -phi * adv * logp
        dP_dR = zero
        dP_dlogp = -phi * adv
        clip = R > inf
    return P, dP_dR, dP_dlogp, clip


@triton.jit
def vespo_log_term(log_ratio, logp, old, is_cap, is_cap_min, IS_MODE: tl.constexpr):
    """A token's term of VESPO's log sequence weight (TRL's get_gamma_weights): log max(w, 1e-8)
    (at most VESPO_LOG_MAX) of its IS weight w, plus its PPO log ratio clamped to [-20, 20]."""
    w = is_weight(log_ratio, is_cap, is_cap_min, IS_MODE)
    # log(max(w, 1e-8)): the clamp's lower edge, without a log of 0.
    log_is = tl.minimum(tl.log(tl.maximum(w, 1e-8)), VESPO_LOG_MAX)
    clamped = tl.minimum(tl.maximum(logp - old, -20.0), 20.0)
    return log_is + clamped


@triton.jit
def vespo_phi(log_is_sum, adv_hat, vk_pos, vl_pos, vk_neg, vl_neg):
    """VESPO's sequence weight phi = exp(lambda + k log W - lambda W) from the sum of the sample's
    `vespo_log_term`s (log W, clamped), k and lambda by the advantage's sign; 0 where not finite."""
    inf = float("inf")
    log_w = tl.minimum(tl.maximum(log_is_sum, VESPO_LOG_MIN), VESPO_LOG_MAX)
    nonneg = adv_hat >= 0.0
    vk = tl.where(nonneg, vk_pos, vk_neg)
    vl = tl.maximum(tl.where(nonneg, vl_pos, vl_neg), 1e-4)
    phi = tl.exp(vl + vk * log_w - vl * tl.exp(log_w))
    return tl.where((phi == phi) & (tl.abs(phi) < inf), phi, 0.0)


@triton.jit
def add_k3_penalty(
    L_tok, dL_dlogp, dL_dR, u, R, beta, BIAS_KL: tl.constexpr, WITH_VALUE: tl.constexpr
):
    """(L_tok, dL_dlogp, dL_dR) with the penalty beta * k3(u) added, u = log pi_ref - logp
    (k3(u) = e^u - 1 - u, d/dlogp = 1 - e^u), times the PPO ratio R with the bias correction.
    WITH_VALUE False: the penalty's value is not added to L_tok (the gradient-in-forward kernel
    needs only its derivatives; the value is still formed where the bias correction's d/dR is)."""
    if WITH_VALUE:
        pen = exp_m1_mx(u)
    dpen = -expm1(u)  # d pen / d logp = 1 - exp(u)
    if BIAS_KL:
        if WITH_VALUE:
            L_tok += beta * pen * R
        dL_dlogp += beta * dpen * R
        dL_dR += beta * exp_m1_mx(u)  # pen, once the compiler has merged the two
    else:
        if WITH_VALUE:
            L_tok += beta * pen
        dL_dlogp += beta * dpen
    return L_tok, dL_dlogp, dL_dR


# The reduction's normaliser (`per_sample.REDUCTION_SCALES`), in two forms. The per-sample kernel
# has decided its sample, so it counts the sample's tokens in the loss (n_loss: 0 for a sample
# rejected by mask) and leaves the batch-wide 1 / N' of "batch_mean" to the finish kernel, which
# sums every sample's n_loss. The gradient-in-forward row kernel writes the gradient before any
# decision, so it counts the mask's tokens (the sample's, or the batch's for "batch_mean"): the
# same numbers wherever it runs, since rejection by mask with "batch_mean" (the one case where the
# decisions change the count of a kept sample's normaliser) keeps the three-pass design, and a
# rejected sample's rows are zeroed in the backward whatever their normaliser.


@triton.jit
def sample_normaliser(n, n_loss, n_samples, length, REDUCTION: tl.constexpr):
    """The per-sample kernel's factor: the normaliser of a decided sample of n completion tokens,
    n_loss of them in the loss (n_samples the batch's B, length dr_grpo's L)."""
    if REDUCTION == SAMPLE_MEAN:
        factor = 1.0 / (n_samples * tl.maximum(n_loss, 1.0))
    elif REDUCTION == BATCH_MEAN:
        factor = 1.0 + 0.0 * n  # the batch-wide 1 / N' is the finish kernel's scale
    elif REDUCTION == CONSTANT:
        factor = 1.0 / (n_samples * length) + 0.0 * n
    elif REDUCTION == SAMPLE_SUM:
        factor = 1.0 / n_samples + 0.0 * n
    return factor


@triton.jit
def mask_normaliser(
    counts_ptr, b, T, n_samples, length,
    REDUCTION: tl.constexpr, HAS_COUNTS: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """The gradient-in-forward row kernel's factor for a token of sample b, from the mask's counts
    (counts_ptr (B,) fp32 completion tokens per sample, or T each without HAS_COUNTS)."""
    if REDUCTION == SAMPLE_MEAN:
        n_b = T + 0.0
        if HAS_COUNTS:
            n_b = tl.load(counts_ptr + b)
        factor = 1.0 / (n_samples * tl.maximum(n_b, 1.0))
    elif REDUCTION == BATCH_MEAN:
        n_all = (n_samples * T) + 0.0
        if HAS_COUNTS:
            acc = tl.zeros([BLOCK_S], dtype=tl.float32)
            for s0 in range(0, n_samples, BLOCK_S):
                i = s0 + tl.arange(0, BLOCK_S)
                acc += tl.load(counts_ptr + i, mask=i < n_samples, other=0.0)
            n_all = tl.sum(acc, axis=0)
        factor = 1.0 / tl.maximum(n_all, 1.0)
    elif REDUCTION == CONSTANT:
        factor = 1.0 / (n_samples * length)
    elif REDUCTION == SAMPLE_SUM:
        factor = 1.0 / n_samples
    return factor


@triton.jit
def token_coef(
    logp, gen, old, adv, is_cap, is_cap_min, lo, hi, clip_high, delta, tau_pos, tau_neg,
    IS_MODE: tl.constexpr, IS_FROM_OLD: tl.constexpr, SURROGATE: tl.constexpr,
):  # fmt: skip
    """The policy term's derivatives for a token with a token-level IS weight and PPO ratio and
    no sequence weight (not VESPO), before the penalty and the reduction's scale: (d loss_tok /
    d logp directly, d loss_tok / d R, R), as the per-sample kernel's pass 2 forms them (the
    caller adds the penalty, then dL_dR * R, in that order). logp, gen, old (old = logp without
    old_logprobs) and adv (0 for a rejected sample) are fp32 scalars or blocks."""
    w = is_weight(is_log_ratio(logp, gen, old, IS_FROM_OLD), is_cap, is_cap_min, IS_MODE)
    R = tl.exp(logp - old)
    P, dP_dR, dP_dlogp, clip = surrogate_and_grad(
        R, adv, lo, hi, clip_high, delta, logp, tau_pos, tau_neg, 0.0, SURROGATE
    )
    has_adv = adv != 0.0
    w_loss = tl.where(has_adv, w, 0.0)
    dL_dR = w_loss * tl.where(has_adv, dP_dR, 0.0)
    dL_dlogp = w_loss * tl.where(has_adv, dP_dlogp, 0.0)
    return dL_dlogp, dL_dR, R
