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

from ftis_kernels.options import FTISOptions, loss_type
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


# Filter rules: (negative, offpolicy) -> rejected.
FILTER_RULES: dict[Optional[str], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "negative_offpolicy": lambda neg, off: neg & off,
    "negative_or_offpolicy": lambda neg, off: neg | off,
    "negative": lambda neg, off: neg,
    "offpolicy": lambda neg, off: off,
    None: lambda neg, off: torch.zeros_like(neg),
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
    B, T = logp.shape
    f32 = torch.float32
    dev = logp.device
    m = torch.ones(B, T, dtype=torch.bool, device=dev) if mask is None else mask.bool()
    zero = torch.zeros((), dtype=f32, device=dev)

    def masked(x: torch.Tensor) -> torch.Tensor:
        return torch.where(m, x.to(f32), zero)

    def seq_sum(x: torch.Tensor) -> torch.Tensor:
        return masked(x).sum(dim=1)

    n_safe = m.to(f32).sum(dim=1).clamp(min=1.0)
    gen = masked(gen_logprobs)
    adv = advantages.to(f32)
    logp_d = logp.detach()
    old = logp_d if old_logprobs is None else masked(old_logprobs)
    source = {"current": logp_d, "old": old}

    # Rejection: KL_i of pi_src against pi_gen over the sample's completion tokens.
    kl_tok = masked(
        kl_estimate(gen - dispatch(source, opt.kl_source, "kl_source"), opt.kl_estimator)
    )
    kl = dispatch(
        {
            "sum": lambda: kl_tok.sum(dim=1),
            "mean": lambda: kl_tok.sum(dim=1) / n_safe,
            # An empty sample has no evidence: KL 0.
            "max": lambda: torch.where(
                m.any(dim=1), torch.where(m, kl_tok, -math.inf).amax(dim=1), zero
            ),
        },
        opt.kl_reduction,
        "kl_reduction",
    )()
    offpolicy = kl > opt.kl_threshold
    if opt.kl_threshold_low is not None:
        offpolicy = offpolicy | (kl < opt.kl_threshold_low)
    filtered = dispatch(FILTER_RULES, opt.filter, "filter")(adv <= 0, offpolicy)
    # The tokens of the loss: rejection by mask (verl) takes the sample out of every normaliser.
    m_loss = dispatch(
        {"advantage": m, "mask": m & ~filtered[:, None]}, opt.reject_mode, "reject_mode"
    )
    adv_hat = torch.where(filtered, zero, adv)[:, None].expand(B, T)

    # IS weight (detached): ratio of pi_src to pi_gen per token or per sequence, then the mode.
    log_ratio = masked(dispatch(source, opt.is_source, "is_source") - gen)
    log_ratio = dispatch(
        {
            "token": lambda: log_ratio,
            "sequence": lambda: (log_ratio.sum(dim=1) / n_safe)[:, None].expand(B, T),
            "sequence_product": lambda: log_ratio.sum(dim=1)[:, None].expand(B, T),
        },
        opt.is_level,
        "is_level",
    )()
    raw_weight = torch.exp(log_ratio)
    lo_w = 0.0 if opt.is_cap_min is None else opt.is_cap_min
    in_band = (raw_weight >= lo_w) & (raw_weight <= opt.is_cap)
    weight = dispatch(
        {
            "none": lambda: torch.ones_like(raw_weight),
            "vis": lambda: raw_weight,
            "tis": lambda: raw_weight.clamp(min=opt.is_cap_min, max=opt.is_cap),
            "mask": lambda: torch.where(in_band, raw_weight, zero),
        },
        opt.is_mode,
        "is_mode",
    )()

    # PPO ratio R = pi_theta / pi_old (value 1, gradient d logp when old_logprobs is None).
    log_r = masked(logp - old)
    log_r = dispatch(
        {"token": lambda: log_r, "sequence": lambda: (log_r.sum(dim=1) / n_safe)[:, None]},
        opt.ratio_level,
        "ratio_level",
    )()
    ratio = torch.exp(log_r).expand(B, T)
    lo, hi = 1.0 - opt.epsilon, 1.0 + opt.clip_high
    kind = loss_type(opt.loss_type)
    surrogate_loss, clipped = dispatch(
        {"clipped": _surrogate, "cispo": _cispo, "sapo": _sapo, "vespo": _vespo},
        kind.surrogate,
        "loss_type",
    )(logp=logp, ratio=ratio, adv=adv_hat, lo=lo, hi=hi, opt=opt, m=m_loss, old=old, weight=weight)
    # VESPO folds the IS weight into its sequence weight; the others multiply it. A zero advantage
    # (a rejected sample) contributes nothing, even where w is inf (VIS).
    has_adv = adv_hat != 0
    w = torch.ones_like(weight) if kind.surrogate == "vespo" else weight
    loss_tok = torch.where(has_adv, w, zero) * torch.where(has_adv, surrogate_loss, zero)
    if opt.beta > 0:
        ref_minus = masked(ref_logprobs) - logp
        penalty = torch.expm1(ref_minus) - ref_minus
        if opt.use_bias_correction_kl:
            penalty = penalty * torch.exp(log_r)
        loss_tok = loss_tok + opt.beta * penalty

    # The one normaliser: the forward's reduction weights are the backward's scale.
    n_tok = m_loss.to(f32).sum(dim=1)
    n_all = n_tok.sum().clamp(min=1.0)
    length = T if opt.max_completion_length is None else opt.max_completion_length
    scale = dispatch(
        {
            "sample_mean": lambda: (1.0 / (B * n_tok.clamp(min=1.0)))[:, None],
            "batch_mean": lambda: 1.0 / n_all,
            "constant": lambda: torch.tensor(1.0 / (B * length), device=dev),
            "sample_sum": lambda: torch.tensor(1.0 / B, device=dev),
        },
        kind.reduction,
        "loss_type",
    )()
    scale = torch.where(m_loss, scale, zero)
    loss = (torch.where(m_loss, loss_tok, zero) * scale).sum()
    if opt.entropy_coef > 0:
        # TRL: the bonus is the mean entropy over the completion tokens, whatever the loss type.
        loss = loss - opt.entropy_coef * (torch.where(m_loss, ent, zero).sum() / n_all)

    with torch.no_grad():
        m_all = m
        mf = m_all.to(f32)
        n_live = mf.sum().clamp(min=1.0)
        any_live = m_all.any()
        truncated = {"tis": ~in_band, "mask": zero.bool(), "none": zero.bool(), "vis": zero.bool()}
        masked_out = ~in_band if opt.is_mode == "mask" else zero.bool()
        metrics = {
            "kl": kl,
            "filtered": filtered,
            "is_truncated": (truncated[opt.is_mode] & m_all).to(f32).sum(dim=1)
            / mf.sum(dim=1).clamp(min=1.0),
            "filtered_frac": filtered.to(f32).mean(),
            "kl_mean": kl.mean(),
            "clip_frac": (clipped & m_all).to(f32).sum() / n_live,
            "is_weight_mean": (weight * mf).sum() / n_live,
            "is_truncated_frac": (truncated[opt.is_mode] & m_all).to(f32).sum() / n_live,
            "is_masked_frac": (masked_out & m_all).to(f32).sum() / n_live,
            "is_ratio_mean": (raw_weight * mf).sum() / n_live,
            "is_ratio_max": torch.where(
                any_live, torch.where(m_all, raw_weight, -math.inf).max(), zero
            ),
            "is_ratio_min": torch.where(
                any_live, torch.where(m_all, raw_weight, math.inf).min(), zero
            ),
            "entropy_mean": (ent.detach() * mf).sum() / n_live,
        }
    return loss, metrics


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
