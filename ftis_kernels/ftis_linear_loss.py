"""`ftis_linear_loss`: the F-TIS loss from the last hidden states and the lm-head, without ever
materialising the (B, T, V) logits (FTIS_SPEC.md §2, applied to `hidden @ weight.T + bias`).

The completion positions are processed in chunks of `chunk_size` rows. Forward: for each chunk,
one matmul gives the chunk's logits (c, V) in the hidden dtype, and the streaming row kernel of
`ftis_loss` (`kernels/logp_lse.py`) reads them for log pi_theta of the taken token and the row's
log-sum-exp. The per-sample part (`per_sample.py`) then needs every token of a sample at once
(KL filter, sequence-level weight, normaliser), so it runs after the loop and yields the loss, the
metrics and coef = d loss / d logp. Backward: each chunk's logits are recomputed, the row backward
kernel overwrites them with dlogits = coef * (onehot - softmax) / temperature, and two matmuls
accumulate grad_hidden and grad_weight (fp32 accumulation). Rows without gradient (masked,
filtered, zero advantage) are skipped in both passes, so their hidden states may hold anything.

Extra memory is one chunk of logits (c * V in the hidden dtype, plus an fp32 upcast of it in the
backward for bf16/fp16 weights on CPU), an fp32 grad_weight accumulator when the weight is not
fp32, and O(B * T) per-token scalars: nothing grows with B * T * V.

This is the "cuBLAS matmul per chunk + the row kernels" design. The matmul itself is torch's
(cuBLAS on GPU, oneDNN/MKL on CPU); only the row passes are Triton. Fusing the log-sum-exp into a
Triton matmul epilogue (Cut Cross-Entropy style) would drop the chunk buffer and one read of it.

Dispatch, by where `hidden` lives, exactly as `ftis_loss`: CUDA -> Triton row kernels; CPU with
the kernels decorated under TRITON_INTERPRET=1 -> the same kernels, interpreted; CPU otherwise ->
the chunked PyTorch row passes.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from ftis_kernels.ftis_loss import METRIC_NAMES, select_backend
from ftis_kernels.kernels import logp_lse
from ftis_kernels.options import FTISOptions
from ftis_kernels.per_sample import per_sample_loss
from ftis_kernels.validate import LOGIT_DTYPES, check_tensor, validate_row_inputs

# With chunk_size=None, a chunk holds at most this many logits (2^26: 128 MiB in bf16, 256 MiB in
# fp32, i.e. 441 rows of Qwen2.5's 151,936-token vocabulary).
AUTO_CHUNK_ELEMENTS = 1 << 26

_FORWARD = {"triton": logp_lse.logp_lse_fwd, "torch": logp_lse.logp_lse_fwd_torch}
_BACKWARD = {"triton": logp_lse.logits_bwd, "torch": logp_lse.logits_bwd_torch}


def auto_chunk_size(V: int) -> int:
    """Rows per chunk when `chunk_size` is None: AUTO_CHUNK_ELEMENTS // V, at least 1."""
    return max(1, AUTO_CHUNK_ELEMENTS // V)


def _chunks(rows: tuple[torch.Tensor, torch.Tensor], chunk_size: int) -> Iterator[tuple]:
    """(b, t) index tensors of at most chunk_size positions each."""
    b, t = rows
    for i in range(0, b.numel(), chunk_size):
        yield b[i : i + chunk_size], t[i : i + chunk_size]


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """(c, V) logits of (c, H) hidden states, in their dtype: the same matmul as the model's."""
    return h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())


def _accumulate_grad_weight(acc: torch.Tensor, dlogits: torch.Tensor, h: torch.Tensor) -> None:
    """acc (V, H) fp32 += dlogits.T @ h with fp32 accumulation across chunks."""
    if dlogits.dtype == torch.float32:
        acc.addmm_(dlogits.t(), h)
    elif dlogits.is_cuda:
        # cuBLAS half-precision GEMM with an fp32 result: no rounding of the chunk's partial sum.
        acc.add_(torch.mm(dlogits.t(), h, out_dtype=torch.float32))
    else:
        # CPU half-precision GEMMs return their dtype; upcast the chunk instead (chunk-bounded).
        acc.addmm_(dlogits.t().float(), h.float())


