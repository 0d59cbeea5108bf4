"""Plain PyTorch reference of the F-TIS loss (docs/method.md §2), written for clarity, not speed.

It takes the full log-softmax over the vocabulary in `compute_dtype` (float32 by default, float64
for the tests' oracle, or the logits' own dtype to measure what plain PyTorch loses in that dtype)
and lets autograd produce the gradient. Every kernel of the library is tested against it.
"""

from __future__ import annotations

from typing import Optional

import torch

from ftis_kernels.options import FTISOptions


def kl_per_token(d: torch.Tensor, estimator: str) -> torch.Tensor:
    """k1, k2 or k3 of d = log pi_gen - log pi_theta, elementwise."""
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    return torch.exp(-d) - 1.0 + d


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
    """F-TIS loss and metrics by the book.

    logits (B, T, V) any float dtype; tokens (B, T) int; gen_logprobs, old_logprobs, ref_logprobs
    (B, T) float; advantages (B,) float; mask (B, T) bool or 0/1, None = all tokens.
    `options` are the keyword options of `ftis_kernels.ftis_loss` (see `FTISOptions`).
    Returns (loss, metrics) with loss 0-dim in `compute_dtype`, differentiable w.r.t. logits.
    """
    opt = FTISOptions(**options)
    cd = compute_dtype
    B, T, V = logits.shape
    m = torch.ones(B, T, dtype=torch.bool, device=logits.device) if mask is None else mask.bool()
    mf = m.to(cd)
    n_tok = mf.sum(dim=1)  # (B,)
    n_safe = n_tok.clamp(min=1.0)

    # log pi_theta of the taken tokens, computed on completion rows only: the logits of masked-out
    # positions may be anything (even inf/nan) and must not reach the loss or the gradient.
    rows = logits[m].to(cd) / opt.temperature  # (N, V)
    logp_rows = torch.log_softmax(rows, dim=-1).gather(-1, tokens[m].long()[:, None])[:, 0]
    logp = torch.zeros(B, T, dtype=cd, device=logits.device).masked_scatter(m, logp_rows)

    def masked(x: Optional[torch.Tensor], fill: float = 0.0) -> torch.Tensor:
        return torch.where(m, x.to(cd), torch.as_tensor(fill, dtype=cd, device=logits.device))

    gen = masked(gen_logprobs)
    logp_d = logp.detach()
    adv = advantages.to(cd)

    # Per-sample KL(pi_theta || pi_gen) estimate from the sampled tokens only.
    kl_tok = masked(kl_per_token(gen - logp_d, opt.kl_estimator))
    kl = kl_tok.sum(dim=1)
    if opt.kl_reduction == "mean":
        kl = kl / n_safe

    # The filter: only the advantage of a filtered sample becomes 0.
    negative = adv <= 0
    offpolicy = kl > opt.kl_threshold
    filtered = {
        "negative_offpolicy": negative & offpolicy,
        "negative_or_offpolicy": negative | offpolicy,
        "negative": negative,
        "offpolicy": offpolicy,
        None: torch.zeros_like(negative),
    }[opt.filter]
    adv_hat = torch.where(filtered, torch.zeros_like(adv), adv)[:, None]  # (B, 1)

    # Importance weight pi_theta / pi_gen, detached, per token or per sequence, maybe truncated.
    log_ratio = masked(logp_d - gen)
    if opt.is_level == "sequence":
        log_ratio = (log_ratio.sum(dim=1) / n_safe)[:, None].expand(B, T)
    raw_weight = torch.exp(log_ratio)
    if opt.is_mode == "none":
        weight = torch.ones_like(raw_weight)
    elif opt.is_mode == "vis":
        weight = raw_weight
    else:
        weight = torch.clamp(raw_weight, max=opt.is_cap)

    # PPO ratio R = pi_theta / pi_old: value 1 and gradient d logp when old_logprobs is None.
    old = logp_d if old_logprobs is None else masked(old_logprobs)
    ratio = torch.exp(logp - old)
    lo, hi = 1.0 - opt.epsilon, 1.0 + opt.clip_high
    surrogate = torch.minimum(ratio * adv_hat, torch.clamp(ratio, lo, hi) * adv_hat)
    # A zero advantage (a filtered sample) contributes nothing, even where the weight is inf (VIS).
    loss_tok = -torch.where(adv_hat != 0, weight, torch.zeros_like(weight)) * surrogate
    if opt.beta > 0:
        ref_minus = masked(ref_logprobs) - logp
        loss_tok = loss_tok + opt.beta * (torch.exp(ref_minus) - ref_minus - 1.0)
    loss_tok = torch.where(m, loss_tok, torch.zeros_like(loss_tok))

    n_all = n_tok.sum().clamp(min=1.0)
    if opt.loss_type == "grpo":
        loss = (loss_tok.sum(dim=1) / n_safe).mean()
    elif opt.loss_type in ("bnpo", "dapo"):
        loss = loss_tok.sum() / n_all
    else:  # dr_grpo
        loss = loss_tok.sum() / (B * T)

    with torch.no_grad():
        r = ratio.detach()
        clipped = ((adv_hat > 0) & (r > hi)) | ((adv_hat < 0) & (r < lo))
        truncated = raw_weight > opt.is_cap if opt.is_mode == "tis" else torch.zeros_like(m)
        metrics = {
            "logp": logp_d,
            "kl": kl,
            "filtered": filtered,
            "filtered_frac": filtered.to(cd).mean(),
            "kl_mean": kl.mean(),
            "clip_frac": (clipped & m).to(cd).sum() / n_all,
            "is_weight_mean": (weight * mf).sum() / n_all,
            "is_truncated_frac": (truncated & m).to(cd).sum() / n_all,
        }
    return loss, metrics
