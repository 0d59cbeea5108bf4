"""The chunk engine of the lm-head ops (`ftis_linear_loss`, `ftis_logprobs`): the (B, T, V) logits
never exist, a chunk of completion rows at a time does.

Per chunk, one matmul gives the chunk's logits (c, V) in the hidden dtype (the model's own
matmul: cuBLAS on GPU, oneDNN/MKL on CPU) and the row passes of `kernels/` read them. Three loops:
- `linear_logp_lse`: the forward's row statistics (log pi_theta of the taken token, row max,
  log-sum-exp, entropy);
- `linear_grads`: the gradients of hidden, weight and bias from the per-row coefficients
  (d loss / d logp and d loss / d entropy), each chunk's logits recomputed;
- `linear_loss_and_grads`: both in one loop over chunks of whole samples, with a callback that
  turns the statistics so far into the coefficients (the per-sample part), so that each chunk's
  logits become their gradient at once.
Rows without gradient (masked, filtered, zero advantage) cost no matmul of the gradients, and
masked rows are never read.

Sizing: `auto_chunk_size` (chunk_size=None) and `sample_chunks` (chunks of whole samples).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Optional

import torch

from ftis_kernels.kernels import BACKWARD, FORWARD
from ftis_kernels.per_sample import PerSample

# With chunk_size=None, a chunk holds at most this many logits (2^27: 256 MiB in bf16, 512 MiB in
# fp32, 883 rows of a 151,936-token vocabulary): large enough for fast GEMMs (bench/README.md,
# "Chunk size of ftis_linear_loss"), and no chunk grows with B * T...
AUTO_CHUNK_ELEMENTS = 1 << 27
# ...or the longest sample, when its logits are at most this many (2^28: 1 GiB in fp32, 1,766 rows
# of 151,936): chunks of whole samples let the forward compute the gradients (6 N H V FLOPs).
AUTO_SAMPLE_CHUNK_ELEMENTS = 1 << 28

# Vocabulary rows per fp32 partial product of grad_weight when the weight is bf16/fp16
# (8192 x H x 4 bytes: 48 MiB at H = 1536).
GRAD_WEIGHT_BLOCK_V = 8192


def auto_chunk_size(V: int, longest: int = 0) -> int:
    """Rows per chunk when `chunk_size` is None: AUTO_CHUNK_ELEMENTS // V (at least 1), raised to
    `longest` (the most completion rows one sample can have) when that many rows hold at most
    AUTO_SAMPLE_CHUNK_ELEMENTS logits."""
    rows = max(1, AUTO_CHUNK_ELEMENTS // V)
    return max(rows, longest) if longest * V <= AUTO_SAMPLE_CHUNK_ELEMENTS else rows


def check_chunk_size(chunk_size: object) -> Optional[int]:
    """chunk_size as given: None or an int >= 1 (a ValueError naming it otherwise)."""
    bad = isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    if chunk_size is not None and bad:
        raise ValueError(f"chunk_size: expected None or an int >= 1, got {chunk_size!r}")
    return chunk_size  # type: ignore[return-value]


def completion_rows(
    mask: Optional[torch.Tensor], B: int, T: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, t) int64 index tensors of the completion positions (mask (B, T) bool, None = all), in
    row-major order."""
    if mask is None:
        pos = torch.arange(B * T, device=device)
        return pos // T, pos % T
    return mask.nonzero(as_tuple=True)


def _chunks(rows: tuple[torch.Tensor, torch.Tensor], chunk_size: int) -> Iterator[tuple]:
    """(b, t) index tensors of at most chunk_size positions each."""
    b, t = rows
    for i in range(0, b.numel(), chunk_size):
        yield b[i : i + chunk_size], t[i : i + chunk_size]


def sample_chunks(
    rows: tuple[torch.Tensor, torch.Tensor], samples: torch.Tensor, chunk_size: int
) -> Optional[list[tuple]]:
    """(b, t) index tensors of chunks of whole samples, at most chunk_size positions each, from the
    completion positions `rows` and the sample of each (n,) (non-decreasing); None when a sample
    has more than chunk_size positions. One synchronisation (the samples' sizes)."""
    sizes = torch.unique_consecutive(samples, return_counts=True)[1].tolist()
    if max(sizes, default=0) > chunk_size:
        return None
    bounds, size = [0], 0
    for n in sizes:
        if size + n > chunk_size:
            bounds.append(bounds[-1] + size)
            size = 0
        size += n
    bounds.append(bounds[-1] + size)
    b, t = rows
    return [(b[i0:i1], t[i0:i1]) for i0, i1 in zip(bounds, bounds[1:]) if i1 > i0]


def _chunk_logits(
    h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """(c, V) logits of (c, H) hidden states, in their dtype: the same matmul as the model's."""
    return h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())


