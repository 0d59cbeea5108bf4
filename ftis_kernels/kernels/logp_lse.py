"""Row kernels over the vocabulary: log pi of the taken token (forward) and d loss / d logits
(backward), in Triton, with the chunked PyTorch equivalents used on CPU without the interpreter.

Row statistics are two fp32 numbers per row r = (b, t), kept apart so that no digit is lost:
    row_max_r = max_v x[r, v] / tau,    log_sum_r = log sum_v exp(x[r, v] / tau - row_max_r).
Forward, per row with mask[r] set:  logp_r = (x[r, token_r] / tau - row_max_r) - log_sum_r, as
`torch.log_softmax` computes it: folding the two into one lse = row_max + log_sum first would round
log_sum away at large |x| (|x| = 1e8 in fp32 has a spacing of 8). The same pass also gives the
row's entropy H_r = -sum_v p_v log p_v = log_sum_r - (sum_v e_v (x_v / tau - row_max_r)) / s_r, with
e_v = exp(x_v / tau - row_max_r) and s_r = sum_v e_v: one more running sum, relative to the running
max like the log-sum-exp (with_entropy=False leaves it out, for measuring its cost). Masked rows read
nothing and write 0 to every output.
Backward: with log p_v = (x[r, v] / tau - row_max_r) - log_sum_r and p_v = exp(log p_v),
dx[r, v] = c_r * (1[v == token_r] - p_v) - e_r * p_v * (log p_v + H_r), where c_r and e_r are
d loss / d logp_r and d loss / d H_r over tau (the caller folds 1 / tau and the incoming gradient
into both); rows with c_r = e_r = 0 read nothing.

Non-finite logits at a live row show in its statistics, which the caller checks (`validate.py`):
a NaN or +inf logit makes log_sum NaN (and row_max +inf for +inf), an all -inf row gives
log_sum = -inf, and -inf at the taken token gives logp = -inf. A -inf logit elsewhere is exact
(vocabulary masking). Token ids outside [0, V) are never used as an address: the forward reads no
logit for them (the caller refuses them after the forward).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ftis_kernels.kernels.tl_utils import NEG_BIG, online_lse_entropy_update, online_lse_update

# Largest vocabulary block one program holds in registers at once (the tests lower it to cover
# the multi-block loop with small vocabularies).
MAX_BLOCK_V = 4096
# The lowest finite fp32: the start of a running max (tl_utils.NEG_BIG), so that an all -inf row
# gives log_sum = -inf rather than NaN from -inf - -inf.
FP32_LOWEST = torch.finfo(torch.float32).min
# Elements of float32 scratch the CPU path holds per chunk (16 MiB).
CPU_CHUNK_ELEMENTS = 1 << 22


def _block_v(V: int) -> int:
    return min(triton.next_power_of_2(V), MAX_BLOCK_V)


def _num_warps(block_v: int) -> int:
    return 4 if block_v <= 1024 else (8 if block_v <= 4096 else 16)


@triton.heuristics(
    {
        "HAS_MASK": lambda args: args["mask_ptr"] is not None,
        "WITH_ENTROPY": lambda args: args["entropy_ptr"] is not None,
    }
)
@triton.jit
def _logp_lse_fwd_kernel(
    # pointers
    logits_ptr,  # (B, T, V) fp32 | bf16 | fp16, any strides
    tokens_ptr,  # (B, T) int32 | int64, in [0, V)
    mask_ptr,  # (B, T) bool, or None
    logp_ptr,  # (B * T,) fp32 out
    row_max_ptr,  # (B * T,) fp32 out
    log_sum_ptr,  # (B * T,) fp32 out
    entropy_ptr,  # (B * T,) fp32 out, or None
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
    WITH_ENTROPY: tl.constexpr,
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
    u = 0.0
    for v0 in range(0, v_end, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs.to(tl.int64) * stride_lv, mask=offs < V, other=-float("inf"))
        if WITH_ENTROPY:
            m, s, u = online_lse_entropy_update(m, s, u, x.to(tl.float32) / temperature)
        else:
            m, s = online_lse_update(m, s, x.to(tl.float32) / temperature)
    token = tl.load(tokens_ptr + b * stride_tb + t * stride_tt).to(tl.int64)
    # A bad token id is refused by the caller after the forward: until then it reads nothing.
    token_ok = (token >= 0) & (token < V)
    x_token = tl.load(row_ptr + token * stride_lv, mask=active & token_ok, other=0.0)
    s_safe = tl.where(active, s, 1.0)
    log_sum = tl.where(active, tl.log(s_safe), 0.0)
    logp = tl.where(active, (x_token.to(tl.float32) / temperature - m) - log_sum, 0.0)
    tl.store(logp_ptr + row, logp)
    tl.store(row_max_ptr + row, tl.where(active, m, 0.0))
    tl.store(log_sum_ptr + row, log_sum)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, tl.where(active, log_sum - u / s_safe, 0.0))


def logp_lse_fwd(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: Optional[torch.Tensor],
    temperature: float,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Triton forward. logits (B, T, V), tokens (B, T), mask (B, T) bool or None.

    Returns logp, row_max, log_sum, entropy (B, T), all fp32, 0 at masked positions; entropy is
    None with with_entropy=False.
    """
    B, T, V = logits.shape
    logp, row_max, log_sum = (
        torch.empty(B, T, dtype=torch.float32, device=logits.device) for _ in range(3)
    )
    entropy = torch.empty_like(logp) if with_entropy else None
    block_v = _block_v(V)
    mask_strides = mask.stride() if mask is not None else (0, 0)
    _logp_lse_fwd_kernel[(B * T,)](
        logits,
        tokens,
        mask,
        logp,
        row_max,
        log_sum,
        entropy,
        float(temperature),
        T,
        V,
        *logits.stride(),
        *tokens.stride(),
        *mask_strides,
        BLOCK_V=block_v,
        num_warps=_num_warps(block_v),
    )
    return logp, row_max, log_sum, entropy


