"""The chunk engine of the lm-head ops (`ftis_linear_loss`, `ftis_logprobs`): the (B, T, V) logits
never exist, a chunk of rows at a time does.

The rows are the (B, T) positions flattened (a packed batch's N tokens), and a chunk is a
contiguous range of them: no index tensor, no gather, and no host read to size anything. Per
chunk, one matmul gives the chunk's logits (c, V) in the hidden dtype (the model's own matmul:
cuBLAS on GPU, oneDNN/MKL on CPU) and the row passes of `kernels/` read them. Three loops:
- `linear_logp_lse`: the forward's row statistics (log pi_theta of the taken token, row max,
  log-sum-exp, entropy);
- `linear_grads`: the gradients of hidden, weight and bias from the per-row coefficients, each
  chunk's logits recomputed (the backward order);
- `linear_loss_and_grads`: both in one loop over chunks of whole samples (the forward order):
  after a chunk's row pass, the per-sample kernel turns its samples' statistics into their
  coefficients, and the chunk's logits become their gradient at once.
Per chunk: the logits' matmul, the row pass, (the per-sample pass,) the backward row pass in place,
then the two matmuls of the gradients: grad_hidden written into its rows, grad_weight accumulated
by the matmul itself (`_accumulate_grad_weight`): in fp32 by default, or in the weight's dtype
(`GRAD_WEIGHT_ACCUMULATIONS`).

Masked rows are computed like the others (a chunk's size is never read back from the device), on
the hidden states as given: their row passes read none of their logits, and their gradient is
written as zeros. The weight gradient's matmul reads a chunk's hidden states through a buffer of
one chunk, zeros at the rows without gradient (the backward row pass fills it), so that whatever a
masked row holds (NaN at padding) reaches no gradient; no masked copy of every hidden state.

Sizing: `auto_chunk_size` (chunk_size=None) and `sample_chunks` (chunks of whole samples).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

from ftis_kernels.kernels import BACKWARD, FORWARD

# With chunk_size=None, a chunk holds at most this many logits (2^27: 256 MiB in bf16, 512 MiB in
# fp32, 883 rows of a 151,936-token vocabulary): large enough for fast GEMMs (bench/README.md,
# "Chunk size of ftis_linear_loss"), and no chunk grows with B * T...
AUTO_CHUNK_ELEMENTS = 1 << 27
# ...or the longest sample, when its logits are at most this many (2^28: 1 GiB in fp32, 1,766 rows
# of 151,936): chunks of whole samples let the forward compute the gradients (6 N H V FLOPs).
AUTO_SAMPLE_CHUNK_ELEMENTS = 1 << 28

# Vocabulary rows per GEMM of grad_weight where a bf16/fp16 GEMM neither accumulates into fp32 nor
# sums in place (the CPU; its fp32 scratch is 8192 x H x 4 bytes: 48 MiB at H = 1536).
GRAD_WEIGHT_BLOCK_V = 8192

# Where grad_weight is summed over the chunks: "fp32" (a (V, H) fp32 accumulator, converted to the
# weight's dtype at the end) or "weight" (the weight's dtype: no accumulator beside the returned
# gradient, half the accumulator's traffic per chunk in bf16/fp16, and one rounding to that dtype
# per chunk; each chunk's product is still summed in fp32 inside the matmul).
GRAD_WEIGHT_ACCUMULATIONS = ("fp32", "weight")


def auto_chunk_size(V: int, longest: int = 0) -> int:
    """Rows per chunk when `chunk_size` is None: AUTO_CHUNK_ELEMENTS // V (at least 1), raised to
    `longest` (the most rows one sample can have) when that many rows hold at most
    AUTO_SAMPLE_CHUNK_ELEMENTS logits."""
    rows = max(1, AUTO_CHUNK_ELEMENTS // V)
    return max(rows, longest) if longest * V <= AUTO_SAMPLE_CHUNK_ELEMENTS else rows


def check_chunk_size(chunk_size: object) -> Optional[int]:
    """chunk_size as given: None or an int >= 1 (a ValueError naming it otherwise)."""
    bad = isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    if chunk_size is not None and bad:
        raise ValueError(f"chunk_size: expected None or an int >= 1, got {chunk_size!r}")
    return chunk_size  # type: ignore[return-value]


def as_rows(hidden: torch.Tensor) -> torch.Tensor:
    """hidden (B, T, H) as (B * T, H) rows: a view where the layout allows, else one copy. Masked
    rows are kept as they are (see the module's docstring)."""
    B, T, H = hidden.shape
    return hidden.reshape(B * T, H)


def row_chunks(n_rows: int, chunk_size: int) -> list[tuple[int, int]]:
    """(r0, r1) ranges of at most chunk_size rows covering 0 : n_rows."""
    return [(r0, min(n_rows, r0 + chunk_size)) for r0 in range(0, n_rows, chunk_size)]


def sample_chunks(offsets: list[int], chunk_size: int) -> Optional[list[tuple[int, int, int, int]]]:
    """(s0, s1, r0, r1) chunks of whole samples s0 : s1, rows r0 : r1, at most chunk_size rows
    each, from the samples' row offsets (S + 1 host ints: k * T padded, cu_seqlens packed); None
    when a sample has more than chunk_size rows."""
    sizes = [b - a for a, b in zip(offsets, offsets[1:])]
    if max(sizes, default=0) > chunk_size:
        return None
    out, s0 = [], 0
    for s in range(1, len(sizes) + 1):
        if s == len(sizes) or offsets[s + 1] - offsets[s0] > chunk_size:
            out.append((s0, s, offsets[s0], offsets[s]))
            s0 = s
    return out


def _chunk_logits(
    h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """(c, V) logits of (c, H) hidden states, in their dtype: the same matmul as the model's."""
    return h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())


def _rows_forward(logits, tokens, mask, temperature, backend, stats, r0, r1) -> None:
    """The forward row pass of a chunk's logits (c, V) into rows r0 : r1 of stats = (logp,
    row_max, log_sum, entropy), each (rows,) fp32; tokens and mask (rows,) (mask or None)."""
    views = tuple(x[r0:r1].view(1, r1 - r0) for x in stats)
    m = None if mask is None else mask[r0:r1][None]
    if m is not None and backend != "triton" and m.dtype != torch.bool:
        m = m != 0  # the PyTorch row passes take a bool mask (the Triton kernel reads 0/1)
    args = (logits[None], tokens[r0:r1][None], m, temperature)
    if backend == "triton":
        FORWARD[backend](*args, out=views)
        return
    for view, value in zip(views, FORWARD[backend](*args)):
        view.copy_(value)


def linear_logp_lse(
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    tokens: torch.Tensor,
    mask: Optional[torch.Tensor],
    temperature: float,
    chunks: list[tuple[int, int]],
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward pass. rows (R, H) hidden states (`as_rows`), weight (V, H), bias (V,) or None,
    tokens (R,), mask (R,) or None; chunks: (r0, r1) row ranges covering every row.

    Returns logp, row_max, log_sum, entropy (R,) fp32: log pi_theta(token), the row statistics
    of logits / temperature and the entropy of softmax(logits / temperature)
    (`kernels/logp_lse.py`), 0 at masked rows.
    """
    stats = tuple(
        torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device) for _ in range(4)
    )
    for r0, r1 in chunks:
        logits = _chunk_logits(rows[r0:r1], weight, bias)
        _rows_forward(logits, tokens, mask, temperature, backend, stats, r0, r1)
        del logits
    return stats  # type: ignore[return-value]


def new_grads(
    rows, weight, needs, accumulation: str = "fp32"
) -> tuple[Optional[torch.Tensor], ...]:
    """grad_hidden (rows' shape and dtype, every row written by a chunk), grad_weight (an
    accumulator, zeroed: fp32, or the weight's dtype with accumulation="weight") and grad_bias
    (fp32, zeroed), each None unless flagged in needs = (hidden, weight, bias)."""
    need_h, need_w, need_b = needs
    f32, dev = torch.float32, weight.device
    w_dtype = weight.dtype if accumulation == "weight" else f32
    return (
        torch.empty_like(rows) if need_h else None,
        torch.zeros(weight.shape, dtype=w_dtype, device=dev) if need_w else None,
        torch.zeros(weight.shape[0], dtype=f32, device=dev) if need_b else None,
    )


def live_rows_buffer(rows, needs, mask, most_rows: int) -> Optional[torch.Tensor]:
    """(most_rows, H) in rows' dtype, contiguous: one chunk's hidden states as the weight
    gradient's matmul reads them (`_chunk_grads`); None (the rows themselves) without a mask
    (every row is a completion token: a non-finite one shows in its logits and the value
    check) or when the weight wants no gradient."""
    return rows.new_empty(most_rows, rows.shape[1]) if needs[1] and mask is not None else None


def finish_grads(grads, weight) -> tuple[Optional[torch.Tensor], ...]:
    """The accumulators of `new_grads` in the weight's dtype."""
    grad_hidden, grad_weight, grad_bias = grads
    return (
        grad_hidden,
        None if grad_weight is None else grad_weight.to(weight.dtype),
        None if grad_bias is None else grad_bias.to(weight.dtype),
    )


def _accumulate_grad_weight(acc: torch.Tensor, dlogits: torch.Tensor, h: torch.Tensor) -> None:
    """acc (V, H) += dlogits.T @ h in the matmul: acc fp32 (fp32 accumulation across chunks) or
    in dlogits' dtype (the product summed in fp32, the sum rounded to that dtype)."""
    if dlogits.dtype == torch.float32 or dlogits.is_cuda:
        if dlogits.dtype == acc.dtype:
            acc.addmm_(dlogits.t(), h)
        else:
            # cuBLAS: a half-precision GEMM whose C (and D) is the fp32 accumulator, beta = 1.
            torch.addmm(acc, dlogits.t(), h, out_dtype=torch.float32, out=acc)
        return
    # CPU, half precision: a GEMM there returns its inputs' dtype and sums through an fp32 copy of
    # its whole output, so a block of vocabulary at a time: an fp32 partial product added to the
    # fp32 accumulator, or the block's own GEMM on the half-precision sum.
    h_mm = h.float() if acc.dtype == torch.float32 else h
    for v0 in range(0, acc.shape[0], GRAD_WEIGHT_BLOCK_V):
        block = slice(v0, v0 + GRAD_WEIGHT_BLOCK_V)
        rows = dlogits[:, block].t()
        acc[block].addmm_(rows.float() if acc.dtype == torch.float32 else rows, h_mm)


def _chunk_grads(
    logits, rows, weight, tokens, per_row, temperature, backend, r0, r1, grads, live_rows
):
    """Overwrites a chunk's logits (c, V) with their gradient and accumulates it into grads =
    (grad_hidden, grad_weight, grad_bias), each None when not needed. per_row = (row_max,
    log_sum, coef, entropy, entropy_coef, scales, grad) as the backward row pass takes them
    (`custom_op.backward_stats`), the per-row ones (rows,); live_rows: `live_rows_buffer`'s."""
    stats = tuple(None if x is None else x[r0:r1][None] for x in per_row[:5])
    extra = per_row[5:] if backend == "triton" else ()
    row_max, log_sum, coef, entropy, entropy_coef = stats
    # The chunk's hidden states, 0 at the rows without gradient (written by the Triton row pass).
    h = rows[r0:r1] if live_rows is None else live_rows[: r1 - r0]
    fill = {} if live_rows is None or backend != "triton" else dict(rows=rows[r0:r1], rows_out=h)
    dlogits = BACKWARD[backend](
        logits[None],
        tokens[r0:r1][None],
        row_max,
        log_sum,
        coef,
        temperature,
        logits[None],
        entropy,
        entropy_coef,
        *extra,
        **fill,
    )[0]
    grad_hidden, grad_weight, grad_bias = grads
    if grad_hidden is not None:
        torch.mm(dlogits, weight, out=grad_hidden[r0:r1])
    if grad_weight is not None:
        if live_rows is not None and not fill:
            live = coef[0] != 0
            if entropy_coef is not None:
                live |= entropy_coef[0] != 0
            h.copy_(rows[r0:r1]).masked_fill_(~live[:, None], 0)
        _accumulate_grad_weight(grad_weight, dlogits, h)
    if grad_bias is not None:
        grad_bias += dlogits.sum(dim=0, dtype=torch.float32)


def linear_grads(
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    tokens: torch.Tensor,
    per_row: tuple[Optional[torch.Tensor], ...],
    temperature: float,
    chunks: list[tuple[int, int]],
    backend: str,
    needs: tuple[bool, bool, bool],
    accumulation: str = "fp32",
    mask: Optional[torch.Tensor] = None,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Backward pass (the gradients in the backward order): rows (R, H), tokens (R,), per_row as
    `_chunk_grads` takes it (per-row tensors (R,)); needs = which of (hidden, weight, bias) want a
    grad; accumulation: where grad_weight is summed (`GRAD_WEIGHT_ACCUMULATIONS`); mask: the
    forward's (any shape), or None. Per chunk:
    the logits again, the backward row pass in place, the gradients' matmuls.

    With dlogits[r, v] = coef[r] * (1[v == token[r]] - p[r, v]) - entropy_coef[r] * p[r, v] *
    (log p[r, v] + entropy[r]), p = softmax(logits / temperature) (`kernels/logp_lse.py`):
    grad_hidden = dlogits @ weight (rows' dtype, (R, H)), grad_weight = dlogits.T @ rows and
    grad_bias = sum_r dlogits[r] (grad_bias in fp32, grad_weight as `accumulation` says; both
    returned in the weight's dtype).
    """
    grads = new_grads(rows, weight, needs, accumulation)
    most = max((r1 - r0 for r0, r1 in chunks), default=0)
    live_rows = live_rows_buffer(rows, needs, mask, most)
    if any(needs):
        for r0, r1 in chunks:
            logits = _chunk_logits(rows[r0:r1], weight, bias)
            args = (per_row, temperature, backend, r0, r1, grads, live_rows)
            _chunk_grads(logits, rows, weight, tokens, *args)
            del logits
    return finish_grads(grads, weight)


def linear_loss_and_grads(
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    tokens: torch.Tensor,
    mask: Optional[torch.Tensor],
    chunks: list[tuple[int, int, int, int]],
    coefficients: Callable[[tuple, int, int], tuple],
    temperature: float,
    backend: str,
    needs: tuple[bool, bool, bool],
    accumulation: str = "fp32",
) -> tuple[tuple[torch.Tensor, ...], tuple[Optional[torch.Tensor], ...]]:
    """The forward pass and the gradients in one (the forward order). rows (R, H), tokens and
    mask (R,); chunks: (s0, s1, r0, r1) chunks of whole samples; coefficients(stats, s0, s1)
    computes samples s0 : s1's coefficients from the statistics so far and returns the per-row
    tuple the backward row pass takes (`_chunk_grads`), exact for those samples.

    Returns ((logp, row_max, log_sum, entropy) as `linear_logp_lse`, the gradients as
    `linear_grads`). Exact when a sample's coefficients depend on its own logp and entropy only
    (`ftis_linear_loss.grad_in_forward_blocker`).
    """
    # Zeros on the PyTorch path: its per-sample part reads every sample, filled in or not yet.
    new = torch.empty if backend == "triton" else torch.zeros
    stats = tuple(new(rows.shape[0], dtype=torch.float32, device=rows.device) for _ in range(4))
    grads = new_grads(rows, weight, needs, accumulation)
    live_rows = live_rows_buffer(rows, needs, mask, max((c[3] - c[2] for c in chunks), default=0))
    for s0, s1, r0, r1 in chunks:
        logits = _chunk_logits(rows[r0:r1], weight, bias)
        _rows_forward(logits, tokens, mask, temperature, backend, stats, r0, r1)
        per_row = coefficients(stats, s0, s1)
        args = (per_row, temperature, backend, r0, r1, grads, live_rows)
        _chunk_grads(logits, rows, weight, tokens, *args)
        del logits
    return stats, finish_grads(grads, weight)
