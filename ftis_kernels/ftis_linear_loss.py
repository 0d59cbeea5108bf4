"""`ftis_linear_loss`: the F-TIS loss from the last hidden states and the lm-head, without ever
materialising the (B, T, V) logits (docs/method.md §2, applied to `hidden @ weight.T + bias`).

The completion positions are processed in chunks of rows (`chunks.py`, the chunk engine). For
each chunk, one matmul gives the chunk's logits (c, V) in the hidden dtype, and the row passes of
`ftis_loss` (`kernels/`) read them for log pi_theta of the taken token and the row's statistics.
The per-sample part (`per_sample.py`) needs every token of a sample (KL filter, sequence-level
weight, normaliser) and yields the loss, the metrics and coef = d loss / d logp. The gradients
follow in one of two orders, with the same results:

- In the forward (6 N H V FLOPs, as Liger's chunked losses do), when every chunk holds whole
  samples and a sample's coef depends on no other sample's logits (`grad_in_forward_blocker`):
  each chunk's coef is known as soon as its logits are, so the row backward kernel overwrites
  them at once with dlogits = coef * (onehot - softmax) / temperature and two matmuls accumulate
  grad_hidden and grad_weight (fp32 accumulation), for an incoming gradient of 1; the backward
  only multiplies them by the incoming gradient (in place, nothing at 1).
- In the backward (8 N H V FLOPs): each chunk's logits are recomputed, turned into dlogits and
  fed to the same two matmuls.

Rows without gradient (masked, filtered, zero advantage) are skipped by the matmuls of the
gradients, and masked rows are never read, so their hidden states may hold anything.

Extra memory is bounded independently of B * T: one chunk of logits, at most
max(chunks.AUTO_CHUNK_ELEMENTS, chunks.AUTO_SAMPLE_CHUNK_ELEMENTS) of them with chunk_size=None
(c * V in the hidden dtype, plus the CPU row passes' fp32 scratch; in the forward order a chunk
with rows without gradient copies out its other rows, up to a second chunk), for bf16/fp16
weights an fp32 grad_weight accumulator and one fp32 partial product of
chunks.GRAD_WEIGHT_BLOCK_V vocabulary rows, and O(B * T) per-token scalars
(`bench/linear_memory.py` measures it). In the forward order the gradients exist from the forward
on instead of from the backward on.

This is the "cuBLAS matmul per chunk + the row kernels" design. The matmul itself is torch's
(cuBLAS on GPU, oneDNN/MKL on CPU); only the row passes are Triton. Fusing the log-sum-exp into a
Triton matmul epilogue (Cut Cross-Entropy style) would drop the chunk buffer and one read of it.

Dispatch, by where `hidden` lives, exactly as `ftis_loss`: CUDA -> Triton row kernels; CPU with
the kernels decorated under TRITON_INTERPRET=1 -> the same kernels, interpreted; CPU otherwise ->
the chunked PyTorch row passes. The custom-op plumbing shared with `ftis_loss` is in
`custom_op.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from ftis_kernels import chunks, custom_op
from ftis_kernels.kernels import select_backend
from ftis_kernels.options import (
    FTISOptions,
    OptionKeywords,
    loss_type,
    option_args,
    resolve_options,
    with_option_keywords,
)
from ftis_kernels.packing import segment_index
from ftis_kernels.per_sample import PerSample
from ftis_kernels.sharded import all_reduce_sum, group_name
from ftis_kernels.validate import LOGIT_DTYPES, check_tensor

if TYPE_CHECKING:
    from typing_extensions import Unpack


def grad_in_forward_blocker(
    opt: FTISOptions, *, with_old: bool, sharded: bool, longest: int, chunk_size: int
) -> Optional[str]:
    """Why the forward cannot compute the gradients chunk by chunk (a phrase), or None when it
    can: every chunk must hold whole samples (`longest` completion rows a sample can have, at
    most `chunk_size`), and one sample's d loss / d logp must depend on no other sample's logits.

    Per sample, the KL filter, the sequence-level IS weight and PPO ratio, VESPO's weight and
    grpo/sapo's per-sample token count read that sample's tokens only. What couples samples
    (`per_sample.py`): rejection by mask (`reject_mode="mask"`) that depends on pi_theta (a
    KL filter on the current policy) takes a rejected sample's tokens out of the batch-wide
    token count of the batch-normalised loss types (`options.LOSS_TYPE_TABLE`) and of the entropy
    bonus; a sharded vocabulary completes each row's statistics only with an all-reduce after the
    forward.
    """
    if sharded:
        return (
            "with a vocabulary-sharded lm-head (process_group: the row statistics are complete "
            "only after an all-reduce)"
        )
    filter_reads_logp = opt.filter not in (None, "negative") and (
        opt.kl_source == "current" or not with_old
    )
    if opt.reject_mode == "mask" and filter_reads_logp:
        why = "(a sample's rejection changes every sample's normaliser)"
        if loss_type(opt.loss_type).batch_normalised:
            return f"with reject_mode='mask' and loss_type={opt.loss_type!r} {why}"
        if opt.entropy_coef > 0:
            return f"with reject_mode='mask' and entropy_coef > 0 {why}"
    if longest > chunk_size:
        return (
            f"when a sample ({longest} rows) does not fit in a chunk of chunk_size={chunk_size} "
            "rows (raise chunk_size)"
        )
    return None


_FWD = custom_op.ForwardSignature(
    leading=(("Tensor", "hidden"), ("Tensor", "weight"), ("Tensor?", "bias")),
    trailing=(
        ("int", "chunk_size"),
        ("str", "backend"),
        ("bool", "grad_in_forward"),
        ("bool", "need_hidden"),
        ("bool", "need_weight"),
        ("bool", "need_bias"),
    ),
    extra_outputs=3,
)


def _ftis_linear_loss_fwd_impl(*inputs):
    """The outputs of `ftis_loss`'s forward op, then grad_hidden, grad_weight, grad_bias for an
    incoming gradient of 1 when grad_in_forward (those flagged need_*; an empty tensor for the
    others and in the backward order)."""
    args = _FWD.bind(inputs)
    opt = _FWD.options(args)
    hidden, weight, bias = args["hidden"], args["weight"], args["bias"]
    chunk_size, backend = args["chunk_size"], args["backend"]
    B, T, _ = hidden.shape
    mask = custom_op.completion_mask(args)
    rows = chunks.completion_rows(mask, B, T, hidden.device)
    shard = custom_op.Shard.of(args, hidden.device, weight.shape[0], hidden.shape[2])
    # Chunks of whole samples when they fit (in both orders, so that both compute the same
    # logits), else of chunk_size rows.
    cu_seqlens = args["cu_seqlens"]
    samples = rows[0] if cu_seqlens is None else segment_index(cu_seqlens, T)[0][rows[1]]
    sample_chunks = chunks.sample_chunks(rows, samples, chunk_size)
    needs = (args["need_hidden"], args["need_weight"], args["need_bias"])
    grads = (None, None, None)
    if args["grad_in_forward"]:
        if sample_chunks is None:  # the public function checked the longest sample
            raise AssertionError("grad_in_forward with a sample longer than chunk_size")

        def coefficients(logp: torch.Tensor, entropy: torch.Tensor) -> PerSample:
            return custom_op.per_sample(args, opt, mask, logp, entropy)

        loop = (opt.temperature, opt.entropy_coef > 0, backend, needs)
        stats, grads = chunks.linear_loss_and_grads(
            hidden, weight, bias, shard.tokens, sample_chunks, coefficients, *loop
        )
    else:
        chunking = (opt.temperature, chunk_size, backend)
        stats = chunks.linear_logp_lse(
            hidden, weight, bias, shard.tokens, rows, *chunking, chunks=sample_chunks
        )
    stats = shard.complete(stats, mask)
    outputs = custom_op.finish_forward(args, opt, shard.vocab, mask, stats, logits_name="hidden")
    return (*outputs, *(hidden.new_empty(0) if g is None else g for g in grads))


_ftis_linear_loss_fwd = torch.library.custom_op(
    "ftis_kernels::ftis_linear_loss_fwd",
    _ftis_linear_loss_fwd_impl,
    mutates_args=(),
    schema=_FWD.schema,
)


@_ftis_linear_loss_fwd.register_fake
def _(*inputs):
    args = _FWD.bind(inputs)
    hidden, weight = args["hidden"], args["weight"]
    outputs = custom_op.fake_forward_outputs(
        hidden, hidden.shape[0], hidden.shape[1], args["cu_seqlens"]
    )
    on = args["grad_in_forward"]
    grads = (
        torch.empty_like(hidden) if on and args["need_hidden"] else hidden.new_empty(0),
        torch.empty_like(weight) if on and args["need_weight"] else hidden.new_empty(0),
        weight.new_empty(weight.shape[0]) if on and args["need_bias"] else hidden.new_empty(0),
    )
    return (*outputs, *grads)


@torch.library.custom_op("ftis_kernels::ftis_linear_loss_bwd", mutates_args=())
def _ftis_linear_loss_bwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    tokens: torch.Tensor,
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    coef: torch.Tensor,
    entropy: Optional[torch.Tensor],
    entropy_coef: Optional[torch.Tensor],
    temperature: float,
    chunk_size: int,
    backend: str,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    group_name: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_hidden, grad_weight, grad_bias); an empty tensor for each one not needed (a custom
    op returns no None). coef and entropy_coef already scaled by the incoming gradient and
    1 / temperature. With group_name (a vocabulary shard per rank), grad_hidden is summed over the
    ranks; grad_weight and grad_bias stay this shard's."""
    needs = (need_hidden, need_weight, need_bias)
    stats = (row_max, log_sum, coef, entropy, entropy_coef)
    grads = chunks.linear_grads(
        hidden, weight, bias, tokens, stats, temperature, chunk_size, backend, needs
    )
    if group_name is not None and grads[0] is not None:
        all_reduce_sum(grads[0], group_name)
    return tuple(hidden.new_empty(0) if g is None else g for g in grads)


