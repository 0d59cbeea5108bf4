"""`ftis_linear_loss`: the F-TIS loss from the last hidden states and the lm-head, without ever
materialising the (B, T, V) logits (FTIS_SPEC.md §2, applied to `hidden @ weight.T + bias`).

The completion positions are processed in chunks of `chunk_size` rows, and the gradients are
computed in the forward (for an incoming gradient of 1; the backward only scales them, as Liger's
chunked losses do). For each chunk, one matmul gives the chunk's logits (c, V) in the hidden
dtype, and the streaming row kernel of `ftis_loss` (`kernels/logp_lse.py`) reads them for
log pi_theta of the taken token and the row's statistics (max and log-sum). The per-sample part
(`per_sample.py`) needs every token of a sample (KL filter, sequence-level weight), and a
sample's coef = d loss / d logp depends on no other sample's tokens. So when the chunks hold
whole samples (the default chunk size makes them so whenever one sample's logits fit in
AUTO_SAMPLE_CHUNK_ELEMENTS), each chunk's coef is known as soon as its logits are: the row
backward kernel overwrites them at once with dlogits = coef * (onehot - softmax) / temperature,
and two matmuls accumulate grad_hidden and grad_weight (fp32 accumulation): 6 N H V FLOPs.
Otherwise every chunk's logp comes first, then each chunk's logits are recomputed for its
gradient (8 N H V FLOPs); both orders give the same gradients. Masked rows are never read, so
their hidden states may hold anything.

Extra memory is one chunk of logits (c * V in the hidden dtype, plus the CPU row passes' fp32
scratch), for bf16/fp16 weights an fp32 grad_weight accumulator and one fp32 partial product of
GRAD_WEIGHT_BLOCK_V vocabulary rows, and O(B * T) per-token scalars: nothing grows with the
number of samples (`bench/linear_memory.py` measures it). The gradients exist from the forward
on, instead of from the backward on.

This is the "cuBLAS matmul per chunk + the row kernels" design. The matmul itself is torch's
(cuBLAS on GPU, oneDNN/MKL on CPU); only the row passes are Triton. Fusing the log-sum-exp into a
Triton matmul epilogue (Cut Cross-Entropy style) would drop the chunk buffer and one read of it.

Dispatch, by where `hidden` lives, exactly as `ftis_loss`: CUDA -> Triton row kernels; CPU with
the kernels decorated under TRITON_INTERPRET=1 -> the same kernels, interpreted; CPU otherwise ->
the chunked PyTorch row passes.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch

from ftis_kernels.ftis_loss import (
    _BACKWARD,
    _FORWARD,
    METRIC_NAMES,
    fake_forward_outputs,
    option_args,
    select_backend,
)
from ftis_kernels.options import FTISOptions
from ftis_kernels.per_sample import PerSample, per_sample_loss
from ftis_kernels.validate import LOGIT_DTYPES, check_row_tensors, check_row_values, check_tensor

# With chunk_size=None, a chunk holds at most this many logits (2^26: 128 MiB in bf16, 256 MiB in
# fp32, i.e. 441 rows of Qwen2.5's 151,936-token vocabulary)...
AUTO_CHUNK_ELEMENTS = 1 << 26
# ...or, when more, the longest sample's completion, if its logits are at most this many (2^28:
# 1 GiB in fp32, 1,766 rows of 151,936): chunks of whole samples let the forward compute the
# gradients from the logits it already holds (6 N H V FLOPs instead of 8), and larger GEMMs run
# faster on CPU (measured: bench/README.md).
AUTO_SAMPLE_CHUNK_ELEMENTS = 1 << 28

# Vocabulary rows per fp32 partial product of grad_weight when the weight is bf16/fp16
# (8192 x H x 4 bytes: 48 MiB at H = 1536).
GRAD_WEIGHT_BLOCK_V = 8192


def auto_chunk_size(V: int, longest: int) -> int:
    """Rows per chunk when `chunk_size` is None, for `longest` completion tokens in one sample:
    AUTO_CHUNK_ELEMENTS // V, raised to `longest` when that many rows hold at most
    AUTO_SAMPLE_CHUNK_ELEMENTS logits; at least 1."""
    rows = max(1, AUTO_CHUNK_ELEMENTS // V)
    return max(rows, longest) if longest * V <= AUTO_SAMPLE_CHUNK_ELEMENTS else rows


def _chunks(rows: tuple[torch.Tensor, torch.Tensor], chunk_size: int) -> Iterator[tuple]:
    """(b, t) index tensors of at most chunk_size positions each."""
    b, t = rows
    for i in range(0, b.numel(), chunk_size):
        yield b[i : i + chunk_size], t[i : i + chunk_size]


def _sample_chunks(
    rows: tuple[torch.Tensor, torch.Tensor], per_sample: torch.Tensor, chunk_size: int
) -> Optional[list[tuple]]:
    """(b, t) index tensors of chunks that each hold whole samples (at most chunk_size positions),
    from the row-major completion positions `rows` and their count per sample (B,); None when a
    sample has more than chunk_size positions."""
    counts = per_sample.tolist()
    if max(counts, default=0) > chunk_size:
        return None
    chunks, start, size = [], 0, 0
    for n in counts:
        if size + n > chunk_size:
            chunks.append((start, start + size))
            start, size = start + size, 0
        size += n
    if size:
        chunks.append((start, start + size))
    b, t = rows
    return [(b[i0:i1], t[i0:i1]) for i0, i1 in chunks]


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """(c, V) logits of (c, H) hidden states, in their dtype: the same matmul as the model's."""
    return h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())


