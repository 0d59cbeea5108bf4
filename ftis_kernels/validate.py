"""Input checks of the public ops, done once at the boundary.

Every failure is a ValueError that names the argument and says what was expected, in one line.
Shapes, dtypes, devices and the in-place backward's preconditions are checked before any kernel
runs. The value checks (token range, finiteness in float32, signs, and the logits' row statistics)
are made on the device by the forward's own kernels into a small record (`CHECKS`), which
`raise_on_faults` reads with one synchronisation where the caller chose (`VALUE_CHECKS`): in the
backward by default, in the call, or never by the op. The kernels never use a bad token id as an
address, so a bad value costs a wrong loss at worst until the record is read, never memory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple, NoReturn, Optional

import torch

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOKEN_DTYPES = (torch.int32, torch.int64)


def refuse(name: str, expected: str, got: object) -> NoReturn:
    """The one form of the library's input errors: ValueError("name: expected ..., got ...") with
    `got` as its str (callers pass a repr where the value itself is shown)."""
    raise ValueError(f"{name}: expected {expected}, got {got}")


def dispatch(table: Mapping[Any, Any], value: Any, option: str) -> Any:
    """table[value], or a ValueError naming the option and the allowed values: no silent else."""
    if value not in table:
        refuse(option, f"one of {tuple(table)}", repr(value))
    return table[value]


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return repr(x)


def _shape_text(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def check_tensor(
    name: str,
    x: object,
    shape: tuple[int, ...],
    dtypes: Optional[tuple[torch.dtype, ...]],
    device: torch.device,
    *,
    floating: bool = False,
) -> torch.Tensor:
    """Shape, dtype and device of one tensor argument."""
    if not isinstance(x, torch.Tensor):
        refuse(name, f"a tensor of shape {_shape_text(shape)}", _describe(x))
    if x.shape != shape:
        refuse(name, f"shape {_shape_text(shape)}", _describe(x))
    if dtypes is not None and x.dtype not in dtypes:
        refuse(name, f"dtype in {dtypes}", _describe(x))
    if floating and not x.is_floating_point():
        refuse(name, "a floating-point tensor", _describe(x))
    if x.device != device:
        refuse(name, f"a tensor on {device} (where the logits are)", _describe(x))
    return x


class Rows(NamedTuple):
    """The row tensors of both ops, one object from the public call to the kernels (flattened only
    in the call of a custom op, `custom_op.ROW_PARAMETERS`). tokens (B, T) int64 | int32;
    gen_logprobs (B, T) float; advantages (S,) float, S = B or a packed batch's segments; mask
    (B, T) bool or 0/1, or None (all); old_logprobs, ref_logprobs (B, T) float, or None. A packed
    batch's per-token tensors are (1, N). Before `check_row_tensors`, whatever the caller gave."""

    tokens: torch.Tensor
    gen_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: Optional[torch.Tensor]
    old_logprobs: Optional[torch.Tensor]
    ref_logprobs: Optional[torch.Tensor]


def check_row_tensors(
    B: int, T: int, device: torch.device, rows: Rows, beta: float, samples: Optional[int] = None
) -> None:
    """Shapes, dtypes and devices of everything but the logits (or hidden states): no sync.
    `samples`: the number of advantages when it is not B (packed batches)."""
    check_tensor("tokens", rows.tokens, (B, T), TOKEN_DTYPES, device)
    check_tensor("gen_logprobs", rows.gen_logprobs, (B, T), None, device, floating=True)
    n = B if samples is None else samples
    check_tensor("advantages", rows.advantages, (n,), None, device, floating=True)
    mask = rows.mask
    if mask is not None:
        check_tensor("mask", mask, (B, T), None, device)
        if mask.is_complex():
            refuse("mask", "bool or 0/1 values", _describe(mask))
    for name in ("old_logprobs", "ref_logprobs"):
        x = getattr(rows, name)
        if x is not None:
            check_tensor(name, x, (B, T), None, device, floating=True)
    if beta > 0 and rows.ref_logprobs is None:
        refuse("ref_logprobs", "a (B, T) tensor when beta > 0", None)


def check_inplace_backward(logits: torch.Tensor, inplace_backward: object) -> bool:
    """The in-place backward's preconditions, before any kernel runs; returns it as a bool.

    Refused: logits whose elements share memory (an expanded, stride-0 view, or any layout where
    two indices reach one address: each would receive two gradients, one overwriting the other),
    and, unless inplace_backward == "force", a leaf tensor that requires grad or a view of one (the
    caller's own tensor would be overwritten by its gradient).
    """
    if not (isinstance(inplace_backward, bool) or inplace_backward == "force"):
        refuse("inplace_backward", 'False, True or "force"', repr(inplace_backward))
    if inplace_backward is False:
        return False
    if overlaps_itself(logits):
        refuse(
            "inplace_backward",
            "logits whose elements do not share memory (an expanded or "
            "overlapping view gets one gradient written over another; use "
            "inplace_backward=False or .contiguous() logits)",
            f"sizes {tuple(logits.shape)} with strides {logits.stride()}",
        )
    base = logits if logits._base is None else logits._base
    if inplace_backward is True and base.is_leaf and base.requires_grad:
        refuse(
            "inplace_backward",
            "logits computed by the graph, not a leaf tensor that requires "
            "grad or a view of one (its values would become its gradient; pass "
            'inplace_backward="force" to allow that)',
            "a leaf tensor",
        )
    return True


