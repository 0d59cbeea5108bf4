"""`ftis_linear_loss`: the F-TIS loss from the last hidden states and the lm-head, without ever
materialising the (B, T, V) logits (docs/method.md §2, applied to `hidden @ weight.T + bias`).

The (B, T) positions are processed in chunks of contiguous rows (`chunks.py`, the chunk engine).
For each chunk, one matmul gives the chunk's logits (c, V) in the hidden dtype, and the row
passes of `ftis_loss` (`kernels/`) read them for log pi_theta of the taken token and the row's
statistics. The per-sample part (`kernels/per_sample.py`) needs every token of a sample (KL
filter, sequence-level weight, normaliser) and yields the loss, the metrics and
coef = d loss / d logp. The gradients follow in one of two orders, with the same results:

- In the forward (6 N H V FLOPs, as Liger's chunked losses do), when every chunk holds whole
  samples and a sample's coef depends on no other sample's logits (`grad_in_forward_blocker`):
  after a chunk's row pass, the per-sample kernel runs on the chunk's samples, the row backward
  kernel overwrites the logits with dlogits = coef * (onehot - softmax) / temperature, and two
  matmuls give grad_hidden's rows and accumulate grad_weight (in fp32, inside the GEMM), for an
  incoming gradient of 1; the backward multiplies them by the incoming gradient (times 1 / N'
  for a batch-normalised loss) on the device, in one launch that touches nothing when that
  factor is 1 (`kernels/grad_scale.py`). Per chunk: 3 matmuls and 3 kernels.
- In the backward (8 N H V FLOPs): each chunk's logits are recomputed, turned into dlogits and
  fed to the same two matmuls.

Nothing is read back from the device to plan the chunks (0 host reads with value_check=
"deferred"; the default reads the value checks once, in the backward). Masked rows are computed
with the others and their logits never read; the weight gradient's matmul reads a chunk's hidden
states zeroed at its rows without gradient (`chunks.py`), so whatever they held reaches no gradient.

Extra memory is bounded independently of B * T: one chunk of logits, at most
max(chunks.AUTO_CHUNK_ELEMENTS, chunks.AUTO_SAMPLE_CHUNK_ELEMENTS) of them with chunk_size=None
(c * V in the hidden dtype, plus the CPU row passes' fp32 scratch), one chunk's hidden states
(c * H), grad_hidden ((B * T, H)), for bf16/fp16 weights an fp32 grad_weight accumulator, and
O(B * T) per-token scalars (`bench/linear_memory.py` measures it). In the forward order the
gradients exist from the forward on instead of from the backward on.

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
from ftis_kernels.kernels.grad_scale import scale_
from ftis_kernels.kernels.per_sample import SampleOutputs, per_sample_fwd
from ftis_kernels.options import (
    FTISOptions,
    OptionKeywords,
    loss_type,
    resolve_options,
    with_option_keywords,
)
from ftis_kernels.packing import per_sample_part
from ftis_kernels.sharded import all_reduce_sum, group_name
from ftis_kernels.validate import LOGIT_DTYPES, Rows, check_now, check_tensor, raise_on_faults

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
    why = "(a sample's rejection changes every sample's normaliser)"
    if opt.reject_mode == "mask" and filter_reads_logp:
        if loss_type(opt.loss_type).batch_normalised:
            return f"with reject_mode='mask' and loss_type={opt.loss_type!r} {why}"
    if opt.reject_mode == "mask" and opt.filter is not None and opt.entropy_coef > 0:
        # The bonus's normaliser N' must be known before the first chunk's gradient.
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
        ("int[]", "sample_offsets"),
        ("int", "chunk_size"),
        ("str", "backend"),
        ("bool", "grad_in_forward"),
        ("bool", "need_hidden"),
        ("bool", "need_weight"),
        ("bool", "need_bias"),
        ("str", "grad_weight_accumulation"),
    ),
    extra_outputs=3,
)


def _pre_scales(opt, mask: Optional[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """The (2,) scales of coef and entropy_coef the forward order's backward row passes apply
    before the batch-wide normaliser is known (`kernels/per_sample.py` writes the true ones at
    the end): 1 and -entropy_coef for a batch-normalised loss (the gradients are multiplied by
    1 / N' afterwards), else 1 and -entropy_coef / N with N the completion tokens (then N' = N:
    `grad_in_forward_blocker` keeps rejection by mask out of this order). No host read."""
    scales = torch.full((2,), 1.0, dtype=torch.float32, device=rows.device)
    if opt.entropy_coef == 0:
        scales[1].zero_()
    elif loss_type(opt.loss_type).batch_normalised:
        scales[1].fill_(-opt.entropy_coef)
    else:
        n = (
            rows.new_full((), rows.shape[0], dtype=torch.float32)
            if mask is None
            else ((mask != 0).sum(dtype=torch.float32))
        )
        torch.div(-opt.entropy_coef, n.clamp_(min=1.0), out=scales[1])
    return scales


def _forward(args: custom_op.ForwardInputs) -> tuple:
    """The outputs of `custom_op.OUTPUT_NAMES`, then grad_hidden, grad_weight, grad_bias for an
    incoming gradient of 1 when grad_in_forward (those flagged need_*; an empty tensor for the
    others and in the backward order); grad_hidden as (B * T, H) rows."""
    opt = args.opt
    hidden, weight, bias = args["hidden"], args["weight"], args["bias"]
    chunk_size, backend = args["chunk_size"], args["backend"]
    B, T, _ = hidden.shape
    mask = args.rows.mask
    shard = custom_op.Shard.of(args, hidden.device, weight.shape[0], hidden.shape[2])
    hidden_rows = chunks.as_rows(hidden)
    tokens = shard.tokens.reshape(B * T)
    flat_mask = None if mask is None else mask.reshape(B * T)
    # Chunks of whole samples when they fit (in both orders, so that both compute the same
    # logits), else of chunk_size rows.
    offsets = list(args["sample_offsets"]) or [b * T for b in range(B + 1)]
    sample_chunks = chunks.sample_chunks(offsets, chunk_size)
    row_chunks = (
        chunks.row_chunks(B * T, chunk_size)
        if sample_chunks is None
        else [(r0, r1) for _, _, r0, r1 in sample_chunks]
    )
    temperature = opt.temperature
    needs = (args["need_hidden"], args["need_weight"], args["need_bias"])
    grads = (None, None, None)
    samples = None
    if args["grad_in_forward"]:
        if sample_chunks is None:  # the public function checked the longest sample
            raise AssertionError("grad_in_forward with a sample longer than chunk_size")
        if backend == "triton":
            samples = SampleOutputs.empty(
                (B, T), args.rows.advantages.shape[0], hidden.device, opt.entropy_coef > 0
            )
            scales = _pre_scales(opt, mask, hidden_rows)
            length = custom_op.dr_grpo_length(args, T)

            def coefficients(stats, s0, s1):
                logp, row_max, log_sum, entropy = (x.view(B, T) for x in stats)
                per_sample_fwd(
                    samples,
                    (logp, entropy, row_max, log_sum),
                    args.rows,
                    opt,
                    V=shard.vocab,
                    length=length,
                    cu_seqlens=args["cu_seqlens"],
                    first=s0,
                    count=s1 - s0,
                )
                ecoef = samples.ecoef
                return (
                    stats[1],
                    stats[2],
                    samples.coef.view(-1),
                    stats[3] if ecoef is not None else None,
                    None if ecoef is None else ecoef.view(-1),
                    scales,
                    None,
                )
        else:

            def coefficients(stats, s0, s1):
                logp, _, _, entropy = (x.view(B, T) for x in stats)
                bool_rows = args.rows._replace(mask=custom_op.completion_mask(mask))
                packing = (args["cu_seqlens"], args["max_seqlen"])
                result = per_sample_part(logp, bool_rows, opt, entropy, *packing)
                ecoef = result.entropy_coef.reshape(-1) / temperature
                bonus = opt.entropy_coef > 0
                return (
                    stats[1],
                    stats[2],
                    (result.coef.reshape(-1) / temperature),
                    stats[3] if bonus else None,
                    ecoef if bonus else None,
                    None,
                    None,
                )

        stats, grads = chunks.linear_loss_and_grads(
            hidden_rows,
            weight,
            bias,
            tokens,
            flat_mask,
            sample_chunks,
            coefficients,
            temperature,
            backend,
            needs,
            args["grad_weight_accumulation"],
        )
    else:
        stats = chunks.linear_logp_lse(
            hidden_rows, weight, bias, tokens, flat_mask, temperature, row_chunks, backend
        )
    stats = tuple(x.view(B, T) for x in stats)
    if shard.group is not None:
        stats = shard.complete(stats, custom_op.completion_mask(mask))
    outputs = custom_op.finish_forward(
        args, shard.vocab, stats, logits_name="hidden", samples=samples
    )
    return (*outputs, *(hidden.new_empty(0) if g is None else g for g in grads))


def _ftis_linear_loss_fwd_impl(*inputs):
    return _forward(_FWD.bind(inputs))


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
        hidden, hidden.shape[0], hidden.shape[1], args["cu_seqlens"], opt=args.opt
    )
    on = args["grad_in_forward"]
    B, T, H = hidden.shape
    grads = (
        hidden.new_empty(B * T, H) if on and args["need_hidden"] else hidden.new_empty(0),
        torch.empty_like(weight) if on and args["need_weight"] else hidden.new_empty(0),
        weight.new_empty(weight.shape[0]) if on and args["need_bias"] else hidden.new_empty(0),
    )
    return (*outputs, *grads)


def _ftis_linear_loss_bwd_impl(
    hidden: torch.Tensor,
    mask: Optional[torch.Tensor],
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    tokens: torch.Tensor,
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    coef: torch.Tensor,
    entropy: Optional[torch.Tensor],
    entropy_coef: Optional[torch.Tensor],
    scales: Optional[torch.Tensor],
    grad: Optional[torch.Tensor],
    record: Optional[torch.Tensor],
    sample_offsets: list[int],
    temperature: float,
    chunk_size: int,
    backend: str,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    group_name: Optional[str] = None,
    grad_weight_accumulation: str = "fp32",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_hidden (R, H), grad_weight, grad_bias) in the backward order; an empty tensor for
    each one not needed (a custom op returns no None). hidden (B, T, H) and mask (B, T) or None
    as the forward took them, tokens (R,), the per-row statistics (R,) and scales and grad as
    `custom_op.backward_stats` gives them; grad_weight summed as `grad_weight_accumulation` says
    (`chunks.GRAD_WEIGHT_ACCUMULATIONS`). With group_name (a vocabulary shard per rank),
    grad_hidden is summed over the ranks; grad_weight and grad_bias stay this shard's. A
    value-check record is read first (one synchronisation, before any GEMM is queued)."""
    needs = (need_hidden, need_weight, need_bias)
    # First: the host waits for the forward only, not for the GEMMs. Sharded, every rank holds
    # the same record (made from the all-reduced statistics of the same rows), so all raise or
    # none does, before the all-reduce below.
    if record is not None:
        raise_on_faults(record)
    rows = chunks.as_rows(hidden)
    offsets = list(sample_offsets)
    sample_chunks = chunks.sample_chunks(offsets, chunk_size) if offsets else None
    row_chunks = (
        chunks.row_chunks(rows.shape[0], chunk_size)
        if sample_chunks is None
        else [(r0, r1) for _, _, r0, r1 in sample_chunks]
    )
    per_row = (row_max, log_sum, coef, entropy, entropy_coef, scales, grad)
    grads = chunks.linear_grads(
        rows,
        weight,
        bias,
        tokens,
        per_row,
        temperature,
        row_chunks,
        backend,
        needs,
        grad_weight_accumulation,
        mask,
    )
    if group_name is not None and grads[0] is not None:
        all_reduce_sum(grads[0], group_name)
    return tuple(rows.new_empty(0) if g is None else g for g in grads)


