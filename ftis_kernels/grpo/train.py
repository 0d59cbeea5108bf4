"""One GRPO update of a node on its own and its peers' samples, with `ftis_loss`.

The batch is cut into micro-batches whose gradients accumulate before one optimizer step (the
paper's one update per batch, so pi_old = stop_grad(pi_theta) and `old_logprobs` is None). Each
micro-batch's loss is weighted by its share of the batch's normaliser, so the accumulated gradient
equals the full batch's: samples for "grpo"/"dr_grpo", completion tokens for "bnpo"/"dapo"
(with `reject_mode="mask"` the tokens the filter kept, counted after each forward: the gradient
is divided by the batch's at the end), dr_grpo's L (`max_completion_length` when unset) the
batch's longest completion. The entropy bonus is a mean over the batch's completion tokens
whatever the loss type: where micro-batches are weighted by samples, each one's `entropy_coef` is
rescaled by its share of tokens over its share of samples (`RunConfig.validate` refuses the bonus
with `reject_mode="mask"` there, whose token count is known only after every forward).

A step whose loss or gradient is not finite is skipped whole (no parameter or optimizer state
changes): one peer sample that the trainer finds far likelier than its generator claims overflows
an untruncated IS weight (VIS), and a single NaN step would turn every parameter into NaN.

A micro-batch is laid out padded (`build_batch`: one row per sequence, prompts left-padded,
completions right-padded) or packed (`build_packed_batch`: whole prompt + completion sequences
concatenated into rows of at most `pack_row_tokens` tokens, no padding but at a row's end). A packed
row keeps its sequences apart by restarting `position_ids` at 0 for each, with no attention mask:
transformers then builds a block-diagonal causal mask for eager and sdpa attention
(`masking_utils.find_packed_sequence_indices`; a 2-D attention mask turns that off). Masked
attention still costs the square of a row's length, hence rows rather than one. The loss runs on the
completion rows alone, concatenated with `cu_seqlens`; it equals the padded step's loss, metrics and
gradients to float32 rounding (tests/test_grpo_pack.py).
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
from ftis_kernels.options import FTISOptions, loss_type


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


def pack_rows(lengths: Sequence[int], row_tokens: int) -> list[list[int]]:
    """Sequence indices per row: first-fit decreasing into rows of at most `row_tokens` tokens
    (a longer sequence gets a row of its own), each row's sequences in increasing index order."""
    rows: list[list[int]] = []
    fill: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = next((r for r, used in enumerate(fill) if used + lengths[i] <= row_tokens), None)
        if r is None:
            rows.append([i])
            fill.append(lengths[i])
        else:
            rows[r].append(i)
            fill[r] += lengths[i]
    return [sorted(row) for row in rows]


def build_packed_batch(
    samples: Sequence[Sample],
    prompt_tokens: Callable[[int], list[int]],
    pad_id: int,
    device: torch.device,
    row_tokens: int,
) -> dict[str, torch.Tensor]:
    """Model inputs and loss inputs of `samples`, packed.

    Each sample's prompt + completion is one sequence; `pack_rows` puts them into R rows of W
    tokens (W the fullest row's fill), positions restarting at 0 for each sequence and for the pad
    tokens that close a shorter row. Completion token j of sample s at column c of row r is scored
    by the hidden state at flat index r * W + c - 1.
    Returns input_ids, position_ids (R, W) int64; scored (N,) int64, the flat indices of the hidden
    states that score the N completion tokens, sample after sample; tokens (N,) int64;
    gen_logprobs (N,) float32; cu_seqlens (S + 1,) int64; advantages (S,) float32.
    """
    prompts = [prompt_tokens(s.prompt_id) for s in samples]
    lengths = [len(p) + s.n_tokens for p, s in zip(prompts, samples)]
    rows = pack_rows(lengths, row_tokens)
    W = max(sum(lengths[i] for i in row) for row in rows)
    input_ids = torch.full((len(rows), W), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), W), dtype=torch.long)
    first_scored = [0] * len(samples)  # flat index scoring each sample's first completion token
    for r, row in enumerate(rows):
        col = 0
        for i in row:
            sequence = prompts[i] + samples[i].tokens.tolist()
            input_ids[r, col : col + lengths[i]] = torch.tensor(sequence, dtype=torch.long)
            position_ids[r, col : col + lengths[i]] = torch.arange(lengths[i])
            first_scored[i] = r * W + col + len(prompts[i]) - 1
            col += lengths[i]
        position_ids[r, col:] = torch.arange(W - col)
    scored = [torch.arange(s.n_tokens) + first_scored[i] for i, s in enumerate(samples)]
    batch = dict(
        input_ids=input_ids,
        position_ids=position_ids,
        scored=torch.cat(scored),
        tokens=torch.cat([s.tokens.long() for s in samples]),
        gen_logprobs=torch.cat([s.logprobs.float() for s in samples]),
        cu_seqlens=torch.tensor([0] + [s.n_tokens for s in samples]).cumsum(0),
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
    )
    return {k: v.to(device) for k, v in batch.items()}


