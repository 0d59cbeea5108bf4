"""The per-sample part of the loss in PyTorch, on (B, T) tensors: KL estimate, rejection, IS
weight, policy surrogate (every loss type of `options.LOSS_TYPES`), penalties, reduction, metrics,
and the coefficients d loss / d logp and d loss / d entropy that the backward row passes need.

It is the CPU path's (without Triton's interpreter) and the spelled-out statement of what the
Triton kernels of `kernels/per_sample.py` compute: written once in the methods' words, with the
gradient with respect to the (B, T) log-probabilities (and entropies) taken by autograd on these
small tensors. On a GPU the same work is two launches of `kernels/per_sample.py`, whose
hand-written derivatives are tested against this module and against the reference: a chain of
small torch ops there would cost a launch each and dominate the op's time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from ftis_kernels.options import CISPO, CLIPPED, SAPO, VESPO, FTISOptions, LossType, loss_type
from ftis_kernels.validate import dispatch

METRIC_NAMES = (
    "logp",
    "entropy",
    "kl",
    "filtered",
    "is_truncated",
    "filtered_frac",
    "kl_mean",
    "clip_frac",
    "is_weight_mean",
    "is_truncated_frac",
    "is_masked_frac",
    "is_ratio_mean",
    "is_ratio_max",
    "is_ratio_min",
    "entropy_mean",
)
"""Metrics of both ops, in the custom ops' output order: logp, entropy (B, T); kl (B,); filtered
(B,) bool; is_truncated (B,) fp32 (the share of the sample's completion tokens whose IS weight
was truncated: is_truncated_frac sample by sample); the rest 0-dim fp32 (filtered_frac and kl_mean
over samples, the others over completion tokens; is_ratio_* is the raw IS ratio before truncation
or masking, at the chosen level)."""
PER_TOKEN_METRICS = ("logp", "entropy")
PER_SAMPLE_METRICS = ("kl", "filtered", "is_truncated")
SCALAR_METRICS = METRIC_NAMES[len(PER_TOKEN_METRICS) + len(PER_SAMPLE_METRICS) :]


@dataclass
class PerSample:
    """Results of `per_sample_loss`. loss 0-dim fp32; coef, entropy_coef (B, T) fp32 =
    d loss / d logp and d loss / d entropy (zero where nothing flows)."""

    loss: torch.Tensor
    coef: torch.Tensor
    entropy_coef: torch.Tensor
    metrics: dict[str, torch.Tensor]


KL_ESTIMATES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": lambda d: d,
    "k2": lambda d: 0.5 * d * d,
    "k3": lambda d: torch.expm1(-d) + d,
}


def kl_estimate(d: torch.Tensor, estimator: str) -> torch.Tensor:
    """k1 d, k2 d^2 / 2 or k3 exp(-d) - 1 + d, elementwise, with d = log pi_gen - log pi_src."""
    return dispatch(KL_ESTIMATES, estimator, "kl_estimator")(d)


@dataclass(frozen=True)
class Completion:
    """The completion tokens of a (B, T) batch, as every step reads them: m (B, T) bool, n_safe
    (B,) fp32 = max(n_i, 1) with n_i the sample's completion tokens, zero a 0-dim fp32 on their
    device."""

    m: torch.Tensor
    n_safe: torch.Tensor
    zero: torch.Tensor

    def masked(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T) as fp32, 0 off the completion (where it may hold anything, even nan)."""
        return torch.where(self.m, x.to(torch.float32), self.zero)


# KL_i from the per-token estimates kl_tok (B, T) fp32, 0 off the completion: (B,) fp32.
KL_REDUCTION_RULES: dict[str, Callable[[torch.Tensor, Completion], torch.Tensor]] = {
    "sum": lambda kl_tok, c: kl_tok.sum(dim=1),
    "mean": lambda kl_tok, c: kl_tok.sum(dim=1) / c.n_safe,
    # An empty sample has no evidence: KL 0.
    "max": lambda kl_tok, c: torch.where(
        c.m.any(dim=1), torch.where(c.m, kl_tok, -math.inf).amax(dim=1), c.zero
    ),
}

# Filter rules: (negative, offpolicy) -> rejected.
FILTER_RULES: dict[Optional[str], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "negative_offpolicy": lambda neg, off: neg & off,
    "negative_or_offpolicy": lambda neg, off: neg | off,
    "negative": lambda neg, off: neg,
    "offpolicy": lambda neg, off: off,
    None: lambda neg, off: torch.zeros_like(neg),
}