def _accumulate_grad_weight(acc: torch.Tensor, dlogits: torch.Tensor, h: torch.Tensor) -> None:
    """acc (V, H) fp32 += dlogits.T @ h, with fp32 accumulation across chunks."""
    if dlogits.dtype == torch.float32:
        acc.addmm_(dlogits.t(), h)
        return
    # No GEMM accumulates bf16/fp16 products into an fp32 tensor in place, and a whole (V, H) fp32
    # product per chunk would be as large as the accumulator: go a block of vocabulary at a time.
    for v0 in range(0, acc.shape[0], GRAD_WEIGHT_BLOCK_V):
        block = slice(v0, v0 + GRAD_WEIGHT_BLOCK_V)
        if dlogits.is_cuda:
            # cuBLAS half-precision GEMM with an fp32 result: the chunk's partial sum is not rounded.
            acc[block].add_(torch.mm(dlogits[:, block].t(), h, out_dtype=torch.float32))
        else:
            # CPU half-precision GEMMs return their dtype: upcast the block instead.
            acc[block].addmm_(dlogits[:, block].t().float(), h.float())


def _chunk_forward(h, weight, bias, tokens, temperature, backend):
    """The chunk's logits (1, c, V) and their row statistics logp, row_max, log_sum (1, c)."""
    logits = _chunk_logits(h, weight, bias)[None]
    return logits, _FORWARD[backend](logits, tokens[None], None, temperature)


def _chunk_grads(
    logits, h, weight, tokens, row_max, log_sum, coef, temperature, backend, rows, grads
) -> None:
    """Overwrites the chunk's logits (1, c, V) with their gradient and accumulates it into
    grads = (grad_hidden (B, T, H) at `rows`, grad_weight (V, H) fp32, grad_bias (V,) fp32)."""
    stats = (row_max, log_sum, coef[None], temperature)
    dlogits = _BACKWARD[backend](logits, tokens[None], *stats, logits)[0]
    grad_hidden, grad_weight, grad_bias = grads
    if grad_hidden is not None:
        grad_hidden[rows] = dlogits @ weight
    if grad_weight is not None:
        _accumulate_grad_weight(grad_weight, dlogits, h)
    if grad_bias is not None:
        grad_bias += dlogits.sum(dim=0, dtype=torch.float32)