@_ftis_linear_loss_bwd.register_fake
def _(hidden, weight, bias, tokens, *stats_and_flags, group_name=None):
    need_hidden, need_weight, need_bias = stats_and_flags[-3:]
    return (
        torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
        torch.empty_like(weight) if need_weight else hidden.new_empty(0),
        weight.new_empty(weight.shape[0]) if need_bias else hidden.new_empty(0),
    )


@torch.library.custom_op(
    "ftis_kernels::ftis_linear_loss_scale_",
    mutates_args=("grad_hidden", "grad_weight", "grad_bias"),
)
def _scale_grads_(
    grad_hidden: torch.Tensor,
    grad_weight: torch.Tensor,
    grad_bias: torch.Tensor,
    grad_loss: torch.Tensor,
) -> None:
    """Multiplies the gradients the forward computed for an incoming gradient of 1 by the
    incoming gradient grad_loss (0-dim), in place: nothing when it is 1 (the usual case, no pass
    over the (V, H) gradient; one synchronisation on CUDA)."""
    if bool(grad_loss == 1):
        return
    scale = float(grad_loss)
    for grad in (grad_hidden, grad_weight, grad_bias):
        grad.mul_(scale)


@_scale_grads_.register_fake
def _(grad_hidden, grad_weight, grad_bias, grad_loss):
    return None