# The tokens of the loss, m' (B, T) bool, from m (B, T) and the rejected samples (B,).
REJECT_RULES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "advantage": lambda m, filtered: m,
    "mask": lambda m, filtered: m & ~filtered[:, None],
}

# The IS log ratio (B, T) from the per-token one x (B, T), 0 off the completion: itself, its mean
# over the sample's completion, or its sum.
IS_LEVEL_RULES: dict[str, Callable[[torch.Tensor, Completion], torch.Tensor]] = {
    "token": lambda x, c: x,
    "sequence": lambda x, c: (x.sum(dim=1) / c.n_safe)[:, None].expand_as(x),
    "sequence_product": lambda x, c: x.sum(dim=1)[:, None].expand_as(x),
}

# The IS weight w (B, T) from the raw ratio (B, T), whether it lies in [C_min, C] (B, T) bool, the
# completion and the options.
IS_MODE_RULES: dict[
    str, Callable[[torch.Tensor, torch.Tensor, Completion, FTISOptions], torch.Tensor]
] = {
    "none": lambda raw, in_band, c, opt: torch.ones_like(raw),
    "vis": lambda raw, in_band, c, opt: raw,
    "tis": lambda raw, in_band, c, opt: raw.clamp(min=opt.is_cap_min, max=opt.is_cap),
    "mask": lambda raw, in_band, c, opt: torch.where(in_band, raw, c.zero),
}

# The PPO log ratio from the per-token one x (B, T), 0 off the completion: (B, T), or (B, 1) per
# sequence (the mean over the sample's completion).
RATIO_LEVEL_RULES: dict[str, Callable[[torch.Tensor, Completion], torch.Tensor]] = {
    "token": lambda x, c: x,
    "sequence": lambda x, c: (x.sum(dim=1) / c.n_safe)[:, None],
}

# The reduction's per-token scale, broadcast to (B, T), from B, n'_i (B,) fp32 (the sample's
# tokens in the loss), N' = max(sum_i n'_i, 1) and dr_grpo's L: 1 / (B max(n'_i, 1)), 1 / N',
# 1 / (B L) or 1 / B.
REDUCTION_SCALES: dict[str, Callable[[int, torch.Tensor, torch.Tensor, int], torch.Tensor]] = {
    "sample_mean": lambda B, n_tok, n_all, L: (1.0 / (B * n_tok.clamp(min=1.0)))[:, None],
    "batch_mean": lambda B, n_tok, n_all, L: 1.0 / n_all,
    "constant": lambda B, n_tok, n_all, L: torch.tensor(1.0 / (B * L), device=n_all.device),
    "sample_sum": lambda B, n_tok, n_all, L: torch.tensor(1.0 / B, device=n_all.device),
}

# Log of VESPO's clamps (TRL get_gamma_weights): log(1e-8) below, 20 above.
VESPO_LOG_MIN = math.log(1e-8)
VESPO_LOG_MAX = 20.0


def per_sample_loss(
    logp: torch.Tensor,
    gen_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor],
    old_logprobs: Optional[torch.Tensor],
    ref_logprobs: Optional[torch.Tensor],
    opt: FTISOptions,
    entropy: Optional[torch.Tensor] = None,
) -> PerSample:
    """The loss from the per-token log-probabilities (and entropies) of the taken tokens.

    logp (B, T) fp32, log pi_theta(token), 0 at masked positions; entropy (B, T) fp32 per-token
    entropy of pi_theta or None (then entropy_coef must be 0 and the metric is 0); gen_logprobs,
    old_logprobs, ref_logprobs (B, T) float; advantages (B,) float; mask (B, T) bool or None.
    Values at masked positions are ignored (they may be anything, even nan).
    """
    with torch.inference_mode(False), torch.enable_grad():
        logp_leaf = logp.detach().float().clone().requires_grad_()
        ent = torch.zeros_like(logp_leaf) if entropy is None else entropy.detach().float().clone()
        ent.requires_grad_()
        loss, metrics = _loss(
            logp_leaf, ent, gen_logprobs, advantages, mask, old_logprobs, ref_logprobs, opt
        )
        if loss.requires_grad:
            coef, ecoef = torch.autograd.grad(loss, (logp_leaf, ent), allow_unused=True)
        else:
            coef = ecoef = None
    zeros = torch.zeros_like(logp_leaf, requires_grad=False)
    coef = zeros if coef is None else coef.detach().contiguous()
    ecoef = zeros if ecoef is None else ecoef.detach().contiguous()
    metrics = {k: v.detach() for k, v in metrics.items()}
    metrics["logp"] = logp.detach().float()
    metrics["entropy"] = ent.detach()
    return PerSample(loss.detach(), coef, ecoef, metrics)