def linear_logp_lse(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    tokens: torch.Tensor,
    rows: tuple[torch.Tensor, torch.Tensor],
    temperature: float,
    chunk_size: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward pass. hidden (B, T, H), weight (V, H), bias (V,) or None, tokens (B, T);
    rows = (b, t) int64 index tensors of the positions to compute.

    Returns logp, lse (B, T) fp32: log pi_theta(token) and logsumexp(logits / temperature) at
    `rows`, 0 elsewhere.
    """
    B, T, _ = hidden.shape
    logp = torch.zeros(B, T, dtype=torch.float32, device=hidden.device)
    lse = torch.zeros(B, T, dtype=torch.float32, device=hidden.device)
    for b, t in _chunks(rows, chunk_size):
        logits = _chunk_logits(hidden[b, t], weight, bias)
        chunk_logp, chunk_lse = _FORWARD[backend](logits[None], tokens[b, t][None], None, temperature)
        logp[b, t] = chunk_logp[0]
        lse[b, t] = chunk_lse[0]
    return logp, lse


def linear_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    tokens: torch.Tensor,
    lse: torch.Tensor,
    coef: torch.Tensor,
    temperature: float,
    chunk_size: int,
    backend: str,
    needs: tuple[bool, bool, bool],
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Backward pass. lse (B, T) fp32 from the forward; coef (B, T) fp32 = d loss / d logp times
    the incoming gradient, over temperature; needs = which of (hidden, weight, bias) want a grad.

    With dlogits[r, v] = coef[r] * (1[v == token[r]] - softmax(logits[r] / temperature)[v]):
    grad_hidden = dlogits @ weight (hidden dtype), grad_weight = dlogits.T @ hidden and
    grad_bias = sum_r dlogits[r] (fp32 accumulation, returned in the weight's dtype).
    """
    need_h, need_w, need_b = needs
    f32 = torch.float32
    grad_hidden = torch.zeros_like(hidden) if need_h else None
    grad_weight = None
    if need_w:
        grad_weight = torch.zeros(weight.shape, dtype=f32, device=weight.device)
    grad_bias = torch.zeros(weight.shape[0], dtype=f32, device=weight.device) if need_b else None
    live = coef != 0
    rows = live.nonzero(as_tuple=True) if bool(live.any()) else None
    if rows is not None and any(needs):
        for b, t in _chunks(rows, chunk_size):
            h = hidden[b, t]
            logits = _chunk_logits(h, weight, bias)[None]
            # In place: the chunk's logits become their gradient.
            dlogits = _BACKWARD[backend](
                logits, tokens[b, t][None], lse[b, t][None], coef[b, t][None], temperature, logits
            )[0]
            if need_h:
                grad_hidden[b, t] = dlogits @ weight
            if need_w:
                _accumulate_grad_weight(grad_weight, dlogits, h)
            if need_b:
                grad_bias += dlogits.sum(dim=0, dtype=f32)
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    if grad_bias is not None:
        grad_bias = grad_bias.to(weight.dtype)
    return grad_hidden, grad_weight, grad_bias


def _completion_rows(mask: Optional[torch.Tensor], B: int, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, t) int64 index tensors of the completion positions, in row-major order."""
    if mask is None:
        pos = torch.arange(B * T, device=device)
        return pos // T, pos % T
    return mask.nonzero(as_tuple=True)


class FTISLinearLossFunction(torch.autograd.Function):
    """Autograd wrapper: outputs (loss, *metrics in METRIC_NAMES order); gradients to hidden,
    weight and bias."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, gen_logprobs, advantages, mask, old_logprobs,
                ref_logprobs, opt: FTISOptions, chunk_size: int, backend: str):  # fmt: skip
        B, T, _ = hidden.shape
        rows = _completion_rows(mask, B, T, hidden.device)
        logp, lse = linear_logp_lse(hidden, weight, bias, tokens, rows, opt.temperature, chunk_size, backend)
        result = per_sample_loss(logp, gen_logprobs, advantages, mask, old_logprobs, ref_logprobs, opt)
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, result.coef)
        ctx.temperature = opt.temperature
        ctx.chunk_size = chunk_size
        ctx.backend = backend
        metrics = tuple(result.metrics[name] for name in METRIC_NAMES)
        ctx.mark_non_differentiable(*metrics)
        return (result.loss, *metrics)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        hidden, weight, bias, tokens, lse, coef = ctx.saved_tensors
        coef = coef * (grad_loss.float() / ctx.temperature)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        grads = linear_grads(hidden, weight, bias, tokens, lse, coef, ctx.temperature, ctx.chunk_size,
                             ctx.backend, needs)  # fmt: skip
        return (*grads,) + (None,) * 9