_ftis_linear_loss_bwd = torch.library.custom_op(
    "ftis_kernels::ftis_linear_loss_bwd", _ftis_linear_loss_bwd_impl, mutates_args=()
)


@_ftis_linear_loss_bwd.register_fake
def _(
    hidden,
    mask,
    weight,
    bias,
    tokens,
    row_max,
    log_sum,
    coef,
    entropy,
    entropy_coef,
    scales,
    grad,
    record,
    sample_offsets,
    temperature,
    chunk_size,
    backend,
    need_hidden,
    need_weight,
    need_bias,
    group_name=None,
    grad_weight_accumulation="fp32",
):
    B, T, H = hidden.shape
    return (
        hidden.new_empty(B * T, H) if need_hidden else hidden.new_empty(0),
        torch.empty_like(weight) if need_weight else hidden.new_empty(0),
        weight.new_empty(weight.shape[0]) if need_bias else hidden.new_empty(0),
    )


def _scale_grads_impl(
    grad_hidden: torch.Tensor,
    grad_weight: torch.Tensor,
    grad_bias: torch.Tensor,
    factor: torch.Tensor,
    record: Optional[torch.Tensor],
) -> None:
    """Multiplies the gradients the forward computed for an incoming gradient of 1 by factor
    (0-dim fp32: the incoming gradient, times 1 / N' for a batch-normalised loss on Triton), in
    place, without reading it on the host, after reading a value-check record (one
    synchronisation). Triton: one launch that reads and writes nothing when factor is 1
    (`kernels/grad_scale.py`); PyTorch: a `mul_` per gradient."""
    if record is not None:
        raise_on_faults(record)
    grads = (grad_hidden, grad_weight, grad_bias)
    if select_backend(factor.device) == "triton":
        return scale_(grads, factor)
    for grad in grads:
        if grad.numel():
            grad.mul_(factor)


