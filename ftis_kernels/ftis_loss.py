"""`ftis_loss`: the fused F-TIS loss from logits (docs/method.md §2).

Forward: one streaming pass over each row of logits (`kernels/logp_lse.py`) gives log pi_theta of
the taken token and the row's log-sum-exp; the per-sample part (`per_sample.py`) turns them into
the loss, the metrics and d loss / d logp. Backward: one pass writes
dlogits = coef * (onehot - softmax) / temperature, recomputing the softmax from the saved row
statistics (max and log-sum-exp relative to it), optionally into the logits buffer itself. No
(B, T, V) temporary is ever created.

Dispatch, by where the logits live: CUDA -> compiled Triton kernels; CPU with the kernels
decorated under TRITON_INTERPRET=1 -> the same Triton kernels, interpreted; CPU otherwise -> a
chunked PyTorch path with the same results.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from ftis_kernels.grad_buffer import grad_buffer
from ftis_kernels.kernels import BACKWARD, FORWARD, select_backend
from ftis_kernels.options import (
    FTISOptions,
    OptionKeywords,
    option_args,
    option_schema,
    options_from_args,
    resolve_options,
    with_option_keywords,
)
from ftis_kernels.packing import check_cu_seqlens, packed_rows, per_sample_part
from ftis_kernels.per_sample import METRIC_NAMES, PER_SAMPLE_METRICS, PER_TOKEN_METRICS
from ftis_kernels.sharded import check_shards, combine_row_stats, group_name
from ftis_kernels.validate import (
    LOGIT_DTYPES,
    check_inplace_backward,
    check_row_tensors,
    check_tensor,
    check_values,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

# What a forward op returns after the loss and the metrics, for the backward.
SAVED_NAMES = ("row_max", "log_sum", "coef", "entropy_coef")
N_OUTPUTS = 1 + len(METRIC_NAMES) + len(SAVED_NAMES)


def forward_schema(leading: str, extra_outputs: int = 0) -> str:
    """Schema of a forward custom op: `leading` tensor arguments, the row tensors, the options
    (options.option_schema), then `trailing`; returns loss, metrics, row_max, log_sum, coef,
    entropy_coef, then `extra_outputs` more tensors."""
    outputs = ", ".join(["Tensor"] * (N_OUTPUTS + extra_outputs))
    return f"({leading}, {option_schema()}, {{trailing}}) -> ({outputs})"


def arguments(op, inputs: tuple) -> dict[str, Any]:
    """A custom op's inputs by name, from its schema: setup_context reads them by name."""
    names = [a.name for a in op._opoverload._schema.arguments]
    return dict(zip(names, inputs))


def forward_outputs(result, row_max: torch.Tensor, log_sum: torch.Tensor) -> tuple:
    """(loss, *metrics in METRIC_NAMES order, row_max, log_sum, coef, entropy_coef)."""
    metrics = (result.metrics[name] for name in METRIC_NAMES)
    return (result.loss, *metrics, row_max, log_sum, result.coef, result.entropy_coef)


def fake_forward_outputs(
    like: torch.Tensor, B: int, T: int, cu_seqlens: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, ...]:
    """Shape-only outputs of a forward op of this library, on the device of `like`; shared by
    `ftis_loss` and `ftis_linear_loss`. Packed (cu_seqlens given): B = 1 row of T tokens and
    cu_seqlens.shape[0] - 1 samples."""
    f32, per_token = torch.float32, (B, T)
    samples = B if cu_seqlens is None else cu_seqlens.shape[0] - 1

    def metric(name: str) -> torch.Tensor:
        if name in PER_TOKEN_METRICS:
            return like.new_empty(per_token, dtype=f32)
        if name in PER_SAMPLE_METRICS:
            return like.new_empty((samples,), dtype=torch.bool if name == "filtered" else f32)
        return like.new_empty((), dtype=f32)

    saved = (like.new_empty(per_token, dtype=f32) for _ in SAVED_NAMES)
    return (like.new_empty((), dtype=f32), *(metric(n) for n in METRIC_NAMES), *saved)


def public_metrics(outputs: tuple, flat: Optional[int] = None) -> dict[str, torch.Tensor]:
    """The metrics of a forward op's outputs, detached, by name; per-token ones as (flat,) when
    given (packed inputs passed as (N, V) or (N, H))."""
    metrics = {name: value.detach() for name, value in zip(METRIC_NAMES, outputs[1:])}
    for name in PER_TOKEN_METRICS if flat is not None else ():
        metrics[name] = metrics[name].reshape(flat)
    return metrics


# The op is registered with torch.library so that torch.compile(fullgraph=True) sees one opaque
# node with a fake (shape-only) implementation and an autograd formula, instead of graph-breaking
# on Triton launches and data-dependent Python. The options travel unpacked (a custom op's schema
# takes tensors and plain scalars only), in the schema built from `FTISOptions`.

