"""Row kernels over the vocabulary in Triton: log pi of the taken token (forward) and d loss /
d logits (backward). `logp_lse_cpu.py` computes the same on CPU without the interpreter.

Row statistics are two fp32 numbers per row r = (b, t), kept apart so that no digit is lost:
    row_max_r = max_v x[r, v] / tau,    log_sum_r = log sum_v exp(x[r, v] / tau - row_max_r)
(the Triton kernels form x * (1 / tau), within an ulp of x / tau: a division per logit costs three
instructions on a GPU).
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
into both); rows with c_r = e_r = 0 read nothing. Given the rows' hidden states (the lm-head
ops), the backward also copies each row's into a buffer for the weight gradient's matmul, zeros
for a row without gradient: whatever a masked row holds (NaN at padding) then reaches no
gradient, without a masked copy of every hidden state.

Non-finite logits at a live row show in its statistics, which the caller checks (`validate.py`):
a NaN or +inf logit makes log_sum NaN (and row_max +inf for +inf), an all -inf row gives
log_sum = -inf, and -inf at the taken token gives logp = -inf. A -inf logit elsewhere is exact
(vocabulary masking). Token ids outside [0, V) are never used as an address: the forward reads no
logit for them (the caller refuses them after the forward).
"""  # noqa: E501

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ftis_kernels.kernels.tl_utils import NEG_BIG, launch

# Largest vocabulary block one program holds in registers at once (the tests lower it to cover
# the multi-block loop with small vocabularies).
MAX_BLOCK_V = 4096


# Logits per thread per block in the forward (`_logp_lse_fwd_kernel`'s VEC).
FWD_VEC = 8