_scale_grads_ = torch.library.custom_op(
    "ftis_kernels::ftis_linear_loss_scale_",
    _scale_grads_impl,
    mutates_args=("grad_hidden", "grad_weight", "grad_bias"),
)


@_scale_grads_.register_fake
def _(grad_hidden, grad_weight, grad_bias, factor, record):
    return None


def _setup(ctx, args: custom_op.ForwardInputs, n_inputs: int, output: tuple) -> None:
    tokens = custom_op.shard_tokens(args)
    ctx.grad_in_forward = args["grad_in_forward"]
    # The outputs other than the loss get no gradient: None, not a zero (V, H) grad_weight.
    ctx.set_materialize_grads(False)
    n = custom_op.N_OUTPUTS
    grads = output[n : n + 3] if ctx.grad_in_forward else ()
    B, T = tokens.shape
    tokens = tokens.reshape(B * T)
    tensors = (args["hidden"], args.rows.mask, args["weight"], args["bias"], tokens, *grads)
    custom_op.save_for_backward(ctx, args, n_inputs, output[:n], *tensors)
    ctx.chunk_size, ctx.group_name = args["chunk_size"], args["group_name"]
    ctx.grad_weight_accumulation = args["grad_weight_accumulation"]
    ctx.sample_offsets = list(args["sample_offsets"]) or [b * T for b in range(B + 1)]
    ctx.hidden_shape = tuple(args["hidden"].shape)
    # Triton's forward order applies the batch-wide normaliser (known at the end) afterwards.
    ctx.end_scale = args["backend"] == "triton" and loss_type(args.opt.loss_type).batch_normalised


