"""The custom-op plumbing `ftis_loss` and `ftis_linear_loss` share.

Each loss registers its passes with torch.library, so that torch.compile(fullgraph=True) sees one
opaque node per pass with a fake (shape-only) implementation and an autograd formula, instead of
graph-breaking on Triton launches and data-dependent Python. A custom op's schema takes tensors and
plain scalars only, so the options cross the boundary unpacked, in `OPTION_NAMES` order, and are
put back together inside without being validated again (the public op validated them once).

What is here, in the order a call meets it:
- the prologue of the public ops: a packed input given as (N, D), the row tensors' checks
  (`validate.check_row_tensors`), and the detached row tensors the forward op takes;
- `ForwardSignature`: a forward op's typed parameters, written out, from which its schema is built
  and its inputs are named (the op's own tensors, the row tensors, the options, the packing and
  shard parameters, then the op's own switches);
- inside the forward op: this shard's token ids, the row statistics completed over the shards, and
  the tail both losses share (value checks, the per-sample part, the outputs);
- the outputs: `forward_outputs`, `fake_forward_outputs`, `public_metrics`;
- the saved-tensor bookkeeping of `setup_context` and the backward (`save_for_backward`,
  `backward_stats`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ftis_kernels.options import FTISOptions, option_parameters, options_from_args
from ftis_kernels.packing import check_cu_seqlens, packed_rows, per_sample_part
from ftis_kernels.per_sample import METRIC_NAMES, PER_SAMPLE_METRICS, PER_TOKEN_METRICS
from ftis_kernels.sharded import check_shards, combine_row_stats
from ftis_kernels.validate import check_row_tensors, check_values

# What a forward op returns after the loss and the metrics, for the backward.
SAVED_NAMES = ("row_max", "log_sum", "coef", "entropy_coef")
N_OUTPUTS = 1 + len(METRIC_NAMES) + len(SAVED_NAMES)

# The row tensors, as both forward ops take them after their own tensors.
ROW_PARAMETERS = (
    ("Tensor", "tokens"),
    ("Tensor", "gen_logprobs"),
    ("Tensor", "advantages"),
    ("Tensor?", "mask"),
    ("Tensor?", "old_logprobs"),
    ("Tensor?", "ref_logprobs"),
)
# After the options: a packed batch's offsets and longest segment, a vocabulary shard's first
# column and its process group's name (None unsharded).
PACKING_PARAMETERS = (
    ("Tensor?", "cu_seqlens"),
    ("int", "max_seqlen"),
    ("int", "vocab_start"),
    ("str?", "group_name"),
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
    rows: tuple,
    beta: float,
    cu_seqlens: Optional[torch.Tensor],
) -> tuple[tuple, int]:
    """The row tensors (tokens, gen_logprobs, advantages, mask, old_logprobs, ref_logprobs) checked
    against x (B, T, `width`) named `x_name`, as the forward op takes them: packed ones as (1, N),
    the float ones detached (gradients flow to x only); and the longest segment of a packed batch
    (0 when padded). cu_seqlens is checked here (one synchronisation)."""
    B, T = x.shape[:2]
    tokens, gen, adv, mask, old, ref = rows
    samples, max_seqlen = B, 0
    if cu_seqlens is not None:
        if B != 1:
            shape = tuple(x.shape)
            raise ValueError(
                f"{x_name}: expected (N, {width}) or (1, N, {width}) with cu_seqlens, got {shape}"
            )
        samples, max_seqlen = check_cu_seqlens(cu_seqlens, T, x.device)
        tokens, gen, mask, old, ref = packed_rows(T, tokens, gen, mask, old, ref)
    check_row_tensors(B, T, x.device, tokens, gen, adv, mask, old, ref, beta, samples=samples)
    old, ref = (None if r is None else r.detach() for r in (old, ref))
    return (tokens, gen.detach(), adv.detach(), mask, old, ref), max_seqlen


# --- the forward ops' parameters -----------------------------------------------------------------


@dataclass(frozen=True)
class ForwardSignature:
    """A forward op's parameters as (schema type, name), in order: `leading` (the op's own
    tensors), ROW_PARAMETERS, the options (`options.option_parameters`, typed from the annotations
    of FTISOptions), PACKING_PARAMETERS, then `trailing` (the op's own switches). Its outputs: the
    loss, the metrics in METRIC_NAMES order, SAVED_NAMES, then `extra_outputs` more tensors."""

    leading: tuple[tuple[str, str], ...]
    trailing: tuple[tuple[str, str], ...]
    extra_outputs: int = 0

    @property
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

    def bind(self, inputs: tuple) -> dict[str, Any]:
        """The op's inputs by name (the fake implementation, the real one and setup_context
        receive them positionally)."""
        return dict(zip((name for _, name in self.parameters), inputs))

    @staticmethod
    def options(args: dict[str, Any]) -> FTISOptions:
        """The options among the bound inputs, as the public op validated them."""
        return options_from_args(args)


# --- inside the forward ops ----------------------------------------------------------------------


def shard_tokens(args: dict[str, Any]) -> torch.Tensor:
    """The token ids in this shard's columns (global ids less vocab_start) when the vocabulary is
    sharded, else the ids themselves: another shard's token is never hit."""
    tokens = args["tokens"]
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
    def of(cls, args: dict[str, Any], device: torch.device, width: int, H: int = 0) -> Shard:
        """From the bound inputs; sharded, after one all-gather that checks the shards tile the
        vocabulary (and agree on H when given)."""
        name, tokens = args["group_name"], shard_tokens(args)
        if name is None:
            return cls(None, width, width, tokens)
        group, vocab = check_shards(name, device, args["vocab_start"], width, H)
        return cls(group, width, vocab, tokens)

    def complete(self, stats: tuple, mask: Optional[torch.Tensor]) -> tuple:
        """(logp, row_max, log_sum, entropy) of the whole vocabulary from this shard's (two
        all-reduces when sharded; unchanged otherwise)."""
        if self.group is None:
            return stats
        return combine_row_stats(self.group, self.tokens, self.width, mask, *stats)