@triton.heuristics({"HAS_ENTROPY_GRAD": lambda args: args["entropy_coef_ptr"] is not None})
@triton.jit
def _logits_bwd_kernel(
    # pointers
    logits_ptr,  # (B, T, V) fp32 | bf16 | fp16, any strides
    dlogits_ptr,  # (B, T, V) out, same dtype; may be logits_ptr itself (in-place backward)
    tokens_ptr,  # (B, T) int32 | int64
    row_max_ptr,  # (B * T,) fp32, from the forward
    log_sum_ptr,  # (B * T,) fp32, from the forward
    coef_ptr,  # (B * T,) fp32: d loss / d logp, times the incoming gradient, over temperature
    entropy_ptr,  # (B * T,) fp32, from the forward, or None
    entropy_coef_ptr,  # (B * T,) fp32: d loss / d entropy, scaled as coef, or None
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
    HAS_ENTROPY_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    t = row % T
    coef = tl.load(coef_ptr + row)
    live = coef != 0.0
    ecoef = 0.0
    entropy = 0.0
    if HAS_ENTROPY_GRAD:
        ecoef = tl.load(entropy_coef_ptr + row)
        entropy = tl.load(entropy_ptr + row)
        live = live | (ecoef != 0.0)
    row_max = tl.load(row_max_ptr + row)
    log_sum = tl.load(log_sum_ptr + row)
    token = tl.load(tokens_ptr + b * stride_tb + t * stride_tt).to(tl.int64)
    row_ptr = logits_ptr + b * stride_lb.to(tl.int64) + t * stride_lt.to(tl.int64)
    drow_ptr = dlogits_ptr + b * stride_db.to(tl.int64) + t * stride_dt.to(tl.int64)
    # Rows without gradient (masked, filtered, zero advantage) read nothing and write zeros.
    v_read = tl.where(live, V, 0)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        in_row = offs < V
        x = tl.load(row_ptr + offs.to(tl.int64) * stride_lv, mask=offs < v_read, other=-float("inf"))
        log_p = (x.to(tl.float32) / temperature - row_max) - log_sum
        p = tl.exp(log_p)
        grad = coef * (tl.where(offs == token, 1.0, 0.0) - p)
        if HAS_ENTROPY_GRAD:
            # dH/dlogit_v = -p_v (log p_v + H); p_v = 0 adds 0 (not 0 * -inf).
            grad -= ecoef * tl.where(p > 0, p * (log_p + entropy), 0.0)
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
    entropy: Optional[torch.Tensor] = None,
    entropy_coef: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Triton backward. logits, out (B, T, V) (out may be logits); tokens (B, T); row_max, log_sum,
    coef (B, T) fp32 contiguous, coef already scaled by the incoming gradient and 1 / temperature;
    entropy, entropy_coef (B, T) fp32 contiguous (d loss / d H, scaled as coef) or both None.
    Returns out.
    """
    B, T, V = logits.shape
    block_v = _block_v(V)
    _logits_bwd_kernel[(B * T,)](
        logits,
        out,
        tokens,
        row_max,
        log_sum,
        coef,
        entropy if entropy_coef is not None else None,
        entropy_coef,
        float(temperature),
        T,
        V,
        *logits.stride(),
        *out.stride(),
        *tokens.stride(),
        BLOCK_V=block_v,
        num_warps=_num_warps(block_v),
    )
    return out


def triton_is_interpreted() -> bool:
    """True when Triton decorated these kernels for its CPU interpreter (TRITON_INTERPRET=1)."""
    kernel = _logits_bwd_kernel
    while not isinstance(kernel, InterpretedFunction) and hasattr(kernel, "fn"):
        kernel = kernel.fn  # through triton.heuristics to the jitted function
    return isinstance(kernel, InterpretedFunction)


# --- CPU path: the same two passes in PyTorch, a chunk of rows at a time ------------------------


def _row_chunks(B: int, T: int, V: int):
    """(b, t0, t1) chunks of at most CPU_CHUNK_ELEMENTS logits each, within one sample, so that a
    strided (B, T, V) view is sliced, never copied whole."""
    rows = max(1, CPU_CHUNK_ELEMENTS // V)
    for b in range(B):
        for t0 in range(0, T, rows):
            yield b, t0, min(T, t0 + rows)


def logp_lse_fwd_torch(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: Optional[torch.Tensor],
    temperature: float,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """PyTorch forward with the signature and results of `logp_lse_fwd` (the same row statistics,
    the same non-finite semantics); fp32 scratch is bounded by one chunk (two with the entropy)."""
    B, T, V = logits.shape
    logp, row_max, log_sum = (
        torch.zeros(B, T, dtype=torch.float32, device=logits.device) for _ in range(3)
    )
    entropy = torch.zeros_like(logp) if with_entropy else None
    for b, t0, t1 in _row_chunks(B, T, V):
        active = None if mask is None else mask[b, t0:t1]
        if active is not None and not bool(active.any()):
            continue
        x = logits[b, t0:t1].float() / temperature
        # The Triton kernels' start value: an all -inf row gets a finite max and log_sum = -inf
        # (not NaN from -inf - -inf); NaN stays NaN.
        chunk_max = x.amax(dim=-1).clamp(min=FP32_LOWEST)
        shifted = x - chunk_max[:, None]
        # A bad token id is refused by the caller after the forward: until then, read a valid one.
        token = tokens[b, t0:t1].long().clamp(0, V - 1)[:, None]
        shifted_token = shifted.gather(-1, token)[:, 0]
        chunk = [chunk_max]
        if with_entropy:
            e = shifted.exp()
            s = e.sum(dim=-1)
            # H = log s - sum e * shifted / s; a -inf logit adds 0 (not 0 * -inf = nan).
            u = e.mul_(shifted.clamp_(min=FP32_LOWEST)).sum(dim=-1)
            chunk_log_sum = s.log()
            chunk_entropy = chunk_log_sum - u / s
        else:
            chunk_log_sum = shifted.exp_().sum(dim=-1).log_()
        chunk += [chunk_log_sum, shifted_token - chunk_log_sum]
        if with_entropy:
            chunk.append(chunk_entropy)
        if active is not None:
            chunk = [torch.where(active, v, 0.0) for v in chunk]
        row_max[b, t0:t1], log_sum[b, t0:t1], logp[b, t0:t1] = chunk[:3]
        if with_entropy:
            entropy[b, t0:t1] = chunk[3]
    return logp, row_max, log_sum, entropy


def logits_bwd_torch(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    coef: torch.Tensor,
    temperature: float,
    out: torch.Tensor,
    entropy: Optional[torch.Tensor] = None,
    entropy_coef: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """PyTorch backward with the signature and results of `logits_bwd`."""
    B, T, V = logits.shape
    for b, t0, t1 in _row_chunks(B, T, V):
        c = coef[b, t0:t1]
        ec = None if entropy_coef is None else entropy_coef[b, t0:t1]
        live = c != 0 if ec is None else (c != 0) | (ec != 0)
        if not bool(live.any()):
            out[b, t0:t1] = 0
            continue
        x = logits[b, t0:t1].float() / temperature
        log_p = (x - row_max[b, t0:t1, None]).sub_(log_sum[b, t0:t1, None])
        entropy_term = None
        if ec is not None and bool((ec != 0).any()):
            # e * p_v (log p_v + H), with dH/dlogit_v = -p_v (log p_v + H). log p_v is clamped
            # where p_v underflows to 0 anyway, so that 0 * -inf stays 0.
            grad = log_p.exp()
            h = entropy[b, t0:t1, None]
            entropy_term = log_p.clamp_(min=-1e4).add_(h).mul_(grad).mul_(ec[:, None])
        else:
            grad = log_p.exp_()
        # c (onehot - p) in the Triton kernel's order, so that both paths agree at the extremes. A
        # token outside [0, V) is another vocabulary shard's (sharded.py): no onehot here.
        token = tokens[b, t0:t1].long()
        owned = ((token >= 0) & (token < V)).to(grad.dtype)[:, None]
        grad.neg_().scatter_add_(-1, token.clamp(0, V - 1)[:, None], owned)
        grad.mul_(c[:, None])
        if entropy_term is not None:
            grad.sub_(entropy_term)
        # Rows without gradient may hold non-finite logits: 0 * nan must stay 0.
        grad = torch.where(live[:, None], grad, 0.0)
        out[b, t0:t1] = grad.to(out.dtype)
    return out