def _backward(ctx, grad_loss, *_):
    if grad_loss is None:
        return (None,) * ctx.n_inputs
    hidden, mask, weight, bias, tokens = ctx.saved_tensors[:5]
    needs = ctx.needs_input_grad
    need_bias = bias is not None and needs[2]
    record = custom_op.saved_record(ctx)
    if ctx.grad_in_forward:
        # Saved tensors scaled in place: a second backward through the same graph is refused by
        # autograd (modified by an inplace operation) instead of being scaled twice.
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors[5:8]
        factor = grad_loss.float()
        if ctx.end_scale:
            scalars = ctx.saved_tensors[-2]
            factor = factor * scalars[len(custom_op.SCALAR_METRICS)]
        custom_op.op_or_impl(ctx, _scale_grads_, _scale_grads_impl)(
            grad_hidden, grad_weight, grad_bias, factor, record
        )
    else:
        stats = custom_op.backward_stats(ctx, grad_loss)
        flat = tuple(None if x is None or x.dim() != 2 else x.reshape(-1) for x in stats[:5])
        bwd = custom_op.op_or_impl(ctx, _ftis_linear_loss_bwd, _ftis_linear_loss_bwd_impl)
        grad_hidden, grad_weight, grad_bias = bwd(
            hidden,
            mask,
            weight,
            bias,
            tokens,
            *flat,
            *stats[5:],
            record,
            ctx.sample_offsets,
            ctx.temperature,
            ctx.chunk_size,
            ctx.backend,
            needs[0],
            needs[1],
            need_bias,
            ctx.group_name,
            ctx.grad_weight_accumulation,
        )
    grads = (
        grad_hidden.view(ctx.hidden_shape) if needs[0] else None,
        grad_weight if needs[1] else None,
        grad_bias if need_bias else None,
    )
    return grads + (None,) * (ctx.n_inputs - len(grads))