def _setup_context(ctx, inputs, output):
    args = _FWD.bind(inputs)
    tokens = custom_op.shard_tokens(args)
    ctx.grad_in_forward = args["grad_in_forward"]
    # The outputs other than the loss get no gradient: None, not a zero (V, H) grad_weight.
    ctx.set_materialize_grads(False)
    grads = output[custom_op.N_OUTPUTS :] if ctx.grad_in_forward else ()
    tensors = (args["hidden"], args["weight"], args["bias"], tokens, *grads)
    custom_op.save_for_backward(ctx, args, inputs, output[: custom_op.N_OUTPUTS], *tensors)
    ctx.chunk_size, ctx.group_name = args["chunk_size"], args["group_name"]


def _backward(ctx, grad_loss, *_):
    if grad_loss is None:
        return (None,) * ctx.n_inputs
    hidden, weight, bias, tokens = ctx.saved_tensors[:4]
    needs = ctx.needs_input_grad
    need_bias = bias is not None and needs[2]
    if ctx.grad_in_forward:
        # Saved tensors scaled in place: a second backward through the same graph is refused by
        # autograd (modified by an inplace operation) instead of being scaled twice.
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors[4:7]
        torch.ops.ftis_kernels.ftis_linear_loss_scale_(
            grad_hidden, grad_weight, grad_bias, grad_loss
        )
    else:
        stats = custom_op.backward_stats(ctx, grad_loss)
        grad_hidden, grad_weight, grad_bias = torch.ops.ftis_kernels.ftis_linear_loss_bwd(
            hidden,
            weight,
            bias,
            tokens,
            *stats,
            ctx.temperature,
            ctx.chunk_size,
            ctx.backend,
            needs[0],
            needs[1],
            need_bias,
            ctx.group_name,
        )
    grads = (
        grad_hidden if needs[0] else None,
        grad_weight if needs[1] else None,
        grad_bias if need_bias else None,
    )
    return grads + (None,) * (ctx.n_inputs - len(grads))