def linear_loss_and_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    tokens: torch.Tensor,
    mask: Optional[torch.Tensor],
    loss_fn: Callable[[torch.Tensor], PerSample],
    temperature: float,
    chunk_size: Optional[int],
    backend: str,
    needs: tuple[bool, bool, bool],
) -> tuple[PerSample, tuple[Optional[torch.Tensor], ...]]:
    """The loss and the gradients of (hidden, weight, bias) flagged in `needs`, for an incoming
    gradient of 1. hidden (B, T, H), weight (V, H), bias (V,) or None, tokens (B, T), mask (B, T)
    bool or None; loss_fn(logp (B, T) fp32) -> `PerSample`; chunk_size None = auto_chunk_size.

    With dlogits[r, v] = coef[r] / tau * (1[v == token[r]] - softmax(logits[r] / tau)[v]):
    grad_hidden = dlogits @ weight (hidden dtype), grad_weight = dlogits.T @ hidden and
    grad_bias = sum_r dlogits[r] (fp32 accumulation, returned in the weight's dtype).

    Two orders, the same gradients: when every chunk holds whole samples, a sample's coef is known
    as soon as its logits are (it depends on no other sample's logp), so each chunk's logits are
    computed once and turned into their gradient at once (6 N H V FLOPs). Otherwise a first pass
    gives every logp, and a second recomputes each chunk's logits for the gradient (8 N H V).
    """
    B, T, _ = hidden.shape
    V = weight.shape[0]
    f32 = torch.float32
    need_h, need_w, need_b = needs
    rows = _completion_rows(mask, B, T, hidden.device)
    per_sample = torch.full((B,), T, device=hidden.device) if mask is None else mask.sum(dim=1)
    if chunk_size is None:
        chunk_size = auto_chunk_size(V, int(per_sample.max()))
    grads = (
        torch.zeros_like(hidden) if need_h else None,
        torch.zeros(weight.shape, dtype=f32, device=weight.device) if need_w else None,
        torch.zeros(V, dtype=f32, device=weight.device) if need_b else None,
    )
    logp = torch.zeros(B, T, dtype=f32, device=hidden.device)
    sample_chunks = _sample_chunks(rows, per_sample, chunk_size) if any(needs) else None
    for b, t in sample_chunks if sample_chunks is not None else _chunks(rows, chunk_size):
        h = hidden[b, t]
        tok = tokens[b, t]
        logits, stats = _chunk_forward(h, weight, bias, tok, temperature, backend)
        chunk_logp, row_max, log_sum = stats
        logp[b, t] = chunk_logp[0]
        if sample_chunks is not None:
            coef = loss_fn(logp).coef[b, t] / temperature
            if bool((coef != 0).any()):
                stats = (row_max, log_sum, coef, temperature, backend)
                _chunk_grads(logits, h, weight, tok, *stats, (b, t), grads)
        del logits
    result = loss_fn(logp)
    if sample_chunks is None and any(needs):
        coef = result.coef / temperature
        for b, t in _chunks((coef != 0).nonzero(as_tuple=True), chunk_size):
            h, tok = hidden[b, t], tokens[b, t]
            logits, (_, row_max, log_sum) = _chunk_forward(h, weight, bias, tok, temperature,
                                                           backend)
            stats = (row_max, log_sum, coef[b, t], temperature, backend)
            _chunk_grads(logits, h, weight, tok, *stats, (b, t), grads)
            del logits
    grad_hidden, grad_weight, grad_bias = grads
    return result, (
        grad_hidden,
        None if grad_weight is None else grad_weight.to(weight.dtype),
        None if grad_bias is None else grad_bias.to(weight.dtype),
    )


def _completion_rows(mask: Optional[torch.Tensor], B: int, T: int, device) -> tuple[torch.Tensor, ...]:
    """(b, t) int64 index tensors of the completion positions, in row-major order."""
    if mask is None:
        pos = torch.arange(B * T, device=device)
        return pos // T, pos % T
    return mask.nonzero(as_tuple=True)


# Registered with torch.library like `ftis_loss`, so that torch.compile(fullgraph=True) sees one
# opaque node with a fake (shape-only) implementation and an autograd formula. The options travel
# unpacked: a custom op's schema takes tensors and plain scalars only. The forward computes the
# gradients as well (for an incoming gradient of 1, as Liger's chunked losses do): the backward
# only scales them.


