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
from ftis_kernels.validate import LOGIT_DTYPES, check_row_tensors, check_row_values, check_tensor

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


# The op is registered with torch.library so that torch.compile(fullgraph=True) sees one opaque
# node with a fake (shape-only) implementation and an autograd formula, instead of graph-breaking
# on Triton launches and data-dependent Python. The options travel unpacked: a custom op's schema
# takes tensors and plain scalars only.


@torch.library.custom_op("ftis_kernels::ftis_loss_fwd", mutates_args=())
def _ftis_loss_fwd(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    gen_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor],
    old_logprobs: Optional[torch.Tensor],
    ref_logprobs: Optional[torch.Tensor],
    is_mode: str,
    is_level: str,
    is_cap: float,
    filter: Optional[str],
    kl_threshold: float,
    kl_estimator: str,
    kl_reduction: str,
    epsilon: float,
    epsilon_high: Optional[float],
    beta: float,
    temperature: float,
    loss_type: str,
    inplace_backward: bool,
    backend: str,
) -> tuple[(torch.Tensor,) * (len(METRIC_NAMES) + 4)]:  # type: ignore[misc]
    """(loss, *metrics in METRIC_NAMES order, row_max, log_sum, coef (B, T)). Checks the input
    values first: here they run eagerly even under torch.compile."""
    check_row_values(logits.shape[-1], tokens, gen_logprobs, advantages, mask, old_logprobs,
                     ref_logprobs)  # fmt: skip
    opt = FTISOptions(is_mode, is_level, is_cap, filter, kl_threshold, kl_estimator, kl_reduction,
                      epsilon, epsilon_high, beta, temperature, loss_type)  # fmt: skip
    m = None if mask is None else mask != 0
    logp, row_max, log_sum = _FORWARD[backend](logits, tokens, m, temperature)
    result = per_sample_loss(logp, gen_logprobs, advantages, m, old_logprobs, ref_logprobs, opt)
    metrics = (result.metrics[name] for name in METRIC_NAMES)
    return (result.loss, *metrics, row_max, log_sum, result.coef)


def fake_forward_outputs(like: torch.Tensor, B: int, T: int) -> tuple[torch.Tensor, ...]:
    """Shape-only outputs of a forward op of this library (loss, metrics, row_max, log_sum,
    coef), on the device of `like`; shared by `ftis_loss` and `ftis_linear_loss`."""
    scalar = like.new_empty((), dtype=torch.float32)
    per_token = like.new_empty((B, T), dtype=torch.float32)
    return (
        scalar,  # loss
        per_token,  # logp
        like.new_empty((B,), dtype=torch.float32),  # kl
        like.new_empty((B,), dtype=torch.bool),  # filtered
        *(torch.empty_like(scalar) for _ in range(5)),  # scalar metrics
        torch.empty_like(per_token),  # row_max
        torch.empty_like(per_token),  # log_sum
        torch.empty_like(per_token),  # coef
    )


def option_args(opt: FTISOptions) -> tuple:
    """The options unpacked in the custom ops' schema order, as plain Python scalars."""
    return (
        opt.is_mode, opt.is_level, float(opt.is_cap), opt.filter, float(opt.kl_threshold),
        opt.kl_estimator, opt.kl_reduction, float(opt.epsilon),
        None if opt.epsilon_high is None else float(opt.epsilon_high), float(opt.beta),
        float(opt.temperature), opt.loss_type,
    )  # fmt: skip


@_ftis_loss_fwd.register_fake
def _(logits, tokens, gen_logprobs, advantages, mask, old_logprobs, ref_logprobs, *options):
    return fake_forward_outputs(logits, logits.shape[0], logits.shape[1])


@torch.library.custom_op("ftis_kernels::ftis_loss_bwd", mutates_args=())
def _ftis_loss_bwd(
    logits: torch.Tensor, tokens: torch.Tensor, row_max: torch.Tensor, log_sum: torch.Tensor,
    coef: torch.Tensor, temperature: float, backend: str,
) -> torch.Tensor:  # fmt: skip
    """d loss / d logits (B, T, V) in a new buffer; coef already scaled by the incoming gradient."""
    stats = (row_max, log_sum, coef, temperature)
    return _BACKWARD[backend](logits, tokens, *stats, torch.empty_like(logits))


@_ftis_loss_bwd.register_fake
def _(logits, tokens, row_max, log_sum, coef, temperature, backend):
    return torch.empty_like(logits)


@torch.library.custom_op("ftis_kernels::ftis_loss_bwd_", mutates_args=("logits",))
def _ftis_loss_bwd_inplace(
    logits: torch.Tensor, tokens: torch.Tensor, row_max: torch.Tensor, log_sum: torch.Tensor,
    coef: torch.Tensor, temperature: float, backend: str,
) -> None:  # fmt: skip
    """d loss / d logits written over the logits themselves."""
    _BACKWARD[backend](logits, tokens, row_max, log_sum, coef, temperature, logits)


def _setup_context(ctx, inputs, output):
    logits, tokens = inputs[0], inputs[1]
    row_max, log_sum, coef = output[-3:]
    ctx.save_for_backward(logits, tokens, row_max, log_sum, coef)
    ctx.temperature, ctx.inplace_backward, ctx.backend = inputs[17], inputs[19], inputs[20]


def _backward(ctx, grad_loss, *_):
    logits, tokens, row_max, log_sum, coef = ctx.saved_tensors
    coef = (coef * (grad_loss.float() / ctx.temperature)).contiguous()
    stats = (row_max, log_sum, coef, ctx.temperature, ctx.backend)
    if ctx.inplace_backward:
        torch.ops.ftis_kernels.ftis_loss_bwd_(logits, tokens, *stats)
        dlogits = logits
    else:
        dlogits = torch.ops.ftis_kernels.ftis_loss_bwd(logits, tokens, *stats)
    return (dlogits,) + (None,) * 20


_ftis_loss_fwd.register_autograd(_backward, setup_context=_setup_context)


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
    check_row_tensors(B, T, logits.device, tokens, gen_logprobs, advantages, mask, old_logprobs,
                      ref_logprobs, beta)  # fmt: skip
    loss, *metrics, _, _, _ = _ftis_loss_fwd(
        logits, tokens, gen_logprobs.detach(), advantages.detach(), mask,
        None if old_logprobs is None else old_logprobs.detach(),
        None if ref_logprobs is None else ref_logprobs.detach(),
        *option_args(opt), bool(inplace_backward), backend,
    )  # fmt: skip
    return loss, {name: value.detach() for name, value in zip(METRIC_NAMES, metrics)}