def _loss(logp, ent, gen_logprobs, advantages, mask, old_logprobs, ref_logprobs, opt):
    """The loss (0-dim fp32, with its graph to the leaves logp and ent, each (B, T) fp32) and the
    metrics, in the method's steps: rejection, IS weight, the loss type's surrogate, reduction,
    metrics. The other arguments as `per_sample_loss` takes them."""
    B, T = logp.shape
    m = torch.ones(B, T, dtype=torch.bool, device=logp.device) if mask is None else mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    c = Completion(m, m.to(torch.float32).sum(dim=1).clamp(min=1.0), zero)
    gen = c.masked(gen_logprobs)
    adv = advantages.to(torch.float32)
    logp_d = logp.detach()
    old = logp_d if old_logprobs is None else c.masked(old_logprobs)
    # log pi_src by its option's value (kl_source, is_source), detached.
    source = {"current": logp_d, "old": old}

    kl, filtered, m_loss, adv_hat = _rejection(gen, adv, source, c, opt)
    raw_weight, in_band, weight = _is_weight(gen, source, c, opt)
    log_r = _ppo_log_ratio(logp, old, c, opt)
    kind = loss_type(opt.loss_type)
    loss_tok, clipped = _token_loss(
        logp, log_r, adv_hat, weight, old, ref_logprobs, m_loss, c, opt, kind
    )
    loss = _reduction(loss_tok, ent, m_loss, c, opt, kind)
    with torch.no_grad():
        metrics = _metrics(kl, filtered, raw_weight, in_band, weight, clipped, ent, c, opt)
    return loss, metrics


def _rejection(gen, adv, source, c: Completion, opt: FTISOptions):
    """Rejection: KL_i of pi_src against pi_gen over the sample's completion tokens, the filter's
    decision and the tokens it leaves in the loss.

    gen (B, T) fp32 log pi_gen, 0 off the completion; adv (B,) fp32; source: log pi_src (B, T)
    fp32, detached, by kl_source. Returns kl (B,) fp32 KL_i; filtered (B,) bool, the rejected
    samples; m_loss (B, T) bool, m' the tokens of the loss (rejection by mask, verl, takes the
    sample out of every normaliser); adv_hat (B, T) fp32, A with 0 for a rejected sample.
    """
    d = gen - dispatch(source, opt.kl_source, "kl_source")
    kl_tok = c.masked(kl_estimate(d, opt.kl_estimator))
    kl = dispatch(KL_REDUCTION_RULES, opt.kl_reduction, "kl_reduction")(kl_tok, c)
    offpolicy = kl > opt.kl_threshold
    if opt.kl_threshold_low is not None:
        offpolicy = offpolicy | (kl < opt.kl_threshold_low)
    filtered = dispatch(FILTER_RULES, opt.filter, "filter")(adv <= 0, offpolicy)
    m_loss = dispatch(REJECT_RULES, opt.reject_mode, "reject_mode")(c.m, filtered)
    adv_hat = torch.where(filtered, c.zero, adv)[:, None].expand_as(c.m)
    return kl, filtered, m_loss, adv_hat


def _is_weight(gen, source, c: Completion, opt: FTISOptions):
    """IS weight w (detached): the ratio of pi_src (is_source) to pi_gen per token or per sequence
    (is_level), then the mode (is_mode: none, vis, tis clamps to [C_min, C], mask zeroes outside).

    gen (B, T) fp32 log pi_gen, 0 off the completion; source: log pi_src (B, T) fp32, detached.
    Returns raw (B, T) fp32, the ratio before truncation or masking; in_band (B, T) bool, raw in
    [C_min, C]; weight (B, T) fp32, w.
    """
    log_ratio = c.masked(dispatch(source, opt.is_source, "is_source") - gen)
    log_ratio = dispatch(IS_LEVEL_RULES, opt.is_level, "is_level")(log_ratio, c)
    raw = torch.exp(log_ratio)
    lo = 0.0 if opt.is_cap_min is None else opt.is_cap_min
    in_band = (raw >= lo) & (raw <= opt.is_cap)
    weight = dispatch(IS_MODE_RULES, opt.is_mode, "is_mode")(raw, in_band, c, opt)
    return raw, in_band, weight


