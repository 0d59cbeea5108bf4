"""The reduction over samples that ends the forward: one program, after `per_sample.py`.

`_finish_kernel` reads the samples' partial sums and value checks (`per_sample.SampleOutputs`) and
writes the loss, the scalar metrics, the two scales the backward applies (the batch-wide
normaliser and the entropy bonus's) and the value-check record, in a fixed order: the result does
not depend on scheduling, and nothing is read back to the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftis_kernels.kernels.per_sample import N_SCALAR_METRICS, SampleOutputs
from ftis_kernels.kernels.sample_passes import (
    N_PARTS,
    PART_CLIPPED,
    PART_ENTROPY,
    PART_FILTERED,
    PART_IS_WEIGHT,
    PART_KL,
    PART_LOSS,
    PART_LOSS_ENTROPY,
    PART_LOSS_TOKENS,
    PART_MASKED,
    PART_PROBABILITIES,
    PART_RATIO_MAX,
    PART_RATIO_MIN,
    PART_RATIO_SUM,
    PART_TOKENS,
    PART_TRUNCATED,
)
from ftis_kernels.kernels.switches import CHECK_ADVANTAGES, CHECK_GEN, CHECK_LOGITS
from ftis_kernels.kernels.tl_utils import launch
from ftis_kernels.kernels.value_checks import BIG, N_CHECKS, RECORD_COLUMNS
from ftis_kernels.options import loss_type

BLOCK_S = 256


@triton.jit(do_not_specialize=["n_samples", "B", "T", "V"])
def _finish_kernel(
    # pointers
    parts_ptr,  # (S, N_PARTS) fp32
    faults_ptr,  # (S, N_CHECKS, 3) fp64
    loss_ptr,  # () fp32 out
    scalars_ptr,  # (N_SCALAR_METRICS + 2,) fp32 out: the scalar metrics, then the two scales
    record_ptr,  # (N_CHECKS, RECORD_COLUMNS) fp64 out: the value checks
    # scalars
    entropy_coef,
    from_hidden,  # 1.0 when the logits come from hidden states (the error names hidden)
    # sizes
    n_samples,
    B,  # the per-token tensors' shape as the caller gave it (packed: N, 0)
    T,
    V,
    # meta-parameters
    BATCH_MEAN: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    inf = float("inf")
    loss = 0.0
    n = 0.0
    n_loss = 0.0
    clip_n = 0.0
    w_sum = 0.0
    trunc_n = 0.0
    masked_n = 0.0
    raw_sum = 0.0
    raw_max = -inf
    raw_min = inf
    ent_sum = 0.0
    ent_loss = 0.0
    filtered_n = 0.0
    kl_sum = 0.0
    probs = 0.0
    for s0 in range(0, n_samples, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S).to(tl.int64)
        ok = s < n_samples
        row = parts_ptr + s * N_PARTS
        loss += tl.sum(tl.load(row + PART_LOSS, mask=ok, other=0.0), axis=0)
        n += tl.sum(tl.load(row + PART_TOKENS, mask=ok, other=0.0), axis=0)
        n_loss += tl.sum(tl.load(row + PART_LOSS_TOKENS, mask=ok, other=0.0), axis=0)
        clip_n += tl.sum(tl.load(row + PART_CLIPPED, mask=ok, other=0.0), axis=0)
        w_sum += tl.sum(tl.load(row + PART_IS_WEIGHT, mask=ok, other=0.0), axis=0)
        trunc_n += tl.sum(tl.load(row + PART_TRUNCATED, mask=ok, other=0.0), axis=0)
        masked_n += tl.sum(tl.load(row + PART_MASKED, mask=ok, other=0.0), axis=0)
        raw_sum += tl.sum(tl.load(row + PART_RATIO_SUM, mask=ok, other=0.0), axis=0)
        raw_max = tl.maximum(
            raw_max, tl.max(tl.load(row + PART_RATIO_MAX, mask=ok, other=-inf), axis=0)
        )
        raw_min = tl.minimum(
            raw_min, tl.min(tl.load(row + PART_RATIO_MIN, mask=ok, other=inf), axis=0)
        )
        ent_sum += tl.sum(tl.load(row + PART_ENTROPY, mask=ok, other=0.0), axis=0)
        ent_loss += tl.sum(tl.load(row + PART_LOSS_ENTROPY, mask=ok, other=0.0), axis=0)
        filtered_n += tl.sum(tl.load(row + PART_FILTERED, mask=ok, other=0.0), axis=0)
        kl_sum += tl.sum(tl.load(row + PART_KL, mask=ok, other=0.0), axis=0)
        probs += tl.sum(tl.load(row + PART_PROBABILITIES, mask=ok, other=0.0), axis=0)
    n_live = tl.maximum(n, 1.0)
    n_all = tl.maximum(n_loss, 1.0)
    if BATCH_MEAN:
        scale = 1.0 / n_all
    else:
        scale = 1.0 + 0.0 * n_all
    bonus = tl.where(entropy_coef > 0, entropy_coef * (ent_loss / n_all), 0.0)
    tl.store(loss_ptr, loss * scale - bonus)
    tl.store(scalars_ptr + 0, filtered_n / n_samples)
    tl.store(scalars_ptr + 1, kl_sum / n_samples)
    tl.store(scalars_ptr + 2, clip_n / n_live)
    tl.store(scalars_ptr + 3, w_sum / n_live)
    tl.store(scalars_ptr + 4, trunc_n / n_live)
    tl.store(scalars_ptr + 5, masked_n / n_live)
    tl.store(scalars_ptr + 6, raw_sum / n_live)
    tl.store(scalars_ptr + 7, tl.where(n > 0, raw_max, 0.0))
    tl.store(scalars_ptr + 8, tl.where(n > 0, raw_min, 0.0))
    tl.store(scalars_ptr + 9, ent_sum / n_live)
    tl.store(scalars_ptr + N_SCALAR_METRICS, scale)
    tl.store(scalars_ptr + N_SCALAR_METRICS + 1, -entropy_coef / n_all)
    # The value checks: counts summed, the first bad position over every sample, its value.
    for check in tl.static_range(N_CHECKS):
        count = tl.zeros([], dtype=tl.float64)
        first = tl.zeros([], dtype=tl.float64) + BIG
        value = tl.zeros([], dtype=tl.float64)
        for s0 in range(0, n_samples, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S).to(tl.int64)
            ok = s < n_samples
            cell = faults_ptr + s * (N_CHECKS * 3) + check * 3
            count += tl.sum(tl.load(cell + 0, mask=ok, other=0.0), axis=0)
            f = tl.load(cell + 1, mask=ok, other=BIG)
            v = tl.load(cell + 2, mask=ok, other=0.0)
            block_first = tl.min(f, axis=0)
            block_value = tl.sum(tl.where(f == block_first, v, 0.0), axis=0)
            value = tl.where(block_first < first, block_value, value)
            first = tl.minimum(first, block_first)
        hint = tl.zeros([], dtype=tl.float32)
        if check == CHECK_GEN:  # gen_logprobs that all look like probabilities
            hint = tl.where((n > 0) & (probs == n), 1.0, 0.0)
        if check == CHECK_LOGITS:  # the logits: whose (their hint flag: from hidden states)
            hint = tl.zeros([], dtype=tl.float32) + from_hidden
        if check == CHECK_ADVANTAGES:  # advantages: (S,)
            dim0 = n_samples + 0 * B
            dim1 = 0 * B
        else:
            dim0 = B + 0 * n_samples
            dim1 = T + 0 * B
        out = record_ptr + check * RECORD_COLUMNS
        tl.store(out + 0, count)
        tl.store(out + 1, tl.where(count > 0, first, 0.0))
        tl.store(out + 2, value)
        tl.store(out + 3, hint.to(tl.float64))
        tl.store(out + 4, dim0.to(tl.float64))
        tl.store(out + 5, dim1.to(tl.float64))
        tl.store(out + 6, (V + 0 * B).to(tl.float64))


def finish_fwd(
    out: SampleOutputs, opt, shape: tuple[int, int], V: int, from_hidden: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch: (loss () fp32, scalars (N_SCALAR_METRICS + 2,) fp32 = the scalar metrics then
    the backward's two scales, the value-check record (N_CHECKS, RECORD_COLUMNS) fp64) from the
    per-sample outputs; shape = the per-token tensors' (B, T) as the caller gave them ((N, 0)
    packed)."""
    device = out.parts.device
    loss = torch.empty((), dtype=torch.float32, device=device)
    scalars = torch.empty(N_SCALAR_METRICS.value + 2, dtype=torch.float32, device=device)
    record = torch.empty(N_CHECKS.value, RECORD_COLUMNS.value, dtype=torch.float64, device=device)
    launch(
        _finish_kernel,
        (1,),
        parts_ptr=out.parts,
        faults_ptr=out.faults,
        loss_ptr=loss,
        scalars_ptr=scalars,
        record_ptr=record,
        entropy_coef=float(opt.entropy_coef),
        from_hidden=float(from_hidden),
        n_samples=out.parts.shape[0],
        B=shape[0],
        T=shape[1],
        V=V,
        BATCH_MEAN=loss_type(opt.loss_type).batch_normalised,
        BLOCK_S=BLOCK_S,
        num_warps=4,
    )
    return loss, scalars, record
