"""The gradient written in the forward: one read of each row of logits and one write of its
gradient, instead of a read in the forward and a read and a write in the backward.

Where no row's gradient depends on what the forward has not yet seen (token-level IS weight and
PPO ratio, a surrogate without a sequence weight, no entropy bonus, normalisers known from the
mask: `ftis_loss.grad_in_forward_reason` lists the options), d loss / d logits of row r is
    dx[r, v] = c_r (1[v == token_r] - p_v),   c_r = (d loss / d logp_r) / tau,
and c_r needs only the row's own log pi_theta: `_logp_grad_fwd_kernel` makes the forward row
pass (`logp_lse.row_pass`), forms c_r from the token's log-probabilities and its sample's
advantage and normaliser as the per-sample kernel does (`loss_terms.token_coef`), then reads the
row again, last block first, and writes dx. That read comes from L2 when the rows the resident
programs hold fit there: wide programs (`grad_meta`) keep few rows in flight, and pass 2's reads
and writes are marked to leave L2 first. The filter's decision needs the whole sample, so the
forward writes every row as if its sample were kept; the per-sample kernel then decides as
always, and `_grad_finish_kernel` in the backward zeroes the rows of the rejected samples
(their gradient is exactly 0 under these options) and multiplies the rest by the incoming
gradient when it is not the one the caller announced (`grad_scale`, 1 by default; read on the
device: nothing is read or written for a kept row when they agree).

Memory traffic per call: the logits once and the gradient once (about 2/3 of the three-pass
design's), plus the rejected rows' zeros and, only for an incoming gradient other than the one
announced (a loss scaled after the op by an unannounced factor), one more read and write of the
gradient.

`_mask_counts_kernel` gives the per-sample token counts the normalisers need before the row pass
(one small launch; none without a mask or for normalisers that do not count tokens).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ftis_kernels.kernels.logp_lse import FWD_VEC, _block_v, row_pass, tail_apart
from ftis_kernels.kernels.loss_terms import add_k3_penalty, mask_normaliser, token_coef
from ftis_kernels.kernels.switches import BATCH_MEAN, SAMPLE_MEAN, token_switches
from ftis_kernels.kernels.tl_utils import launch

# Tokens one program of `_mask_counts_kernel` sums per step; samples the row kernel sums per
# step for a batch-wide token count (a constexpr: the kernel reads it as a global).
BLOCK_T = 1024
BLOCK_S = tl.constexpr(1024)
# A full-block `_logp_grad_fwd_kernel` program (`grad_meta`): its warps, and its largest block
# (the tests lower it to cover the vocabulary loop with small vocabularies).
GRAD_WARPS = 32
MAX_GRAD_BLOCK_V = 16384


@triton.jit(do_not_specialize=["T"])
def _mask_counts_kernel(
    mask_ptr,  # (B, T) bool | 0/1, any strides
    counts_ptr,  # (B,) fp32 out: the sample's completion tokens
    T,
    stride_mb,
    stride_mt,
    BLOCK_T: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.zeros([BLOCK_T], dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        # No `other`: Triton's interpreter fails on one for a bf16 pointer (a bf16 0/1 mask).
        mv = tl.load(mask_ptr + b * stride_mb + t.to(tl.int64) * stride_mt, mask=t < T)
        n += ((t < T) & (mv != 0)).to(tl.float32)
    tl.store(counts_ptr + b, tl.sum(n, axis=0))


@triton.jit
def _grad_block(
    row_ptr, drow_ptr, offs, read_end, write_end, stride_lv, stride_dv,
    inv_t, row_max, log_sum, c,
):  # fmt: skip
    """One block of pass 2: -c p_v at offs below write_end, from the logits below read_end (-inf
    past it: a zero written). Its reads are the row's last and its writes are not read here
    again: both leave L2 first."""
    x = tl.load(
        row_ptr + offs.to(tl.int64) * stride_lv,
        mask=offs < read_end,
        other=-float("inf"),
        eviction_policy="evict_first",
    )
    p = tl.exp((x.to(tl.float32) * inv_t - row_max) - log_sum)
    tl.store(
        drow_ptr + offs.to(tl.int64) * stride_dv,
        (p * -c).to(drow_ptr.dtype.element_ty),
        mask=offs < write_end,
        eviction_policy="evict_first",
    )


@triton.heuristics(
    {
        "HAS_MASK": lambda args: args["mask_ptr"] is not None,
        "HAS_OLD": lambda args: args["old_ptr"] is not None,
        "HAS_REF": lambda args: args["ref_ptr"] is not None,
        "HAS_COUNTS": lambda args: args["counts_ptr"] is not None,
        "TAIL_APART": tail_apart,
    }
)
@triton.jit(do_not_specialize=["T", "n_samples", "length"])
def _logp_grad_fwd_kernel(
    # pointers: the logits and their gradient
    logits_ptr,  # (B, T, V) fp32 | bf16 | fp16, any strides
    dlogits_ptr,  # (B, T, V) out, the logits' dtype, any strides; may be logits_ptr (in place)
    # pointers: the caller's (B, T) tensors, any strides, and (B,) advantages
    tokens_ptr,
    mask_ptr,  # or None
    gen_ptr,
    old_ptr,  # or None
    ref_ptr,  # or None (beta = 0)
    adv_ptr,
    counts_ptr,  # (B,) fp32 completion tokens per sample, or None (no mask: T each)
    # pointers: outputs, (B * T,) fp32
    logp_ptr,
    row_max_ptr,
    log_sum_ptr,
    entropy_ptr,
    coef_ptr,  # c_r as written into the gradient (with 1 / tau)
    # scalars
    grad_scale,  # the incoming gradient the caller announced: folded into c_r
    temperature,
    is_cap,
    is_cap_min,  # 0 when unset
    lo,  # 1 - epsilon
    hi,  # 1 + epsilon_high (or epsilon)
    clip_high,  # epsilon_high (or epsilon)
    delta,  # inf when unset
    tau_pos,
    tau_neg,
    beta,
    # sizes
    T,
    V,
    n_samples,  # B, the normaliser's
    length,  # dr_grpo's L
    # strides
    stride_lb,
    stride_lt,
    stride_lv,
    stride_db,
    stride_dt,
    stride_dv,
    stride_tb,
    stride_tt,
    stride_mb,
    stride_mt,
    stride_gb,
    stride_gt,
    stride_ob,
    stride_ot,
    stride_rb,
    stride_rt,
    stride_adv,
    # meta-parameters
    IS_MODE: tl.constexpr,
    IS_FROM_OLD: tl.constexpr,
    SURROGATE: tl.constexpr,
    REDUCTION: tl.constexpr,
    ZERO_NEGATIVE: tl.constexpr,  # the filter rejects every sample with A <= 0, whatever its KL
    HAS_MASK: tl.constexpr,
    BIAS_KL: tl.constexpr,
    HAS_OLD: tl.constexpr,
    HAS_REF: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    VEC: tl.constexpr,
    LANES: tl.constexpr,
    TAIL_APART: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    t = row % T
    active = t >= 0  # every row, as a tensor (a load's mask below)
    if HAS_MASK:
        active = tl.load(mask_ptr + b * stride_mb + t * stride_mt) != 0
    row_ptr = logits_ptr + b * stride_lb + t * stride_lt
    drow_ptr = dlogits_ptr + b * stride_db + t * stride_dt
    token = tl.load(tokens_ptr + b * stride_tb + t * stride_tt).to(tl.int64)
    token_ok = (token >= 0) & (token < V)
    inv_t = tl.math.div_rn(1.0, temperature)
    # Pass 1, the forward row kernel's: row statistics, log pi_theta(token), entropy.
    logp, row_max, log_sum, entropy, x_token = row_pass(
        row_ptr, token, active, V, stride_lv, temperature, True, BLOCK_V, VEC, LANES, TAIL_APART
    )
    tl.store(logp_ptr + row, logp)
    tl.store(row_max_ptr + row, row_max)
    tl.store(log_sum_ptr + row, log_sum)
    tl.store(entropy_ptr + row, entropy)

    # d loss / d logp of this token, as the per-sample kernel's pass 2 forms it for a kept sample.
    gen = tl.load(gen_ptr + b * stride_gb + t * stride_gt, mask=active, other=0.0).to(tl.float32)
    old = logp
    if HAS_OLD:
        old = tl.load(old_ptr + b * stride_ob + t * stride_ot, mask=active, other=0.0)
        old = old.to(tl.float32)
    adv = tl.load(adv_ptr + b * stride_adv).to(tl.float32)
    if ZERO_NEGATIVE:
        adv = tl.where(adv <= 0.0, 0.0, adv)
    dL_dlogp, dL_dR, R = token_coef(
        logp, gen, old, adv, is_cap, is_cap_min, lo, hi, clip_high, delta, tau_pos, tau_neg,
        IS_MODE, IS_FROM_OLD, SURROGATE,
    )  # fmt: skip
    if HAS_REF:  # beta * k3(ref - logp), times R with the bias correction
        ref = tl.load(ref_ptr + b * stride_rb + t * stride_rt, mask=active, other=0.0)
        u_ref = tl.where(active, ref.to(tl.float32), 0.0) - logp
        _, dL_dlogp, dL_dR = add_k3_penalty(0.0, dL_dlogp, dL_dR, u_ref, R, beta, BIAS_KL, False)
    dL_dlogp += dL_dR * R
    # The reduction's scale, the samples' token counts read here (`loss_terms` says why they are
    # the mask's).
    factor = mask_normaliser(counts_ptr, b, T, n_samples, length, REDUCTION, HAS_COUNTS, BLOCK_S)
    c = tl.where(active, dL_dlogp * factor, 0.0) * (inv_t * grad_scale)
    tl.store(coef_ptr + row, c)

    # Pass 2: the row again (a row without gradient reads nothing), its gradient written: -c p_v
    # in the loop, then c (1 - p_v) at the taken token (the one-hot kept out of the loop: a
    # compare and a select per logit fewer). Last block first: the blocks pass 1 read last are
    # the likeliest still in L2. Its reads are the row's last use and its writes are not read
    # here again, so both are marked to leave L2 first, before the rows other programs have
    # read once and will read again.
    v_read = tl.where(c != 0.0, V, 0)
    # In place (dlogits is logits) every thread has read the token's logit before any writes.
    tl.debug_barrier()
    lane = tl.arange(0, LANES)
    offs_in = lane[:, None] * VEC + tl.arange(0, VEC)[None, :]
    # The last partial block apart where V is not a multiple of 16 (`logp_lse.tail_apart`): the
    # whole blocks then keep masks Triton can see are uniform.
    n_blocks = tl.cdiv(V, BLOCK_V)
    v_loop = V
    if TAIL_APART:
        n_blocks = V // BLOCK_V
        v_loop = n_blocks * BLOCK_V
        if v_loop < V:
            _grad_block(
                row_ptr, drow_ptr, v_loop + offs_in, v_read, V, stride_lv, stride_dv,
                inv_t, row_max, log_sum, c,
            )  # fmt: skip
    read_end = tl.where(c != 0.0, v_loop, 0)
    for i in range(0, n_blocks):
        _grad_block(
            row_ptr, drow_ptr, (n_blocks - 1 - i) * BLOCK_V + offs_in, read_end, v_loop,
            stride_lv, stride_dv, inv_t, row_max, log_sum, c,
        )  # fmt: skip
    # The loop's store of the token's element, by another thread, lands before this one.
    tl.debug_barrier()
    p_token = tl.exp((x_token.to(tl.float32) * inv_t - row_max) - log_sum)
    tl.store(
        drow_ptr + token * stride_dv,
        (c * (1.0 - p_token)).to(dlogits_ptr.dtype.element_ty),
        mask=(c != 0.0) & token_ok,
    )


@triton.heuristics({"HAS_FILTER": lambda args: args["final_coef_ptr"] is not None})
@triton.jit(do_not_specialize=["T"])
def _grad_finish_kernel(
    dlogits_ptr,  # (B, T, V), written by `_logp_grad_fwd_kernel`; updated in place
    coef_ptr,  # (B * T,) fp32: the forward's c_r
    final_coef_ptr,  # (B * T,) fp32: the per-sample kernel's coef, 0 on a rejected sample's
    # rows (None without a filter: then no row is rejected)
    grad_ptr,  # () fp32: d (outer loss) / d loss
    grad_scale,  # fp32: the incoming gradient the forward folded in
    T,
    V,
    stride_db,
    stride_dt,
    stride_dv,
    HAS_FILTER: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    t = row % T
    written = tl.load(coef_ptr + row) != 0.0
    # The incoming gradient over the one the forward folded in: exactly 1 when they are equal
    # (an IEEE division, not the reciprocal's approximation).
    g = tl.math.div_rn(tl.load(grad_ptr).to(tl.float32), grad_scale)
    # A rejected sample's rows become zeros (nothing read); a kept row is scaled by g only when
    # g != 1; rows the forward left at zero stay as they are.
    scaled = written & (g != 1.0)
    n_zero = V * 0
    if HAS_FILTER:
        # The forward's c_r and the per-sample kernel's coef are the same operations on the same
        # values: a written row whose final coefficient is 0 belongs to a rejected sample.
        rejected = tl.load(final_coef_ptr + row) == 0.0
        n_zero = tl.where(written & rejected, V, 0)
        scaled = scaled & (~rejected)
    n_scale = tl.where(scaled, V, 0)
    drow_ptr = dlogits_ptr + b * stride_db + t * stride_dt
    for v0 in range(0, n_zero, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        zeros = tl.zeros([BLOCK_V], dtype=dlogits_ptr.dtype.element_ty)
        tl.store(drow_ptr + offs.to(tl.int64) * stride_dv, zeros, mask=offs < V)
    for v0 in range(0, n_scale, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        ptrs = drow_ptr + offs.to(tl.int64) * stride_dv
        x = tl.load(ptrs, mask=offs < V, other=0.0).to(tl.float32)
        tl.store(ptrs, (x * g).to(dlogits_ptr.dtype.element_ty), mask=offs < V)


# --- launchers -----------------------------------------------------------------------------------


def grad_meta(V: int, itemsize: int) -> dict:
    """`_logp_grad_fwd_kernel`'s meta-parameters for V logits of `itemsize` bytes: BLOCK_V, VEC,
    LANES, num_warps.

    Pass 2 re-reads the row pass 1 has just read, last block first. A block comes from L2 if
    less than L2's size is read for a first time, by every program resident, between its two
    reads: at its distance d from the row's end, about d per program. Programs of 8 warps at 32
    registers a thread fill an SM 8 at a time; 1,056 on an H200's 132 SMs keep d below 50 KB of
    a 297 KB bf16 row (151,936 logits). Programs of 32 warps fill it with the same 64 warps in 2
    programs: d up to 190 KB, about 2/3 of the row (`python -m bench.hopper_asm` prints the
    programs per SM from the compiled kernel, `bench.tune_rows` times the alternatives). A full
    block gives each of the 1,024 threads 32 bytes (16,384 bf16 or 8,192 fp32 logits), or 16
    bytes of 16-bit logits when V is not a multiple of 16: rows whose stride is V then load
    logit by logit and at 32 bytes a thread spill (64 registers is the most 1,024 threads can
    have); a sliced vocabulary's aligned rows would hold 52 registers, one program an SM, and at
    16 bytes hold 32, two. At most MAX_GRAD_BLOCK_V. VEC is the forward kernel's
    (`logp_lse.FWD_VEC`): under the interpreter, at equal block sizes, both kernels sum a row in
    the same order (on a GPU their warps may combine the lanes in another order)."""
    per_thread = 32 if V % 16 == 0 or itemsize >= 4 else 16
    block_v = min(1 << (V - 1).bit_length(), GRAD_WARPS * 32 * per_thread // itemsize)
    block_v = min(block_v, MAX_GRAD_BLOCK_V)
    vec = min(FWD_VEC, block_v)
    warps = max(4, min(GRAD_WARPS, block_v * itemsize // (32 * per_thread)))
    return dict(BLOCK_V=block_v, VEC=vec, LANES=block_v // vec, num_warps=warps)


def _strides(x: Optional[torch.Tensor]) -> tuple[int, int]:
    return (0, 0) if x is None else tuple(x.stride())


def logp_grad_fwd(
    logits: torch.Tensor,
    out: torch.Tensor,
    rows,
    opt,
    length: int,
    grad_scale: float = 1.0,
    *,
    meta: Optional[dict] = None,
) -> tuple[torch.Tensor, ...]:
    """The forward row pass with the gradient: one launch (two with a mask and a token-counting
    normaliser). logits, out (B, T, V) (out: any strides, the logits' dtype); rows the op's
    `validate.Rows` ((B, T) tensors, advantages (B,)); opt the options (their compile-time
    switches: `switches.token_switches`); length dr_grpo's L; meta in place of `grad_meta`'s.

    Returns logp, row_max, log_sum, entropy, coef, each (B, T) fp32 (0 at masked positions; coef
    is c_r, what `grad_finish` reads), with out holding d loss / d logits of every row as if no
    sample were rejected, for an incoming gradient of grad_scale.
    """
    B, T, V = logits.shape
    f32, dev = torch.float32, logits.device
    mask, old = rows.mask, rows.old_logprobs
    ref = None if opt.beta == 0 else rows.ref_logprobs
    switches = token_switches(opt, old is not None)
    counted = (SAMPLE_MEAN.value, BATCH_MEAN.value)  # the normalisers that count tokens
    with_counts = mask is not None and switches["REDUCTION"] in counted
    # One allocation for the five (on a GPU each is host time) and the (B,) counts of a mask's
    # tokens when the normaliser needs them, each a contiguous view starting 128 bytes aligned,
    # as a fresh allocation would (Triton specialises on a pointer's 16-byte alignment: an
    # unaligned view would compile another binary).
    n = -(-(B * T) // 32) * 32
    slab = torch.empty(5 + with_counts, n, dtype=f32, device=dev)
    logp, row_max, log_sum, entropy, coef = slab[:5, : B * T].view(5, B, T).unbind(0)
    counts = None
    if with_counts:
        counts = slab[5, :B]
        stride_mb, stride_mt = mask.stride()
        launch(
            _mask_counts_kernel,
            (B,),
            mask_ptr=mask,
            counts_ptr=counts,
            T=T,
            stride_mb=stride_mb,
            stride_mt=stride_mt,
            BLOCK_T=BLOCK_T,
            num_warps=4,
        )
    stride_lb, stride_lt, stride_lv = logits.stride()
    stride_db, stride_dt, stride_dv = out.stride()
    stride_tb, stride_tt = rows.tokens.stride()
    stride_mb, stride_mt = _strides(mask)
    stride_gb, stride_gt = rows.gen_logprobs.stride()
    stride_ob, stride_ot = _strides(old)
    stride_rb, stride_rt = _strides(ref)
    launch(
        _logp_grad_fwd_kernel,
        (B * T,),
        logits_ptr=logits,
        dlogits_ptr=out,
        tokens_ptr=rows.tokens,
        mask_ptr=mask,
        gen_ptr=rows.gen_logprobs,
        old_ptr=old,
        ref_ptr=ref,
        adv_ptr=rows.advantages,
        counts_ptr=counts,
        logp_ptr=logp,
        row_max_ptr=row_max,
        log_sum_ptr=log_sum,
        entropy_ptr=entropy,
        coef_ptr=coef,
        grad_scale=float(grad_scale),
        temperature=float(opt.temperature),
        is_cap=float(opt.is_cap),
        is_cap_min=0.0 if opt.is_cap_min is None else float(opt.is_cap_min),
        lo=1.0 - opt.epsilon,
        hi=1.0 + opt.clip_high,
        clip_high=float(opt.clip_high),
        delta=float("inf") if opt.delta is None else float(opt.delta),
        tau_pos=float(opt.sapo_temperature_pos),
        tau_neg=float(opt.sapo_temperature_neg),
        beta=float(opt.beta),
        T=T,
        V=V,
        n_samples=B,
        length=length,
        stride_lb=stride_lb,
        stride_lt=stride_lt,
        stride_lv=stride_lv,
        stride_db=stride_db,
        stride_dt=stride_dt,
        stride_dv=stride_dv,
        stride_tb=stride_tb,
        stride_tt=stride_tt,
        stride_mb=stride_mb,
        stride_mt=stride_mt,
        stride_gb=stride_gb,
        stride_gt=stride_gt,
        stride_ob=stride_ob,
        stride_ot=stride_ot,
        stride_rb=stride_rb,
        stride_rt=stride_rt,
        stride_adv=rows.advantages.stride(0),
        BIAS_KL=bool(opt.use_bias_correction_kl),
        **switches,
        **(meta if meta is not None else grad_meta(V, logits.element_size())),
    )
    return logp, row_max, log_sum, entropy, coef


def grad_finish(
    dlogits: torch.Tensor,
    coef: torch.Tensor,
    final_coef: Optional[torch.Tensor],
    grad: torch.Tensor,
    grad_scale: float = 1.0,
) -> torch.Tensor:
    """The backward of the gradient-in-forward path, one launch, in place: zeroes the rows of the
    rejected samples (the rows where final_coef, the per-sample kernel's (B, T) fp32 coef, is 0;
    None without a filter) and multiplies the others by
    grad / grad_scale (grad a 0-dim fp32 tensor, grad_scale what `logp_grad_fwd` folded in) when
    it is not 1. dlogits (B, T, V), coef (B, T) fp32 as
    `logp_grad_fwd` returned them. Returns dlogits."""
    B, T, V = dlogits.shape
    block_v = _block_v(V)
    stride_db, stride_dt, stride_dv = dlogits.stride()
    launch(
        _grad_finish_kernel,
        (B * T,),
        dlogits_ptr=dlogits,
        coef_ptr=coef,
        final_coef_ptr=final_coef,
        grad_ptr=grad,
        grad_scale=float(grad_scale),
        T=T,
        V=V,
        stride_db=stride_db,
        stride_dt=stride_dt,
        stride_dv=stride_dv,
        BLOCK_V=block_v,
        num_warps=8 if block_v >= 2048 else 4,
    )
    return dlogits
