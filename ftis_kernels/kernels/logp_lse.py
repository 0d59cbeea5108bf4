"""Row kernels over the vocabulary: log pi of the taken token (forward) and d loss / d logits
(backward), in Triton, with the chunked PyTorch equivalents used on CPU without the interpreter.

Forward, per row r = (b, t) with mask[r] set: row_max_r = max_v x[r, v] / tau,
log_sum_r = log sum_v exp(x[r, v] / tau - row_max_r), logp_r = (x[r, token_r] / tau - row_max_r)
- log_sum_r (two statistics rather than their sum, the log-sum-exp, which would round away the
low bits of x / tau - row_max at large logits); masked rows read nothing and write 0.
Backward: dx[r, v] = c_r * (1[v == token_r] - exp((x[r, v] / tau - row_max_r) - log_sum_r)) with
c_r = coef_r / tau (the caller folds 1 / tau and the incoming gradient into c); rows with c_r = 0
read nothing.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ftis_kernels.kernels.tl_utils import NEG_BIG, online_lse_update

# Largest vocabulary block one program holds in registers at once (the tests lower it to cover
# the multi-block loop with small vocabularies).
MAX_BLOCK_V = 4096
# Logits per chunk of the CPU path, and the size of its one fp32 scratch buffer (16 MiB): small
# enough that a chunk mostly stays in cache between its passes, large enough that the parallel
# loops (~5 per chunk and direction) stay few: on a loaded machine each one waits for both
# threads to be scheduled (measured: bench/README.md, CPU path).
CPU_CHUNK_ELEMENTS = 1 << 22


def _block_v(V: int) -> int:
    return min(triton.next_power_of_2(V), MAX_BLOCK_V)


def _num_warps(block_v: int) -> int:
    return 4 if block_v <= 1024 else (8 if block_v <= 4096 else 16)


@triton.heuristics({"HAS_MASK": lambda args: args["mask_ptr"] is not None})
@triton.jit
def _logp_lse_fwd_kernel(
    # pointers
    logits_ptr,  # (B, T, V) fp32 | bf16 | fp16, any strides
    tokens_ptr,  # (B, T) int32 | int64, in [0, V)
    mask_ptr,  # (B, T) bool, or None
    logp_ptr,  # (B * T,) fp32 out
    row_max_ptr,  # (B * T,) fp32 out
    log_sum_ptr,  # (B * T,) fp32 out
    # scalars
    temperature,
    # sizes
    T,
    V,
    # strides
    stride_lb,
    stride_lt,
    stride_lv,
    stride_tb,
    stride_tt,
    stride_mb,
    stride_mt,
    # meta-parameters
    HAS_MASK: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    t = row % T
    active = True
    if HAS_MASK:
        active = tl.load(mask_ptr + b * stride_mb + t * stride_mt) != 0
    row_ptr = logits_ptr + b * stride_lb.to(tl.int64) + t * stride_lt.to(tl.int64)
    # A masked row runs no iteration: its logits may be anything, even nan, and are never read.
    v_end = tl.where(active, V, 0)
    m = NEG_BIG
    s = 0.0
    for v0 in range(0, v_end, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs.to(tl.int64) * stride_lv, mask=offs < V, other=-float("inf"))
        m, s = online_lse_update(m, s, x.to(tl.float32) / temperature)
    token = tl.load(tokens_ptr + b * stride_tb + t * stride_tt).to(tl.int64)
    x_token = tl.load(row_ptr + token * stride_lv, mask=active, other=0.0).to(tl.float32)
    log_sum = tl.where(active, tl.log(tl.where(active, s, 1.0)), 0.0)
    row_max = tl.where(active, m, 0.0)
    logp = tl.where(active, (x_token / temperature - row_max) - log_sum, 0.0)
    tl.store(logp_ptr + row, logp)
    tl.store(row_max_ptr + row, row_max)
    tl.store(log_sum_ptr + row, log_sum)


def logp_lse_fwd(
    logits: torch.Tensor, tokens: torch.Tensor, mask: Optional[torch.Tensor], temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton forward. logits (B, T, V), tokens (B, T), mask (B, T) bool or None.

    Returns logp, row_max, log_sum (B, T), all fp32; 0 at masked positions.
    """
    B, T, V = logits.shape
    logp = torch.empty(B, T, dtype=torch.float32, device=logits.device)
    row_max = torch.empty(B, T, dtype=torch.float32, device=logits.device)
    log_sum = torch.empty(B, T, dtype=torch.float32, device=logits.device)
    block_v = _block_v(V)
    mask_strides = mask.stride() if mask is not None else (0, 0)
    _logp_lse_fwd_kernel[(B * T,)](
        logits, tokens, mask, logp, row_max, log_sum,
        float(temperature),
        T, V,
        *logits.stride(), *tokens.stride(), *mask_strides,
        BLOCK_V=block_v, num_warps=_num_warps(block_v),
    )  # fmt: skip
    return logp, row_max, log_sum