_ftis_linear_loss_fwd.register_autograd(_backward, setup_context=_setup_context)


def _check_linear_inputs(
    hidden: object, weight: object, bias: object, chunk_size: object
) -> tuple[int, ...]:
    """Shapes, dtypes and devices of hidden, weight, bias and chunk_size; returns (B, T, H, V)."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or min(hidden.shape) < 1:
        raise ValueError(
            f"hidden: expected a (B, T, H) tensor with B, T, H >= 1, got "
            f"{hidden.shape if isinstance(hidden, torch.Tensor) else hidden!r}"
        )
    B, T, H = hidden.shape
    check_tensor("hidden", hidden, (B, T, H), LOGIT_DTYPES, hidden.device)
    if hidden.device.type not in ("cuda", "cpu"):
        raise ValueError(f"hidden: expected a CUDA or CPU tensor, got a tensor on {hidden.device}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] < 1:
        raise ValueError(
            f"weight: expected a (V, {H}) tensor with V >= 1, got "
            f"{weight.shape if isinstance(weight, torch.Tensor) else weight!r}"
        )
    V = weight.shape[0]
    check_tensor("weight", weight, (V, H), (hidden.dtype,), hidden.device)
    if bias is not None:
        check_tensor("bias", bias, (V,), (hidden.dtype,), hidden.device)
    chunks.check_chunk_size(chunk_size)
    return B, T, H, V


def _check_grad_in_forward(grad_in_forward: object, blocker: Optional[str]) -> bool:
    """Whether the gradients may be computed in the forward: "auto" -> where exact (blocker is
    None), True -> yes (a ValueError naming the reason where not exact), False -> no."""
    valid = grad_in_forward is True or grad_in_forward is False or grad_in_forward == "auto"
    if not (valid and isinstance(grad_in_forward, (bool, str))):
        raise ValueError(
            f"grad_in_forward: expected 'auto', True or False, got {grad_in_forward!r}"
        )
    if grad_in_forward is True and blocker is not None:
        raise ValueError(f"grad_in_forward: expected 'auto' or False {blocker}, got True")
    return grad_in_forward is not False and blocker is None


def _needs_grad(hidden, weight, bias) -> tuple[bool, bool, bool]:
    """Which of (hidden, weight, bias) a backward would give a gradient (none under no_grad)."""
    on = torch.is_grad_enabled()
    return (
        on and hidden.requires_grad,
        on and weight.requires_grad,
        on and bias is not None and bias.requires_grad,
    )


@with_option_keywords
def ftis_linear_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    gen_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    old_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    *,
    bias: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
    options: Optional[FTISOptions] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    vocab_start: int = 0,
    process_group: Optional[Any] = None,
    grad_in_forward: bool | str = "auto",
    **option_keywords: Unpack[OptionKeywords],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and metrics of `ftis_loss(hidden @ weight.T + bias, ...)`, from the hidden
    states, a chunk of positions at a time: the (B, T, V) logits never exist.

    Args:
        hidden: (B, T, H) fp32 | bf16 | fp16, any strides; hidden[b, t] scores tokens[b, t].
        weight: (V, H), the hidden dtype: the lm-head (or tied embedding) weight.
        tokens, gen_logprobs, advantages, mask, old_logprobs, ref_logprobs: as in `ftis_loss`
            ((B, T) tokens in [0, V), (B, T) gen/old/ref logprobs, (B,) advantages, (B, T) mask).
        bias: (V,) in the hidden dtype, or None.
        chunk_size: positions per chunk (rows of logits alive at once); None = as many as keep a
            chunk within AUTO_CHUNK_ELEMENTS logits, or the longest sample (T, or the longest
            segment when packed) when its logits are at most AUTO_SAMPLE_CHUNK_ELEMENTS. Only
            memory and speed depend on it (`chunks.auto_chunk_size`): one chunk of logits is the
            extra memory, whatever B * T.
        options, **option_keywords: as in `ftis_loss` (the fields of `FTISOptions`).
        cu_seqlens: packed batches as in `ftis_loss`: hidden (N, H) or (1, N, H).
        vocab_start, process_group: a vocabulary-sharded lm-head, as in `ftis_loss`: weight
            (V_local, H) (and bias (V_local,)) are the rows vocab_start : vocab_start + V_local of
            the full lm-head on this rank; hidden and the rows are the same on every rank.
            grad_hidden is summed over the ranks (one all-reduce of (B, T, H) in the backward);
            grad_weight and grad_bias are this shard's.
        grad_in_forward: "auto" (default), True or False: compute the gradients in the forward
            (6 N H V FLOPs; the backward multiplies them by the incoming gradient) or in the
            backward (8 N H V: each chunk's logits again). "auto" takes the forward whenever it
            is exact (`grad_in_forward_blocker`: every chunk holds whole samples, i.e. T, or the
            longest segment, <= the chunk size, and no option couples samples: reject_mode="mask"
            with a filter on pi_theta and a batch-wide normaliser or entropy bonus, or a sharded
            vocabulary); True raises a ValueError naming the reason there. Both orders give the
            same loss and metrics and the same gradients up to the matmuls' rounding. Without
            any gradient to compute (torch.no_grad(), no input requiring grad) neither order
            does gradient work. In the forward order the gradients are held from the forward
            on, and one backward through the graph is allowed.

    The logits of a chunk are computed in the hidden dtype, as the model's lm-head would; the
    row passes and the reductions accumulate in fp32. Hidden states at masked positions are never
    read into a loss or a gradient (they may hold anything).

    Returns:
        loss: 0-dim fp32; gradients flow to `hidden`, `weight` and `bias`.
        metrics: as `ftis_loss`.
    """
    opt = resolve_options(options, option_keywords)
    hidden, flat = custom_op.packed_input(hidden, cu_seqlens)
    B, T, H, V = _check_linear_inputs(hidden, weight, bias, chunk_size)
    backend = select_backend(hidden.device)
    rows = (tokens, gen_logprobs, advantages, mask, old_logprobs, ref_logprobs)
    rows, max_seqlen = custom_op.row_inputs("hidden", "H", hidden, rows, opt.beta, cu_seqlens)
    name = group_name(process_group, vocab_start)
    longest = T if cu_seqlens is None else max_seqlen
    chunk = chunks.auto_chunk_size(V, longest) if chunk_size is None else int(chunk_size)
    needs = _needs_grad(hidden, weight, bias)
    blocker = grad_in_forward_blocker(
        opt,
        with_old=rows[4] is not None,
        sharded=name is not None,
        longest=longest,
        chunk_size=chunk,
    )
    in_forward = _check_grad_in_forward(grad_in_forward, blocker) and any(needs)
    packing = (cu_seqlens, max_seqlen, vocab_start, name)
    switches = (chunk, backend, in_forward, *needs)
    lm_head = (hidden, weight, bias)
    outputs = _ftis_linear_loss_fwd(*lm_head, *rows, *option_args(opt), *packing, *switches)
    return outputs[0], custom_op.public_metrics(outputs, T if flat else None)