@torch.library.custom_op("ftis_kernels::ftis_linear_loss_fwd", mutates_args=())
def _ftis_linear_loss_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
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
    chunk_size: int,
    backend: str,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[(torch.Tensor,) * (len(METRIC_NAMES) + 4)]:  # type: ignore[misc]
    """(loss, *metrics in METRIC_NAMES order, grad_hidden, grad_weight, grad_bias): the gradients
    for an incoming gradient of 1, an empty tensor for each one not needed (a custom op returns no
    None). chunk_size 0 = auto_chunk_size. Checks the input values first: here they run eagerly
    even under torch.compile."""
    check_row_values(weight.shape[0], tokens, gen_logprobs, advantages, mask, old_logprobs,
                     ref_logprobs)  # fmt: skip
    opt = FTISOptions(is_mode, is_level, is_cap, filter, kl_threshold, kl_estimator, kl_reduction,
                      epsilon, epsilon_high, beta, temperature, loss_type)  # fmt: skip
    m = None if mask is None else mask != 0

    def loss_fn(logp: torch.Tensor) -> PerSample:
        return per_sample_loss(logp, gen_logprobs, advantages, m, old_logprobs, ref_logprobs, opt)

    needs = (need_hidden, need_weight, need_bias)
    result, grads = linear_loss_and_grads(
        hidden, weight, bias, tokens, m, loss_fn, temperature, chunk_size or None, backend, needs
    )
    metrics = (result.metrics[name] for name in METRIC_NAMES)
    return (result.loss, *metrics, *(hidden.new_empty(0) if g is None else g for g in grads))


@_ftis_linear_loss_fwd.register_fake
def _(hidden, weight, bias, tokens, gen_logprobs, advantages, mask, old, ref, *options):
    need_hidden, need_weight, need_bias = options[-3:]
    return (
        *fake_forward_outputs(hidden, hidden.shape[0], hidden.shape[1])[: len(METRIC_NAMES) + 1],
        torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
        torch.empty_like(weight) if need_weight else hidden.new_empty(0),
        weight.new_empty(weight.shape[0]) if need_bias else hidden.new_empty(0),
    )


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*output[-3:])


def _backward(ctx, grad_loss, *_):
    # In place: these gradients exist for this backward alone (a second backward through the same
    # graph fails autograd's version check instead of scaling them twice).
    needs = ctx.needs_input_grad[:3]
    grads = tuple(g.mul_(grad_loss) if need else None for g, need in zip(ctx.saved_tensors, needs))
    return grads + (None,) * 23


_ftis_linear_loss_fwd.register_autograd(_backward, setup_context=_setup_context)


def _check_linear_inputs(hidden: object, weight: object, bias: object, chunk_size: object) -> tuple[int, ...]:
    """Shapes, dtypes and devices of hidden, weight, bias and chunk_size; returns (B, T, H, V)."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or min(hidden.shape) < 1:
        raise ValueError(f"hidden: expected a (B, T, H) tensor with B, T, H >= 1, got "
                         f"{hidden.shape if isinstance(hidden, torch.Tensor) else hidden!r}")  # fmt: skip
    B, T, H = hidden.shape
    check_tensor("hidden", hidden, (B, T, H), LOGIT_DTYPES, hidden.device)
    if hidden.device.type not in ("cuda", "cpu"):
        raise ValueError(f"hidden: expected a CUDA or CPU tensor, got a tensor on {hidden.device}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] < 1:
        raise ValueError(f"weight: expected a (V, {H}) tensor with V >= 1, got "
                         f"{weight.shape if isinstance(weight, torch.Tensor) else weight!r}")  # fmt: skip
    V = weight.shape[0]
    check_tensor("weight", weight, (V, H), (hidden.dtype,), hidden.device)
    if bias is not None:
        check_tensor("bias", bias, (V,), (hidden.dtype,), hidden.device)
    bad_chunk = isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    if chunk_size is not None and bad_chunk:
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
            chunk within AUTO_CHUNK_ELEMENTS logits, or one whole sample's completion when larger
            and within AUTO_SAMPLE_CHUNK_ELEMENTS (`auto_chunk_size`). Only memory and speed
            depend on it (chunks of whole samples: 6 N H V FLOPs instead of 8).
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
    check_row_tensors(B, T, hidden.device, tokens, gen_logprobs, advantages, mask, old_logprobs,
                      ref_logprobs, beta)  # fmt: skip
    grad_on = torch.is_grad_enabled()
    loss, *metrics, _, _, _ = _ftis_linear_loss_fwd(
        hidden, weight, bias, tokens, gen_logprobs.detach(), advantages.detach(), mask,
        None if old_logprobs is None else old_logprobs.detach(),
        None if ref_logprobs is None else ref_logprobs.detach(),
        *option_args(opt), 0 if chunk_size is None else int(chunk_size), backend,
        grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
    )  # fmt: skip
    return loss, {name: value.detach() for name, value in zip(METRIC_NAMES, metrics)}
