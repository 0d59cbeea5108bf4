"""Packed (padding-free) batches: completions concatenated along one token axis, sample s owning
the tokens cu_seqlens[s] : cu_seqlens[s + 1] (the flash-attention / TRL convention).

The row passes treat a packed batch as one sample of N rows: each row is independent, so they need
no segment lookup at all. The per-sample part (`per_sample.py`) is not rewritten for packing: its
(N,) inputs are scattered into an (S, L) layout (L the longest segment, O(S * L) floats, never
anything of size V), it runs unchanged, and its per-token outputs (d loss / d logp, d loss / d
entropy, the per-token metrics) are gathered back. The result is what the padded call gives on the
same data (with dr_grpo's constant L = max_completion_length, or the longest segment when unset).
"""

from __future__ import annotations

from typing import Optional

import torch

from ftis_kernels.options import FTISOptions
from ftis_kernels.per_sample import PerSample, per_sample_loss
from ftis_kernels.validate import Rows


def check_cu_seqlens(cu_seqlens: object, N: int, device: torch.device) -> tuple[int, int]:
    """cu_seqlens (S + 1,) int32 | int64: starts at 0, non-decreasing, ends at N (one
    synchronisation). Returns (S, the longest segment)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens: expected a 1-D tensor of S + 1 >= 2 offsets, got "
            f"{tuple(cu_seqlens.shape) if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens!r}"
        )
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens: expected dtype int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens: expected a tensor on {device}, got {cu_seqlens.device}")
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens: expected offsets starting at 0, got {offsets[0]} first")
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    if min(lengths) < 0:
        s = next(i for i, n in enumerate(lengths) if n < 0)
        raise ValueError(
            f"cu_seqlens: expected non-decreasing offsets, got {offsets[s]} then {offsets[s + 1]}"
            f" at {s}"
        )
    if offsets[-1] != N:
        raise ValueError(
            f"cu_seqlens: expected offsets ending at N = {N} (the packed token count), got "
            f"{offsets[-1]}"
        )
    return len(lengths), max(lengths)


def packed_rows(N: int, rows: Rows) -> Rows:
    """The per-token row tensors (all but advantages) given as (N,) or (1, N), as (1, N) views;
    anything else unchanged (the shape check then names it)."""

    def view(x: object) -> object:
        if isinstance(x, torch.Tensor) and tuple(x.shape) in ((N,), (1, N)):
            return x.reshape(1, N)
        return x

    return Rows(*(x if name == "advantages" else view(x) for name, x in zip(Rows._fields, rows)))


def segment_index(cu_seqlens: torch.Tensor, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sample, position in the sample), each (N,) int64, of every packed token."""
    offsets = cu_seqlens.long()
    token = torch.arange(N, device=cu_seqlens.device)
    sample = torch.searchsorted(offsets[1:], token, right=True)
    return sample, token - offsets[sample]


def per_sample_part(
    logp: torch.Tensor,
    rows: Rows,
    opt: FTISOptions,
    entropy: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    max_seqlen: int,
) -> PerSample:
    """`per_sample_loss` on (B, T) inputs, or on packed (1, N) inputs with cu_seqlens (S + 1,)
    and advantages (S,); the per-token results keep the inputs' layout. rows.mask is bool or
    None; rows.tokens is not read."""
    if cu_seqlens is None:
        return _per_sample_loss(logp, rows, opt, entropy)
    N = logp.numel()
    index = segment_index(cu_seqlens.to(logp.device), N)
    shape = (rows.advantages.shape[0], max_seqlen)

    def pad(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if x is None else x.new_zeros(shape).index_put_(index, x.reshape(N))

    live = torch.ones(N, dtype=torch.bool, device=logp.device) if rows.mask is None else rows.mask
    padded_mask = torch.zeros(shape, dtype=torch.bool, device=logp.device)
    padded_mask.index_put_(index, live.reshape(N))
    padded = rows._replace(  # tokens are not read here: left as they are
        gen_logprobs=pad(rows.gen_logprobs),
        mask=padded_mask,
        old_logprobs=pad(rows.old_logprobs),
        ref_logprobs=pad(rows.ref_logprobs),
    )
    result = _per_sample_loss(pad(logp), padded, opt, pad(entropy))

    def unpad(x: torch.Tensor) -> torch.Tensor:
        return x[index].reshape(logp.shape)

    metrics = dict(result.metrics, logp=unpad(result.metrics["logp"]))
    metrics["entropy"] = unpad(result.metrics["entropy"])
    return PerSample(result.loss, unpad(result.coef), unpad(result.entropy_coef), metrics)


def _per_sample_loss(
    logp: torch.Tensor, rows: Rows, opt: FTISOptions, entropy: Optional[torch.Tensor]
) -> PerSample:
    """`per_sample_loss` of (B, T) rows (mask bool or None; tokens are not read)."""
    return per_sample_loss(
        logp,
        rows.gen_logprobs,
        rows.advantages,
        rows.mask,
        rows.old_logprobs,
        rows.ref_logprobs,
        opt,
        entropy,
    )