def fwd_meta(block_v: int) -> dict:
    """The forward kernel's meta-parameters for a vocabulary block: BLOCK_V, VEC, LANES and
    num_warps."""
    vec = min(FWD_VEC, block_v)
    return dict(BLOCK_V=block_v, VEC=vec, LANES=block_v // vec, num_warps=_num_warps(block_v))


def bwd_meta(block_v: int) -> dict:
    """The backward kernel's meta-parameters: BLOCK_V and num_warps (16 warps for a full block:
    1-5% faster than 8 at 1k and 16k tokens x 151,936 in bf16 and fp32 on an H200,
    bench/tune_rows.py, 2026-12-04)."""
    return dict(BLOCK_V=block_v, num_warps=16 if block_v >= MAX_BLOCK_V else _num_warps(block_v))


def _block_v(V: int) -> int:
    return min(1 << (V - 1).bit_length(), MAX_BLOCK_V)  # the next power of 2, at most the cap


def tail_apart(args: dict) -> bool:
    """Whether a row kernel's loops take the last partial block apart (its launch arguments):
    when V is not a multiple of 16 but the rows are 16-byte aligned and contiguous (a vocabulary
    sliced to the tokenizer's size, `logits[..., :n]`). The mask `offs < V` is then not uniform
    over 16 bytes, and Triton would load every block logit by logit: 13.9 bf16 forward
    instructions a logit instead of 11.5 (`bench/hopper_asm.py`). Rows that are not aligned load
    logit by logit anyway, and the split only costs them registers. Triton already compiles
    these classes of V and strides apart, so this costs no binary."""
    return (
        args["V"] % 16 != 0
        and args["stride_lv"] == 1
        and args["stride_lt"] % 16 == 0
        and args["stride_lb"] % 16 == 0
    )


def _num_warps(block_v: int) -> int:
    return 4 if block_v <= 1024 else (8 if block_v <= 4096 else 16)


@triton.jit
def _lanes_update(x, m, s, u, k, WITH_ENTROPY: tl.constexpr):
    """One block of logits x (LANES, VEC) fp32 into each lane's running (m, s, u) (`row_stats`)."""
    m_new = tl.maximum(m, tl.max(x, axis=1))
    # A lane with nothing summed yet has no past to rescale (its max may be the sentinel, whose
    # product by k would overflow).
    shift = tl.where(s > 0, (m - m_new) * k, 0.0)
    alpha = tl.exp2(shift)
    # (x - m) k, not x k - m k: the difference is exact near the max (Sterbenz), where the digits
    # matter, so that |logits| = 1e8 keep the digits of log_softmax. A lane that has seen only
    # -inf keeps the finite sentinel: -inf - NEG_BIG = -inf, 2^-inf = 0.
    d = (x - m_new[:, None]) * k
    e = tl.exp2(d)
    if WITH_ENTROPY:
        # max(d, -200): exact wherever e > 0 (2^-150 underflows), and e * d = 0, not 0 * -inf,
        # at a -inf logit.
        u = alpha * (u + shift * s) + tl.sum(e * tl.maximum(d, -200.0), axis=1)
    s = s * alpha + tl.sum(e, axis=1)
    return m_new, s, u


@triton.jit
def row_stats(
    row_ptr, v_end, V, stride_lv, inv_t,
    WITH_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr, VEC: tl.constexpr, LANES: tl.constexpr,
    TAIL_APART: tl.constexpr,
):  # fmt: skip
    """One streaming pass over logits row_ptr[0 : v_end] (v_end = V for a live row, 0 for a masked
    one): (m, s, u) with m = max_v x_v / tau (rounded as x * inv_t rounds the max element),
    s = sum_v 2^((x_v - max) k) and u = sum_v 2^((x_v - max) k) (x_v - max) k (base-2 units, the
    entropy's sum; 0 without WITH_ENTROPY), k = inv_t / ln 2. TAIL_APART (`tail_apart`): the
    whole blocks first, under a mask Triton can see is uniform over each, then the last partial
    block; the same blocks in the same order, so the same results."""
    # The exponentials in base 2: e^(x / tau - m / tau) = 2^((x - m) k), one MUFU.EX2 a logit.
    # The block is (LANES, VEC), VEC contiguous logits in one thread: each lane keeps its own
    # running max, sum and entropy sum, rescaled once per VEC logits, and the lanes are combined
    # once after the loop; a block costs no cross-thread reduction (bench/hopper_asm.py: no
    # barrier in the loop).
    k = inv_t * 1.4426950408889634
    lane = tl.arange(0, LANES)
    offs_in = lane[:, None] * VEC + tl.arange(0, VEC)[None, :]
    m = tl.full([LANES], NEG_BIG, dtype=tl.float32)  # each lane's running max of the raw logits
    s = tl.zeros([LANES], dtype=tl.float32)  # sum of 2^(x k - m k)
    u = tl.zeros([LANES], dtype=tl.float32)  # sum of 2^(x k - m k) (x k - m k): base-2 units
    if TAIL_APART:
        v_full = (v_end // BLOCK_V) * BLOCK_V
        for v0 in range(0, v_full, BLOCK_V):
            offs = v0 + offs_in
            x = tl.load(
                row_ptr + offs.to(tl.int64) * stride_lv, mask=offs < v_full, other=-float("inf")
            )
            m, s, u = _lanes_update(x.to(tl.float32), m, s, u, k, WITH_ENTROPY)
        if v_full < v_end:
            offs = v_full + offs_in
            x = tl.load(row_ptr + offs.to(tl.int64) * stride_lv, mask=offs < V, other=-float("inf"))
            m, s, u = _lanes_update(x.to(tl.float32), m, s, u, k, WITH_ENTROPY)
    else:
        for v0 in range(0, v_end, BLOCK_V):
            offs = v0 + offs_in
            x = tl.load(row_ptr + offs.to(tl.int64) * stride_lv, mask=offs < V, other=-float("inf"))
            m, s, u = _lanes_update(x.to(tl.float32), m, s, u, k, WITH_ENTROPY)
    m_row = tl.max(m, axis=0)
    shift = tl.where(s > 0, (m - m_row) * k, 0.0)
    alpha = tl.exp2(shift)
    u = tl.sum(alpha * (u + shift * s), axis=0)
    s = tl.sum(s * alpha, axis=0)
    m = m_row * inv_t
    return m, s, u


@triton.jit
def row_pass(
    row_ptr, token, active, V, stride_lv, temperature,
    WITH_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr, VEC: tl.constexpr, LANES: tl.constexpr,
    TAIL_APART: tl.constexpr,
):  # fmt: skip
    """The forward pass over one row (`row_stats`) and what it gives: (logp, row_max, log_sum,
    entropy, x_token), fp32 but x_token (the taken token's logit as stored), each 0 for a row
    that is not active (masked: nothing is read). A token id outside [0, V) reads nothing."""
    # x * (1 / tau), not x / tau: compiled Triton divides by a runtime scalar with a reciprocal and
    # two range fix-ups per element (bench/hopper_asm.py counted 3 instructions a logit).
    inv_t = tl.math.div_rn(1.0, temperature)
    # A masked row runs no iteration: its logits may be anything, even nan, and are never read.
    v_end = tl.where(active, V, 0)
    m, s, u = row_stats(
        row_ptr, v_end, V, stride_lv, inv_t, WITH_ENTROPY, BLOCK_V, VEC, LANES, TAIL_APART
    )
    # A bad token id is refused by the caller after the forward: until then it reads nothing.
    token_ok = (token >= 0) & (token < V)
    x_token = tl.load(row_ptr + token * stride_lv, mask=active & token_ok, other=0.0)
    s_safe = tl.where(active, s, 1.0)
    log_sum = tl.where(active, tl.log(s_safe), 0.0)
    logp = tl.where(active, (x_token.to(tl.float32) / temperature - m) - log_sum, 0.0)
    # H = log s - (sum_v e_v (x_v / tau - m)) / s, the sum in base-2 units times ln 2.
    entropy = tl.where(active, log_sum - 0.6931471805599453 * u / s_safe, 0.0)
    return logp, tl.where(active, m, 0.0), log_sum, entropy, x_token


@triton.heuristics(
    {
        "HAS_MASK": lambda args: args["mask_ptr"] is not None,
        "WITH_ENTROPY": lambda args: args["entropy_ptr"] is not None,
        "TAIL_APART": tail_apart,
    }
)
@triton.jit(do_not_specialize=["T"])
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
    VEC: tl.constexpr,  # logits a thread holds contiguously (16 bytes of bf16)
    LANES: tl.constexpr,  # BLOCK_V // VEC
    TAIL_APART: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    t = row % T
    active = t >= 0  # every row, as a tensor
    if HAS_MASK:
        active = tl.load(mask_ptr + b * stride_mb + t * stride_mt) != 0
    # b and t are int64 (from the program id), so the row offsets are: no stride is cast, since
    # Triton turns a stride equal to 1 into a compile-time constant, which has no .to().
    row_ptr = logits_ptr + b * stride_lb + t * stride_lt
    token = tl.load(tokens_ptr + b * stride_tb + t * stride_tt).to(tl.int64)
    logp, row_max, log_sum, entropy, x_token = row_pass(
        row_ptr, token, active, V, stride_lv, temperature, WITH_ENTROPY, BLOCK_V, VEC, LANES,
        TAIL_APART,
    )  # fmt: skip
    tl.store(logp_ptr + row, logp)
    tl.store(row_max_ptr + row, row_max)
    tl.store(log_sum_ptr + row, log_sum)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, entropy)


def logp_lse_fwd(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: Optional[torch.Tensor],
    temperature: float,
    with_entropy: bool = True,
    out: Optional[tuple[torch.Tensor, ...]] = None,
    *,
    meta: Optional[dict] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Triton forward, one launch. logits (B, T, V), tokens (B, T), mask (B, T) bool or 0/1, or
    None; out: the four results' buffers (B * T contiguous fp32 each), or None to allocate them;
    meta: the kernel's meta-parameters in place of `fwd_meta`'s (BLOCK_V, VEC, LANES, num_warps,
    and optionally num_stages: `bench/tune_rows.py` times alternatives).

    Returns logp, row_max, log_sum, entropy (B, T), all fp32, 0 at masked positions; entropy is
    None with with_entropy=False.
    """
    B, T, V = logits.shape
    if out is None:
        logp, row_max, log_sum = (
            torch.empty(B, T, dtype=torch.float32, device=logits.device) for _ in range(3)
        )
        entropy = torch.empty_like(logp) if with_entropy else None
    else:
        logp, row_max, log_sum, entropy = out
    block_v = _block_v(V)
    stride_lb, stride_lt, stride_lv = logits.stride()
    stride_tb, stride_tt = tokens.stride()
    stride_mb, stride_mt = mask.stride() if mask is not None else (0, 0)
    launch(
        _logp_lse_fwd_kernel,
        (B * T,),
        logits_ptr=logits,
        tokens_ptr=tokens,
        mask_ptr=mask,
        logp_ptr=logp,
        row_max_ptr=row_max,
        log_sum_ptr=log_sum,
        entropy_ptr=entropy,
        temperature=float(temperature),
        T=T,
        V=V,
        stride_lb=stride_lb,
        stride_lt=stride_lt,
        stride_lv=stride_lv,
        stride_tb=stride_tb,
        stride_tt=stride_tt,
        stride_mb=stride_mb,
        stride_mt=stride_mt,
        **(meta if meta is not None else fwd_meta(block_v)),
    )
    return logp, row_max, log_sum, entropy


@triton.jit
def _bwd_block(
    row_ptr, drow_ptr, offs, read_end, write_end, stride_lv, stride_dv,
    inv_t, row_max, log_sum, coef, ecoef, entropy, HAS_ENTROPY_GRAD: tl.constexpr,
):  # fmt: skip
    """One block of the backward row loop: -coef p_v (and the entropy's term) at offs below
    write_end, from the logits below read_end (-inf past it: p = 0, a zero written)."""
    x = tl.load(row_ptr + offs.to(tl.int64) * stride_lv, mask=offs < read_end, other=-float("inf"))
    log_p = (x.to(tl.float32) * inv_t - row_max) - log_sum
    p = tl.exp(log_p)
    grad = p * -coef
    if HAS_ENTROPY_GRAD:
        # dH/dlogit_v = -p_v (log p_v + H); p_v = 0 adds 0 * 0, not 0 * -inf (no lane forms a
        # nan, even one discarded afterwards).
        grad -= ecoef * p * tl.where(p > 0, log_p + entropy, 0.0)
    tl.store(
        drow_ptr + offs.to(tl.int64) * stride_dv,
        grad.to(drow_ptr.dtype.element_ty),
        mask=offs < write_end,
    )


@triton.heuristics(
    {
        "HAS_ENTROPY_GRAD": lambda args: args["entropy_coef_ptr"] is not None,
        "HAS_SCALES": lambda args: args["scales_ptr"] is not None,
        "HAS_GRAD": lambda args: args["grad_ptr"] is not None,
        "HAS_ROWS": lambda args: args["rows_ptr"] is not None,
        "TAIL_APART": tail_apart,
    }
)
@triton.jit(do_not_specialize=["T"])
def _logits_bwd_kernel(
    # pointers
    logits_ptr,  # (B, T, V) fp32 | bf16 | fp16, any strides
    dlogits_ptr,  # (B, T, V) out, same dtype; may be logits_ptr itself (in-place backward)
    tokens_ptr,  # (B, T) int32 | int64
    row_max_ptr,  # (B * T,) fp32, from the forward
    log_sum_ptr,  # (B * T,) fp32, from the forward
    coef_ptr,  # (B * T,) fp32: d loss / d logp (times scales[0] * grad / temperature)
    entropy_ptr,  # (B * T,) fp32, from the forward, or None
    entropy_coef_ptr,  # (B * T,) fp32: d loss / d entropy (times scales[1] * ...), or None
    scales_ptr,  # (2,) fp32: the forward's scales of coef and entropy_coef, or None (applied)
    grad_ptr,  # () fp32: d (outer loss) / d loss, with scales_ptr; None: 1
    rows_ptr,  # (B * T, H) hidden states, any strides, or None
    rows_out_ptr,  # (B * T, H) contiguous out, the rows' dtype: the row, or 0 without gradient
    # scalars
    temperature,
    # sizes
    T,
    V,
    H,
    # strides
    stride_lb,
    stride_lt,
    stride_lv,
    stride_db,
    stride_dt,
    stride_dv,
    stride_tb,
    stride_tt,
    stride_hr,
    stride_hh,
    # meta-parameters
    HAS_ENTROPY_GRAD: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    HAS_GRAD: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    TAIL_APART: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    t = row % T
    inv_t = tl.math.div_rn(1.0, temperature)  # as in the forward
    coef = tl.load(coef_ptr + row)
    live = coef != 0.0
    if HAS_SCALES:
        # The incoming gradient and the forward's batch-wide scale, read here rather than folded
        # in by small launches between the passes.
        outer = inv_t
        if HAS_GRAD:
            outer = tl.load(grad_ptr) * inv_t
        coef = coef * (tl.load(scales_ptr) * outer)
    ecoef = 0.0
    entropy = 0.0
    if HAS_ENTROPY_GRAD:
        ecoef = tl.load(entropy_coef_ptr + row)
        entropy = tl.load(entropy_ptr + row)
        live = live | (ecoef != 0.0)
        if HAS_SCALES:
            ecoef = ecoef * (tl.load(scales_ptr + 1) * outer)
    row_max = tl.load(row_max_ptr + row)
    log_sum = tl.load(log_sum_ptr + row)
    token = tl.load(tokens_ptr + b * stride_tb + t * stride_tt).to(tl.int64)
    row_ptr = logits_ptr + b * stride_lb + t * stride_lt  # int64, as in the forward
    drow_ptr = dlogits_ptr + b * stride_db + t * stride_dt
    # Rows without gradient (masked, filtered, zero advantage) read nothing and write zeros. The
    # loop writes -coef p_v (and the entropy's term); the taken token's element, coef (1 - p_v)
    # and the same term, is written after it (a compare and a select per logit fewer).
    v_read = tl.where(live, V, 0)
    # The taken token's logit, read before the loop: in place, the loop overwrites it.
    token_ok = (token >= 0) & (token < V)
    x_token = tl.load(row_ptr + token * stride_lv, mask=live & token_ok, other=-float("inf"))
    # Every thread holds it before any thread's store can overwrite it (in place).
    tl.debug_barrier()
    # The whole blocks under masks Triton can see are uniform, then the last partial one (as
    # `row_stats`); else every block under the same masks.
    v_loop = V
    if TAIL_APART:
        v_loop = (V // BLOCK_V) * BLOCK_V
    for v0 in range(0, v_loop, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        _bwd_block(
            row_ptr, drow_ptr, offs, tl.where(live, v_loop, 0), v_loop, stride_lv, stride_dv,
            inv_t, row_max, log_sum, coef, ecoef, entropy, HAS_ENTROPY_GRAD,
        )  # fmt: skip
    if TAIL_APART:
        if v_loop < V:
            offs = v_loop + tl.arange(0, BLOCK_V)
            _bwd_block(
                row_ptr, drow_ptr, offs, v_read, V, stride_lv, stride_dv,
                inv_t, row_max, log_sum, coef, ecoef, entropy, HAS_ENTROPY_GRAD,
            )  # fmt: skip
    # The loop's store of the token's element, by another thread, lands before this one.
    tl.debug_barrier()
    log_p = (x_token.to(tl.float32) * inv_t - row_max) - log_sum
    p = tl.exp(log_p)
    grad = coef * (1.0 - p)
    if HAS_ENTROPY_GRAD:
        grad -= ecoef * p * tl.where(p > 0, log_p + entropy, 0.0)
    tl.store(
        drow_ptr + token * stride_dv,
        grad.to(dlogits_ptr.dtype.element_ty),
        mask=live & token_ok,
    )
    if HAS_ROWS:
        # The row's hidden state for grad_weight = dx.T @ rows, 0 where dx is: a row without
        # gradient reads nothing, so a NaN there cannot reach the matmul's sums (0 * NaN).
        h_read = tl.where(live, H, 0)
        for h0 in range(0, H, BLOCK_V):
            offs = h0 + tl.arange(0, BLOCK_V)
            h = tl.load(
                rows_ptr + row * stride_hr + offs.to(tl.int64) * stride_hh,
                mask=offs < h_read,
                other=0.0,
            )
            tl.store(rows_out_ptr + row * H + offs, h, mask=offs < H)


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
    scales: Optional[torch.Tensor] = None,
    grad: Optional[torch.Tensor] = None,
    *,
    rows: Optional[torch.Tensor] = None,
    rows_out: Optional[torch.Tensor] = None,
    meta: Optional[dict] = None,
) -> torch.Tensor:
    """Triton backward, one launch. logits, out (B, T, V) (out may be logits); tokens (B, T);
    row_max, log_sum, coef (B, T) fp32 contiguous; entropy, entropy_coef (B, T) fp32 contiguous
    (d loss / d H) or both None. With scales (2,) and grad () fp32 tensors, the kernel multiplies
    coef by scales[0] * grad / temperature and entropy_coef by scales[1] * grad / temperature;
    without them, coef and entropy_coef come with those factors applied. With rows (B * T, H)
    (any strides) and rows_out (B * T, H) contiguous in rows' dtype, rows_out[r] = rows[r] where
    row r has a gradient, else 0 (rows of no gradient are not read). meta: BLOCK_V and num_warps
    (optionally num_stages) in place of the defaults. Returns out.
    """
    B, T, V = logits.shape
    if (rows is None) != (rows_out is None):
        raise ValueError("rows and rows_out: expected both or neither")
    block_v = _block_v(V)
    stride_lb, stride_lt, stride_lv = logits.stride()
    stride_db, stride_dt, stride_dv = out.stride()
    stride_tb, stride_tt = tokens.stride()
    stride_hr, stride_hh = (0, 0) if rows is None else rows.stride()
    launch(
        _logits_bwd_kernel,
        (B * T,),
        logits_ptr=logits,
        dlogits_ptr=out,
        tokens_ptr=tokens,
        row_max_ptr=row_max,
        log_sum_ptr=log_sum,
        coef_ptr=coef,
        entropy_ptr=entropy if entropy_coef is not None else None,
        entropy_coef_ptr=entropy_coef,
        scales_ptr=scales,
        grad_ptr=grad,
        rows_ptr=rows,
        rows_out_ptr=rows_out,
        temperature=float(temperature),
        T=T,
        V=V,
        H=0 if rows is None else rows.shape[1],
        stride_lb=stride_lb,
        stride_lt=stride_lt,
        stride_lv=stride_lv,
        stride_db=stride_db,
        stride_dt=stride_dt,
        stride_dv=stride_dv,
        stride_tb=stride_tb,
        stride_tt=stride_tt,
        stride_hr=stride_hr,
        stride_hh=stride_hh,
        **(meta if meta is not None else bwd_meta(block_v)),
    )
    return out


def _decorated_for_interpreter(kernel) -> bool:
    while not isinstance(kernel, InterpretedFunction) and hasattr(kernel, "fn"):
        kernel = kernel.fn  # through triton.heuristics to the jitted function
    return isinstance(kernel, InterpretedFunction)


# Decided once, at import (when the decorators ran): an isinstance check on a Triton kernel inside
# a torch.compile'd region is a graph break under Dynamo on CUDA, a plain bool is not.
INTERPRETED = _decorated_for_interpreter(_logits_bwd_kernel)


def triton_is_interpreted() -> bool:
    """True when Triton decorated these kernels for its CPU interpreter (TRITON_INTERPRET=1)."""
    return INTERPRETED
