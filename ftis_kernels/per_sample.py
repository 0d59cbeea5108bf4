"""The per-sample part of F-TIS on (B, T) tensors: KL estimate, filter, IS weight, clipped
surrogate, reduction, metrics, and the coefficient d loss / d logp that the backward kernels need.

It is a handful of PyTorch ops on (B, T) fp32 tensors rather than a Triton kernel on purpose: it
moves O(B * T) bytes against the O(B * T * V) of the row kernels (a 1 / V fraction, < 0.01% for
real vocabularies), so fusing it would save nothing measurable, while here it is written once, in
the paper's words, for `ftis_loss` and `ftis_linear_loss` alike. Its gradient is written out by
hand (not autograd) so the row kernels can take it as one scalar per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ftis_kernels.options import FTISOptions


@dataclass
class PerSample:
    """Results of `per_sample_loss`. loss 0-dim fp32; coef (B, T) fp32 = d loss / d logp."""

    loss: torch.Tensor
    coef: torch.Tensor
    metrics: dict[str, torch.Tensor]


def kl_estimate(d: torch.Tensor, estimator: str) -> torch.Tensor:
    """k1 d, k2 d^2 / 2 or k3 exp(-d) - 1 + d, elementwise, with d = log pi_gen - log pi_theta."""
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    return torch.expm1(-d) + d


def per_sample_loss(
    logp: torch.Tensor,
    gen_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor],
    old_logprobs: Optional[torch.Tensor],
    ref_logprobs: Optional[torch.Tensor],
    opt: FTISOptions,
) -> PerSample:
    """F-TIS loss from the per-token log-probabilities of the taken tokens.

    logp (B, T) fp32, log pi_theta(token), 0 at masked positions; gen_logprobs, old_logprobs,
    ref_logprobs (B, T) float; advantages (B,) float; mask (B, T) bool or None (all tokens).
    Per token: loss_t = -w_t * min(R_t A, clip(R_t, 1 - eps, 1 + eps_high) A) + beta * k3(ref - logp),
    with A = 0 for filtered samples, then the `loss_type` reduction. Values at masked positions
    are ignored (they may be anything, even nan).
    """
    B, T = logp.shape
    f32 = torch.float32
    m = torch.ones(B, T, dtype=torch.bool, device=logp.device) if mask is None else mask
    mf = m.to(f32)
    zero = torch.zeros((), dtype=f32, device=logp.device)

    def masked(x: torch.Tensor) -> torch.Tensor:
        return torch.where(m, x.to(f32), zero)

    n_tok = mf.sum(dim=1)
    n_safe = n_tok.clamp(min=1.0)
    n_all = n_tok.sum().clamp(min=1.0)
    gen = masked(gen_logprobs)
    adv = advantages.to(f32)

    kl = masked(kl_estimate(gen - logp, opt.kl_estimator)).sum(dim=1)
    if opt.kl_reduction == "mean":
        kl = kl / n_safe

    negative = adv <= 0
    offpolicy = kl > opt.kl_threshold
    if opt.filter == "negative_offpolicy":
        filtered = negative & offpolicy
    elif opt.filter == "negative_or_offpolicy":
        filtered = negative | offpolicy
    elif opt.filter == "negative":
        filtered = negative
    elif opt.filter == "offpolicy":
        filtered = offpolicy
    else:
        filtered = torch.zeros_like(negative)
    adv_hat = torch.where(filtered, zero, adv)[:, None].expand(B, T)

    log_ratio = masked(logp - gen)
    if opt.is_level == "sequence":
        log_ratio = (log_ratio.sum(dim=1) / n_safe)[:, None].expand(B, T)
    raw_weight = torch.exp(log_ratio)
    if opt.is_mode == "none":
        weight = torch.ones_like(raw_weight)
    elif opt.is_mode == "vis":
        weight = raw_weight
    else:
        weight = raw_weight.clamp(max=opt.is_cap)

    # R = pi_theta / pi_old; with old_logprobs None, R = exp(logp - stop_grad(logp)) = 1.
    ratio = torch.ones_like(logp) if old_logprobs is None else torch.exp(logp - masked(old_logprobs))
    lo, hi = 1.0 - opt.epsilon, 1.0 + opt.clip_high
    clipped = ((adv_hat > 0) & (ratio > hi)) | ((adv_hat < 0) & (ratio < lo))
    surrogate = torch.minimum(ratio * adv_hat, ratio.clamp(lo, hi) * adv_hat)
    # d surrogate / d logp = R * A where the unclipped branch is the minimum, else 0.
    dsurrogate = torch.where(clipped, zero, ratio * adv_hat)
    # A zero advantage (a filtered sample) contributes nothing, even where w is inf (VIS).
    has_adv = adv_hat != 0
    loss_tok = torch.where(has_adv, -weight * surrogate, zero)
    dloss_tok = torch.where(has_adv, -weight * dsurrogate, zero)
    if opt.beta > 0:
        ref_minus = masked(ref_logprobs) - logp
        loss_tok = loss_tok + opt.beta * (torch.expm1(ref_minus) - ref_minus)
        dloss_tok = dloss_tok - opt.beta * torch.expm1(ref_minus)

    # The one normaliser: the forward's reduction weights are the backward's scale.
    if opt.loss_type == "grpo":
        scale = (1.0 / (B * n_safe))[:, None].expand(B, T)
    elif opt.loss_type in ("bnpo", "dapo"):
        scale = (1.0 / n_all).expand(B, T)
    else:
        scale = torch.full((B, T), 1.0 / (B * T), dtype=f32, device=logp.device)
    scale = torch.where(m, scale, zero)
    loss = (loss_tok * scale).sum()
    coef = (dloss_tok * scale).contiguous()

    truncated = raw_weight > opt.is_cap if opt.is_mode == "tis" else torch.zeros_like(m)
    metrics = {
        "logp": logp,
        "kl": kl,
        "filtered": filtered,
        "filtered_frac": filtered.to(f32).mean(),
        "kl_mean": kl.mean(),
        "clip_frac": (clipped & m).to(f32).sum() / n_all,
        "is_weight_mean": (weight * mf).sum() / n_all,
        "is_truncated_frac": (truncated & m).to(f32).sum() / n_all,
    }
    return PerSample(loss=loss, coef=coef, metrics=metrics)