def completion_mask(args: dict[str, Any]) -> Optional[torch.Tensor]:
    """The mask as bool (it may come as 0/1), or None."""
    mask = args["mask"]
    return None if mask is None else mask != 0


def per_sample(
    args: dict[str, Any],
    opt: FTISOptions,
    mask: Optional[torch.Tensor],
    logp: torch.Tensor,
    entropy: torch.Tensor,
):
    """`packing.per_sample_part` on the bound inputs: the loss, coef, entropy_coef, metrics."""
    rows = (args["gen_logprobs"], args["advantages"], mask, args["old_logprobs"])
    packing = (args["cu_seqlens"], args["max_seqlen"])
    return per_sample_part(logp, *rows, args["ref_logprobs"], opt, entropy, *packing)


def finish_forward(
    args: dict[str, Any],
    opt: FTISOptions,
    vocab: int,
    mask: Optional[torch.Tensor],
    stats: tuple,
    logits_name: str = "logits",
) -> tuple:
    """The tail of both forward ops: the input values and the row statistics (logp, row_max,
    log_sum, entropy) checked with one synchronisation (here they run eagerly even under
    torch.compile), then the per-sample part and the outputs (`forward_outputs`)."""
    logp, row_max, log_sum, entropy = stats
    names = ("tokens", "gen_logprobs", "advantages", "mask", "old_logprobs", "ref_logprobs")
    rows = tuple(args[name] for name in names)
    check_values(vocab, *rows, (logp, row_max, log_sum), logits_name=logits_name)
    return forward_outputs(per_sample(args, opt, mask, logp, entropy), row_max, log_sum)


# --- the outputs ---------------------------------------------------------------------------------


def forward_outputs(result, row_max: torch.Tensor, log_sum: torch.Tensor) -> tuple:
    """(loss, *metrics in METRIC_NAMES order, row_max, log_sum, coef, entropy_coef)."""
    metrics = (result.metrics[name] for name in METRIC_NAMES)
    return (result.loss, *metrics, row_max, log_sum, result.coef, result.entropy_coef)


def fake_forward_outputs(
    like: torch.Tensor, B: int, T: int, cu_seqlens: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, ...]:
    """Shape-only outputs of a forward op, on the device of `like`. Packed (cu_seqlens given):
    B = 1 row of T tokens and cu_seqlens.shape[0] - 1 samples."""
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


# --- the saved tensors ---------------------------------------------------------------------------


def save_for_backward(ctx, args: dict[str, Any], inputs: tuple, output: tuple, *tensors) -> None:
    """Saves `tensors`, then row_max, log_sum, coef, the entropy and entropy_coef; keeps the
    temperature and the backend, and the number of inputs (the backward's tuple length)."""
    row_max, log_sum, coef, entropy_coef = output[-len(SAVED_NAMES) :]
    entropy = output[1 + METRIC_NAMES.index("entropy")]
    ctx.save_for_backward(*tensors, row_max, log_sum, coef, entropy, entropy_coef)
    ctx.temperature, ctx.backend, ctx.n_inputs = args["temperature"], args["backend"], len(inputs)
    ctx.entropy_grad = args["entropy_coef"] > 0


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