def _check_linear_inputs(hidden: object, weight: object, bias: object, chunk_size: object) -> tuple[int, int, int, int]:
    """Shapes, dtypes and devices of hidden, weight, bias and chunk_size; returns (B, T, H, V)."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or min(hidden.shape) < 1:
        raise ValueError(f"hidden: expected a (B, T, H) tensor with B, T, H >= 1, got "
                         f"{hidden.shape if isinstance(hidden, torch.Tensor) else hidden!r}")  # fmt: skip
    B, T, H = hidden.shape
    check_tensor("hidden", hidden, (B, T, H), LOGIT_DTYPES, hidden.device)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] < 1:
        raise ValueError(f"weight: expected a (V, {H}) tensor with V >= 1, got "
                         f"{weight.shape if isinstance(weight, torch.Tensor) else weight!r}")  # fmt: skip
    V = weight.shape[0]
    check_tensor("weight", weight, (V, H), (hidden.dtype,), hidden.device)
    if bias is not None:
        check_tensor("bias", bias, (V,), (hidden.dtype,), hidden.device)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size: expected None or an int >= 1, got {chunk_size!r}")
    return B, T, H, V


def ftis_linear_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    gen_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    old_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    *,
    bias: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """F-TIS loss and metrics of `ftis_loss(hidden @ weight.T + bias, ...)`, from the hidden
    states, a chunk of positions at a time: the (B, T, V) logits never exist.

    Args:
        hidden: (B, T, H) fp32 | bf16 | fp16, any strides; hidden[b, t] scores tokens[b, t].
        weight: (V, H), the hidden dtype: the lm-head (or tied embedding) weight.
        tokens, gen_logprobs, advantages, mask, old_logprobs, ref_logprobs: as in `ftis_loss`
            ((B, T) tokens in [0, V), (B, T) gen/old/ref logprobs, (B,) advantages, (B, T) mask).
        bias: (V,) in the hidden dtype, or None.
        chunk_size: positions per chunk (rows of logits alive at once); None = as many as keep a
            chunk within AUTO_CHUNK_ELEMENTS logits. Only memory and speed depend on it.
        is_mode, is_level, is_cap, filter, kl_threshold, kl_estimator, kl_reduction, epsilon,
        epsilon_high, beta, temperature, loss_type: see `FTISOptions`.

    The logits of a chunk are computed in the hidden dtype, as the model's lm-head would; the
    row passes and the reductions accumulate in fp32. Hidden states at masked positions are never
    read into a loss or a gradient (they may hold anything).

    Returns:
        loss: 0-dim fp32; gradients flow to `hidden`, `weight` and `bias`.
        metrics: as `ftis_loss`: "logp" (B, T) fp32, "kl" (B,) fp32, "filtered" (B,) bool, and
            0-dim fp32 "filtered_frac", "kl_mean", "clip_frac", "is_weight_mean", "is_truncated_frac".
    """
    opt = FTISOptions(
        is_mode=is_mode, is_level=is_level, is_cap=is_cap, filter=filter,
        kl_threshold=kl_threshold, kl_estimator=kl_estimator, kl_reduction=kl_reduction,
        epsilon=epsilon, epsilon_high=epsilon_high, beta=beta, temperature=temperature,
        loss_type=loss_type,
    )  # fmt: skip
    B, T, H, V = _check_linear_inputs(hidden, weight, bias, chunk_size)
    backend = select_backend(hidden.device)
    mask = validate_row_inputs(B, T, V, hidden.device, tokens, gen_logprobs, advantages, mask,
                               old_logprobs, ref_logprobs, beta)  # fmt: skip
    loss, *metrics = FTISLinearLossFunction.apply(
        hidden, weight, bias, tokens, gen_logprobs.detach(), advantages.detach(), mask,
        None if old_logprobs is None else old_logprobs.detach(),
        None if ref_logprobs is None else ref_logprobs.detach(),
        opt, auto_chunk_size(V) if chunk_size is None else chunk_size, backend,
    )  # fmt: skip
    return loss, dict(zip(METRIC_NAMES, metrics))
