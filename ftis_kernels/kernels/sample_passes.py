"""The phases of the per-sample kernel (`per_sample.py`), in the kernel's order, as Triton
functions it calls (Triton inlines them: the kernel compiles to the code it would as one body):
the sample's span, pass 1's sums and value checks, the sample's decision, its sequence-level
ratios, VESPO's pass, pass 2's loss and coefficients, pass 3's sequence gradient, and the store of
its partial sums, whose columns are named here once (`sample_reduce.py` reads them by name).
"""

import triton
import triton.language as tl

from ftis_kernels.kernels.loss_terms import (
    add_k3_penalty,
    is_log_ratio,
    is_weight,
    kl_estimate,
    surrogate_and_grad,
    vespo_log_term,
    vespo_phi,
)
from ftis_kernels.kernels.switches import (
    IS_MASK,
    IS_SEQUENCE,
    IS_SEQUENCE_PRODUCT,
    IS_TIS,
    IS_TOKEN,
    KL_MAX,
    KL_MEAN,
    KL_SUM,
    NEGATIVE,
    NEGATIVE_OFFPOLICY,
    NEGATIVE_OR_OFFPOLICY,
    NO_FILTER,
    OFFPOLICY,
    VESPO,
)
from ftis_kernels.kernels.value_checks import BIG, check_finite, first_bad, logit_fault

# The columns of a sample's partial sums: `store_parts` writes them, `_finish_kernel` sums
# them over the samples.
(
    PART_LOSS,  # the sample's loss times its normaliser
    PART_TOKENS,  # n_i, its completion tokens
    PART_LOSS_TOKENS,  # its tokens in the loss (0 when rejected by mask)
    PART_CLIPPED,  # tokens whose ratio the surrogate clipped
    PART_IS_WEIGHT,  # sum of the IS weights
    PART_TRUNCATED,  # tokens whose IS weight was truncated (tis)
    PART_MASKED,  # tokens whose IS weight was masked (mask)
    PART_RATIO_SUM,  # sum, max and min of the raw IS ratio
    PART_RATIO_MAX,
    PART_RATIO_MIN,
    PART_ENTROPY,  # sum of the entropies
    PART_LOSS_ENTROPY,  # sum of the entropies of the tokens in the loss
    PART_FILTERED,  # 1 when rejected
    PART_KL,  # KL_i
    PART_PROBABILITIES,  # tokens whose gen_logprobs lie in (0, 1]: probabilities?
) = (tl.constexpr(i) for i in range(15))
N_PARTS = tl.constexpr(15)


@triton.jit
def sample_span(s, cu_seqlens_ptr, stride_cu, T, PACKED: tl.constexpr):
    """Sample s's tokens: (start, L, b, row0): its first position in row b of the (B, T) tensors
    (packed: of the (1, N) ones), its token count, and the index of its first token in the
    (rows,) arrays."""
    if PACKED:
        start = tl.load(cu_seqlens_ptr + s * stride_cu).to(tl.int64)
        L = tl.load(cu_seqlens_ptr + (s + 1) * stride_cu).to(tl.int64) - start
        b = s * 0  # the (1, N) tensors' only row
    else:
        start = s * 0
        L = s * 0 + T
        b = s
    row0 = b * T + start
    return start, L, b, row0


@triton.jit
def completion(mask_ptr, b, t, inb, stride_mask_b, stride_mask_t, HAS_MASK: tl.constexpr):
    """(m, mv) of a block of positions t of row b (inb: inside the sample): the completion tokens,
    and the mask's values as stored (inb without a mask)."""
    m = inb
    mv = inb
    if HAS_MASK:
        mv = tl.load(mask_ptr + b * stride_mask_b + t * stride_mask_t, mask=inb, other=0)
        m = inb & (mv != 0)
    return m, mv


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
    m, mv = completion(mask_ptr, b, t, inb, stride_mask_b, stride_mask_t, HAS_MASK)
    logp = tl.load(logp_ptr + row0 + j, mask=m, other=0.0)
    gen = tl.load(gen_ptr + b * stride_gen_b + t * stride_gen_t, mask=m, other=0.0).to(tl.float32)
    old = logp
    if HAS_OLD:
        old = tl.load(old_ptr + b * stride_old_b + t * stride_old_t, mask=m, other=0.0)
        old = old.to(tl.float32)
    return j, inb, m, logp, gen, old


