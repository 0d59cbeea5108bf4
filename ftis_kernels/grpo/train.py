"""One GRPO update of a node on its own and its peers' samples, with `ftis_loss`.

The batch is cut into micro-batches whose gradients accumulate before one optimizer step (the
paper's one update per batch, so pi_old = stop_grad(pi_theta) and `old_logprobs` is None). Each
micro-batch's loss is weighted by its share of the batch's normaliser, so the accumulated gradient
equals the full batch's: samples for "grpo"/"dr_grpo", completion tokens for "bnpo"/"dapo".

A step whose loss or gradient is not finite is skipped whole (no parameter or optimizer state
changes): one peer sample that the trainer finds far likelier than its generator claims overflows
an untruncated IS weight (VIS), and a single NaN step would turn every parameter into NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Optional

import torch

from ftis_kernels import ftis_loss
from ftis_kernels.grpo.audit import sample_stats
from ftis_kernels.grpo.exchange import Sample
from ftis_kernels.grpo.rollout import left_pad
from ftis_kernels.options import FTISOptions


def build_batch(
    samples: Sequence[Sample],
    prompt_tokens: Callable[[int], list[int]],
    pad_id: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Model inputs and loss inputs of `samples`.

    Prompts are left-padded to P columns and completions right-padded to L, so completion token j
    of every row sits at column P + j and is scored by the logits at column P + j - 1.
    Returns input_ids, attention_mask, position_ids (B, P + L) int64; tokens (B, L) int64;
    gen_logprobs (B, L) float32; mask (B, L) bool; advantages (B,) float32.
    """
    prompt_ids, prompt_mask = left_pad([prompt_tokens(s.prompt_id) for s in samples], pad_id)
    B, L = len(samples), max(s.n_tokens for s in samples)
    tokens = torch.full((B, L), pad_id, dtype=torch.long)
    gen = torch.zeros((B, L), dtype=torch.float32)
    mask = torch.zeros((B, L), dtype=torch.bool)
    for i, s in enumerate(samples):
        tokens[i, : s.n_tokens] = s.tokens.long()
        gen[i, : s.n_tokens] = s.logprobs
        mask[i, : s.n_tokens] = True
    attention = torch.cat([prompt_mask, mask.long()], dim=1)
    batch = dict(
        input_ids=torch.cat([prompt_ids, tokens], dim=1),
        attention_mask=attention,
        position_ids=(attention.cumsum(dim=1) - 1).clamp(min=0),
        tokens=tokens,
        gen_logprobs=gen,
        mask=mask,
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
    )
    return {k: v.to(device) for k, v in batch.items()}


def completion_logits(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, L, V) logits with logits[b, j] scoring tokens[b, j] (the causal LM's, shifted by one)."""
    L = batch["tokens"].shape[1]
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        use_cache=False,
        logits_to_keep=L + 1,
    )
    return out.logits[:, :L]


def grpo_update(
    model,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[Sample],
    prompt_tokens: Callable[[int], list[int]],
    options: FTISOptions,
    *,
    micro_batch: int,
    pad_id: int,
    grad_clip: float,
    device: torch.device,
    per_sample: Optional[dict[str, list[float]]] = None,
) -> dict[str, float]:
    """One optimizer step on `samples`, skipped when the loss or the gradient is not finite.

    Returns loss, kl_mean, filtered_frac (per sample) and clip_frac, is_weight_mean,
    is_truncated_frac (per completion token) over the whole batch, grad_norm (before clipping) and
    skipped (1.0 when the step was skipped, else 0.0; `skip_cause` says why). A `per_sample` dict
    is filled with lists in `samples`' order: `audit.sample_stats`' kl, filtered and truncated.
    """
    model.train()
    n_samples = len(samples)
    n_tokens = sum(s.n_tokens for s in samples)
    by_tokens = options.loss_type in ("bnpo", "dapo", "cispo", "vespo")  # token means
    totals = dict.fromkeys(
        ("loss", "kl_mean", "filtered_frac", "clip_frac", "is_weight_mean", "is_truncated_frac"),
        0.0,
    )
    optimizer.zero_grad(set_to_none=True)
    for start in range(0, n_samples, micro_batch):
        chunk = samples[start : start + micro_batch]
        batch = build_batch(chunk, prompt_tokens, pad_id, device)
        logits = completion_logits(model, batch)
        loss, metrics = ftis_loss(
            logits,
            batch["tokens"],
            batch["gen_logprobs"],
            batch["advantages"],
            batch["mask"],
            **options.as_kwargs(),
        )
        chunk_tokens = int(batch["mask"].sum())
        share = chunk_tokens / max(n_tokens, 1) if by_tokens else len(chunk) / n_samples
        (loss * share).backward()
        if per_sample is not None:
            for key, values in sample_stats(metrics, batch, options).items():
                per_sample.setdefault(key, []).extend(values)
        token_share = chunk_tokens / max(n_tokens, 1)
        totals["loss"] += float(loss.detach()) * share
        totals["kl_mean"] += float(metrics["kl"].sum()) / n_samples
        totals["filtered_frac"] += float(metrics["filtered"].float().sum()) / n_samples
        for key in ("clip_frac", "is_weight_mean", "is_truncated_frac"):
            totals[key] += float(metrics[key]) * token_share
    params = [p for p in model.parameters() if p.requires_grad]
    # The norm before clipping: a non-finite one means a non-finite gradient (or one too large
    # for float32), and clipping would only spread it over every parameter.
    totals["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
    totals["skipped"] = float(skip_cause(totals) is not None)
    if not totals["skipped"]:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return totals


def skip_cause(stats: dict[str, float]) -> Optional[str]:
    """Why `grpo_update` skipped the step that produced `stats`; None when it was taken."""
    if not math.isfinite(stats["loss"]):
        return f"non-finite loss ({stats['loss']})"
    if not math.isfinite(stats["grad_norm"]):
        return f"non-finite gradient norm ({stats['grad_norm']})"
    return None