def _ppo_log_ratio(logp, old, c: Completion, opt: FTISOptions) -> torch.Tensor:
    """log R = log pi_theta - log pi_old per token, or its mean over the completion per sequence
    (ratio_level, GSPO), with the gradient to logp; value 0, gradient d logp when old_logprobs is
    None. logp (B, T) fp32, old (B, T) fp32 (0 off the completion); returns (B, T) or (B, 1)."""
    log_r = c.masked(logp - old)
    return dispatch(RATIO_LEVEL_RULES, opt.ratio_level, "ratio_level")(log_r, c)


def _token_loss(
    logp, log_r, adv_hat, weight, old, ref_logprobs, m_loss, c: Completion, opt, kind: LossType
):
    """The per-token loss before the reduction: w times the loss type's surrogate of
    R = exp(log_r) and the advantage, plus beta * k3(ref_logprobs - logp) (times R with
    use_bias_correction_kl).

    logp (B, T) fp32 leaf; log_r (B, T) or (B, 1) from `_ppo_log_ratio`; adv_hat, weight (B, T)
    fp32; old (B, T) fp32; ref_logprobs (B, T) float or None (beta = 0); m_loss (B, T) bool.
    Returns loss_tok (B, T) fp32 and clipped (B, T) bool (tokens whose ratio was clipped).
    """
    ratio = torch.exp(log_r).expand_as(logp)
    lo, hi = 1.0 - opt.epsilon, 1.0 + opt.clip_high
    surrogate = dispatch(SURROGATES, kind.surrogate, "loss_type")
    surrogate_loss, clipped = surrogate(
        logp=logp, ratio=ratio, adv=adv_hat, lo=lo, hi=hi, opt=opt, m=m_loss, old=old, weight=weight
    )
    # VESPO folds the IS weight into its sequence weight; the others multiply it. A zero advantage
    # (a rejected sample) contributes nothing, even where w is inf (VIS).
    has_adv = adv_hat != 0
    w = torch.ones_like(weight) if kind.sequence_weighted else weight
    loss_tok = torch.where(has_adv, w, c.zero) * torch.where(has_adv, surrogate_loss, c.zero)
    if opt.beta > 0:
        ref_minus = c.masked(ref_logprobs) - logp
        penalty = torch.expm1(ref_minus) - ref_minus
        if opt.use_bias_correction_kl:
            penalty = penalty * torch.exp(log_r)
        loss_tok = loss_tok + opt.beta * penalty
    return loss_tok, clipped


def _reduction(loss_tok, ent, m_loss, c: Completion, opt: FTISOptions, kind: LossType):
    """The loss: the token losses over m' (B, T) bool weighted by the loss type's scale (the one
    normaliser: the forward's reduction weights are the backward's scale), less entropy_coef times
    the mean entropy over m' (TRL: whatever the loss type). loss_tok, ent (B, T) fp32; 0-dim."""
    B, T = m_loss.shape
    n_tok = m_loss.to(torch.float32).sum(dim=1)
    n_all = n_tok.sum().clamp(min=1.0)
    length = T if opt.max_completion_length is None else opt.max_completion_length
    scale = dispatch(REDUCTION_SCALES, kind.reduction, "loss_type")(B, n_tok, n_all, length)
    scale = torch.where(m_loss, scale, c.zero)
    loss = (torch.where(m_loss, loss_tok, c.zero) * scale).sum()
    if opt.entropy_coef > 0:
        loss = loss - opt.entropy_coef * (torch.where(m_loss, ent, c.zero).sum() / n_all)
    return loss