def _accumulate_grad_weight(acc: torch.Tensor, dlogits: torch.Tensor, h: torch.Tensor) -> None:
    """acc (V, H) fp32 += dlogits.T @ h, with fp32 accumulation across chunks."""
    if dlogits.dtype == torch.float32:
        acc.addmm_(dlogits.t(), h)
        return
    # No GEMM accumulates bf16/fp16 products into an fp32 tensor in place, and a whole (V, H) fp32
    # product per chunk would be as large as the accumulator: go a block of vocabulary at a time.
    h32 = None if dlogits.is_cuda else h.float()
    for v0 in range(0, acc.shape[0], GRAD_WEIGHT_BLOCK_V):
        block = slice(v0, v0 + GRAD_WEIGHT_BLOCK_V)
        if dlogits.is_cuda:
            # cuBLAS half-precision GEMM with an fp32 result: the chunk's partial sum is not rounded.  # noqa: E501
            acc[block].add_(torch.mm(dlogits[:, block].t(), h, out_dtype=torch.float32))
        else:
            # CPU half-precision GEMMs return their dtype: upcast the block instead.
            acc[block].addmm_(dlogits[:, block].t().float(), h32)


def linear_logp_lse(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    tokens: torch.Tensor,
    rows: tuple[torch.Tensor, torch.Tensor],
    temperature: float,
    chunk_size: int,
    backend: str,
    chunks: Optional[list[tuple]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward pass. hidden (B, T, H), weight (V, H), bias (V,) or None, tokens (B, T);
    rows = (b, t) int64 index tensors of the positions to compute, in chunks of chunk_size, or
    in `chunks` of them when given (`sample_chunks`).

    Returns logp, row_max, log_sum, entropy (B, T) fp32: log pi_theta(token), the row statistics
    of logits / temperature and the entropy of softmax(logits / temperature)
    (`kernels/logp_lse.py`) at `rows`, 0 elsewhere.
    """
    B, T, _ = hidden.shape
    logp, row_max, log_sum, entropy = (
        torch.zeros(B, T, dtype=torch.float32, device=hidden.device) for _ in range(4)
    )
    for b, t in _chunks(rows, chunk_size) if chunks is None else chunks:
        chunk = _chunk_forward(hidden[b, t], weight, bias, tokens[b, t], temperature, backend)[1]
        logp[b, t], row_max[b, t], log_sum[b, t], entropy[b, t] = chunk
    return logp, row_max, log_sum, entropy


def _chunk_forward(h, weight, bias, tokens, temperature, backend):
    """(the chunk's logits (c, V), their (logp, row_max, log_sum, entropy) (c,)). One function
    per chunk, so that a chunk's logits are freed before the next chunk allocates its own."""
    logits = _chunk_logits(h, weight, bias)
    stats = FORWARD[backend](logits[None], tokens[None], None, temperature)
    return logits, tuple(x[0] for x in stats)


def _new_grads(hidden, weight, needs) -> tuple[Optional[torch.Tensor], ...]:
    """Zero grad_hidden (hidden's dtype), grad_weight and grad_bias (fp32 accumulators), each
    None unless flagged in needs = (hidden, weight, bias)."""
    need_h, need_w, need_b = needs
    f32, dev = torch.float32, weight.device
    return (
        torch.zeros_like(hidden) if need_h else None,
        torch.zeros(weight.shape, dtype=f32, device=dev) if need_w else None,
        torch.zeros(weight.shape[0], dtype=f32, device=dev) if need_b else None,
    )


def _finish_grads(grads, weight) -> tuple[Optional[torch.Tensor], ...]:
    """The accumulators of `_new_grads` in the weight's dtype."""
    grad_hidden, grad_weight, grad_bias = grads
    return (
        grad_hidden,
        None if grad_weight is None else grad_weight.to(weight.dtype),
        None if grad_bias is None else grad_bias.to(weight.dtype),
    )


def _chunk_grads(logits, h, weight, tokens, stats, temperature, backend, rows, grads) -> None:
    """Overwrites a chunk's logits (c, V) with their gradient (stats = row_max, log_sum, coef,
    entropy, entropy_coef (c,), the last two None without an entropy bonus) and accumulates it
    into grads = (grad_hidden at `rows`, grad_weight, grad_bias), each None when not needed."""
    row_max, log_sum, coef, entropy, entropy_coef = (None if x is None else x[None] for x in stats)
    dlogits = BACKWARD[backend](
        logits[None],
        tokens[None],
        row_max,
        log_sum,
        coef,
        temperature,
        logits[None],
        entropy,
        entropy_coef,
    )[0]
    grad_hidden, grad_weight, grad_bias = grads
    if grad_hidden is not None:
        grad_hidden[rows] = dlogits @ weight
    if grad_weight is not None:
        _accumulate_grad_weight(grad_weight, dlogits, h)
    if grad_bias is not None:
        grad_bias += dlogits.sum(dim=0, dtype=torch.float32)


def linear_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    tokens: torch.Tensor,
    per_row: tuple[Optional[torch.Tensor], ...],
    temperature: float,
    chunk_size: int,
    backend: str,
    needs: tuple[bool, bool, bool],
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Backward pass (the gradients in the backward order). per_row = (row_max, log_sum, coef,
    entropy, entropy_coef) as `custom_op.backward_stats` gives them: row_max, log_sum, entropy
    (B, T) fp32 from the forward; coef, entropy_coef (B, T) fp32 = d loss / d logp and
    d loss / d entropy times the incoming gradient, over temperature (entropy and entropy_coef
    None without an entropy bonus); needs = which of (hidden, weight, bias) want a grad.

    With dlogits[r, v] = coef[r] * (1[v == token[r]] - p[r, v]) - entropy_coef[r] * p[r, v] *
    (log p[r, v] + entropy[r]), p = softmax(logits / temperature) (`kernels/logp_lse.py`):
    grad_hidden = dlogits @ weight (hidden dtype), grad_weight = dlogits.T @ hidden and
    grad_bias = sum_r dlogits[r] (fp32 accumulation, returned in the weight's dtype).
    """
    grads = _new_grads(hidden, weight, needs)
    if any(needs):
        coef, entropy_coef = per_row[2], per_row[4]
        live = coef != 0 if entropy_coef is None else (coef != 0) | (entropy_coef != 0)
        for b, t in _chunks(live.nonzero(as_tuple=True), chunk_size):
            stats = tuple(None if x is None else x[b, t] for x in per_row)
            h = hidden[b, t]
            logits = _chunk_logits(h, weight, bias)
            _chunk_grads(
                logits, h, weight, tokens[b, t], stats, temperature, backend, (b, t), grads
            )
            del logits
    return _finish_grads(grads, weight)


def linear_loss_and_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    tokens: torch.Tensor,
    chunks: list[tuple],
    coefficients: Callable[[torch.Tensor, torch.Tensor], PerSample],
    temperature: float,
    entropy_grad: bool,
    backend: str,
    needs: tuple[bool, bool, bool],
) -> tuple[tuple[torch.Tensor, ...], tuple[Optional[torch.Tensor], ...]]:
    """The forward pass and the gradients in one (the forward order), for an incoming gradient
    of 1. hidden (B, T, H), weight (V, H), bias (V,) or None, tokens (B, T); chunks: (b, t) index
    tensors of chunks of whole samples; coefficients(logp, entropy) -> `PerSample` on (B, T)
    tensors (its coef and entropy_coef are read at a chunk's rows, after every earlier chunk);
    entropy_grad: whether the entropy bonus is on.

    Returns ((logp, row_max, log_sum, entropy) as `linear_logp_lse`, the gradients as
    `linear_grads`). Exact when a sample's coefficients depend on its own logp and entropy only
    (`ftis_linear_loss.grad_in_forward_blocker`): the rows not computed yet hold 0 and change no
    other sample's.
    """
    B, T, _ = hidden.shape
    f32 = torch.float32
    logp, row_max, log_sum, entropy = (
        torch.zeros(B, T, dtype=f32, device=hidden.device) for _ in range(4)
    )
    grads = _new_grads(hidden, weight, needs)
    # The scale `backward_stats` gives coef and entropy_coef, for an incoming gradient of 1.
    scale = torch.ones((), dtype=f32, device=hidden.device) / temperature
    for b, t in chunks:
        h, tok = hidden[b, t], tokens[b, t]
        logits, stats = _chunk_forward(h, weight, bias, tok, temperature, backend)
        logp[b, t], row_max[b, t], log_sum[b, t], entropy[b, t] = stats
        result = coefficients(logp, entropy)
        coef = result.coef[b, t] * scale
        ecoef = result.entropy_coef[b, t] * scale if entropy_grad else None
        live = coef != 0 if ecoef is None else (coef != 0) | (ecoef != 0)
        if not bool(live.any()):
            continue
        per_row = (stats[1], stats[2], coef, stats[3] if entropy_grad else None, ecoef)
        if not bool(live.all()):
            # Rows without gradient (a rejected sample, a zero advantage) cost no matmul: their
            # logits are left out (a copy of c * V, against 4 * c * H * V FLOPs of matmuls).
            logits, h, tok, b, t = logits[live], h[live], tok[live], b[live], t[live]
            per_row = tuple(None if x is None else x[live] for x in per_row)
        _chunk_grads(logits, h, weight, tok, per_row, temperature, backend, (b, t), grads)
        del logits
    return (logp, row_max, log_sum, entropy), _finish_grads(grads, weight)
