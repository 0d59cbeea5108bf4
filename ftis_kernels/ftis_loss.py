"""`ftis_loss`: the fused F-TIS loss from logits (FTIS_SPEC.md §2).

Forward: one streaming pass over each row of logits (`kernels/logp_lse.py`) gives log pi_theta of
the taken token and the row's log-sum-exp; the per-sample part (`per_sample.py`) turns them into
the loss, the metrics and d loss / d logp. Backward: one pass writes
dlogits = coef * (onehot - softmax) / temperature, recomputing the softmax from the saved
log-sum-exp, optionally into the logits buffer itself. No (B, T, V) temporary is ever created.

Dispatch, by where the logits live: CUDA -> compiled Triton kernels; CPU with the kernels
decorated under TRITON_INTERPRET=1 -> the same Triton kernels, interpreted; CPU otherwise -> a
chunked PyTorch path with the same results.
"""

from __future__ import annotations

from typing import Optional

import torch

from ftis_kernels.kernels import logp_lse
from ftis_kernels.options import FTISOptions
from ftis_kernels.per_sample import per_sample_loss
from ftis_kernels.validate import LOGIT_DTYPES, check_tensor, validate_row_inputs

METRIC_NAMES = (
    "logp",
    "kl",
    "filtered",
    "filtered_frac",
    "kl_mean",
    "clip_frac",
    "is_weight_mean",
    "is_truncated_frac",
)


def select_backend(device: torch.device) -> str:
    """"triton" for CUDA tensors and for CPU tensors under the Triton interpreter, else "torch"."""
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu":
        return "triton" if logp_lse.triton_is_interpreted() else "torch"
    raise ValueError(f"logits: expected a CUDA or CPU tensor, got a tensor on {device}")


_FORWARD = {"triton": logp_lse.logp_lse_fwd, "torch": logp_lse.logp_lse_fwd_torch}
_BACKWARD = {"triton": logp_lse.logits_bwd, "torch": logp_lse.logits_bwd_torch}


class FTISLossFunction(torch.autograd.Function):
    """Autograd wrapper: outputs (loss, *metrics in METRIC_NAMES order); gradient to logits only."""

    @staticmethod
    def forward(ctx, logits, tokens, gen_logprobs, advantages, mask, old_logprobs, ref_logprobs,
                opt: FTISOptions, inplace_backward: bool, backend: str):  # fmt: skip
        logp, lse = _FORWARD[backend](logits, tokens, mask, opt.temperature)
        result = per_sample_loss(logp, gen_logprobs, advantages, mask, old_logprobs, ref_logprobs, opt)
        ctx.save_for_backward(logits, tokens, lse, result.coef)
        ctx.temperature = opt.temperature
        ctx.inplace_backward = inplace_backward
        ctx.backend = backend
        metrics = tuple(result.metrics[name] for name in METRIC_NAMES)
        ctx.mark_non_differentiable(*metrics)
        return (result.loss, *metrics)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        logits, tokens, lse, coef = ctx.saved_tensors
        coef = (coef * (grad_loss.float() / ctx.temperature)).contiguous()
        out = logits if ctx.inplace_backward else torch.empty_like(logits)
        dlogits = _BACKWARD[ctx.backend](logits, tokens, lse, coef, ctx.temperature, out)
        return (dlogits,) + (None,) * 9


def ftis_loss(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    gen_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    old_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    *,
    is_mode: str = "tis",
    is_level: str = "token",
    is_cap: float = 2.0,
    filter: Optional[str] = "negative_offpolicy",
    kl_threshold: float = 50.0,
    kl_estimator: str = "k3",
    kl_reduction: str = "sum",
    epsilon: float = 0.2,
    epsilon_high: Optional[float] = None,
    beta: float = 0.0,
    temperature: float = 1.0,
    loss_type: str = "grpo",
    inplace_backward: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """F-TIS loss (the quantity to minimise) and its metrics, fused from the logits.

    Args:
        logits: (B, T, V) fp32 | bf16 | fp16, any strides; logits[b, t] scores tokens[b, t].
        tokens: (B, T) int64 | int32, every id in [0, V).
        gen_logprobs: (B, T) float, log pi_gen(tokens) of the generating policy, finite and <= 0
            at completion positions.
        advantages: (B,) float, group-relative advantages (filtered samples included).
        mask: (B, T) bool or 0/1, the completion tokens; None = all.
        old_logprobs: (B, T) float, log pi_old for the PPO ratio; None = stop_grad(current).
        ref_logprobs: (B, T) float for the beta * k3 penalty; required when beta > 0.
        is_mode, is_level, is_cap, filter, kl_threshold, kl_estimator, kl_reduction, epsilon,
        epsilon_high, beta, temperature, loss_type: see `FTISOptions`.
        inplace_backward: write d loss / d logits into the logits buffer during backward, saving
            a (B, T, V) allocation. Only when nothing reads the logits after the loss: they are
            overwritten by their gradient.

    Per token, with A = 0 for filtered samples:
        loss_t = -min(pi/pi_gen, C) * min(R A, clip(R, 1-eps, 1+eps_high) A) + beta * k3(ref - logp)
    reduced by `loss_type` ("grpo": per-sample token mean, then mean over B).

    Returns:
        loss: 0-dim fp32; gradients flow to `logits` only.
        metrics: detached tensors: "logp" (B, T) fp32 (0 where masked), "kl" (B,) fp32,
            "filtered" (B,) bool, and 0-dim fp32 "filtered_frac", "kl_mean", "clip_frac",
            "is_weight_mean", "is_truncated_frac" (the last three over completion tokens).
    """
    opt = FTISOptions(
        is_mode=is_mode, is_level=is_level, is_cap=is_cap, filter=filter,
        kl_threshold=kl_threshold, kl_estimator=kl_estimator, kl_reduction=kl_reduction,
        epsilon=epsilon, epsilon_high=epsilon_high, beta=beta, temperature=temperature,
        loss_type=loss_type,
    )  # fmt: skip
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or min(logits.shape) < 1:
        raise ValueError(f"logits: expected a (B, T, V) tensor with B, T, V >= 1, got "
                         f"{logits.shape if isinstance(logits, torch.Tensor) else logits!r}")  # fmt: skip
    B, T, V = logits.shape
    check_tensor("logits", logits, (B, T, V), LOGIT_DTYPES, logits.device)
    backend = select_backend(logits.device)
    mask = validate_row_inputs(B, T, V, logits.device, tokens, gen_logprobs, advantages, mask,
                               old_logprobs, ref_logprobs, beta)  # fmt: skip
    loss, *metrics = FTISLossFunction.apply(
        logits, tokens, gen_logprobs.detach(), advantages.detach(), mask,
        None if old_logprobs is None else old_logprobs.detach(),
        None if ref_logprobs is None else ref_logprobs.detach(),
        opt, bool(inplace_backward), backend,
    )  # fmt: skip
    return loss, dict(zip(METRIC_NAMES, metrics))
