"""`ftis_loss`: the fused F-TIS loss from logits (docs/method.md §2).

Forward, three launches: one streaming pass over each row of logits (`kernels/logp_lse.py`) gives
log pi_theta of the taken token and the row's log-sum-exp; one program per sample
(`kernels/per_sample.py`) turns them into d loss / d logp, the sample's decisions, its share of
the loss and metrics and the value checks; one program reduces the samples. Backward, one launch:
dlogits = coef * (onehot - softmax) / temperature, recomputing the softmax from the saved row
statistics (max and log-sum-exp relative to it), with the incoming gradient and the batch-wide
normaliser read on the device, optionally into the logits buffer itself. No (B, T, V) temporary
is ever created, and no host read happens in the forward.

Gradient in the forward (the default where it applies, `grad_in_forward`): the forward's row pass
also writes d loss / d logits while the row is on chip or in L2 (`kernels/logp_grad.py`), as if
no sample were rejected, and the backward's one launch zeroes the rejected samples' rows and
applies an incoming gradient other than 1: the logits are read once and the gradient written
once, instead of two reads and a write. Four launches in the forward (one counts the mask's
tokens), one in the backward.

Dispatch, by where the logits live: CUDA -> compiled Triton kernels; CPU with the kernels
decorated under TRITON_INTERPRET=1 -> the same Triton kernels, interpreted; CPU otherwise -> a
chunked PyTorch path with the same results (`kernels/logp_lse_cpu.py`). The custom-op plumbing
shared with `ftis_linear_loss` is in `custom_op.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from ftis_kernels import custom_op
from ftis_kernels.grad_buffer import grad_buffer
from ftis_kernels.kernels import BACKWARD, FORWARD, select_backend
from ftis_kernels.kernels.logp_grad import grad_finish, logp_grad_fwd
from ftis_kernels.options import (
    FTISOptions,
    OptionKeywords,
    loss_type,
    resolve_options,
    with_option_keywords,
)
from ftis_kernels.sharded import group_name
from ftis_kernels.validate import (
    LOGIT_DTYPES,
    Rows,
    check_inplace_backward,
    check_now,
    check_tensor,
    raise_on_faults,
    refuse,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

_FWD = custom_op.ForwardSignature(
    leading=(("Tensor", "logits"),),
    trailing=(("bool", "inplace_backward"), ("str", "backend")),
)


def _forward(args: custom_op.ForwardInputs) -> tuple:
    """The outputs of `custom_op.OUTPUT_NAMES`: the row pass, then the per-sample part
    (`custom_op.finish_forward`). Three launches on Triton, unsharded."""
    logits, backend = args["logits"], args["backend"]
    shard = custom_op.Shard.of(args, logits.device, logits.shape[-1])
    # The Triton row kernel reads a 0/1 mask as it is; the PyTorch path wants bool.
    mask = args.rows.mask
    mask = mask if backend == "triton" else custom_op.completion_mask(mask)
    stats = FORWARD[backend](logits, shard.tokens, mask, args.opt.temperature)
    if shard.group is not None:
        stats = shard.complete(stats, custom_op.completion_mask(args.rows.mask))
    return custom_op.finish_forward(args, shard.vocab, stats)


def _ftis_loss_fwd_impl(*inputs):
    return _forward(_FWD.bind(inputs))


_ftis_loss_fwd = torch.library.custom_op(
    "ftis_kernels::ftis_loss_fwd", _ftis_loss_fwd_impl, mutates_args=(), schema=_FWD.schema
)


@_ftis_loss_fwd.register_fake
def _(*inputs):
    args = _FWD.bind(inputs)
    logits = args["logits"]
    return custom_op.fake_forward_outputs(
        logits, logits.shape[0], logits.shape[1], args["cu_seqlens"], opt=args.opt
    )


def _ftis_loss_bwd_impl(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    coef: torch.Tensor,
    entropy: Optional[torch.Tensor],
    entropy_coef: Optional[torch.Tensor],
    scales: Optional[torch.Tensor],
    grad: Optional[torch.Tensor],
    record: Optional[torch.Tensor],
    temperature: float,
    backend: str,
) -> torch.Tensor:
    """d loss / d logits (B, T, V) in a buffer no one else holds (on the CPU, one reused across
    calls: grad_buffer.py); one launch on Triton (`custom_op.backward_stats` says what coef,
    entropy_coef, scales and grad are). With a value-check record, it is read first (one
    synchronisation, which waits for the forward's kernels only: the backward's then runs while
    the host goes on) and a bad input raises before any gradient is written."""
    if record is not None:
        raise_on_faults(record)
    out = grad_buffer(logits)
    stats = (row_max, log_sum, coef, temperature, out, entropy, entropy_coef)
    extra = (scales, grad) if backend == "triton" else ()
    return BACKWARD[backend](logits, tokens, *stats, *extra)


_ftis_loss_bwd = torch.library.custom_op(
    "ftis_kernels::ftis_loss_bwd", _ftis_loss_bwd_impl, mutates_args=()
)


@_ftis_loss_bwd.register_fake
def _(logits, *_):
    return torch.empty_like(logits)


def _ftis_loss_bwd_inplace_impl(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    coef: torch.Tensor,
    entropy: Optional[torch.Tensor],
    entropy_coef: Optional[torch.Tensor],
    scales: Optional[torch.Tensor],
    grad: Optional[torch.Tensor],
    record: Optional[torch.Tensor],
    temperature: float,
    backend: str,
) -> None:
    """d loss / d logits written over the logits themselves (as `_ftis_loss_bwd` otherwise)."""
    if record is not None:  # read first, as `_ftis_loss_bwd_impl`: the logits stay intact
        raise_on_faults(record)
    stats = (row_max, log_sum, coef, temperature, logits, entropy, entropy_coef)
    extra = (scales, grad) if backend == "triton" else ()
    BACKWARD[backend](logits, tokens, *stats, *extra)


_ftis_loss_bwd_inplace = torch.library.custom_op(
    "ftis_kernels::ftis_loss_bwd_", _ftis_loss_bwd_inplace_impl, mutates_args=("logits",)
)


def _setup(ctx, args: custom_op.ForwardInputs, n_inputs: int, output: tuple) -> None:
    # The outputs other than the loss get no gradient: None, not zero tensors made for them.
    ctx.set_materialize_grads(False)
    custom_op.save_for_backward(
        ctx, args, n_inputs, output, args["logits"], custom_op.shard_tokens(args)
    )
    ctx.inplace_backward = args["inplace_backward"]


def _backward(ctx, grad_loss, *_):
    if grad_loss is None:  # a gradient through the metrics only: none reaches the logits
        return (None,) * ctx.n_inputs
    logits, tokens = ctx.saved_tensors[:2]
    stats = custom_op.backward_stats(ctx, grad_loss)
    args = (*stats, custom_op.saved_record(ctx), ctx.temperature, ctx.backend)
    if ctx.inplace_backward:
        custom_op.op_or_impl(ctx, _ftis_loss_bwd_inplace, _ftis_loss_bwd_inplace_impl)(
            logits, tokens, *args
        )
        dlogits = logits
    else:
        dlogits = custom_op.op_or_impl(ctx, _ftis_loss_bwd, _ftis_loss_bwd_impl)(
            logits, tokens, *args
        )
    return (dlogits,) + (None,) * (ctx.n_inputs - 1)


custom_op.register_autograd(_ftis_loss_fwd, _FWD, _setup, _backward)
_FTISLoss = custom_op.eager_function("_FTISLoss", _forward, _setup, _backward)


# --- the gradient written in the forward (eager calls on the Triton backend) ---------------------


def grad_in_forward_reason(opt: FTISOptions) -> Optional[str]:
    """Why these options cannot have d loss / d logits written in the forward (a row's gradient
    would depend on other rows' results, or take a form other than c_r (onehot - p)), or None
    when they can (`kernels/logp_grad.py`)."""
    if opt.is_level != "token":
        return f"is_level={opt.is_level!r} (a sequence-level IS weight needs the whole sample)"
    if opt.ratio_level != "token":
        return f"ratio_level={opt.ratio_level!r} (a sequence-level ratio needs the whole sample)"
    kind = loss_type(opt.loss_type)
    if kind.sequence_weighted:
        return f"loss_type={opt.loss_type!r} (its sequence weight needs the whole sample)"
    if opt.entropy_coef > 0:
        return "entropy_coef > 0 (the entropy bonus's gradient)"
    if opt.beta > 0 and opt.filter is not None:
        return "beta > 0 with a filter (a rejected sample keeps its penalty's gradient)"
    if opt.filter is not None and opt.reject_mode == "mask" and kind.reduction == "batch_mean":
        return (
            f"reject_mode='mask' with loss_type={opt.loss_type!r} (the rejected samples leave "
            "the batch-wide token count)"
        )
    return None


class _FTISLossGradInForward(torch.autograd.Function):
    """`ftis_loss` with d loss / d logits written by the forward's row pass (`logp_grad.py`): the
    same outputs as the custom op's forward, then a backward of one launch that zeroes the
    rejected samples' rows and applies an incoming gradient other than 1, in place. Nothing of
    the logits is saved. Eager Triton calls only (`ftis_loss` decides); backward runs once."""

    @staticmethod
    def forward(ctx, grad_scale, logits, args):
        opt, rows = args.opt, args.rows
        ctx.set_materialize_grads(False)  # the metrics get no gradient: no zeros made for them
        inplace = args["inplace_backward"]
        dlogits = logits if inplace else grad_buffer(logits)
        length = custom_op.dr_grpo_length(args, logits.shape[1])
        *stats, coef = logp_grad_fwd(logits, dlogits, rows, opt, length, grad_scale)
        outputs = custom_op.finish_forward(args, logits.shape[-1], tuple(stats))
        named = dict(zip(custom_op.OUTPUT_NAMES, outputs))
        ctx.dlogits, ctx.coef = dlogits, coef
        # The per-sample kernel's coefficients (not a tensor the caller holds): 0 on the rows of
        # the samples it rejected.
        ctx.final_coef = named["coef"] if opt.filter is not None else None
        ctx.record = named["record"]
        ctx.check_in_backward = args["value_check"] == "backward" and not args["check_now"]
        ctx.grad_scale = grad_scale
        if inplace:
            # The logits now hold their gradient: autograd is told, so that a graph node that
            # saved them for its own backward raises instead of reading the gradient.
            ctx.mark_dirty(logits)
            ctx.mark_non_differentiable(*outputs[1:], logits)
            return (*outputs, logits)
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx, grad_loss, *_):
        if grad_loss is None:  # a gradient through the metrics only: none reaches the logits
            return None, None, None
        dlogits = ctx.dlogits
        if dlogits is None:
            raise RuntimeError(
                "ftis_loss: a second backward through a call whose gradient was written in its "
                "forward; pass grad_in_forward=False to backpropagate through it more than once"
            )
        if ctx.check_in_backward:  # before the launch, as the three-pass backward
            raise_on_faults(ctx.record)
        ctx.dlogits = None  # the gradient is handed on: autograd may accumulate into it
        grad = grad_loss if grad_loss.dtype == torch.float32 else grad_loss.float()
        grad_finish(dlogits, ctx.coef, ctx.final_coef, grad, ctx.grad_scale)
        return None, dlogits.detach(), None


@with_option_keywords
def ftis_loss(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    gen_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    old_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    *,
    options: Optional[FTISOptions] = None,
    inplace_backward: bool | str = False,
    grad_in_forward: Optional[bool] = None,
    grad_scale: Optional[float] = None,
    value_check: str = "backward",
    cu_seqlens: Optional[torch.Tensor] = None,
    vocab_start: int = 0,
    process_group: Optional[Any] = None,
    **option_keywords: Unpack[OptionKeywords],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO-family loss (the quantity to minimise) and its metrics, fused from the logits.

    Args:
        logits: (B, T, V) fp32 | bf16 | fp16, any strides; logits[b, t] scores tokens[b, t].
        tokens: (B, T) int64 | int32, every id in [0, V).
        gen_logprobs: (B, T) float, log pi_gen(tokens) of the generating policy, finite and <= 0
            at completion positions.
        advantages: (B,) float, group-relative advantages (filtered samples included).
        mask: (B, T) bool or 0/1, the completion tokens; None = all.
        old_logprobs: (B, T) float, log pi_old for the PPO ratio (and for is_source="old",
            kl_source="old"); None = stop_grad(current).
        ref_logprobs: (B, T) float for the beta * k3 penalty; required when beta > 0.
        options: an `FTISOptions` (e.g. `FTISOptions.preset("gspo")`); None = the defaults.
        value_check: where the values of the inputs and the logits are checked (the kernels
            check them on the device in any case; this says where the host reads the verdict,
            one synchronisation): "backward" (default) before the backward launches anything,
            or in the call when no backward will follow (no gradient recorded); "call" in the
            call; "deferred" never by the op: metrics["value_faults"] holds the verdict and
            `ftis_kernels.raise_on_bad_values(metrics)` raises the same error (for CUDA graphs,
            or a step that reads the host anyway).
        **option_keywords: any field of `FTISOptions` (is_mode, filter, loss_type, ratio_level,
            entropy_coef, ...), applied over `options`; help(ftis_loss) lists them all.
        inplace_backward: write d loss / d logits into the logits buffer during backward (with
            grad_in_forward=True: during the forward), saving a (B, T, V) allocation. Only when
            nothing reads the logits after the loss: they are overwritten by their gradient.
            Refused (ValueError) for logits whose elements share memory (expanded or
            overlapping views) and, unless "force", for a leaf tensor that requires grad or a
            view of one (your own tensor would become its gradient).
        grad_in_forward: write d loss / d logits in the forward's pass over the logits, and
            only fix it up in the backward (one read of the logits and one write of the
            gradient per call, instead of a read in each pass and a write): None (default)
            where it applies, True to require it (ValueError naming the option that prevents
            it), False for the three-pass design. It applies on the Triton backend to eager,
            unpacked and unsharded calls that record a gradient (with inplace_backward only when
            True: the logits are then overwritten at the call, and autograd raises if a graph
            node saved them; never on a leaf), with options
            under which a row's gradient depends on its own row only (`grad_in_forward_reason`:
            token-level IS weight and PPO ratio, not VESPO, no entropy bonus, no penalty beside
            a filter). The gradient buffer then lives from the forward to the backward; an
            incoming gradient other than `grad_scale` costs one more read and write of it; the
            graph can be backpropagated once. Under None, fp16 logits take it only with
            grad_scale given.
        grad_scale: the factor the caller multiplies the loss by before its backward (d outer
            loss / d loss: 1 / accumulation steps, a micro-batch's share, an AMP loss scale),
            or None (not announced: 1 is assumed). The loss is returned unscaled; where the
            gradient is written in the forward, it is written times grad_scale, so that the
            backward has nothing to rescale. Another incoming gradient is applied in one more
            pass to the gradient already rounded to the logits' dtype (bf16: at most one more
            unit in the last place than the three-pass design); fp16 logits, whose small
            gradients would underflow before an unannounced loss scale reaches them, take the
            three-pass design unless grad_scale is given. Finite, nonzero and in fp32's normal
            range.
        cu_seqlens: (S + 1,) int32 | int64 offsets of a packed (padding-free) batch, or None.
            Then logits are (N, V) or (1, N, V), the per-token tensors (N,) or (1, N), advantages
            (S,), and sample s is tokens cu_seqlens[s] : cu_seqlens[s + 1]; the result is the
            padded call's on the same data (dr_grpo's L: max_completion_length, else the longest
            segment). Starts at 0, non-decreasing, ends at N (one synchronisation to check).
        vocab_start, process_group: a vocabulary-sharded lm-head: logits (B, T, V_local) are the
            columns vocab_start : vocab_start + V_local of the full logits, held by this rank of
            `process_group` (the shards tile [0, V) in rank order); tokens are global ids. Loss,
            metrics and the saved row statistics are global (sharded.py: one all-reduce of max,
            one of sum over 3 (B, T) floats, and an all-gather of the shard sizes per forward);
            d loss / d logits covers this rank's columns. Every rank calls with the same rows.

    Per token, with A = 0 for rejected samples and the defaults (F-TIS, loss_type "grpo"):
        loss_t = -min(pi/pi_gen, C) * min(R A, clip(R, 1-eps, 1+eps_high) A) + beta * k3(ref - logp)
    reduced by `loss_type`; `per_sample.py` writes out every loss type and correction.

    Returns:
        loss: 0-dim fp32; gradients flow to `logits` only.
        metrics: detached tensors (per_sample.METRIC_NAMES): "logp", "entropy" (B, T) fp32 (0
            where masked; packed: (N,) or (1, N) as the logits), "kl" (B,) fp32, "filtered" (B,)
            bool, "is_truncated" (B,) fp32 (per sample: is_truncated_frac; packed: (S,) each),
            and 0-dim fp32 "filtered_frac",
            "kl_mean", "clip_frac", "is_weight_mean", "is_truncated_frac", "is_masked_frac",
            "is_ratio_mean", "is_ratio_max", "is_ratio_min", "entropy_mean" (over completion
            tokens; is_ratio_* is the raw IS ratio before truncation or masking).

    Raises:
        ValueError naming the argument, in one line: shapes, dtypes, devices, options (an unknown
        name, a bad value, a bad combination naming both options) and the in-place backward's
        preconditions before any kernel runs; values (token ids, finiteness and sign in float32,
        the logits) where `value_check` says, with the number of failing positions, the first
        one and its value (a bad token id is never used as an address). Logits at a completion
        position must give a finite log pi_theta(token): a row with a NaN or +inf logit (after
        dividing by temperature), with every logit -inf, or with -inf at the taken token is
        refused, on every backend. -inf at other tokens is legal (vocabulary masking) and exact.
        Logits at masked positions may hold anything and never reach the loss or the gradient.
    """
    opt = resolve_options(options, option_keywords)
    logits, flat = custom_op.packed_input(logits, cu_seqlens)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or min(logits.shape) < 1:
        got = logits.shape if isinstance(logits, torch.Tensor) else logits
        raise ValueError(f"logits: expected a (B, T, V) tensor with B, T, V >= 1, got {got!r}")
    B, T, V = logits.shape
    check_tensor("logits", logits, (B, T, V), LOGIT_DTYPES, logits.device)
    backend = select_backend(logits.device)
    rows = Rows(tokens, gen_logprobs, advantages, mask, old_logprobs, ref_logprobs)
    rows, max_seqlen = custom_op.row_inputs("logits", "V", logits, rows, opt.beta, cu_seqlens)
    inplace = check_inplace_backward(logits, inplace_backward)
    scale = _check_grad_scale(grad_scale)
    shard = (vocab_start, group_name(process_group, vocab_start))
    checks = (value_check, check_now(value_check, logits))
    packing = (cu_seqlens, max_seqlen, *shard, *checks)
    parts = ((logits,), rows, opt, packing, (inplace, backend))
    if custom_op.traced(logits, *rows, cu_seqlens):
        outputs = _ftis_loss_fwd(*_FWD.flatten(*parts))
    elif _use_grad_in_forward(
        grad_in_forward, opt, logits, backend, inplace, cu_seqlens, shard, grad_scale is not None
    ):
        outputs = _FTISLossGradInForward.apply(scale, logits, _FWD.inputs(*parts))
    else:
        outputs = _FTISLoss.apply(logits, _FWD.inputs(*parts))
    return outputs[0], custom_op.public_metrics(outputs, T if flat else None, value_check)


def _use_grad_in_forward(
    requested, opt, logits, backend, inplace, cu_seqlens, shard, announced: bool
) -> bool:
    """Whether an eager call takes `_FTISLossGradInForward` (`ftis_loss`'s grad_in_forward;
    announced: whether the caller gave grad_scale)."""
    if requested is not None and not isinstance(requested, bool):
        refuse("grad_in_forward", "None, True or False", repr(requested))
    if requested is False:
        return False
    reason = grad_in_forward_reason(opt)
    if reason is None and backend != "triton":
        reason = "logits on the CPU without the Triton interpreter (the PyTorch path)"
    if reason is None and inplace:
        base = logits if logits._base is None else logits._base
        if base.is_leaf and base.requires_grad:
            reason = "inplace_backward on a leaf tensor (autograd forbids writing over it)"
        elif requested is None:
            # Written in the forward, the gradient overwrites the logits at the call, not at
            # the backward: only on request.
            reason = "inplace_backward without grad_in_forward=True"
    if reason is None and cu_seqlens is not None:
        reason = "cu_seqlens (a packed batch)"
    if reason is None and shard[1] is not None:
        reason = "process_group (a vocabulary-sharded lm-head)"
    if reason is not None:
        if requested:
            refuse("grad_in_forward", "options and inputs it applies to", reason)
        return False
    if requested is None and logits.dtype == torch.float16 and not announced:
        return False  # an unannounced loss scale would meet gradients already underflowed
    return torch.is_grad_enabled() and logits.requires_grad


def _check_grad_scale(grad_scale: object) -> float:
    """grad_scale as a float (None: 1), finite, nonzero and a normal fp32 number (the kernels
    take it in fp32, and the backward divides by it)."""
    if grad_scale is None:
        return 1.0
    ok = isinstance(grad_scale, (int, float)) and not isinstance(grad_scale, bool)
    if not ok or not _FP32_NORMAL_MIN <= abs(grad_scale) <= _FP32_MAX:
        refuse(
            "grad_scale", "None or a finite, nonzero float in fp32's normal range", repr(grad_scale)
        )
    return float(grad_scale)


_FP32_MAX = 3.4028234663852886e38
_FP32_NORMAL_MIN = 1.1754943508222875e-38
