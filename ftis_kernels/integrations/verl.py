"""F-TIS as a verl policy loss (verl >= 0.9: `verl.trainer.ppo.core_algos.register_policy_loss`).

Importing this module registers `loss_mode: ftis`. verl's actor computes log pi_theta itself (its
`log_prob`, with the graph) and calls the policy loss on (B, T) tensors; the loss here is the
per-sample part of the library (`per_sample.py`, the one written for both ops) applied to those
log-probabilities, so every F-TIS option is available and the result is the op's.

Mapping:
- pi_gen: verl's `rollout_log_probs` when the caller passes them, else its `old_log_prob`. verl
  0.9.1's actor passes no rollout log-probabilities to a policy loss (its `bypass_mode`, which sets
  old_log_prob = rollout_log_probs, also forces its own loss_mode), so there pi_gen = pi_old: the
  rollout engine samples with the weights the actor recomputed pi_old with.
- pi_old: `old_log_prob`; log pi_theta: `log_prob`; advantages: verl's (B, T) token-level ones,
  which GRPO-family estimators make constant over a sample (one per sample is taken; varying
  values, e.g. from GAE, are refused).
- `loss_agg_mode` -> loss_type: token-mean -> "dapo", seq-mean-token-mean -> "grpo",
  seq-mean-token-sum -> "luspo", seq-mean-token-sum-norm -> "dr_grpo" (L = loss_scale_factor or
  T), token-sum -> "luspo" times B; then verl's global-batch scaling (dp_size, batch_num_tokens,
  global_batch_size in `config.global_batch_info`), as its `agg_loss` does.
- clip_ratio_low / clip_ratio_high (or clip_ratio) -> epsilon / epsilon_high; clip_ratio_c (verl's
  dual-clip, default 3) -> delta: for A < 0 verl caps the clipped loss at -A c, which is the op's
  cap R <= delta of the unclipped branch (for A > 0 neither changes anything while c >= 1 +
  clip_ratio_high; a smaller c is refused). The other F-TIS options come from `policy_loss.ftis`
  (a mapping of `FTISOptions` fields) when the policy loss config is an `FTISPolicyLossConfig`
  (`_target_: ftis_kernels.integrations.verl.FTISPolicyLossConfig`). verl's rollout correction
  weights are refused (F-TIS applies its own truncated IS); verl adds its entropy bonus and KL
  loss outside the policy loss, as for every loss mode (`policy_loss.ftis` refuses entropy_coef,
  beta and temperature, which would do nothing or fail here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ftis_kernels._extras import require

require("verl", "ftis_kernels.integrations.verl")

from verl.trainer.ppo.core_algos import register_policy_loss  # noqa: E402
from verl.workers.config import PolicyLossConfig  # noqa: E402

from ftis_kernels.options import LOSS_TYPE_TABLE, FTISOptions  # noqa: E402
from ftis_kernels.per_sample import per_sample_loss  # noqa: E402

LOSS_MODE = "ftis"
# verl's loss_agg_mode -> our loss_type, from the loss-type table.
AGG_LOSS_TYPES = {mode: t.name for t in LOSS_TYPE_TABLE.values() for mode in t.verl}
# `FTISOptions` fields that verl's own settings decide (or that have no effect on log-probs: the
# entropy, the reference KL and the temperature are verl's), with the setting to use instead.
VERL_SETS = {
    "loss_type": "loss_agg_mode",
    "epsilon": "clip_ratio_low",
    "epsilon_high": "clip_ratio_high",
    "delta": "clip_ratio_c",
    "max_completion_length": "loss_scale_factor",
    "entropy_coef": "entropy_coeff",
    "beta": "use_kl_loss, kl_loss_coef, kl_loss_type",
    "use_bias_correction_kl": "use_kl_loss, kl_loss_coef, kl_loss_type",
    "temperature": "the rollout temperature, which verl's actor applies to the logits",
}


@dataclass
class FTISPolicyLossConfig(PolicyLossConfig):
    """verl's policy-loss config with the F-TIS options: `ftis` maps `FTISOptions` field names to
    values, but those in `VERL_SETS`, which come from verl's own settings."""

    loss_mode: str = LOSS_MODE
    ftis: dict = field(default_factory=dict)