def _metrics(kl, filtered, raw, in_band, weight, clipped, ent, c: Completion, opt: FTISOptions):
    """The metrics (METRIC_NAMES but logp and entropy), without a graph: kl (B,) fp32 and
    filtered (B,) bool as `_rejection` gives them, raw, weight (B, T) fp32 and in_band (B, T) bool
    as `_is_weight`, clipped (B, T) bool, ent (B, T) fp32; per sample over its completion tokens,
    over samples (filtered_frac, kl_mean), the rest over the batch's completion tokens."""
    f32, zero, m_all = torch.float32, c.zero, c.m
    mf = m_all.to(f32)
    n_live = mf.sum().clamp(min=1.0)
    any_live = m_all.any()
    truncated = {"tis": ~in_band, "mask": zero.bool(), "none": zero.bool(), "vis": zero.bool()}
    masked_out = ~in_band if opt.is_mode == "mask" else zero.bool()
    return {
        "kl": kl,
        "filtered": filtered,
        "is_truncated": (truncated[opt.is_mode] & m_all).to(f32).sum(dim=1)
        / mf.sum(dim=1).clamp(min=1.0),
        "filtered_frac": filtered.to(f32).mean(),
        "kl_mean": kl.mean(),
        "clip_frac": (clipped & m_all).to(f32).sum() / n_live,
        "is_weight_mean": torch.where(m_all, weight, 0.0).sum() / n_live,
        "is_truncated_frac": (truncated[opt.is_mode] & m_all).to(f32).sum() / n_live,
        "is_masked_frac": (masked_out & m_all).to(f32).sum() / n_live,
        "is_ratio_mean": torch.where(m_all, raw, 0.0).sum() / n_live,
        "is_ratio_max": torch.where(any_live, torch.where(m_all, raw, -math.inf).max(), zero),
        "is_ratio_min": torch.where(any_live, torch.where(m_all, raw, math.inf).min(), zero),
        "entropy_mean": (ent.detach() * mf).sum() / n_live,
    }


def _surrogate(*, ratio, adv, lo, hi, opt, **_):
    """PPO's clipped surrogate as a loss, -min(R' A, clip(R, lo, hi) A), with R' = min(R, delta)
    under two-sided clipping (TRL: delta caps the unclipped branch only)."""
    unclipped = ratio if opt.delta is None else ratio.clamp(max=opt.delta)
    loss = -torch.minimum(unclipped * adv, ratio.clamp(lo, hi) * adv)
    r = ratio.detach()
    clipped = ((adv > 0) & (r > hi)) | ((adv < 0) & (r < lo))
    return loss, clipped


def _cispo(*, logp, ratio, adv, opt, **_):
    """CISPO: -sg(min(R, epsilon_high)) A logp (TRL caps R at epsilon_high itself)."""
    cap = opt.clip_high
    r = ratio.detach()
    return -r.clamp(max=cap) * adv * logp, (adv > 0) & (r > cap)


def _sapo(*, ratio, adv, opt, **_):
    """SAPO: -sigmoid(tau (R - 1)) * 4 / tau * A, tau by the sign of A (TRL: A > 0 -> pos)."""
    tau = torch.where(adv > 0, opt.sapo_temperature_pos, opt.sapo_temperature_neg)
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv, torch.zeros_like(
        adv, dtype=torch.bool
    )


def _vespo(*, logp, adv, opt, m, old, weight, **_):
    """VESPO (TRL get_gamma_weights): -phi(w) A logp, phi(w) = exp(lambda + k log w - lambda w)
    detached, with log w = sum_t clamp(logp - old, +-20) + sum_t clamp(log IS weight, log 1e-8,
    20), clamped to [log 1e-8, 20]; (k, lambda) by A >= 0."""
    with torch.no_grad():
        zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
        log_r = torch.where(m, (logp - old).clamp(-20.0, 20.0), zero).sum(dim=1)
        log_is = torch.log(weight).clamp(VESPO_LOG_MIN, VESPO_LOG_MAX)
        log_w = (log_r + torch.where(m, log_is, zero).sum(dim=1)).clamp(
            VESPO_LOG_MIN, VESPO_LOG_MAX
        )
        nonneg = adv[:, 0] >= 0
        k = torch.where(nonneg, opt.vespo_k_pos, opt.vespo_k_neg)
        lam = torch.where(nonneg, opt.vespo_lambda_pos, opt.vespo_lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        phi = phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)[:, None]
    return -phi * adv * logp, torch.zeros_like(adv, dtype=torch.bool)


# The surrogates by the loss type's form (`options.LossType.surrogate`). Each takes keywords logp,
# ratio R, adv (A, 0 for a rejected sample), old, weight (w), all (B, T) fp32, m (m', (B, T) bool),
# lo, hi (PPO's clip range) and opt, and returns the per-token surrogate loss (B, T) fp32 and the
# tokens whose ratio was clipped (B, T) bool.
SURROGATES = {CLIPPED: _surrogate, CISPO: _cispo, SAPO: _sapo, VESPO: _vespo}
