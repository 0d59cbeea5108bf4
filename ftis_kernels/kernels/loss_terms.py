"""The terms of the loss that differ by option, as Triton functions of a block of a sample's
tokens: the IS weight of each `is_mode`, and each loss type's policy term with its derivatives
(`per_sample.py`'s kernel calls them; `ftis_kernels/per_sample.py` states the same in PyTorch).

d/dR of PPO's clipped min follows torch.minimum's convention (half to each side at a tie, as at
R = 1 on-policy) and clamp's (inclusive edges), so that the hand-written derivative is autograd's.
"""

import triton
import triton.language as tl


@triton.jit
def is_weight(log_ratio, is_cap, is_cap_min, IS_MODE: tl.constexpr):
    """w of docs/method.md §2 from the log ratio: 1 | r | clamp(r, C_min, C) | r in band else 0."""
    raw = tl.exp(log_ratio)
    if IS_MODE == 0:
        w = tl.zeros_like(raw) + 1.0
    elif IS_MODE == 1:
        w = raw
    elif IS_MODE == 2:
        w = tl.minimum(tl.maximum(raw, is_cap_min), is_cap)
    else:
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
    if SURROGATE == 0:  # PPO's clipped min, R' = min(R, delta) in the unclipped branch
        a = tl.minimum(R, delta) * adv
        clipped_r = tl.minimum(tl.maximum(R, lo), hi)
        b = clipped_r * adv
        P = -tl.minimum(a, b)
        da = tl.where(R <= delta, adv, 0.0)
        db = tl.where((R >= lo) & (R <= hi), adv, 0.0)
        dP_dR = -tl.where(a < b, da, tl.where(a > b, db, 0.5 * (da + db)))
        dP_dlogp = zero
        clip = ((adv > 0) & (R > hi)) | ((adv < 0) & (R < lo))
    elif SURROGATE == 1:  # CISPO: -sg(min(R, eps_high)) A logp
        c = tl.minimum(R, eps_high) * adv
        P = -c * logp
        dP_dR = zero
        dP_dlogp = -c
        clip = (adv > 0) & (R > eps_high)
    elif SURROGATE == 2:  # SAPO: -sigmoid(tau (R - 1)) 4 / tau A
        tau = tl.where(adv > 0, tau_pos, tau_neg)
        sig = tl.sigmoid(tau * (R - 1.0))
        P = -sig * (4.0 / tau) * adv
        dP_dR = -4.0 * adv * sig * (1.0 - sig)
        dP_dlogp = zero
        clip = R > inf  # never
    else:  # VESPO: -phi A logp
        P = -phi * adv * logp
        dP_dR = zero
        dP_dlogp = -phi * adv
        clip = R > inf
    return P, dP_dR, dP_dlogp, clip


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
    if IS_FROM_OLD:
        log_ratio = old - gen
    else:
        log_ratio = logp - gen
    w = is_weight(log_ratio, is_cap, is_cap_min, IS_MODE)
    R = tl.exp(logp - old)
    P, dP_dR, dP_dlogp, clip = surrogate_and_grad(
        R, adv, lo, hi, clip_high, delta, logp, tau_pos, tau_neg, 0.0, SURROGATE
    )
    has_adv = adv != 0.0
    w_loss = tl.where(has_adv, w, 0.0)
    dL_dR = w_loss * tl.where(has_adv, dP_dR, 0.0)
    dL_dlogp = w_loss * tl.where(has_adv, dP_dlogp, 0.0)
    return dL_dlogp, dL_dR, R
