"""The per-sample part of the loss in Triton: two launches between the row passes, no host read.

`_per_sample_kernel`, one program per sample, reads the sample's (B, T) per-token values (log
pi_theta and the row statistics from the forward row kernel, the caller's tokens, gen/old/ref
log-probabilities, mask and advantage) in blocks of BLOCK_T tokens, in up to three passes:
1. the sums the sample's decisions need: n_i, KL_i, the sequence-level log ratios, VESPO's log
   weight; and the value checks of every input (docs/method.md §2, "Errors");
2. per token: the IS weight, the PPO ratio, the policy term of the loss type, the penalty; writes
   coef = d loss / d logp (times the sample's own normaliser) and the entropy bonus's token
   indicator, and the sample's partial sums of the loss and of every metric;
3. with a sequence-level PPO ratio only: the ratio's gradient, spread over the sample's tokens.
`sample_reduce.py` then reduces the samples' partial sums (one program).

The derivatives are written by hand from the formulas of `per_sample.py` (the PyTorch path, which
lets autograd take them) and tested against the reference's autograd: d/dR of PPO's clipped
min follows torch.minimum's convention (half to each side at a tie, as at R = 1 on-policy) and
clamp's (inclusive edges). Every option value is a runtime argument; only structural choices (the
loss type's form, the IS mode and level, the filter rule) are compile-time switches, and T, the
sample count and the sizes are not specialised, so a new completion length never recompiles.

The value-check record (`CHECKS` rows): per check, (count of bad positions, the first one as a
flat index, its value, a hint flag), float64, read by `validate.raise_on_faults`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ftis_kernels.kernels.loss_terms import is_weight, surrogate_and_grad
from ftis_kernels.kernels.tl_utils import exp_m1_mx, expm1, launch
from ftis_kernels.options import loss_type
from ftis_kernels.validate import Rows

# The value checks, in the record's row order (validate.CHECKS names them), and the record's
# columns: count, first bad position (flat), its value, a hint flag, the checked tensor's two
# dimensions (one for advantages), and the vocabulary size.
N_CHECKS = tl.constexpr(7)
RECORD_COLUMNS = tl.constexpr(7)
# Columns of a sample's partial sums (`_per_sample_kernel` writes, `_finish_kernel` reads).
N_PARTS = tl.constexpr(15)
# Outputs of `_finish_kernel` besides the loss: the scalar metrics in per_sample.METRIC_NAMES
# order, then the two backward scales.
N_SCALAR_METRICS = tl.constexpr(10)
BLOCK_T = 256
BLOCK_S = 256
# "No bad position yet": above any flat index, exact in fp64.
_BIG = tl.constexpr(2**62)

# Compile-time codes of the options (the kernel branches on them at compile time).
KL_ESTIMATOR_CODE = {"k1": 0, "k2": 1, "k3": 2}
KL_REDUCTION_CODE = {"sum": 0, "mean": 1, "max": 2}
FILTER_CODE = {
    None: 0,
    "negative_offpolicy": 1,
    "negative_or_offpolicy": 2,
    "negative": 3,
    "offpolicy": 4,
}
IS_MODE_CODE = {"none": 0, "vis": 1, "tis": 2, "mask": 3}
IS_LEVEL_CODE = {"token": 0, "sequence": 1, "sequence_product": 2}
SURROGATE_CODE = {"clipped": 0, "cispo": 1, "sapo": 2, "vespo": 3}
REDUCTION_CODE = {"sample_mean": 0, "batch_mean": 1, "constant": 2, "sample_sum": 3}
VESPO_LOG_MIN = tl.constexpr(-18.420680743952367)  # log(1e-8), TRL's get_gamma_weights
VESPO_LOG_MAX = tl.constexpr(20.0)


@triton.jit
def _first_bad(count, first, value, bad, j, x):
    """A value check's running (count, first bad position, its value) after one block: bad (BLOCK,)
    bool, j (BLOCK,) int64 positions, x (BLOCK,) fp64 values."""
    count += tl.sum(bad.to(tl.float32), axis=0)
    block_first = tl.min(tl.where(bad, j, _BIG), axis=0)
    block_value = tl.sum(tl.where(j == block_first, x, 0.0), axis=0)
    value = tl.where(first < _BIG, value, block_value)
    return count, tl.minimum(first, block_first), value


@triton.jit
def _token_block(
    j0, L, start, b, row0, logp_ptr, gen_ptr, mask_ptr, old_ptr,
    stride_gen_b, stride_gen_t, stride_mask_b, stride_mask_t, stride_old_b, stride_old_t,
    HAS_MASK: tl.constexpr, HAS_OLD: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """A block of a sample's tokens: (positions j, in the sample, completion tokens, logp, gen,
    old), fp32, 0 off the completion (old is logp without old_logprobs)."""
    j = j0 + tl.arange(0, BLOCK_T).to(tl.int64)
    inb = j < L
    t = start + j
    m = inb
    if HAS_MASK:
        mv = tl.load(mask_ptr + b * stride_mask_b + t * stride_mask_t, mask=inb, other=0)
        m = inb & (mv != 0)
    logp = tl.load(logp_ptr + row0 + j, mask=m, other=0.0)
    gen = tl.load(gen_ptr + b * stride_gen_b + t * stride_gen_t, mask=m, other=0.0).to(tl.float32)
    old = logp
    if HAS_OLD:
        old = tl.load(old_ptr + b * stride_old_b + t * stride_old_t, mask=m, other=0.0)
        old = old.to(tl.float32)
    return j, inb, m, logp, gen, old


@triton.heuristics(
    {
        "HAS_MASK": lambda args: args["mask_ptr"] is not None,
        "HAS_OLD": lambda args: args["old_ptr"] is not None,
        "HAS_REF": lambda args: args["ref_ptr"] is not None,
        "PACKED": lambda args: args["cu_seqlens_ptr"] is not None,
        "ENTROPY_GRAD": lambda args: args["ecoef_ptr"] is not None,
    }
)
@triton.jit(do_not_specialize=["T", "n_samples", "sample_offset", "V", "length"])
def _per_sample_kernel(
    # pointers: the row kernel's outputs, (rows,) fp32 contiguous (row = b * T + t; packed: the
    # token's index)
    logp_ptr,
    entropy_ptr,
    row_max_ptr,
    log_sum_ptr,
    # pointers: the caller's tensors (B, T) (packed: (1, N)), any strides, and (S,) advantages
    tokens_ptr,
    gen_ptr,
    mask_ptr,  # or None
    old_ptr,  # or None
    ref_ptr,  # or None (beta = 0)
    adv_ptr,
    cu_seqlens_ptr,  # (S + 1,) int32 | int64, any stride, or None (padded)
    # pointers: outputs
    coef_ptr,  # (rows,) fp32: d loss / d logp over the batch-wide scale
    ecoef_ptr,  # (rows,) fp32: 1 where the entropy bonus reaches the token, or None
    kl_ptr,  # (S,) fp32
    filtered_ptr,  # (S,) bool
    truncated_ptr,  # (S,) fp32
    parts_ptr,  # (S, N_PARTS) fp32
    faults_ptr,  # (S, N_CHECKS, 3) fp64
    # scalars: the options
    kl_threshold,
    kl_threshold_low,  # -inf when unset
    is_cap,
    is_cap_min,  # 0 when unset
    lo,  # 1 - epsilon
    hi,  # 1 + epsilon_high (or epsilon)
    clip_high,  # epsilon_high (or epsilon): CISPO's cap on R
    delta,  # inf when unset
    beta,
    tau_pos,
    tau_neg,
    vk_pos,
    vl_pos,
    vk_neg,
    vl_neg,
    # sizes
    T,  # tokens per row of the (B, T) tensors (packed: N)
    n_samples,  # S, the normaliser's B
    sample_offset,  # the first sample of this launch (chunks of samples)
    V,
    length,  # dr_grpo's L
    # strides
    stride_tok_b,
    stride_tok_t,
    stride_gen_b,
    stride_gen_t,
    stride_mask_b,
    stride_mask_t,
    stride_old_b,
    stride_old_t,
    stride_ref_b,
    stride_ref_t,
    stride_adv,
    stride_cu,
    # meta-parameters
    KL_ESTIMATOR: tl.constexpr,
    KL_REDUCTION: tl.constexpr,
    FILTER: tl.constexpr,
    REJECT_MASK: tl.constexpr,
    KL_FROM_OLD: tl.constexpr,
    IS_MODE: tl.constexpr,
    IS_LEVEL: tl.constexpr,
    IS_FROM_OLD: tl.constexpr,
    SURROGATE: tl.constexpr,
    REDUCTION: tl.constexpr,
    RATIO_SEQ: tl.constexpr,
    BIAS_KL: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_OLD: tl.constexpr,
    HAS_REF: tl.constexpr,
    PACKED: tl.constexpr,
    ENTROPY_GRAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64) + sample_offset
    if PACKED:
        start = tl.load(cu_seqlens_ptr + s * stride_cu).to(tl.int64)
        L = tl.load(cu_seqlens_ptr + (s + 1) * stride_cu).to(tl.int64) - start
        b = s * 0  # the (1, N) tensors' only row
    else:
        start = s * 0
        L = s * 0 + T
        b = s
    row0 = b * T + start  # index of the sample's first token in the (rows,) arrays
    adv = tl.load(adv_ptr + s * stride_adv).to(tl.float32)
    adv64 = tl.load(adv_ptr + s * stride_adv).to(tl.float64)
    inf = float("inf")

    # --- pass 1: the sample's sums, and the value checks --------------------------------------
    n = 0.0
    kl_acc = 0.0
    kl_max = -inf
    is_sum = 0.0
    r_sum = 0.0
    probs = 0.0  # completion tokens whose gen_logprobs lie in (0, 1]: probabilities?
    zero64 = adv64 * 0.0
    zero32 = tl.zeros([], dtype=tl.float32)
    c0, f0, v0 = zero32, s * 0 + _BIG, zero64
    c1, f1, v1 = zero32, s * 0 + _BIG, zero64
    c2, f2, v2 = zero32, s * 0 + _BIG, zero64
    c4, f4, v4 = zero32, s * 0 + _BIG, zero64
    c5, f5, v5 = zero32, s * 0 + _BIG, zero64
    c6, f6, v6 = zero32, s * 0 + _BIG, zero64
    for j0 in range(0, L, BLOCK_T):
        j = j0 + tl.arange(0, BLOCK_T).to(tl.int64)
        inb = j < L
        t = start + j
        flat = row0 + j
        tok = tl.load(tokens_ptr + b * stride_tok_b + t * stride_tok_t, mask=inb, other=0)
        c0, f0, v0 = _first_bad(
            c0, f0, v0, inb & ((tok < 0) | (tok >= V)), flat, tok.to(tl.float64)
        )
        m = inb
        if HAS_MASK:
            mv = tl.load(mask_ptr + b * stride_mask_b + t * stride_mask_t, mask=inb, other=0)
            m = inb & (mv != 0)
            if not MASK_IS_BOOL:
                c1, f1, v1 = _first_bad(
                    c1, f1, v1, inb & (mv != 0) & (mv != 1), flat, mv.to(tl.float64)
                )
        logp = tl.load(logp_ptr + row0 + j, mask=m, other=0.0)
        g_raw = tl.load(gen_ptr + b * stride_gen_b + t * stride_gen_t, mask=m, other=0.0)
        gen = g_raw.to(tl.float32)
        c2, f2, v2 = _first_bad(
            c2,
            f2,
            v2,
            m & ~((gen == gen) & (gen <= 0.0) & (gen > -inf)),
            flat,
            g_raw.to(tl.float64),
        )
        probs += tl.sum((m & (gen > 0.0) & (gen <= 1.0)).to(tl.float32), axis=0)
        if HAS_OLD:
            o_raw = tl.load(old_ptr + b * stride_old_b + t * stride_old_t, mask=m, other=0.0)
            old = o_raw.to(tl.float32)
            c4, f4, v4 = _first_bad(
                c4, f4, v4, m & ~((old == old) & (tl.abs(old) < inf)), flat, o_raw.to(tl.float64)
            )
        else:
            old = logp
        if HAS_REF:
            r_raw = tl.load(ref_ptr + b * stride_ref_b + t * stride_ref_t, mask=m, other=0.0)
            ref = r_raw.to(tl.float32)
            c5, f5, v5 = _first_bad(
                c5, f5, v5, m & ~((ref == ref) & (tl.abs(ref) < inf)), flat, r_raw.to(tl.float64)
            )
        # The logits, judged by their row statistics (validate.LOGIT_FAULTS codes).
        row_max = tl.load(row_max_ptr + row0 + j, mask=m, other=0.0)
        log_sum = tl.load(log_sum_ptr + row0 + j, mask=m, other=0.0)
        code = tl.where(~((logp == logp) & (tl.abs(logp) < inf)), 4, 0)
        code = tl.where(log_sum == -inf, 3, code)
        code = tl.where((row_max != row_max) | (log_sum != log_sum), 1, code)
        code = tl.where(row_max == inf, 2, code)
        c6, f6, v6 = _first_bad(c6, f6, v6, m & (code != 0), flat, code.to(tl.float64))

        n += tl.sum(m.to(tl.float32), axis=0)
        if KL_FROM_OLD:
            d = gen - old
        else:
            d = gen - logp
        if KL_ESTIMATOR == 0:
            k = d
        elif KL_ESTIMATOR == 1:
            k = 0.5 * d * d
        else:
            k = exp_m1_mx(-d)
        kl_acc += tl.sum(tl.where(m, k, 0.0), axis=0)
        kl_max = tl.maximum(kl_max, tl.max(tl.where(m, k, -inf), axis=0))
        if IS_LEVEL != 0:
            if IS_FROM_OLD:
                is_sum += tl.sum(tl.where(m, old - gen, 0.0), axis=0)
            else:
                is_sum += tl.sum(tl.where(m, logp - gen, 0.0), axis=0)
        if RATIO_SEQ:
            r_sum += tl.sum(tl.where(m, logp - old, 0.0), axis=0)

    n_safe = tl.maximum(n, 1.0)
    if KL_REDUCTION == 0:
        kl = kl_acc
    elif KL_REDUCTION == 1:
        kl = kl_acc / n_safe
    else:
        kl = tl.where(n > 0, kl_max, 0.0)
    offpolicy = (kl > kl_threshold) | (kl < kl_threshold_low)
    negative = adv <= 0.0
    if FILTER == 0:
        filtered = negative & (n < 0.0)  # never
    elif FILTER == 1:
        filtered = negative & offpolicy
    elif FILTER == 2:
        filtered = negative | offpolicy
    elif FILTER == 3:
        filtered = negative
    else:
        filtered = offpolicy
    adv_hat = tl.where(filtered, 0.0, adv)
    has_adv = adv_hat != 0.0
    if REJECT_MASK:
        in_loss = ~filtered
    else:
        in_loss = n == n
    n_loss = tl.where(in_loss, n, 0.0)
    if REDUCTION == 0:
        factor = 1.0 / (n_samples * tl.maximum(n_loss, 1.0))
    elif REDUCTION == 1:
        factor = 1.0 + 0.0 * n  # the batch-wide 1 / N' is the finish kernel's scale
    elif REDUCTION == 2:
        factor = 1.0 / (n_samples * length) + 0.0 * n
    else:
        factor = 1.0 / n_samples + 0.0 * n
    if IS_LEVEL == 1:
        log_ratio_seq = is_sum / n_safe
    else:
        log_ratio_seq = is_sum
    R_seq = tl.exp(r_sum / n_safe)

    # VESPO's sequence weight phi (TRL get_gamma_weights), from the token IS weights: pass 1b.
    phi = 0.0
    if SURROGATE == 3:
        log_is_sum = 0.0
        for j0 in range(0, L, BLOCK_T):
            j, inb, m, logp, gen, old = _token_block(
                j0, L, start, b, row0, logp_ptr, gen_ptr, mask_ptr, old_ptr, stride_gen_b,
                stride_gen_t, stride_mask_b, stride_mask_t, stride_old_b, stride_old_t, HAS_MASK,
                HAS_OLD, BLOCK_T,
            )  # fmt: skip
            if IS_FROM_OLD:
                log_r = old - gen
            else:
                log_r = logp - gen
            w = is_weight(log_r, is_cap, is_cap_min, IS_MODE)
            # log(max(w, 1e-8)): the clamp's lower edge, without a log of 0.
            log_is = tl.minimum(tl.log(tl.maximum(w, 1e-8)), VESPO_LOG_MAX)
            clamped = tl.minimum(tl.maximum(logp - old, -20.0), 20.0)
            log_is_sum += tl.sum(
                tl.where(tl.where(in_loss, m, False), log_is + clamped, 0.0), axis=0
            )
        log_w = tl.minimum(tl.maximum(log_is_sum, VESPO_LOG_MIN), VESPO_LOG_MAX)
        nonneg = adv_hat >= 0.0
        vk = tl.where(nonneg, vk_pos, vk_neg)
        vl = tl.maximum(tl.where(nonneg, vl_pos, vl_neg), 1e-4)
        phi = tl.exp(vl + vk * log_w - vl * tl.exp(log_w))
        phi = tl.where((phi == phi) & (tl.abs(phi) < inf), phi, 0.0)

    # --- pass 2: per token, the loss, coef = d loss / d logp, the metrics' partial sums --------
    loss_acc = 0.0
    grad_r = 0.0  # sum over the sample's loss tokens of d L / d R (sequence-level R)
    clip_n = 0.0
    w_sum = 0.0
    trunc_n = 0.0
    masked_n = 0.0
    raw_sum = 0.0
    raw_max = -inf
    raw_min = inf
    ent_sum = 0.0
    ent_loss = 0.0
    for j0 in range(0, L, BLOCK_T):
        j, inb, m, logp, gen, old = _token_block(
            j0, L, start, b, row0, logp_ptr, gen_ptr, mask_ptr, old_ptr,
            stride_gen_b, stride_gen_t, stride_mask_b, stride_mask_t, stride_old_b, stride_old_t,
            HAS_MASK, HAS_OLD, BLOCK_T,
        )  # fmt: skip
        t = start + j
        # (The interpreter cannot & a scalar bool with a block.)
        m_loss = tl.where(in_loss, m, False)
        # The IS weight (no gradient) from the token's or the sample's log ratio.
        if IS_LEVEL == 0:
            if IS_FROM_OLD:
                log_ratio = old - gen
            else:
                log_ratio = logp - gen
        else:
            log_ratio = tl.zeros_like(logp) + log_ratio_seq
        raw = tl.exp(log_ratio)
        w = is_weight(log_ratio, is_cap, is_cap_min, IS_MODE)
        in_band = (raw >= is_cap_min) & (raw <= is_cap)
        # The PPO ratio R (its gradient flows through logp).
        if RATIO_SEQ:
            R = tl.zeros_like(logp) + R_seq
        else:
            R = tl.exp(logp - old)
        P, dP_dR, dP_dlogp, clip = surrogate_and_grad(
            R,
            adv_hat + tl.zeros_like(R),
            lo,
            hi,
            clip_high,
            delta,
            logp,
            tau_pos,
            tau_neg,
            phi,
            SURROGATE,
        )
        if SURROGATE == 3:
            w_loss = tl.where(has_adv, 1.0, 0.0)
        else:
            w_loss = tl.where(has_adv, w, 0.0)
        P = tl.where(has_adv, P, 0.0)
        L_tok = w_loss * P
        dL_dR = w_loss * tl.where(has_adv, dP_dR, 0.0)
        dL_dlogp = w_loss * tl.where(has_adv, dP_dlogp, 0.0)
        if HAS_REF:
            ref = tl.load(ref_ptr + b * stride_ref_b + t * stride_ref_t, mask=m, other=0.0)
            u = tl.where(m, ref.to(tl.float32), 0.0) - logp
            pen = exp_m1_mx(u)
            dpen = -expm1(u)  # d pen / d logp = 1 - exp(u)
            if BIAS_KL:
                L_tok += beta * pen * R
                dL_dlogp += beta * dpen * R
                dL_dR += beta * pen
            else:
                L_tok += beta * pen
                dL_dlogp += beta * dpen
        if not RATIO_SEQ:
            dL_dlogp += dL_dR * R
        loss_acc += tl.sum(tl.where(m_loss, L_tok, 0.0), axis=0)
        grad_r += tl.sum(tl.where(m_loss, dL_dR, 0.0), axis=0)
        tl.store(coef_ptr + row0 + j, tl.where(m_loss, dL_dlogp * factor, 0.0), mask=inb)
        ent = tl.load(entropy_ptr + row0 + j, mask=m, other=0.0)
        if ENTROPY_GRAD:
            tl.store(ecoef_ptr + row0 + j, tl.where(m_loss, 1.0, 0.0), mask=inb)
        ent_sum += tl.sum(tl.where(m, ent, 0.0), axis=0)
        ent_loss += tl.sum(tl.where(m_loss, ent, 0.0), axis=0)
        clip_n += tl.sum((m & clip).to(tl.float32), axis=0)
        w_sum += tl.sum(tl.where(m, w, 0.0), axis=0)
        if IS_MODE == 2:
            trunc_n += tl.sum((m & ~in_band).to(tl.float32), axis=0)
        if IS_MODE == 3:
            masked_n += tl.sum((m & ~in_band).to(tl.float32), axis=0)
        raw_sum += tl.sum(tl.where(m, raw, 0.0), axis=0)
        raw_max = tl.maximum(raw_max, tl.max(tl.where(m, raw, -inf), axis=0))
        raw_min = tl.minimum(raw_min, tl.min(tl.where(m, raw, inf), axis=0))

    # --- pass 3: a sequence-level R's gradient reaches every token of the sample --------------
    if RATIO_SEQ:
        spread = grad_r * R_seq / n_safe * factor
        # Pass 2's coef stores, visible to every thread of the program before they are re-read.
        tl.debug_barrier()
        for j0 in range(0, L, BLOCK_T):
            j = j0 + tl.arange(0, BLOCK_T).to(tl.int64)
            inb = j < L
            m = inb
            if HAS_MASK:
                t = start + j
                mv = tl.load(mask_ptr + b * stride_mask_b + t * stride_mask_t, mask=inb, other=0)
                m = inb & (mv != 0)
            c = tl.load(coef_ptr + row0 + j, mask=inb, other=0.0)
            tl.store(coef_ptr + row0 + j, c + tl.where(m, spread, 0.0), mask=inb)

    tl.store(kl_ptr + s, kl)
    tl.store(filtered_ptr + s, filtered)
    tl.store(truncated_ptr + s, trunc_n / n_safe)
    parts = parts_ptr + s * N_PARTS
    tl.store(parts + 0, loss_acc * factor)
    tl.store(parts + 1, n)
    tl.store(parts + 2, n_loss)
    tl.store(parts + 3, clip_n)
    tl.store(parts + 4, w_sum)
    tl.store(parts + 5, trunc_n)
    tl.store(parts + 6, masked_n)
    tl.store(parts + 7, raw_sum)
    tl.store(parts + 8, raw_max)
    tl.store(parts + 9, raw_min)
    tl.store(parts + 10, ent_sum)
    tl.store(parts + 11, ent_loss)
    tl.store(parts + 12, filtered.to(tl.float32))
    tl.store(parts + 13, kl)
    tl.store(parts + 14, probs)
    faults = faults_ptr + s * (N_CHECKS * 3)
    bad_adv = ~((adv == adv) & (tl.abs(adv) < inf))
    _store_check(faults, 0, c0, f0, v0)
    _store_check(faults, 1, c1, f1, v1)
    _store_check(faults, 2, c2, f2, v2)
    _store_check(faults, 3, bad_adv.to(tl.float32), tl.where(bad_adv, s, _BIG), adv64)
    _store_check(faults, 4, c4, f4, v4)
    _store_check(faults, 5, c5, f5, v5)
    _store_check(faults, 6, c6, f6, v6)


@triton.jit
def _store_check(faults, row, count, first, value):
    tl.store(faults + row * 3 + 0, count.to(tl.float64))
    tl.store(faults + row * 3 + 1, first.to(tl.float64))
    tl.store(faults + row * 3 + 2, value.to(tl.float64))


# --- launchers -----------------------------------------------------------------------------------


@dataclass
class SampleOutputs:
    """What `per_sample_fwd` writes, allocated once per call (chunks of samples fill it in turn).

    coef (rows,) fp32: d loss / d logp over the batch-wide scale; ecoef (rows,) fp32: 1 where the
    entropy bonus reaches the token (None without a bonus); kl, truncated (S,) fp32, filtered
    (S,) bool; parts (S, N_PARTS) fp32 and faults (S, N_CHECKS, 3) fp64 for `finish_fwd`.
    """

    coef: torch.Tensor
    ecoef: Optional[torch.Tensor]
    kl: torch.Tensor
    filtered: torch.Tensor
    truncated: torch.Tensor
    parts: torch.Tensor
    faults: torch.Tensor

    @classmethod
    def empty(cls, shape: tuple[int, int], n_samples: int, device, entropy_grad: bool):
        f32 = torch.float32
        return cls(
            coef=torch.empty(shape, dtype=f32, device=device),
            ecoef=torch.empty(shape, dtype=f32, device=device) if entropy_grad else None,
            kl=torch.empty(n_samples, dtype=f32, device=device),
            filtered=torch.empty(n_samples, dtype=torch.bool, device=device),
            truncated=torch.empty(n_samples, dtype=f32, device=device),
            parts=torch.empty(n_samples, N_PARTS.value, dtype=f32, device=device),
            faults=torch.empty(n_samples, N_CHECKS.value, 3, dtype=torch.float64, device=device),
        )


def _strides(x: Optional[torch.Tensor]) -> tuple[int, int]:
    return (0, 0) if x is None else tuple(x.stride())


def per_sample_fwd(
    out: SampleOutputs,
    stats: tuple[torch.Tensor, ...],
    rows: Rows,
    opt,
    *,
    V: int,
    length: int,
    cu_seqlens: Optional[torch.Tensor] = None,
    first: int = 0,
    count: Optional[int] = None,
) -> None:
    """One launch over samples first : first + count (all by default) into `out`.

    stats = (logp, entropy, row_max, log_sum), (B, T) fp32 contiguous from the row kernel;
    rows as the op takes them ((B, T), or (1, N) with cu_seqlens (S + 1,); advantages (S,)); V
    the vocabulary; length dr_grpo's L. ref_logprobs is read only when opt.beta > 0.
    """
    logp, entropy, row_max, log_sum = stats
    mask, old = rows.mask, rows.old_logprobs
    ref = None if opt.beta == 0 else rows.ref_logprobs
    n_samples = rows.advantages.shape[0]
    count = n_samples - first if count is None else count
    if count == 0:
        return
    kind = loss_type(opt.loss_type)
    launch(
        _per_sample_kernel,
        (count,),
        logp,
        entropy,
        row_max,
        log_sum,
        rows.tokens,
        rows.gen_logprobs,
        mask,
        old,
        ref,
        rows.advantages,
        cu_seqlens,
        out.coef,
        out.ecoef,
        out.kl,
        out.filtered,
        out.truncated,
        out.parts,
        out.faults,
        float(opt.kl_threshold),
        -math.inf if opt.kl_threshold_low is None else float(opt.kl_threshold_low),
        float(opt.is_cap),
        0.0 if opt.is_cap_min is None else float(opt.is_cap_min),
        1.0 - opt.epsilon,
        1.0 + opt.clip_high,
        float(opt.clip_high),
        math.inf if opt.delta is None else float(opt.delta),
        float(opt.beta),
        float(opt.sapo_temperature_pos),
        float(opt.sapo_temperature_neg),
        float(opt.vespo_k_pos),
        float(opt.vespo_lambda_pos),
        float(opt.vespo_k_neg),
        float(opt.vespo_lambda_neg),
        logp.shape[1],
        n_samples,
        first,
        V,
        length,
        *rows.tokens.stride(),
        *rows.gen_logprobs.stride(),
        *_strides(mask),
        *_strides(old),
        *_strides(ref),
        rows.advantages.stride(0),
        0 if cu_seqlens is None else cu_seqlens.stride(0),
        KL_ESTIMATOR=KL_ESTIMATOR_CODE[opt.kl_estimator],
        KL_REDUCTION=KL_REDUCTION_CODE[opt.kl_reduction],
        FILTER=FILTER_CODE[opt.filter],
        REJECT_MASK=opt.reject_mode == "mask",
        KL_FROM_OLD=opt.kl_source == "old" and old is not None,
        IS_MODE=IS_MODE_CODE[opt.is_mode],
        IS_LEVEL=IS_LEVEL_CODE[opt.is_level],
        IS_FROM_OLD=opt.is_source == "old" and old is not None,
        SURROGATE=SURROGATE_CODE[kind.surrogate],
        REDUCTION=REDUCTION_CODE[kind.reduction],
        RATIO_SEQ=opt.ratio_level == "sequence",
        BIAS_KL=bool(opt.use_bias_correction_kl),
        MASK_IS_BOOL=mask is None or mask.dtype == torch.bool,
        BLOCK_T=BLOCK_T,
        num_warps=4,
    )