@triton.jit
def _logits_bwd_kernel(
    # pointers
    logits_ptr,  # (B, T, V) fp32 | bf16 | fp16, any strides
    dlogits_ptr,  # (B, T, V) out, same dtype; may be logits_ptr itself (in-place backward)
    tokens_ptr,  # (B, T) int32 | int64
    row_max_ptr,  # (B * T,) fp32, from the forward
    log_sum_ptr,  # (B * T,) fp32, from the forward
    coef_ptr,  # (B * T,) fp32: d loss / d logp, times the incoming gradient, over temperature
    # scalars
    temperature,
    # sizes
    T,
    V,
    # strides
    stride_lb,
    stride_lt,
    stride_lv,
    stride_db,
    stride_dt,
    stride_dv,
    stride_tb,
    stride_tt,
    # meta-parameters
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    t = row % T
    coef = tl.load(coef_ptr + row)
    row_max = tl.load(row_max_ptr + row)
    log_sum = tl.load(log_sum_ptr + row)
    token = tl.load(tokens_ptr + b * stride_tb + t * stride_tt).to(tl.int64)
    row_ptr = logits_ptr + b * stride_lb.to(tl.int64) + t * stride_lt.to(tl.int64)
    drow_ptr = dlogits_ptr + b * stride_db.to(tl.int64) + t * stride_dt.to(tl.int64)
    # Rows without gradient (masked, filtered, zero advantage) read nothing and write zeros.
    v_read = tl.where(coef != 0.0, V, 0)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        in_row = offs < V
        x = tl.load(row_ptr + offs.to(tl.int64) * stride_lv, mask=offs < v_read, other=-float("inf"))
        p = tl.exp((x.to(tl.float32) / temperature - row_max) - log_sum)
        grad = coef * (tl.where(offs == token, 1.0, 0.0) - p)
        tl.store(
            drow_ptr + offs.to(tl.int64) * stride_dv,
            grad.to(dlogits_ptr.dtype.element_ty),
            mask=in_row,
        )


def logits_bwd(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    coef: torch.Tensor,
    temperature: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Triton backward. logits, out (B, T, V) (out may be logits); tokens (B, T); row_max, log_sum,
    coef (B, T) fp32 contiguous, coef already scaled by the incoming gradient and 1 / temperature.
    Returns out.
    """
    B, T, V = logits.shape
    block_v = _block_v(V)
    _logits_bwd_kernel[(B * T,)](
        logits, out, tokens, row_max, log_sum, coef,
        float(temperature),
        T, V,
        *logits.stride(), *out.stride(), *tokens.stride(),
        BLOCK_V=block_v, num_warps=_num_warps(block_v),
    )  # fmt: skip
    return out


def triton_is_interpreted() -> bool:
    """True when Triton decorated these kernels for its CPU interpreter (TRITON_INTERPRET=1)."""
    return isinstance(_logits_bwd_kernel, InterpretedFunction)


# --- CPU path: the same two passes in PyTorch, a chunk of rows at a time ------------------------
#
# Every pass over a chunk writes into memory allocated once per call (one fp32 scratch chunk, or
# the output itself), and the chunk is small enough to stay in cache between its passes, so the
# logits are read from memory about once per direction. The exponential is torch's exp2 of
# (x / tau - row_max) * log2(e): on CPU, exp2 runs several times faster than exp.
# Forward per chunk: [bf16/fp16: up-cast into the scratch], max, shift into the scratch, scale,
# exp2, sum. Backward: [up-cast], shift into the scratch, scale, exp2, one multiply by -coef / sum
# that writes the output, and the taken tokens' entries.

LOG2E = 1.4426950408889634


def _row_chunks(B: int, T: int, V: int):
    """(b, t0, t1) chunks of at most CPU_CHUNK_ELEMENTS logits each, within one sample, so that a
    strided (B, T, V) view is sliced, never copied whole."""
    rows = max(1, CPU_CHUNK_ELEMENTS // V)
    for b in range(B):
        for t0 in range(0, T, rows):
            yield b, t0, min(T, t0 + rows)


def _scratch(B: int, T: int, V: int, device) -> torch.Tensor:
    """The one fp32 (rows, V) buffer a call's chunks share."""
    rows = min(T, max(1, CPU_CHUNK_ELEMENTS // V))
    return torch.empty(rows, V, dtype=torch.float32, device=device)


def _exp2_shifted(
    x: torch.Tensor, neg_row_max: torch.Tensor, temperature: float, out: torch.Tensor
) -> torch.Tensor:
    """out = exp(x / tau - row_max), as exp2((x / tau - row_max) * log2 e); x may be out itself."""
    return torch.add(neg_row_max, x, alpha=1.0 / temperature, out=out).mul_(LOG2E).exp2_()


def logp_lse_fwd_torch(
    logits: torch.Tensor, tokens: torch.Tensor, mask: Optional[torch.Tensor], temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch forward with the results of `logp_lse_fwd`, a chunk of rows at a time.
    logits (B, T, V) fp32 | bf16 | fp16, any strides; tokens (B, T); mask (B, T) bool or None.

    Returns logp, row_max, log_sum (B, T) fp32, 0 at masked rows: row_max = max_v x / tau,
    log_sum = log sum_v exp(x / tau - row_max), logp = (x_token / tau - row_max) - log_sum.
    """
    B, T, V = logits.shape
    f32 = torch.float32
    logp = torch.zeros(B, T, dtype=f32, device=logits.device)
    row_max = torch.zeros(B, T, dtype=f32, device=logits.device)
    log_sum = torch.zeros(B, T, dtype=f32, device=logits.device)
    if mask is not None and bool(mask.all()):
        mask = None
    scratch = _scratch(B, T, V, logits.device)
    for b, t0, t1 in _row_chunks(B, T, V):
        live = None if mask is None else mask[b, t0:t1]
        if live is not None:
            if not bool(live.any()):
                continue
            if bool(live.all()):
                live = None
        x = logits[b, t0:t1]
        s = scratch[: t1 - t0]
        if x.dtype != f32:
            # One up-cast into the scratch, then fp32 passes in place (mixed-dtype ops are slow).
            x = s.copy_(x)
        x_token = x.gather(-1, tokens[b, t0:t1, None].long())
        # max_v(x / tau) = max_v(x) / tau exactly: rounded division is monotonic.
        m = x.amax(dim=-1, keepdim=True)
        if temperature != 1.0:
            m.div_(temperature)
        neg_m = m.neg_()
        total = _exp2_shifted(x, neg_m, temperature, s).sum(dim=-1, keepdim=True)
        shifted_token = torch.add(neg_m, x_token, alpha=1.0 / temperature)
        chunk = torch.cat([neg_m.neg(), total.log_(), shifted_token], dim=1)
        chunk[:, 2].sub_(chunk[:, 1])
        if live is not None:
            # The chunk's masked rows were read with the rest (may hold anything): written as 0.
            chunk.masked_fill_(~live[:, None], 0.0)
        row_max[b, t0:t1] = chunk[:, 0]
        log_sum[b, t0:t1] = chunk[:, 1]
        logp[b, t0:t1] = chunk[:, 2]
    return logp, row_max, log_sum


def logits_bwd_torch(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    coef: torch.Tensor,
    temperature: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """PyTorch backward with the results of `logits_bwd`. logits, out (B, T, V), out may be the
    logits themselves; tokens (B, T); row_max, log_sum, coef (B, T) fp32 from the forward, coef
    already scaled by the incoming gradient and 1 / temperature. Returns out.

    out[r, v] = -coef_r * exp(x[r, v] / tau - row_max_r) * exp(-log_sum_r) (one multiply writes
    it), and at the taken token -coef_r * expm1(logp_r) = coef_r * (1 - p_r) without the
    cancellation of 1 - p near p = 1. Rows with coef = 0 are written as 0, whatever they hold.
    """
    B, T, V = logits.shape
    f32 = torch.float32
    scratch = _scratch(B, T, V, out.device)
    for b, t0, t1 in _row_chunks(B, T, V):
        c = coef[b, t0:t1, None]
        o = out[b, t0:t1]
        dead = c == 0
        if bool(dead.all()):
            o.zero_()
            continue
        x = logits[b, t0:t1]
        tok = tokens[b, t0:t1, None].long()
        neg_m = row_max[b, t0:t1, None].neg()
        ls = log_sum[b, t0:t1, None]
        # Gathered before o is written: o may be the logits.
        logp = torch.add(neg_m, x.gather(-1, tok).float(), alpha=1.0 / temperature).sub_(ls)
        s = scratch[: t1 - t0]
        # exp2 always runs on the contiguous scratch: its vectorised and scalar (tail) results
        # differ in the last bit, and where the tail falls must not depend on the layout of out.
        e = _exp2_shifted(s.copy_(x) if x.dtype != f32 else x, neg_m, temperature, s)
        k = ls.neg().exp_().mul_(c).neg_()
        if o.dtype == f32:
            torch.mul(e, k, out=o)
        else:
            o.copy_(e.mul_(k))
        o.scatter_(-1, tok, logp.expm1_().mul_(c).neg_().to(o.dtype))
        if bool(dead.any()):
            # Rows without gradient may hold non-finite logits: 0 * nan must stay 0.
            o.masked_fill_(dead, 0.0)
    return out
