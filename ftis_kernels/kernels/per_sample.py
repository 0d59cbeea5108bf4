"""The per-sample part of the loss in Triton: two launches between the row passes, no host read.

`_per_sample_kernel`, one program per sample, reads the sample's (B, T) per-token values (log
pi_theta and the row statistics from the forward row kernel, the caller's tokens, gen/old/ref
log-probabilities, mask and advantage) in blocks of BLOCK_T tokens, in up to three passes; the
kernel's body is the list of its phases, each a function of `sample_passes.py`:
1. the sums the sample's decisions need: n_i, KL_i, the sequence-level log ratios; and the value
   checks of every input (docs/method.md §2, "Errors"); then the sample's decision (its KL, the
   filter) and its normaliser; with VESPO, a pass for its sequence weight;
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

The value checks (`value_checks.py`): per sample and check, (count of bad positions, the first one
as a flat index, its value), float64, reduced by `sample_reduce.py` into the record that
`validate.raise_on_faults` reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ftis_kernels.kernels.loss_terms import sample_normaliser
from ftis_kernels.kernels.sample_passes import (
    N_PARTS,
    decide,
    loss_pass,
    sample_span,
    sequence_ratios,
    spread_pass,
    store_parts,
    sums_and_checks,
    vespo_pass,
)
from ftis_kernels.kernels.switches import VESPO, sample_switches
from ftis_kernels.kernels.tl_utils import launch
from ftis_kernels.kernels.value_checks import N_CHECKS, store_checks
from ftis_kernels.validate import Rows

# Outputs of `_finish_kernel` besides the loss: the scalar metrics in per_sample.METRIC_NAMES
# order, then the two backward scales.
N_SCALAR_METRICS = tl.constexpr(10)
BLOCK_T = 256
BLOCK_S = 256


# --- the kernel -----------------------------------------------------------------------------------


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
    # meta-parameters (`switches.sample_switches`, then the heuristics above)
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
    start, L, b, row0 = sample_span(s, cu_seqlens_ptr, stride_cu, T, PACKED)
    adv = tl.load(adv_ptr + s * stride_adv).to(tl.float32)
    adv64 = tl.load(adv_ptr + s * stride_adv).to(tl.float64)

    # 1. The sample's sums, and the value checks.
    (
        n, kl_acc, kl_max, is_sum, r_sum, probs,
        c0, f0, v0, c1, f1, v1, c2, f2, v2, c4, f4, v4, c5, f5, v5, c6, f6, v6,
    ) = sums_and_checks(
        s, adv64, start, L, b, row0,
        logp_ptr, row_max_ptr, log_sum_ptr, tokens_ptr, gen_ptr, mask_ptr, old_ptr, ref_ptr, V,
        stride_tok_b, stride_tok_t, stride_gen_b, stride_gen_t, stride_mask_b, stride_mask_t,
        stride_old_b, stride_old_t, stride_ref_b, stride_ref_t,
        KL_ESTIMATOR, KL_FROM_OLD, IS_LEVEL, IS_FROM_OLD, RATIO_SEQ, MASK_IS_BOOL,
        HAS_MASK, HAS_OLD, HAS_REF, BLOCK_T,
    )  # fmt: skip
    # The sample's decision, its normaliser, its sequence-level ratios.
    kl, filtered, adv_hat, has_adv, in_loss, n_loss, n_safe = decide(
        n, kl_acc, kl_max, adv, kl_threshold, kl_threshold_low, KL_REDUCTION, FILTER, REJECT_MASK
    )
    factor = sample_normaliser(n, n_loss, n_samples, length, REDUCTION)
    log_ratio_seq, R_seq = sequence_ratios(is_sum, r_sum, n_safe, IS_LEVEL)
    # 1b. VESPO's sequence weight.
    phi = 0.0
    if SURROGATE == VESPO:
        phi = vespo_pass(
            L, start, b, row0, logp_ptr, gen_ptr, mask_ptr, old_ptr,
            stride_gen_b, stride_gen_t, stride_mask_b, stride_mask_t, stride_old_b, stride_old_t,
            is_cap, is_cap_min, in_loss, adv_hat, vk_pos, vl_pos, vk_neg, vl_neg,
            IS_MODE, IS_FROM_OLD, HAS_MASK, HAS_OLD, BLOCK_T,
        )  # fmt: skip
    # 2. Per token: the loss, coef = d loss / d logp, the metrics' partial sums.
    (
        loss_acc, grad_r, clip_n, w_sum, trunc_n, masked_n, raw_sum, raw_max, raw_min, ent_sum,
        ent_loss,
    ) = loss_pass(
        L, start, b, row0, logp_ptr, entropy_ptr, gen_ptr, mask_ptr, old_ptr, ref_ptr,
        coef_ptr, ecoef_ptr,
        stride_gen_b, stride_gen_t, stride_mask_b, stride_mask_t, stride_old_b, stride_old_t,
        stride_ref_b, stride_ref_t,
        in_loss, adv_hat, has_adv, factor, log_ratio_seq, R_seq, phi,
        is_cap, is_cap_min, lo, hi, clip_high, delta, beta, tau_pos, tau_neg,
        IS_MODE, IS_LEVEL, IS_FROM_OLD, SURROGATE, RATIO_SEQ, BIAS_KL,
        HAS_MASK, HAS_OLD, HAS_REF, ENTROPY_GRAD, BLOCK_T,
    )  # fmt: skip
    # 3. A sequence-level R's gradient reaches every token of the sample.
    if RATIO_SEQ:
        spread = grad_r * R_seq / n_safe * factor
        spread_pass(
            L, start, b, row0, mask_ptr, coef_ptr, spread, stride_mask_b, stride_mask_t,
            HAS_MASK, BLOCK_T,
        )  # fmt: skip

    tl.store(kl_ptr + s, kl)
    tl.store(filtered_ptr + s, filtered)
    tl.store(truncated_ptr + s, trunc_n / n_safe)
    store_parts(
        parts_ptr + s * N_PARTS, loss_acc * factor, n, n_loss, clip_n, w_sum, trunc_n, masked_n,
        raw_sum, raw_max, raw_min, ent_sum, ent_loss, filtered, kl, probs,
    )  # fmt: skip
    store_checks(
        faults_ptr + s * (N_CHECKS * 3), s, adv, adv64,
        c0, f0, v0, c1, f1, v1, c2, f2, v2, c4, f4, v4, c5, f5, v5, c6, f6, v6,
    )  # fmt: skip


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
    stride_tok_b, stride_tok_t = rows.tokens.stride()
    stride_gen_b, stride_gen_t = rows.gen_logprobs.stride()
    stride_mask_b, stride_mask_t = _strides(mask)
    stride_old_b, stride_old_t = _strides(old)
    stride_ref_b, stride_ref_t = _strides(ref)
    launch(
        _per_sample_kernel,
        (count,),
        logp_ptr=logp,
        entropy_ptr=entropy,
        row_max_ptr=row_max,
        log_sum_ptr=log_sum,
        tokens_ptr=rows.tokens,
        gen_ptr=rows.gen_logprobs,
        mask_ptr=mask,
        old_ptr=old,
        ref_ptr=ref,
        adv_ptr=rows.advantages,
        cu_seqlens_ptr=cu_seqlens,
        coef_ptr=out.coef,
        ecoef_ptr=out.ecoef,
        kl_ptr=out.kl,
        filtered_ptr=out.filtered,
        truncated_ptr=out.truncated,
        parts_ptr=out.parts,
        faults_ptr=out.faults,
        kl_threshold=float(opt.kl_threshold),
        kl_threshold_low=-math.inf if opt.kl_threshold_low is None else float(opt.kl_threshold_low),
        is_cap=float(opt.is_cap),
        is_cap_min=0.0 if opt.is_cap_min is None else float(opt.is_cap_min),
        lo=1.0 - opt.epsilon,
        hi=1.0 + opt.clip_high,
        clip_high=float(opt.clip_high),
        delta=math.inf if opt.delta is None else float(opt.delta),
        beta=float(opt.beta),
        tau_pos=float(opt.sapo_temperature_pos),
        tau_neg=float(opt.sapo_temperature_neg),
        vk_pos=float(opt.vespo_k_pos),
        vl_pos=float(opt.vespo_lambda_pos),
        vk_neg=float(opt.vespo_k_neg),
        vl_neg=float(opt.vespo_lambda_neg),
        T=logp.shape[1],
        n_samples=n_samples,
        sample_offset=first,
        V=V,
        length=length,
        stride_tok_b=stride_tok_b,
        stride_tok_t=stride_tok_t,
        stride_gen_b=stride_gen_b,
        stride_gen_t=stride_gen_t,
        stride_mask_b=stride_mask_b,
        stride_mask_t=stride_mask_t,
        stride_old_b=stride_old_b,
        stride_old_t=stride_old_t,
        stride_ref_b=stride_ref_b,
        stride_ref_t=stride_ref_t,
        stride_adv=rows.advantages.stride(0),
        stride_cu=0 if cu_seqlens is None else cu_seqlens.stride(0),
        **sample_switches(opt, old is not None, mask),
        BLOCK_T=BLOCK_T,
        num_warps=4,
    )
