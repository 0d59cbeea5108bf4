"""The custom-op plumbing `ftis_loss` and `ftis_linear_loss` share.

Each loss registers its passes with torch.library, so that torch.compile(fullgraph=True) sees one
opaque node per pass with a fake (shape-only) implementation and an autograd formula, instead of
graph-breaking on Triton launches and data-dependent Python. The public op resolves one
`FTISOptions` (validated once, on construction); a custom op's schema takes tensors and plain
scalars only, so `ForwardSignature.flatten` unpacks it, in `OPTION_NAMES` order, in the call of
the op, and `ForwardSignature.bind` puts it back together once inside (`ForwardInputs.opt`)
without validating it again. Nothing in between reads the options or derives them anew. Eager
calls skip both (`ForwardSignature.inputs` binds the public op's values directly, "eager
calls" below).

What is here, in the order a call meets it:
- the prologue of the public ops: a packed input given as (N, D), the row tensors' checks
  (`validate.check_row_tensors`), and the detached row tensors the forward op takes (one
  `validate.Rows`, flattened in the op's call and bound back inside as the options are);
- `ForwardSignature`: a forward op's typed parameters, written out, from which its schema is built,
  its inputs are flattened for the call and bound again inside (the op's own tensors, the row
  tensors, the options, the packing and shard parameters, then the op's own switches);
- inside the forward op: this shard's token ids, the row statistics completed over the shards, and
  the tail both losses share (the per-sample part and the value checks, `finish_forward`);
- the outputs (`OUTPUT_NAMES`): `fake_forward_outputs`, `public_metrics`;
- the autograd of both ways of calling (`register_autograd` for the custom op,
  `eager_function` for eager calls) and the saved-tensor bookkeeping of their setup and backward
  (`save_for_backward`, `backward_stats`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ftis_kernels.kernels.per_sample import SampleOutputs, per_sample_fwd
from ftis_kernels.kernels.sample_reduce import finish_fwd
from ftis_kernels.options import OPTION_FIELDS, OPTION_NAMES, FTISOptions
from ftis_kernels.packing import check_cu_seqlens, packed_rows, per_sample_part
from ftis_kernels.per_sample import (
    PER_SAMPLE_METRICS,
    PER_TOKEN_METRICS,
    SCALAR_METRICS,
)
from ftis_kernels.sharded import check_shards, combine_row_stats
from ftis_kernels.validate import CHECKS as CHECK_ROWS
from ftis_kernels.validate import (
    Rows,
    check_row_tensors,
    dispatch,
    fault_record,
    raise_on_faults,
)

# A forward op's outputs, in order: the loss, the per-token and per-sample metrics, the scalar
# metrics as one (len(SCALAR_METRICS) + 2,) vector whose last two entries are the backward's
# scales (of coef and of entropy_coef), then what the backward reads: the row statistics, coef
# (d loss / d logp over its scale), entropy_coef (the entropy bonus's per-token factor over its
# scale; empty without a bonus) and the value-check record (validate.CHECKS).
OUTPUT_NAMES = (
    "loss",
    *PER_TOKEN_METRICS,
    *PER_SAMPLE_METRICS,
    "scalars",
    "row_max",
    "log_sum",
    "coef",
    "entropy_coef",
    "record",
)
N_OUTPUTS = len(OUTPUT_NAMES)

# The row tensors (`validate.Rows`, by name), as both forward ops take them after their own tensors.
ROW_PARAMETERS = (
    ("Tensor", "tokens"),
    ("Tensor", "gen_logprobs"),
    ("Tensor", "advantages"),
    ("Tensor?", "mask"),
    ("Tensor?", "old_logprobs"),
    ("Tensor?", "ref_logprobs"),
)
# After the options: a packed batch's offsets and longest segment, a vocabulary shard's first
# column and its process group's name (None unsharded), where the value checks are read
# (validate.VALUE_CHECKS) and whether the forward reads them itself (validate.check_now).
PACKING_PARAMETERS = (
    ("Tensor?", "cu_seqlens"),
    ("int", "max_seqlen"),
    ("int", "vocab_start"),
    ("str?", "group_name"),
    ("str", "value_check"),
    ("bool", "check_now"),
)


# --- the public ops' prologue --------------------------------------------------------------------


def packed_input(x: Any, cu_seqlens: Optional[torch.Tensor]) -> tuple[Any, bool]:
    """(x as (1, N, D) when a packed batch gives it as (N, D), whether it did)."""
    flat = cu_seqlens is not None and isinstance(x, torch.Tensor) and x.dim() == 2
    return (x.unsqueeze(0) if flat else x), flat


def row_inputs(
    x_name: str,
    width: str,
    x: torch.Tensor,
    rows: Rows,
    beta: float,
    cu_seqlens: Optional[torch.Tensor],
) -> tuple[Rows, int]:
    """The row tensors checked against x (B, T, `width`) named `x_name`, as the forward op takes
    them: packed ones as (1, N), the float ones detached (gradients flow to x only); and the
    longest segment of a packed batch (0 when padded). cu_seqlens is checked here (one
    synchronisation)."""
    B, T = x.shape[:2]
    samples, max_seqlen = B, 0
    if cu_seqlens is not None:
        if B != 1:
            shape = tuple(x.shape)
            raise ValueError(
                f"{x_name}: expected (N, {width}) or (1, N, {width}) with cu_seqlens, got {shape}"
            )
        samples, max_seqlen = check_cu_seqlens(cu_seqlens, T, x.device)
        rows = packed_rows(T, rows)
    check_row_tensors(B, T, x.device, rows, beta, samples=samples)
    old, ref = (None if r is None else r.detach() for r in (rows.old_logprobs, rows.ref_logprobs))
    detached = rows._replace(
        gen_logprobs=rows.gen_logprobs.detach(),
        advantages=rows.advantages.detach(),
        old_logprobs=old,
        ref_logprobs=ref,
    )
    return detached, max_seqlen


# --- the options across the custom-op boundary ------------------------------------------------
# A torch.library custom op takes tensors and plain scalars only: the options travel unpacked, in
# OPTION_NAMES order, with schema types derived from the field annotations.

_SCHEMA_TYPES: dict[str, tuple[str, type]] = {
    "str": ("str", str),
    "Optional[str]": ("str?", str),
    "float": ("float", float),
    "Optional[float]": ("float?", float),
    "Optional[int]": ("int?", int),
    "bool": ("bool", bool),
}


def option_parameters() -> tuple[tuple[str, str], ...]:
    """The options as custom-op parameters (schema type, name): ("str", "is_mode"), ..."""
    return tuple(
        (dispatch(_SCHEMA_TYPES, f.type, f"the type of {name}")[0], name)
        for name, f in OPTION_FIELDS.items()
    )


def option_args(opt: FTISOptions) -> tuple:
    """The options unpacked in OPTION_NAMES order, as plain Python scalars of their schema type."""
    casts = [_SCHEMA_TYPES[f.type][1] for f in OPTION_FIELDS.values()]
    values = (getattr(opt, name) for name in OPTION_NAMES)
    return tuple(None if v is None else cast(v) for cast, v in zip(casts, values))


def options_from_args(args: Mapping[str, Any]) -> FTISOptions:
    """FTISOptions from a custom op's arguments, read by name: the values `option_args` unpacked
    from options the public op validated, put back together without validating them again."""
    opt = object.__new__(FTISOptions)
    for name in OPTION_NAMES:
        object.__setattr__(opt, name, args[name])
    return opt


# --- the forward ops' parameters -----------------------------------------------------------------


@dataclass(frozen=True)
class ForwardSignature:
    """A forward op's parameters as (schema type, name), in order: `leading` (the op's own
    tensors), ROW_PARAMETERS, the options (`option_parameters`, typed from the annotations
    of FTISOptions), PACKING_PARAMETERS, then `trailing` (the op's own switches). Its outputs:
    OUTPUT_NAMES, then `extra_outputs` more tensors."""

    leading: tuple[tuple[str, str], ...]
    trailing: tuple[tuple[str, str], ...]
    extra_outputs: int = 0

    @functools.cached_property
    def parameters(self) -> tuple[tuple[str, str], ...]:
        return (
            *self.leading,
            *ROW_PARAMETERS,
            *option_parameters(),
            *PACKING_PARAMETERS,
            *self.trailing,
        )

    @property
    def schema(self) -> str:
        """The torch.library schema: "(Tensor logits, ..., str backend) -> (Tensor, ...)"."""
        arguments = ", ".join(f"{kind} {name}" for kind, name in self.parameters)
        outputs = ", ".join(["Tensor"] * (N_OUTPUTS + self.extra_outputs))
        return f"({arguments}) -> ({outputs})"

    def flatten(
        self, leading: tuple, rows: Rows, opt: FTISOptions, packing: tuple, trailing: tuple
    ) -> tuple:
        """The op's inputs in the schema's order, the rows and the options unpacked
        (`option_args`): what the public op passes the custom op, the one place its row tensors
        and its options are flattened."""
        return (*leading, *rows, *option_args(opt), *packing, *trailing)

    @functools.cached_property
    def _layout(self) -> tuple[tuple[str, ...], slice, slice, tuple[str, ...]]:
        """(every parameter's name, the rows' slice, the options' slice, the other names)."""
        names = tuple(name for _, name in self.parameters)
        r0 = len(self.leading)
        o0 = r0 + len(ROW_PARAMETERS)
        o1 = o0 + len(OPTION_NAMES)
        return names, slice(r0, o0), slice(o0, o1), names[:r0] + names[o1:]

    def inputs(
        self, leading: tuple, rows: Rows, opt: FTISOptions, packing: tuple, trailing: tuple
    ) -> ForwardInputs:
        """The inputs `flatten` would pass, already bound as `bind` would give them back: what
        an eager call hands its autograd.Function (`eager_function`), nothing unpacked."""
        rest = self._layout[3]
        return ForwardInputs(
            rows, opt, dict(zip(rest, (*leading, *packing, *trailing), strict=True))
        )

    def bind(self, inputs: tuple) -> ForwardInputs:
        """The op's inputs as the fake implementation, the real one and setup_context receive them
        (positionally), put back together: the rows and the options once, the rest by name."""
        names, rows, options, rest = self._layout
        named = dict(zip(names, inputs))
        opt = options_from_args(dict(zip(OPTION_NAMES, inputs[options])))
        return ForwardInputs(Rows(*inputs[rows]), opt, {name: named[name] for name in rest})


@dataclass(frozen=True)
class ForwardInputs:
    """A forward op's inputs, bound (`ForwardSignature.bind` inside the custom op,
    `ForwardSignature.inputs` for an eager call): `rows` the row tensors, `opt` the
    options as the public op validated them, every other input by name (`args["cu_seqlens"]`);
    the rows and the options are read from `rows` and `opt` only."""

    rows: Rows
    opt: FTISOptions
    named: dict[str, Any]

    def __getitem__(self, name: str) -> Any:
        return self.named[name]


# --- inside the forward ops ----------------------------------------------------------------------


def shard_tokens(args: ForwardInputs) -> torch.Tensor:
    """The token ids in this shard's columns (global ids less vocab_start) when the vocabulary is
    sharded, else the ids themselves: another shard's token is never hit."""
    tokens = args.rows.tokens
    return tokens if args["group_name"] is None else tokens - args["vocab_start"]


@dataclass
class Shard:
    """This rank's part of the vocabulary: `width` columns of `vocab` (both the same unsharded),
    the process group (None unsharded) and the token ids in this shard's columns."""

    group: Any
    width: int
    vocab: int
    tokens: torch.Tensor

    @classmethod
    def of(cls, args: ForwardInputs, device: torch.device, width: int, H: int = 0) -> Shard:
        """From the bound inputs; sharded, after one all-gather that checks the shards tile the
        vocabulary and agree on the rows' (B, T) (and on H when given)."""
        name, tokens = args["group_name"], shard_tokens(args)
        if name is None:
            return cls(None, width, width, tokens)
        rows = tuple(tokens.shape)
        group, vocab = check_shards(name, device, args["vocab_start"], width, H, rows)
        return cls(group, width, vocab, tokens)

    def complete(self, stats: tuple, mask: Optional[torch.Tensor]) -> tuple:
        """(logp, row_max, log_sum, entropy) of the whole vocabulary from this shard's (two
        all-reduces when sharded; unchanged otherwise)."""
        if self.group is None:
            return stats
        return combine_row_stats(self.group, self.tokens, self.width, mask, *stats)


def completion_mask(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The mask as bool (it may come as 0/1: then mask != 0), or None."""
    return mask if mask is None or mask.dtype == torch.bool else mask != 0


def dr_grpo_length(args: ForwardInputs, T: int) -> int:
    """dr_grpo's L: max_completion_length, else the padded length (packed: the longest segment)."""
    if args.opt.max_completion_length is not None:
        return args.opt.max_completion_length
    return args["max_seqlen"] if args["cu_seqlens"] is not None else T


def segment_offsets(cu_seqlens: torch.Tensor) -> list[int]:
    """A packed batch's offsets on the host (one synchronisation; the public ops' packed path
    has read them already to check them)."""
    return [int(x) for x in cu_seqlens.tolist()]


def finish_forward(
    args: ForwardInputs,
    vocab: int,
    stats: tuple,
    logits_name: str = "logits",
    samples: Optional[SampleOutputs] = None,
) -> tuple:
    """The tail of both forward ops, from the row statistics (logp, row_max, log_sum, entropy),
    each (B, T) fp32: the per-sample part and the value checks (Triton: two launches,
    `kernels/per_sample.py`, the first skipped when `samples` holds its results already;
    PyTorch: `per_sample.py` and `validate.fault_record`), the checks read at once when the call
    asked for it, and the outputs in OUTPUT_NAMES order."""
    logp, row_max, log_sum, entropy = stats
    opt, rows = args.opt, args.rows
    shape = tuple(logp.shape)
    if args["backend"] == "triton":
        out = samples
        if out is None:
            n_samples = rows.advantages.shape[0]
            out = SampleOutputs.empty(shape, n_samples, logp.device, opt.entropy_coef > 0)
            per_sample_fwd(
                out,
                (logp, entropy, row_max, log_sum),
                rows,
                opt,
                V=vocab,
                length=dr_grpo_length(args, shape[1]),
                cu_seqlens=args["cu_seqlens"],
            )
        # A packed call's per-token tensors are (N,): its record says (N, 0), as the caller's.
        dims = shape if args["cu_seqlens"] is None else (shape[0] * shape[1], 0)
        loss, scalars, record = finish_fwd(out, opt, dims, vocab, logits_name != "logits")
        per_sample = (out.kl, out.filtered, out.truncated)
        coef, entropy_coef = out.coef, out.ecoef
    else:
        # ref_logprobs are read only by the beta penalty, and checked only then (as on Triton).
        read = rows if opt.beta > 0 else rows._replace(ref_logprobs=None)
        record = fault_record(
            vocab,
            read,
            (logp, row_max, log_sum),
            from_hidden=logits_name != "logits",
            packed=args["cu_seqlens"] is not None,
        )
        bool_rows = rows._replace(mask=completion_mask(rows.mask))
        packing = (args["cu_seqlens"], args["max_seqlen"])
        result = per_sample_part(logp, bool_rows, opt, entropy, *packing)
        loss, coef = result.loss, result.coef
        entropy_coef = result.entropy_coef if opt.entropy_coef > 0 else None
        one = torch.ones((), dtype=torch.float32, device=logp.device)
        scalars = torch.stack([result.metrics[name] for name in SCALAR_METRICS] + [one, one])
        per_sample = tuple(result.metrics[name] for name in PER_SAMPLE_METRICS)
    if args["check_now"]:
        raise_on_faults(record)
    if entropy_coef is None:
        entropy_coef = logp.new_empty(0)
    return (loss, logp, entropy, *per_sample, scalars, row_max, log_sum, coef, entropy_coef, record)


# --- the outputs ---------------------------------------------------------------------------------


def fake_forward_outputs(
    like: torch.Tensor, B: int, T: int, cu_seqlens: Optional[torch.Tensor] = None, *, opt=None
) -> tuple[torch.Tensor, ...]:
    """Shape-only outputs of a forward op (OUTPUT_NAMES), on the device of `like`. Packed
    (cu_seqlens given): B = 1 row of T tokens and cu_seqlens.shape[0] - 1 samples."""
    f32, per_token = torch.float32, (B, T)
    samples = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    bonus = opt is not None and opt.entropy_coef > 0
    return (
        like.new_empty((), dtype=f32),
        *(like.new_empty(per_token, dtype=f32) for _ in PER_TOKEN_METRICS),
        like.new_empty((samples,), dtype=f32),
        like.new_empty((samples,), dtype=torch.bool),
        like.new_empty((samples,), dtype=f32),
        like.new_empty((len(SCALAR_METRICS) + 2,), dtype=f32),
        *(like.new_empty(per_token, dtype=f32) for _ in range(3)),
        like.new_empty(per_token if bonus else (0,), dtype=f32),
        like.new_empty((len(CHECK_ROWS), 7), dtype=torch.float64),
    )


def _detached(t: torch.Tensor) -> torch.Tensor:
    """t out of the graph: itself when nothing records its gradient (an eager call's outputs
    other than the loss, marked non-differentiable), else `t.detach()` (the custom op's)."""
    return t.detach() if t.requires_grad else t


def public_metrics(
    outputs: tuple, flat: Optional[int] = None, value_check: str = "backward"
) -> dict[str, torch.Tensor]:
    """The metrics of a forward op's outputs, detached, by name (per_sample.METRIC_NAMES order);
    per-token ones as (flat,) when given (packed inputs passed as (N, V) or (N, H)). The scalar
    metrics are views of one vector: no kernel runs here. With value_check="deferred", the
    value-check record too, as "value_faults" (`ftis_kernels.raise_on_bad_values` reads it)."""
    named = dict(zip(OUTPUT_NAMES, outputs))
    metrics = {name: _detached(named[name]) for name in (*PER_TOKEN_METRICS, *PER_SAMPLE_METRICS)}
    # One call for the views of the scalar metrics (not one indexing each).
    metrics.update(zip(SCALAR_METRICS, _detached(named["scalars"]).unbind(0)))
    for name in PER_TOKEN_METRICS if flat is not None else ():
        metrics[name] = metrics[name].reshape(flat)
    if value_check == "deferred":
        metrics["value_faults"] = _detached(named["record"])
    return metrics


# --- eager calls: the same computation without the dispatcher ------------------------------------
# A torch.library custom op costs a call in the dispatcher's Python: its autograd wrapper fills the
# schema's defaults argument by argument, each lookup rebuilding the argument list (quadratic in
# the ~45 parameters of a forward op: about 0.8 ms a call, profiled with cProfile on the CPU and
# seen as the forward's CPU time in torch.profiler on an H200). Eager calls on plain tensors
# take an autograd.Function running the same implementation, setup and backward; calls being
# traced (torch.compile, export) or on tensor subclasses (FakeTensor, DTensor) take the op. The
# Function takes the op's differentiable tensors and the bound inputs (`ForwardSignature.inputs`):
# nothing is flattened into ~45 arguments and bound again, and autograd sees a few inputs.

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def traced(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a call must go through the custom op: under torch.compile or export, or with a
    tensor of a subclass among `tensors` (None entries ignored)."""
    if torch.compiler.is_compiling():
        return True
    return any(t is not None and type(t) not in _PLAIN_TENSORS for t in tensors)


def register_autograd(op, signature: ForwardSignature, setup, backward) -> None:
    """The custom op's autograd: `setup(ctx, args, n_inputs, output)` on its bound inputs, then
    `backward(ctx, grad_loss, *_)` returning one gradient per input."""

    def setup_context(ctx, inputs, output):
        setup(ctx, signature.bind(inputs), len(inputs), output)

    op.register_autograd(backward, setup_context=setup_context)


def eager_function(name: str, forward, setup, backward) -> type:
    """An autograd.Function doing what a forward custom op does, called as
    `apply(*tensors, args)`: `tensors` the ones gradients flow to (the logits; hidden, weight,
    bias), `args` the bound inputs (`ForwardSignature.inputs`, holding those tensors too).
    `forward(args)` gives the op's outputs, `setup(ctx, args, n_inputs, outputs)` and
    `backward` are the op's; the outputs after the first (the loss) are non-differentiable. Its
    ctx.eager is True, so that the backward calls its own ops' implementations directly
    (`op_or_impl`)."""

    def forward_(ctx, *inputs):
        args = inputs[-1]
        outputs = forward(args)
        setup(ctx, args, len(inputs), outputs)
        ctx.eager = True
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    members = {"forward": staticmethod(forward_), "backward": staticmethod(backward)}
    return type(name, (torch.autograd.Function,), members)


def op_or_impl(ctx, op, impl):
    """The backward's own op for a traced forward, its plain implementation for an eager one."""
    return impl if getattr(ctx, "eager", False) else op


# --- the saved tensors ---------------------------------------------------------------------------


def save_for_backward(ctx, args: ForwardInputs, n_inputs: int, output: tuple, *tensors) -> None:
    """Saves `tensors`, then what the backward reads of the forward's outputs; keeps the
    temperature, the backend, whether the backward reads the value checks, and the number of
    inputs (the backward's tuple length)."""
    named = dict(zip(OUTPUT_NAMES, output))
    saved = ("row_max", "log_sum", "coef", "entropy", "entropy_coef", "scalars", "record")
    ctx.save_for_backward(*tensors, *(named[name] for name in saved))
    ctx.temperature, ctx.backend, ctx.n_inputs = args.opt.temperature, args["backend"], n_inputs
    ctx.entropy_grad = args.opt.entropy_coef > 0
    ctx.check_in_backward = args["value_check"] == "backward" and not args["check_now"]


def backward_stats(ctx, grad_loss: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
    """(row_max, log_sum, coef, entropy, entropy_coef, scales, grad_loss) for a backward row
    pass, from a forward op's saved tensors: on Triton, coef and entropy_coef as saved and the
    scales (2,) and the incoming gradient () as tensors the kernel multiplies in (no launch
    here); on the PyTorch path, coef and entropy_coef with them and 1 / temperature folded in
    (scales and grad_loss None). entropy and entropy_coef are None without an entropy bonus."""
    *_, row_max, log_sum, coef, entropy, entropy_coef, scalars, _ = ctx.saved_tensors
    scales = scalars[len(SCALAR_METRICS) :]
    if not ctx.entropy_grad:
        entropy = entropy_coef = None
    if ctx.backend == "triton":
        return row_max, log_sum, coef, entropy, entropy_coef, scales, grad_loss
    scale = grad_loss.float() / ctx.temperature
    coef = (coef * (scales[0] * scale)).contiguous()
    if entropy_coef is not None:
        entropy_coef = (entropy_coef * (scales[1] * scale)).contiguous()
    return row_max, log_sum, coef, entropy, entropy_coef, None, None


def saved_record(ctx) -> Optional[torch.Tensor]:
    """The value-check record when the backward reads it (value_check="backward"), else None."""
    return ctx.saved_tensors[-1] if ctx.check_in_backward else None
