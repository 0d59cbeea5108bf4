"""Plain PyTorch reference of the loss (docs/method.md §2 and every option of `FTISOptions`),
written for clarity, not speed.

It takes the full log-softmax over the vocabulary in `compute_dtype` (float32 by default, float64
for the tests' oracle, or the logits' own dtype to measure what plain PyTorch loses in that dtype)
and lets autograd produce the gradient. Every kernel of the library is tested against it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ftis_kernels.options import FTISOptions, loss_type


def kl_per_token(d: torch.Tensor, estimator: str) -> torch.Tensor:
    """k1, k2 or k3 of d = log pi_gen - log pi_src, elementwise."""
    estimators = {"k1": lambda: d, "k2": lambda: 0.5 * d * d, "k3": lambda: torch.exp(-d) - 1.0 + d}
    return estimators[estimator]()


def ref_ftis_loss(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    gen_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    old_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    *,
    compute_dtype: torch.dtype = torch.float32,
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and metrics by the book.

    logits (B, T, V) any float dtype; tokens (B, T) int; gen_logprobs, old_logprobs, ref_logprobs
    (B, T) float; advantages (B,) float; mask (B, T) bool or 0/1, None = all tokens.
    `options` are the keyword options of `ftis_kernels.ftis_loss` (see `FTISOptions`).
    Returns (loss, metrics) with loss 0-dim in `compute_dtype`, differentiable w.r.t. logits.
    """
    opt = FTISOptions(**options)
    cd = compute_dtype
    B, T, V = logits.shape
    m = torch.ones(B, T, dtype=torch.bool, device=logits.device) if mask is None else mask.bool()
    n_tok = m.to(cd).sum(dim=1)  # (B,)
    n_safe = n_tok.clamp(min=1.0)
    zero = torch.zeros((), dtype=cd, device=logits.device)

    # log pi_theta of the taken tokens and the entropy, on completion rows only: the logits of
    # masked-out positions may be anything (even inf/nan) and must not reach the loss or gradient.
    rows = logits[m].to(cd) / opt.temperature  # (N, V)
    log_probs = torch.log_softmax(rows, dim=-1)
    logp_rows = log_probs.gather(-1, tokens[m].long()[:, None])[:, 0]
    probs = log_probs.exp()
    entropy_rows = -(probs * torch.where(probs > 0, log_probs, zero)).sum(dim=-1)
    logp = torch.zeros(B, T, dtype=cd, device=logits.device).masked_scatter(m, logp_rows)
    entropy = torch.zeros(B, T, dtype=cd, device=logits.device).masked_scatter(m, entropy_rows)

    def masked(x: torch.Tensor) -> torch.Tensor:
        return torch.where(m, x.to(cd), zero)

    gen = masked(gen_logprobs)
    logp_d = logp.detach()
    old = logp_d if old_logprobs is None else masked(old_logprobs)
    policy = {"current": logp_d, "old": old}
    adv = advantages.to(cd)

    # Rejection: per-sample KL estimate of pi_src against pi_gen, from the sampled tokens only.
    kl_tok = masked(kl_per_token(gen - policy[opt.kl_source], opt.kl_estimator))
    if opt.kl_reduction == "sum":
        kl = kl_tok.sum(dim=1)
    elif opt.kl_reduction == "mean":
        kl = kl_tok.sum(dim=1) / n_safe
    else:  # max; a sample without tokens has KL 0
        kl = torch.stack([kl_tok[b][m[b]].max() if m[b].any() else zero for b in range(B)])
    negative = adv <= 0
    offpolicy = kl > opt.kl_threshold
    if opt.kl_threshold_low is not None:
        offpolicy = offpolicy | (kl < opt.kl_threshold_low)
    filtered = {
        "negative_offpolicy": negative & offpolicy,
        "negative_or_offpolicy": negative | offpolicy,
        "negative": negative,
        "offpolicy": offpolicy,
        None: torch.zeros_like(negative),
    }[opt.filter]
    adv_hat = torch.where(filtered, zero, adv)[:, None]  # (B, 1)
    loss_mask = m & ~filtered[:, None] if opt.reject_mode == "mask" else m

    # IS weight of pi_src over pi_gen, detached, per token or per sequence, then the mode.
    log_ratio = masked(policy[opt.is_source] - gen)
    if opt.is_level == "sequence":
        log_ratio = (log_ratio.sum(dim=1) / n_safe)[:, None].expand(B, T)
    elif opt.is_level == "sequence_product":
        log_ratio = log_ratio.sum(dim=1)[:, None].expand(B, T)
    raw_weight = torch.exp(log_ratio)
    c_min = 0.0 if opt.is_cap_min is None else opt.is_cap_min
    in_band = (raw_weight >= c_min) & (raw_weight <= opt.is_cap)
    if opt.is_mode == "none":
        weight = torch.ones_like(raw_weight)
    elif opt.is_mode == "vis":
        weight = raw_weight
    elif opt.is_mode == "tis":
        weight = torch.clamp(raw_weight, min=opt.is_cap_min, max=opt.is_cap)
    else:  # mask
        weight = torch.where(in_band, raw_weight, zero)

    # PPO ratio R = pi_theta / pi_old, per token or per sequence (GSPO).
    log_r = masked(logp - old)
    if opt.ratio_level == "sequence":
        log_r = (log_r.sum(dim=1) / n_safe)[:, None]
    ratio = torch.exp(log_r).expand(B, T)
    lo, hi = 1.0 - opt.epsilon, 1.0 + opt.clip_high
    clipped = torch.zeros_like(m)
    kind = loss_type(opt.loss_type)  # the op's table: an unknown loss type is refused here
    if kind.surrogate == "cispo":
        policy_loss = -torch.clamp(ratio, max=opt.clip_high).detach() * adv_hat * logp
        clipped = (adv_hat > 0) & (ratio.detach() > opt.clip_high)
    elif kind.surrogate == "sapo":
        # Options as tensors of the compute dtype: torch.where of two Python floats is fp32.
        tau_pos, tau_neg = opt.sapo_temperature_pos, opt.sapo_temperature_neg
        tau = torch.where(adv_hat > 0, adv_hat.new_tensor(tau_pos), adv_hat.new_tensor(tau_neg))
        policy_loss = -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv_hat
    elif kind.surrogate == "vespo":
        with torch.no_grad():
            lmin = math.log(1e-8)
            log_w = masked(torch.clamp(logp_d - old, -20.0, 20.0)).sum(dim=1) + masked(
                torch.clamp(torch.log(weight), lmin, 20.0)
            ).sum(dim=1)
            log_w = torch.clamp(log_w, lmin, 20.0)
            nonneg = adv_hat[:, 0] >= 0
            pos = (opt.vespo_k_pos, opt.vespo_lambda_pos)
            neg = (opt.vespo_k_neg, opt.vespo_lambda_neg)
            k_pos, lam_pos, k_neg, lam_neg = (log_w.new_tensor(v) for v in (*pos, *neg))
            k = torch.where(nonneg, k_pos, k_neg)
            lam = torch.where(nonneg, lam_pos, lam_neg).clamp(min=1e-4)
            phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
            phi = phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)[:, None]
        policy_loss = -phi * adv_hat * logp
        weight_used = torch.ones_like(weight)  # VESPO folds the IS weight into phi
    else:  # "clipped": PPO's clipped surrogate, with delta capping the unclipped branch
        unclipped = ratio if opt.delta is None else torch.clamp(ratio, max=opt.delta)
        policy_loss = -torch.minimum(unclipped * adv_hat, torch.clamp(ratio, lo, hi) * adv_hat)
        r = ratio.detach()
        clipped = ((adv_hat > 0) & (r > hi)) | ((adv_hat < 0) & (r < lo))
    if kind.surrogate != "vespo":
        weight_used = weight
    # A zero advantage (a rejected sample) contributes nothing, even where the weight is inf (VIS).
    has_adv = (adv_hat != 0).expand(B, T)
    loss_tok = torch.where(has_adv, weight_used, zero) * torch.where(has_adv, policy_loss, zero)
    if opt.beta > 0:
        ref_minus = masked(ref_logprobs) - logp
        penalty = torch.exp(ref_minus) - ref_minus - 1.0
        if opt.use_bias_correction_kl:
            penalty = penalty * torch.exp(log_r)
        loss_tok = loss_tok + opt.beta * penalty
    loss_tok = torch.where(loss_mask, loss_tok, zero)

    kept = loss_mask.to(cd).sum(dim=1)
    n_all = kept.sum().clamp(min=1.0)
    if kind.reduction == "sample_mean":  # grpo, sapo
        loss = (loss_tok.sum(dim=1) / kept.clamp(min=1.0)).mean()
    elif kind.reduction == "batch_mean":  # bnpo, dapo, cispo, vespo
        loss = loss_tok.sum() / n_all
    elif kind.reduction == "constant":  # dr_grpo
        loss = loss_tok.sum() / (B * (opt.max_completion_length or T))
    else:  # "sample_sum": luspo
        loss = loss_tok.sum(dim=1).mean()
    if opt.entropy_coef > 0:
        loss = loss - opt.entropy_coef * torch.where(loss_mask, entropy, zero).sum() / n_all

    with torch.no_grad():
        mf = m.to(cd)
        n_live = mf.sum().clamp(min=1.0)
        truncated = ~in_band if opt.is_mode == "tis" else torch.zeros_like(m)
        masked_out = ~in_band if opt.is_mode == "mask" else torch.zeros_like(m)
        live_ratios = raw_weight[m]
        metrics = {
            "logp": logp_d,
            "entropy": entropy.detach(),
            "kl": kl,
            "filtered": filtered,
            "is_truncated": (truncated & m).to(cd).sum(dim=1) / mf.sum(dim=1).clamp(min=1.0),
            "filtered_frac": filtered.to(cd).mean(),
            "kl_mean": kl.mean(),
            "clip_frac": (clipped & m).to(cd).sum() / n_live,
            "is_weight_mean": torch.where(m, weight, 0.0).sum() / n_live,
            "is_truncated_frac": (truncated & m).to(cd).sum() / n_live,
            "is_masked_frac": (masked_out & m).to(cd).sum() / n_live,
            "is_ratio_mean": torch.where(m, raw_weight, 0.0).sum() / n_live,
            "is_ratio_max": live_ratios.max() if live_ratios.numel() else zero,
            "is_ratio_min": live_ratios.min() if live_ratios.numel() else zero,
            "entropy_mean": (entropy.detach() * mf).sum() / n_live,
        }
    return loss, metrics