def packed_completion_logits(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N, V) logits with logits[k] scoring tokens[k], from a `build_packed_batch` batch.

    No attention mask, so that the restarting position_ids alone delimit the sequences. The
    lm-head sees only the N scoring hidden states: a pre-hook gathers them, since `logits_to_keep`
    takes one set of columns for every row, and anything the model applies after its lm-head
    (a logit scale or soft-cap) still applies.
    """
    scored = batch["scored"]

    def gather(module, args):
        hidden = args[0]
        return (hidden.reshape(-1, hidden.shape[-1])[scored].unsqueeze(0), *args[1:])

    hook = model.get_output_embeddings().register_forward_pre_hook(gather)
    try:
        out = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        )
    finally:
        hook.remove()
    return out.logits[0]


def packing_keeps_sequences_apart(model, vocab_size: int, atol: float = 1e-4) -> bool:
    """True when `model` gives two sequences packed in one row (position_ids restarting, no
    attention mask) the logits it gives each alone; a model whose attention ignores the restart
    lets the second sequence see the first. Two forward passes of 7 tokens, no gradient."""
    g = torch.Generator().manual_seed(0)
    device = model.get_input_embeddings().weight.device
    first, second = (torch.randint(0, vocab_size, (1, n), generator=g).to(device) for n in (3, 4))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]], device=device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        packed = model(
            input_ids=torch.cat([first, second], dim=1), position_ids=positions, use_cache=False
        ).logits[0, 3:]
        alone = model(input_ids=second, use_cache=False).logits[0]
    model.train(was_training)
    return bool(torch.allclose(packed, alone, rtol=0, atol=atol))


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
    pack_row_tokens: Optional[int] = None,
    per_sample: Optional[dict[str, list[float]]] = None,
) -> dict[str, float]:
    """One optimizer step on `samples`, skipped when the loss or the gradient is not finite.

    Micro-batches of `micro_batch` samples, packed into rows of at most `pack_row_tokens` tokens,
    or padded when it is None (the module docstring).

    Returns loss, kl_mean, filtered_frac (per sample) and clip_frac, is_weight_mean,
    is_truncated_frac (per completion token) over the whole batch, grad_norm (before clipping) and
    skipped (1.0 when the step was skipped, else 0.0; `skip_cause` says why). A `per_sample` dict
    is filled with lists in `samples`' order: `audit.sample_stats`' kl, filtered and truncated.
    """
    model.train()
    n_samples = len(samples)
    n_tokens = sum(s.n_tokens for s in samples)
    by_tokens = loss_type(options.loss_type).batch_normalised  # token means
    # Token means whose rejected samples leave the mask divide by the tokens the filter kept, known
    # only after each forward: each micro-batch's loss is weighted by its kept tokens, the sum
    # divided by the batch's at the end.
    by_kept = by_tokens and options.reject_mode == "mask"
    kept_total = 0
    if loss_type(options.loss_type).reduction == "constant" and not options.max_completion_length:
        # dr_grpo's L unset is the call's longest completion: the batch's, not each chunk's.
        options = options.replace(
            max_completion_length=max((s.n_tokens for s in samples), default=1)
        )
    totals = dict.fromkeys(
        ("loss", "kl_mean", "filtered_frac", "clip_frac", "is_weight_mean", "is_truncated_frac"),
        0.0,
    )
    optimizer.zero_grad(set_to_none=True)
    for start in range(0, n_samples, micro_batch):
        chunk = samples[start : start + micro_batch]
        if pack_row_tokens is None:
            batch = build_batch(chunk, prompt_tokens, pad_id, device)
            logits, mask, packing = completion_logits(model, batch), batch["mask"], {}
        else:
            batch = build_packed_batch(chunk, prompt_tokens, pad_id, device, pack_row_tokens)
            logits, mask = packed_completion_logits(model, batch), None
            packing = dict(cu_seqlens=batch["cu_seqlens"])
        chunk_tokens = sum(s.n_tokens for s in chunk)
        share = chunk_tokens / max(n_tokens, 1) if by_tokens else len(chunk) / n_samples
        chunk_options = options
        if options.entropy_coef > 0 and not by_tokens:  # the bonus: a mean over the batch's tokens
            token_share = chunk_tokens / max(n_tokens, 1)
            chunk_options = options.replace(entropy_coef=options.entropy_coef * token_share / share)
        loss, metrics = ftis_loss(
            logits,
            batch["tokens"],
            batch["gen_logprobs"],
            batch["advantages"],
            mask,
            **packing,
            options=chunk_options,
            # The backward below: a gradient written in the forward is final (an empty chunk's
            # share is 0, which scales nothing: not announced; nor is a share by kept tokens).
            grad_scale=None if by_kept else share or None,
        )
        if by_kept:
            kept = metrics["filtered"].logical_not().cpu().tolist()
            share = sum(s.n_tokens for s, k in zip(chunk, kept) if k)
            kept_total += share
        (loss * share).backward()
        if per_sample is not None:
            for key, values in sample_stats(metrics).items():
                per_sample.setdefault(key, []).extend(values)
        token_share = chunk_tokens / max(n_tokens, 1)
        totals["loss"] += float(loss.detach()) * share
        totals["kl_mean"] += float(metrics["kl"].sum()) / n_samples
        totals["filtered_frac"] += float(metrics["filtered"].float().sum()) / n_samples
        for key in ("clip_frac", "is_weight_mean", "is_truncated_frac"):
            totals[key] += float(metrics[key]) * token_share
    params = [p for p in model.parameters() if p.requires_grad]
    if by_kept:
        totals["loss"] /= max(kept_total, 1)
        for p in params:
            if p.grad is not None:
                p.grad.div_(max(kept_total, 1))
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