def ftis_options(config: Any, loss_agg_mode: str, T: int) -> FTISOptions:
    """The `FTISOptions` of a verl actor config and loss_agg_mode."""
    if loss_agg_mode not in AGG_LOSS_TYPES:
        raise ValueError(
            f"loss_agg_mode: expected one of {tuple(AGG_LOSS_TYPES)}, got {loss_agg_mode!r}"
        )
    policy_loss = config.get("policy_loss", None) if config is not None else None
    extra = dict((policy_loss.get("ftis", None) if policy_loss is not None else None) or {})
    for name, setting in VERL_SETS.items():
        if name in extra:
            raise ValueError(f"policy_loss.ftis.{name}: set by verl ({setting})")
    clip = config.clip_ratio
    low = config.clip_ratio_low if config.clip_ratio_low is not None else clip
    high = config.clip_ratio_high if config.clip_ratio_high is not None else clip
    # verl's dual-clip bound (its vanilla loss reads it with this default).
    dual_clip = float(config.get("clip_ratio_c", 3.0))
    if dual_clip < 1.0 + high:
        raise ValueError(
            f"clip_ratio_c: expected >= 1 + clip_ratio_high = {1.0 + high} with loss_mode=ftis "
            f"(verl's dual-clip is the op's delta only there), got {dual_clip}"
        )
    options = {
        "loss_type": AGG_LOSS_TYPES[loss_agg_mode],
        "epsilon": low,
        "epsilon_high": high,
        "delta": dual_clip,
    }
    if loss_agg_mode == "seq-mean-token-sum-norm":
        factor = config.global_batch_info.get("loss_scale_factor", None)
        options["max_completion_length"] = T if factor is None else int(factor)
    return FTISOptions.from_kwargs(**options, **extra)


def sample_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) advantages from verl's (B, T) token-level ones, constant over each sample's tokens."""
    first = mask.to(torch.int8).argmax(dim=1, keepdim=True)
    per_sample = advantages.gather(1, first)[:, 0]
    if bool(((advantages != per_sample[:, None]) & mask).any()):
        raise ValueError(
            "advantages: expected one value per sample over its response tokens (GRPO-family "
            "estimators); F-TIS takes sample-level advantages, got values that vary within a sample"
        )
    return per_sample


def _global_scale(loss_agg_mode: str, info: dict, mask: torch.Tensor) -> torch.Tensor | float:
    """verl's agg_loss normalises by global counts times dp_size; ours by the local batch."""
    dp_size = info.get("dp_size", 1) or 1
    B = mask.shape[0]
    if loss_agg_mode == "token-mean":
        tokens = info.get("batch_num_tokens", None)
        return 1.0 if tokens is None else mask.sum().float() * dp_size / tokens
    if loss_agg_mode == "token-sum":
        return float(B * dp_size)
    samples = info.get("global_batch_size", None)
    if samples is None:  # verl leaves fully masked samples out of its sample count
        samples = (mask.sum(dim=1) > 0).sum().float().clamp(min=1.0)
    return B * dp_size / samples


@register_policy_loss(LOSS_MODE)
def compute_policy_loss_ftis(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Optional[Any] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    rollout_log_probs: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's policy-loss signature: (B, T) old_log_prob, log_prob (with grad), advantages,
    response_mask; returns the loss (0-dim, differentiable w.r.t. log_prob) and float metrics."""
    if config is None:
        raise ValueError("config: expected verl's actor config, got None")
    if rollout_is_weights is not None:
        raise ValueError(
            "rollout_is_weights: F-TIS applies its own truncated IS; turn verl's "
            "algorithm.rollout_correction.rollout_is off with loss_mode=ftis"
        )
    mask = response_mask.bool()
    opt = ftis_options(config, loss_agg_mode, log_prob.shape[1])
    gen = old_log_prob if rollout_log_probs is None else rollout_log_probs
    adv = sample_advantages(advantages, mask)
    logp = torch.where(mask, log_prob, 0.0)
    result = per_sample_loss(logp.detach(), gen, adv, mask, old_log_prob, None, opt)
    # The loss's value, with d loss / d log_prob = coef (the per-sample part's gradient).
    loss = result.loss + (result.coef * (logp - logp.detach())).sum()
    scale = _global_scale(loss_agg_mode, dict(config.global_batch_info), mask)
    loss = loss * scale
    m = result.metrics
    ratio = torch.exp(torch.where(mask, log_prob.detach() - old_log_prob, 0.0))
    n = mask.sum().clamp(min=1)
    metrics = {
        "actor/pg_clipfrac": float(m["clip_frac"]),
        "actor/ppo_kl": float(torch.where(mask, old_log_prob - log_prob.detach(), 0.0).sum() / n),
        "actor/ftis_ratio_mean": float(torch.where(mask, ratio, 0.0).sum() / n),
    }
    for name in ("filtered_frac", "kl_mean", "is_weight_mean", "is_truncated_frac"):
        metrics[f"actor/ftis_{name}"] = float(m[name])
    return loss, metrics