@triton.jit
def sums_and_checks(
    s, adv64, start, L, b, row0,
    logp_ptr, row_max_ptr, log_sum_ptr, tokens_ptr, gen_ptr, mask_ptr, old_ptr, ref_ptr, V,
    stride_tok_b, stride_tok_t, stride_gen_b, stride_gen_t, stride_mask_b, stride_mask_t,
    stride_old_b, stride_old_t, stride_ref_b, stride_ref_t,
    KL_ESTIMATOR: tl.constexpr, KL_FROM_OLD: tl.constexpr, IS_LEVEL: tl.constexpr,
    IS_FROM_OLD: tl.constexpr, RATIO_SEQ: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """Pass 1 over the sample: the sums its decisions need, n (completion tokens), the KL
    estimates' sum and max, the IS log ratios' sum, the PPO log ratios' sum and the count of
    gen_logprobs that look like probabilities; then the running (count, first, value) of the
    value checks of the tokens, mask, gen, old and ref log-probabilities and the logits (by their
    row statistics), in `CHECKS` order without the advantages (`value_checks.store_checks`)."""
    inf = float("inf")
    n = 0.0
    kl_acc = 0.0
    kl_max = -inf
    is_sum = 0.0
    r_sum = 0.0
    probs = 0.0  # completion tokens whose gen_logprobs lie in (0, 1]: probabilities?
    zero64 = adv64 * 0.0
    zero32 = tl.zeros([], dtype=tl.float32)
    c0, f0, v0 = zero32, s * 0 + BIG, zero64
    c1, f1, v1 = zero32, s * 0 + BIG, zero64
    c2, f2, v2 = zero32, s * 0 + BIG, zero64
    c4, f4, v4 = zero32, s * 0 + BIG, zero64
    c5, f5, v5 = zero32, s * 0 + BIG, zero64
    c6, f6, v6 = zero32, s * 0 + BIG, zero64
    for j0 in range(0, L, BLOCK_T):
        j = j0 + tl.arange(0, BLOCK_T).to(tl.int64)
        inb = j < L
        t = start + j
        flat = row0 + j
        tok = tl.load(tokens_ptr + b * stride_tok_b + t * stride_tok_t, mask=inb, other=0)
        c0, f0, v0 = first_bad(c0, f0, v0, inb & ((tok < 0) | (tok >= V)), flat, tok.to(tl.float64))
        m, mv = completion(mask_ptr, b, t, inb, stride_mask_b, stride_mask_t, HAS_MASK)
        if HAS_MASK:
            if not MASK_IS_BOOL:
                c1, f1, v1 = first_bad(
                    c1, f1, v1, inb & (mv != 0) & (mv != 1), flat, mv.to(tl.float64)
                )
        logp = tl.load(logp_ptr + row0 + j, mask=m, other=0.0)
        g_raw = tl.load(gen_ptr + b * stride_gen_b + t * stride_gen_t, mask=m, other=0.0)
        gen = g_raw.to(tl.float32)
        bad_gen = m & ~((gen == gen) & (gen <= 0.0) & (gen > -inf))
        c2, f2, v2 = first_bad(c2, f2, v2, bad_gen, flat, g_raw.to(tl.float64))
        probs += tl.sum((m & (gen > 0.0) & (gen <= 1.0)).to(tl.float32), axis=0)
        old = logp
        if HAS_OLD:
            o_raw = tl.load(old_ptr + b * stride_old_b + t * stride_old_t, mask=m, other=0.0)
            old = o_raw.to(tl.float32)
            c4, f4, v4 = check_finite(c4, f4, v4, o_raw, old, m, flat)
        if HAS_REF:
            r_raw = tl.load(ref_ptr + b * stride_ref_b + t * stride_ref_t, mask=m, other=0.0)
            c5, f5, v5 = check_finite(c5, f5, v5, r_raw, r_raw.to(tl.float32), m, flat)
        row_max = tl.load(row_max_ptr + row0 + j, mask=m, other=0.0)
        log_sum = tl.load(log_sum_ptr + row0 + j, mask=m, other=0.0)
        code = logit_fault(logp, row_max, log_sum)
        c6, f6, v6 = first_bad(c6, f6, v6, m & (code != 0), flat, code.to(tl.float64))

        n += tl.sum(m.to(tl.float32), axis=0)
        if KL_FROM_OLD:
            k = kl_estimate(gen - old, KL_ESTIMATOR)
        else:
            k = kl_estimate(gen - logp, KL_ESTIMATOR)
        kl_acc += tl.sum(tl.where(m, k, 0.0), axis=0)
        kl_max = tl.maximum(kl_max, tl.max(tl.where(m, k, -inf), axis=0))
        if IS_LEVEL != IS_TOKEN:
            is_sum += tl.sum(tl.where(m, is_log_ratio(logp, gen, old, IS_FROM_OLD), 0.0), axis=0)
        if RATIO_SEQ:
            r_sum += tl.sum(tl.where(m, logp - old, 0.0), axis=0)
    return (
        n, kl_acc, kl_max, is_sum, r_sum, probs,
        c0, f0, v0, c1, f1, v1, c2, f2, v2, c4, f4, v4, c5, f5, v5, c6, f6, v6,
    )  # fmt: skip


@triton.jit
def decide(
    n, kl_acc, kl_max, adv, kl_threshold, kl_threshold_low,
    KL_REDUCTION: tl.constexpr, FILTER: tl.constexpr, REJECT_MASK: tl.constexpr,
):  # fmt: skip
    """The sample's decision from pass 1's sums: (KL_i, rejected, its advantage after the filter,
    whether that is nonzero, whether its tokens stay in the loss, its tokens in the loss,
    max(n, 1))."""
    n_safe = tl.maximum(n, 1.0)
    if KL_REDUCTION == KL_SUM:
        kl = kl_acc
    elif KL_REDUCTION == KL_MEAN:
        kl = kl_acc / n_safe
    elif KL_REDUCTION == KL_MAX:
        kl = tl.where(n > 0, kl_max, 0.0)
    offpolicy = (kl > kl_threshold) | (kl < kl_threshold_low)
    negative = adv <= 0.0
    if FILTER == NO_FILTER:
        filtered = negative & (n < 0.0)  # never
    elif FILTER == NEGATIVE_OFFPOLICY:
        filtered = negative & offpolicy
    elif FILTER == NEGATIVE_OR_OFFPOLICY:
        filtered = negative | offpolicy
    elif FILTER == NEGATIVE:
        filtered = negative
    elif FILTER == OFFPOLICY:
        filtered = offpolicy
    adv_hat = tl.where(filtered, 0.0, adv)
    has_adv = adv_hat != 0.0
    if REJECT_MASK:
        in_loss = ~filtered
    else:
        in_loss = n == n
    n_loss = tl.where(in_loss, n, 0.0)
    return kl, filtered, adv_hat, has_adv, in_loss, n_loss, n_safe


@triton.jit
def sequence_ratios(is_sum, r_sum, n_safe, IS_LEVEL: tl.constexpr):
    """The sample's sequence-level IS log ratio (mean or sum of the tokens': `is_level`) and its
    sequence-level PPO ratio exp(mean log ratio)."""
    if IS_LEVEL == IS_SEQUENCE:
        log_ratio_seq = is_sum / n_safe
    elif IS_LEVEL == IS_TOKEN or IS_LEVEL == IS_SEQUENCE_PRODUCT:
        log_ratio_seq = is_sum
    return log_ratio_seq, tl.exp(r_sum / n_safe)


@triton.jit
def vespo_pass(
    L, start, b, row0, logp_ptr, gen_ptr, mask_ptr, old_ptr,
    stride_gen_b, stride_gen_t, stride_mask_b, stride_mask_t, stride_old_b, stride_old_t,
    is_cap, is_cap_min, in_loss, adv_hat, vk_pos, vl_pos, vk_neg, vl_neg,
    IS_MODE: tl.constexpr, IS_FROM_OLD: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_OLD: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """Pass 1b, VESPO only: its sequence weight phi (`loss_terms.vespo_phi`) from the token IS
    weights of the sample's tokens in the loss."""
    log_is_sum = 0.0
    for j0 in range(0, L, BLOCK_T):
        j, inb, m, logp, gen, old = _token_block(
            j0, L, start, b, row0, logp_ptr, gen_ptr, mask_ptr, old_ptr, stride_gen_b,
            stride_gen_t, stride_mask_b, stride_mask_t, stride_old_b, stride_old_t, HAS_MASK,
            HAS_OLD, BLOCK_T,
        )  # fmt: skip
        log_r = is_log_ratio(logp, gen, old, IS_FROM_OLD)
        term = vespo_log_term(log_r, logp, old, is_cap, is_cap_min, IS_MODE)
        log_is_sum += tl.sum(tl.where(tl.where(in_loss, m, False), term, 0.0), axis=0)
    return vespo_phi(log_is_sum, adv_hat, vk_pos, vl_pos, vk_neg, vl_neg)


@triton.jit
def loss_pass(
    L, start, b, row0, logp_ptr, entropy_ptr, gen_ptr, mask_ptr, old_ptr, ref_ptr,
    coef_ptr, ecoef_ptr,
    stride_gen_b, stride_gen_t, stride_mask_b, stride_mask_t, stride_old_b, stride_old_t,
    stride_ref_b, stride_ref_t,
    in_loss, adv_hat, has_adv, factor, log_ratio_seq, R_seq, phi,
    is_cap, is_cap_min, lo, hi, clip_high, delta, beta, tau_pos, tau_neg,
    IS_MODE: tl.constexpr, IS_LEVEL: tl.constexpr, IS_FROM_OLD: tl.constexpr,
    SURROGATE: tl.constexpr, RATIO_SEQ: tl.constexpr, BIAS_KL: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr,
    ENTROPY_GRAD: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """Pass 2, per token: the IS weight, the PPO ratio, the loss type's term and the penalty;
    stores coef = d loss / d logp times the sample's normaliser (and the entropy bonus's token
    indicator), and returns the sample's sums: the loss (before its normaliser), d L / d R over
    its tokens in the loss (a sequence-level R's), then the metrics' (`PART_*`) from clipped on."""
    inf = float("inf")
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
        if IS_LEVEL == IS_TOKEN:
            log_ratio = is_log_ratio(logp, gen, old, IS_FROM_OLD)
        elif IS_LEVEL == IS_SEQUENCE or IS_LEVEL == IS_SEQUENCE_PRODUCT:
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
            R, adv_hat + tl.zeros_like(R), lo, hi, clip_high, delta, logp, tau_pos, tau_neg, phi,
            SURROGATE,
        )  # fmt: skip
        if SURROGATE == VESPO:  # phi stands in for the IS weight
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
            L_tok, dL_dlogp, dL_dR = add_k3_penalty(
                L_tok, dL_dlogp, dL_dR, u, R, beta, BIAS_KL, True
            )
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
        if IS_MODE == IS_TIS:
            trunc_n += tl.sum((m & ~in_band).to(tl.float32), axis=0)
        if IS_MODE == IS_MASK:
            masked_n += tl.sum((m & ~in_band).to(tl.float32), axis=0)
        raw_sum += tl.sum(tl.where(m, raw, 0.0), axis=0)
        raw_max = tl.maximum(raw_max, tl.max(tl.where(m, raw, -inf), axis=0))
        raw_min = tl.minimum(raw_min, tl.min(tl.where(m, raw, inf), axis=0))
    return (
        loss_acc, grad_r, clip_n, w_sum, trunc_n, masked_n, raw_sum, raw_max, raw_min, ent_sum,
        ent_loss,
    )  # fmt: skip


@triton.jit
def spread_pass(
    L, start, b, row0, mask_ptr, coef_ptr, spread, stride_mask_b, stride_mask_t,
    HAS_MASK: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """Pass 3, a sequence-level PPO ratio only: its gradient (spread, the same for each token)
    added to the coef of every completion token of the sample."""
    # Pass 2's coef stores, visible to every thread of the program before they are re-read.
    tl.debug_barrier()
    for j0 in range(0, L, BLOCK_T):
        j = j0 + tl.arange(0, BLOCK_T).to(tl.int64)
        inb = j < L
        m, mv = completion(mask_ptr, b, start + j, inb, stride_mask_b, stride_mask_t, HAS_MASK)
        c = tl.load(coef_ptr + row0 + j, mask=inb, other=0.0)
        tl.store(coef_ptr + row0 + j, c + tl.where(m, spread, 0.0), mask=inb)


@triton.jit
def store_parts(
    parts, loss, n, n_loss, clip_n, w_sum, trunc_n, masked_n, raw_sum, raw_max, raw_min,
    ent_sum, ent_loss, filtered, kl, probs,
):  # fmt: skip
    """The sample's row of partial sums (`PART_*`)."""
    tl.store(parts + PART_LOSS, loss)
    tl.store(parts + PART_TOKENS, n)
    tl.store(parts + PART_LOSS_TOKENS, n_loss)
    tl.store(parts + PART_CLIPPED, clip_n)
    tl.store(parts + PART_IS_WEIGHT, w_sum)
    tl.store(parts + PART_TRUNCATED, trunc_n)
    tl.store(parts + PART_MASKED, masked_n)
    tl.store(parts + PART_RATIO_SUM, raw_sum)
    tl.store(parts + PART_RATIO_MAX, raw_max)
    tl.store(parts + PART_RATIO_MIN, raw_min)
    tl.store(parts + PART_ENTROPY, ent_sum)
    tl.store(parts + PART_LOSS_ENTROPY, ent_loss)
    tl.store(parts + PART_FILTERED, filtered.to(tl.float32))
    tl.store(parts + PART_KL, kl)
    tl.store(parts + PART_PROBABILITIES, probs)