_FWD_SCHEMA = forward_schema(
    "Tensor logits, Tensor tokens, Tensor gen_logprobs, Tensor advantages, Tensor? mask, "
    "Tensor? old_logprobs, Tensor? ref_logprobs"
).format(
    trailing="Tensor? cu_seqlens, int max_seqlen, int vocab_start, str? group_name, "
    "bool inplace_backward, str backend"
)


def _ftis_loss_fwd_impl(*inputs):
    """Checks the input values and the logits' row statistics right after the row pass, with
    one synchronisation: here they run eagerly even under torch.compile."""
    args = arguments(_ftis_loss_fwd, inputs)
    opt = options_from_args(args)
    logits, tokens, gen, adv = (args[k] for k in ("logits", "tokens", "gen_logprobs", "advantages"))
    mask, old, ref = args["mask"], args["old_logprobs"], args["ref_logprobs"]
    m = None if mask is None else mask != 0
    V, name, start = logits.shape[-1], args["group_name"], args["vocab_start"]
    local = tokens if name is None else tokens - start
    if name is not None:
        group, V = check_shards(name, logits.device, start, logits.shape[-1])
    logp, row_max, log_sum, entropy = FORWARD[args["backend"]](logits, local, m, opt.temperature)
    if name is not None:
        stats = (logp, row_max, log_sum, entropy)
        shard = (group, local, logits.shape[-1], m)
        logp, row_max, log_sum, entropy = combine_row_stats(*shard, *stats)
    check_values(V, tokens, gen, adv, mask, old, ref, (logp, row_max, log_sum))
    packing = (args["cu_seqlens"], args["max_seqlen"])
    result = per_sample_part(logp, gen, adv, m, old, ref, opt, entropy, *packing)
    return forward_outputs(result, row_max, log_sum)


_ftis_loss_fwd = torch.library.custom_op(
    "ftis_kernels::ftis_loss_fwd", _ftis_loss_fwd_impl, mutates_args=(), schema=_FWD_SCHEMA
)


@_ftis_loss_fwd.register_fake
def _(*inputs):
    args = arguments(_ftis_loss_fwd, inputs)
    logits = args["logits"]
    return fake_forward_outputs(logits, logits.shape[0], logits.shape[1], args["cu_seqlens"])


@torch.library.custom_op("ftis_kernels::ftis_loss_bwd", mutates_args=())
def _ftis_loss_bwd(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    coef: torch.Tensor,
    entropy: Optional[torch.Tensor],
    entropy_coef: Optional[torch.Tensor],
    temperature: float,
    backend: str,
) -> torch.Tensor:
    """d loss / d logits (B, T, V) in a buffer no one else holds (on the CPU, one reused across
    calls: grad_buffer.py); coef and entropy_coef already scaled by the incoming gradient and
    1 / temperature."""
    out = grad_buffer(logits)
    stats = (row_max, log_sum, coef, temperature, out, entropy, entropy_coef)
    return BACKWARD[backend](logits, tokens, *stats)


@_ftis_loss_bwd.register_fake
def _(logits, *_):
    return torch.empty_like(logits)


@torch.library.custom_op("ftis_kernels::ftis_loss_bwd_", mutates_args=("logits",))
def _ftis_loss_bwd_inplace(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    coef: torch.Tensor,
    entropy: Optional[torch.Tensor],
    entropy_coef: Optional[torch.Tensor],
    temperature: float,
    backend: str,
) -> None:
    """d loss / d logits written over the logits themselves."""
    stats = (row_max, log_sum, coef, temperature, logits, entropy, entropy_coef)
    BACKWARD[backend](logits, tokens, *stats)