def overlaps_itself(x: torch.Tensor) -> bool:
    """True when two indices of x may reach the same memory. Exact for the layouts torch builds
    (dense, sliced, permuted, expanded); an exotic interleaved layout may be called overlapping:
    with dimensions sorted by stride, each stride must exceed the furthest offset the smaller
    ones reach."""
    reach = 0
    for stride, size in sorted((st, n) for st, n in zip(x.stride(), x.shape) if n > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


# Names of the ways a row of logits fails, by the code `_logit_faults` gives it.
LOGIT_FAULTS = {
    1: "a NaN among its logits",
    2: "+inf among its logits / temperature",
    3: "every logit -inf",
    4: "log pi_theta(token) = -inf (the taken token's logit is -inf, or far below the others')",
}
_FP32_MAX = torch.finfo(torch.float32).max

# The value checks, in the order they are reported: the rows of a value-check record. A record
# is an (N_CHECKS, 7) float64 tensor on the inputs' device, one row per check: the number of bad
# positions, the first one (a flat index into the checked tensor), its value, a hint flag, the
# checked tensor's two dimensions (advantages: (S, 0)) and the vocabulary size. The logits row's
# hint flag says that they came from hidden states (the error then names `hidden`). The Triton path
# writes it in its per-sample kernels (`kernels/per_sample.py`), the PyTorch path with
# `fault_record`; `raise_on_faults` reads it with one synchronisation.
CHECKS = ("tokens", "mask", "gen_logprobs", "advantages", "old_logprobs", "ref_logprobs", "logits")


def _logit_faults(logp: torch.Tensor, row_max: torch.Tensor, log_sum: torch.Tensor) -> torch.Tensor:
    """(B, T) int code of each row's fault (0: none; LOGIT_FAULTS), from the forward's row
    statistics; the same on both backends (`kernels/logp_lse.py` says how each fault shows)."""
    code = torch.where(~torch.isfinite(logp), 4, 0)
    code = torch.where(log_sum == -torch.inf, 3, code)
    code = torch.where(torch.isnan(row_max) | torch.isnan(log_sum), 1, code)
    return torch.where(row_max == torch.inf, 2, code)


def fault_record(
    V: int,
    rows: Rows,
    row_stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    from_hidden: bool = False,
    packed: bool = False,
) -> torch.Tensor:
    """The value-check record (`CHECKS`) of the inputs and the logits, in PyTorch, without a
    synchronisation: what the Triton path's per-sample kernels write (`packed`: the caller's
    per-token tensors are (N,), held here as (1, N); the record says (N, 0)).

    Token ids are checked at every position (they index memory); gen/old/ref logprobs only at
    completion positions, where they are used (padding may hold anything there), and in float32,
    the precision of the math (fp64 -1e300 becomes -inf there). The logits are judged by the
    forward's row statistics row_stats = (logp, row_max, log_sum), each (B, T) fp32: a completion
    row with a NaN or +inf logit, with every logit -inf, or with log pi_theta(token) = -inf is
    refused (pi_theta(token) = 0 leaves the ratios, the KL and the beta penalty undefined).
    """
    tokens, mask = rows.tokens, rows.mask
    device = tokens.device
    keep = torch.ones((), dtype=torch.bool, device=device) if mask is None else mask != 0
    never = torch.zeros((), dtype=torch.bool, device=device)
    gen = rows.gen_logprobs.float()
    probabilities = keep.any() & (((gen > 0) & (gen <= 1)) | ~keep).all()
    code = torch.where(keep, _logit_faults(*row_stats), 0)
    checks = [
        (tokens, (tokens < 0) | (tokens >= V), never),
        (tokens, never, never)
        if mask is None or mask.dtype == torch.bool
        else (mask, (mask != 0) & (mask != 1), never),
        (rows.gen_logprobs, ~(torch.isfinite(gen) & (gen <= 0)) & keep, probabilities),
        (rows.advantages, ~rows.advantages.float().isfinite(), never),
    ]
    for x in (rows.old_logprobs, rows.ref_logprobs):
        checks.append(
            (tokens, never, never) if x is None else (x, ~x.float().isfinite() & keep, never)
        )
    checks.append((code, code != 0, torch.full((), from_hidden, device=device)))
    B, T = tokens.shape
    per_token = (B * T, 0) if packed else (B, T)
    record = []
    for x, bad, hint in checks:
        bad = bad.expand(x.shape)
        first = bad.flatten().to(torch.int8).argmax()
        dims = (x.shape[0], 0) if x.dim() == 1 else per_token
        record.append(
            torch.stack(
                [
                    bad.sum().double(),
                    first.double(),
                    x.flatten()[first].double(),
                    hint.double(),
                    *(torch.tensor(float(d), dtype=torch.float64, device=device) for d in dims),
                    torch.tensor(float(V), dtype=torch.float64, device=device),
                ]
            )
        )
    return torch.stack(record)


# Where the op reads its value checks (`value_check` of the public ops).
VALUE_CHECKS = ("backward", "call", "deferred")


def raise_on_bad_values(metrics: dict) -> None:
    """The value checks of a call made with value_check="deferred", from its metrics (one
    synchronisation): the ValueError the op would have raised for a bad input, or nothing. Call
    it where the training step reads the host anyway (logging a metric, the optimizer's step)."""
    if not isinstance(metrics, dict) or "value_faults" not in metrics:
        got = f"keys {sorted(metrics)}" if isinstance(metrics, dict) else repr(metrics)[:80]
        refuse(
            "metrics",
            'the metrics of a call with value_check="deferred" (they hold "value_faults")',
            f"metrics without them ({got})",
        )
    raise_on_faults(metrics["value_faults"])


def check_now(value_check: object, x: torch.Tensor) -> bool:
    """Whether the forward reads the value checks itself: value_check="call", or "backward" on a
    call no backward will follow (no gradient is recorded for x). "deferred": never."""
    if value_check not in VALUE_CHECKS:
        refuse("value_check", f"one of {VALUE_CHECKS}", repr(value_check))
    if value_check == "backward":
        return not (torch.is_grad_enabled() and x.requires_grad)
    return value_check == "call"


def raise_on_faults(record: torch.Tensor) -> None:
    """Reads a value-check record (one synchronisation) and raises the first failing check's
    ValueError: it names the argument, counts the failing positions and gives the first one, its
    value and, where the mistake is recognisable, a hint, in one line."""
    rows = record.tolist()
    logits_name = "hidden" if rows[-1][3] else "logits"
    for name, row in zip(CHECKS, rows):
        count, first, value, hint, dim0, dim1, V = row
        if not count:
            continue
        shape = (int(dim0),) if not dim1 else (int(dim0), int(dim1))  # (N, 0): a 1-D tensor
        name = logits_name if name == "logits" else name
        position = _position(int(first), shape)
        unit = "rows" if name == logits_name else "positions"
        got = f"{int(count)} of {math.prod(shape)} {unit} outside that, the first at {position}: "
        got += _describe_value(name, value, logits_name) + _hint(name, value, bool(hint), int(V))
        refuse(name, _expected(name, int(V), logits_name), got)


def _expected(name: str, V: int, logits_name: str) -> str:
    if name == logits_name:
        what = "values" if logits_name == "logits" else "logits (hidden @ weight.T + bias)"
        return f"finite {what} at completion positions and pi_theta(token) > 0"
    return {
        "tokens": f"ids in [0, {V}) at every position (pad masked positions with a valid id)",
        "mask": "bool or 0/1 values",
        "gen_logprobs": "finite values <= 0 at completion positions, in float32",
        "advantages": "finite values, in float32",
    }.get(name, "finite values at completion positions, in float32")


def _position(flat: int, shape: tuple[int, ...]) -> str:
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return "(" + ", ".join(str(i) for i in reversed(index)) + ("," if len(shape) == 1 else "") + ")"


def _describe_value(name: str, value: float, logits_name: str) -> str:
    if name == logits_name:
        return LOGIT_FAULTS[int(value)]
    if name == "tokens":
        return str(int(value))
    return f"{value:.6g}"


def _hint(name: str, value: float, flag: bool, V: int) -> str:
    if name == "tokens":
        if value >= V:
            return (
                f"; ids >= V: the tokenizer's vocabulary is larger than the logits' V = {V}"
                " (a different tokenizer, or added tokens without resized embeddings?)"
            )
        return "; a negative id (an ignore_index such as -100?): pad with a valid id and mask it"
    if name == "gen_logprobs" and flag:
        return "; these look like probabilities: pass log-probabilities"
    if math.isfinite(value) and abs(value) > _FP32_MAX:
        return "; it does not fit in float32, where the loss is computed"
    if name == "gen_logprobs" and value > 0:
        return "; log-probabilities are <= 0"
    if name == "advantages" and math.isnan(value):
        return "; a group's rewards normalised by a std of 0 without an eps?"
    return ""