custom_op.register_autograd(_ftis_linear_loss_fwd, _FWD, _setup, _backward)
_FTISLinearLoss = custom_op.eager_function("_FTISLinearLoss", _forward, _setup, _backward)


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


def _check_grad_weight_accumulation(value: object) -> str:
    """The option's value, one of `chunks.GRAD_WEIGHT_ACCUMULATIONS` (a ValueError naming it)."""
    if not (isinstance(value, str) and value in chunks.GRAD_WEIGHT_ACCUMULATIONS):
        raise ValueError(
            f"grad_weight_accumulation: expected one of {chunks.GRAD_WEIGHT_ACCUMULATIONS}, "
            f"got {value!r}"
        )
    return value


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
    value_check: str = "backward",
    grad_weight_accumulation: str = "fp32",
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
            with a filter on pi_theta and a batch-wide normaliser, or any filter and a bonus, or a
            sharded vocabulary); True raises a ValueError naming the reason there. Both give the
            same loss and metrics and the same gradients up to the matmuls' rounding. Without
            any gradient to compute (torch.no_grad(), no input requiring grad) neither order
            does gradient work. In the forward order the gradients are held from the forward
            on, and one backward through the graph is allowed.
        value_check: as in `ftis_loss` ("backward", "call" or "deferred"); "deferred" makes the
            call read the host 0 times.
        grad_weight_accumulation: where grad_weight is summed over the chunks. "fp32" (default):
            in a (V, H) fp32 accumulator, returned in the weight's dtype. "weight": in the
            weight's dtype, as Liger's chunked losses do across their chunks: for bf16/fp16
            no accumulator beside the gradient (4 V H bytes less memory: 2.3 GiB at V = 151,936,
            H = 4096, half the bf16 logits of 16k tokens) and half the bytes moved per chunk for
            the sum, for one rounding to that dtype per chunk (each chunk's product is summed in
            fp32 inside the matmul): after n chunks grad_weight may differ from "fp32" by n + 1
            roundings of the sum of the chunks' |products|. The same as "fp32" for fp32
            weights.

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
    accumulation = _check_grad_weight_accumulation(grad_weight_accumulation)
    backend = select_backend(hidden.device)
    rows = Rows(tokens, gen_logprobs, advantages, mask, old_logprobs, ref_logprobs)
    rows, max_seqlen = custom_op.row_inputs("hidden", "H", hidden, rows, opt.beta, cu_seqlens)
    name = group_name(process_group, vocab_start)
    longest = T if cu_seqlens is None else max_seqlen
    chunk = chunks.auto_chunk_size(V, longest) if chunk_size is None else int(chunk_size)
    needs = _needs_grad(hidden, weight, bias)
    blocker = grad_in_forward_blocker(
        opt,
        with_old=rows.old_logprobs is not None,
        sharded=name is not None,
        longest=longest,
        chunk_size=chunk,
    )
    in_forward = _check_grad_in_forward(grad_in_forward, blocker) and any(needs)
    graded = [x for x, need in zip((hidden, weight, bias), needs) if need]  # a backward follows
    checks = (value_check, check_now(value_check, graded[0] if graded else hidden))
    if not any(needs):
        checks = (value_check, value_check != "deferred")
    packing = (cu_seqlens, max_seqlen, vocab_start, name, *checks)
    offsets = [] if cu_seqlens is None else custom_op.segment_offsets(cu_seqlens)
    switches = (offsets, chunk, backend, in_forward, *needs, accumulation)
    lm_head = (hidden, weight, bias)
    parts = (lm_head, rows, opt, packing, switches)
    if custom_op.traced(*lm_head, *rows, cu_seqlens):
        outputs = _ftis_linear_loss_fwd(*_FWD.flatten(*parts))
    else:
        outputs = _FTISLinearLoss.apply(*lm_head, _FWD.inputs(*parts))
    return outputs[0], custom_op.public_metrics(outputs, T if flat else None, value_check)