def backward_stats(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(row_max, log_sum, coef, entropy, entropy_coef) from a forward op's saved tensors, with
    the incoming gradient and 1 / temperature folded into coef and entropy_coef; entropy and
    entropy_coef are None without an entropy bonus (the row kernels then skip that term)."""
    *_, row_max, log_sum, coef, entropy, entropy_coef = ctx.saved_tensors
    scale = grad_loss.float() / ctx.temperature
    coef = (coef * scale).contiguous()
    if not ctx.entropy_grad:
        return row_max, log_sum, coef, None, None
    return row_max, log_sum, coef, entropy, (entropy_coef * scale).contiguous()


def save_for_backward(ctx, args: dict[str, Any], inputs: tuple, output: tuple, *tensors) -> None:
    """Saves `tensors`, then row_max, log_sum, coef, the entropy and entropy_coef; keeps the
    temperature and the backend, and the number of inputs (the backward's tuple length)."""
    row_max, log_sum, coef, entropy_coef = output[-len(SAVED_NAMES) :]
    entropy = output[1 + METRIC_NAMES.index("entropy")]
    ctx.save_for_backward(*tensors, row_max, log_sum, coef, entropy, entropy_coef)
    ctx.temperature, ctx.backend, ctx.n_inputs = args["temperature"], args["backend"], len(inputs)
    ctx.entropy_grad = args["entropy_coef"] > 0


def _setup_context(ctx, inputs, output):
    args = arguments(_ftis_loss_fwd, inputs)
    tokens = args["tokens"]
    if args["group_name"] is not None:  # this shard's ids; another shard's token is never hit
        tokens = tokens - args["vocab_start"]
    save_for_backward(ctx, args, inputs, output, args["logits"], tokens)
    ctx.inplace_backward = args["inplace_backward"]


def _backward(ctx, grad_loss, *_):
    logits, tokens = ctx.saved_tensors[:2]
    row_max, log_sum, coef, entropy, entropy_coef = backward_stats(ctx, grad_loss)
    stats = (row_max, log_sum, coef, entropy, entropy_coef, ctx.temperature, ctx.backend)
    if ctx.inplace_backward:
        torch.ops.ftis_kernels.ftis_loss_bwd_(logits, tokens, *stats)
        dlogits = logits
    else:
        dlogits = torch.ops.ftis_kernels.ftis_loss_bwd(logits, tokens, *stats)
    return (dlogits,) + (None,) * (ctx.n_inputs - 1)


_ftis_loss_fwd.register_autograd(_backward, setup_context=_setup_context)


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
        **option_keywords: any field of `FTISOptions` (is_mode, filter, loss_type, ratio_level,
            entropy_coef, ...), applied over `options`; help(ftis_loss) lists them all.
        inplace_backward: write d loss / d logits into the logits buffer during backward, saving
            a (B, T, V) allocation. Only when nothing reads the logits after the loss: they are
            overwritten by their gradient. Refused (ValueError) for logits whose elements share
            memory (expanded or overlapping views) and, unless "force", for a leaf tensor that
            requires grad or a view of one (your own tensor would become its gradient).
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
            bool (packed: (S,)), and 0-dim fp32 "filtered_frac",
            "kl_mean", "clip_frac", "is_weight_mean", "is_truncated_frac", "is_masked_frac",
            "is_ratio_mean", "is_ratio_max", "is_ratio_min", "entropy_mean" (over completion
            tokens; is_ratio_* is the raw IS ratio before truncation or masking).

    Raises:
        ValueError naming the argument, in one line: shapes, dtypes, devices, options (an unknown
        name, a bad value, a bad combination naming both options) and the in-place backward's
        preconditions before any kernel runs; values (token ids, finiteness
        and sign in float32, the logits) with one synchronisation right after the row pass, with
        the number of failing positions, the first one and its value. Logits at a completion
        position must give a finite log pi_theta(token): a row with a NaN or +inf logit (after
        dividing by temperature), with every logit -inf, or with -inf at the taken token is
        refused, on every backend. -inf at other tokens is legal (vocabulary masking) and exact.
        Logits at masked positions may hold anything and never reach the loss or the gradient.
    """
    opt = resolve_options(options, option_keywords)
    flat = cu_seqlens is not None and isinstance(logits, torch.Tensor) and logits.dim() == 2
    logits = logits.unsqueeze(0) if flat else logits
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or min(logits.shape) < 1:
        got = logits.shape if isinstance(logits, torch.Tensor) else logits
        raise ValueError(f"logits: expected a (B, T, V) tensor with B, T, V >= 1, got {got!r}")
    B, T, V = logits.shape
    check_tensor("logits", logits, (B, T, V), LOGIT_DTYPES, logits.device)
    backend = select_backend(logits.device)
    samples, max_seqlen = B, 0
    if cu_seqlens is not None:
        if B != 1:
            shape = tuple(logits.shape)
            raise ValueError(f"logits: expected (N, V) or (1, N, V) with cu_seqlens, got {shape}")
        samples, max_seqlen = check_cu_seqlens(cu_seqlens, T, logits.device)
        tokens, gen_logprobs, mask, old_logprobs, ref_logprobs = packed_rows(
            T, tokens, gen_logprobs, mask, old_logprobs, ref_logprobs
        )
    rows = (tokens, gen_logprobs, advantages, mask, old_logprobs, ref_logprobs)
    check_row_tensors(B, T, logits.device, *rows, opt.beta, samples=samples)
    inplace = check_inplace_backward(logits, inplace_backward)
    outputs = _ftis_loss_fwd(
        logits,
        tokens,
        gen_logprobs.detach(),
        advantages.detach(),
        mask,
        None if old_logprobs is None else old_logprobs.detach(),
        None if ref_logprobs is None else ref_logprobs.detach(),
        *option_args(opt),
        cu_seqlens,
        max_seqlen,
        vocab_start,
        group_name(process_group, vocab_start),
        inplace,
        backend,
    )
    return outputs[0], public_metrics(outputs, T if flat else None)
