"""Input checks of the public ops, done once at the boundary, before any kernel runs.

Every failure is a ValueError that names the argument and says what was expected. The value
checks (token range, finiteness, signs) are reduced on the inputs' device into one small tensor
and read back with a single synchronisation.
"""

from __future__ import annotations

from typing import Optional

import torch

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOKEN_DTYPES = (torch.int32, torch.int64)


def _fail(name: str, expected: str, got: object) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return repr(x)


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
    shape_txt = "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
    if not isinstance(x, torch.Tensor):
        _fail(name, f"a tensor of shape {shape_txt}", _describe(x))
    if tuple(x.shape) != shape:
        _fail(name, f"shape {shape_txt}", _describe(x))
    if dtypes is not None and x.dtype not in dtypes:
        _fail(name, f"dtype in {dtypes}", _describe(x))
    if floating and not x.is_floating_point():
        _fail(name, "a floating-point tensor", _describe(x))
    if x.device != device:
        _fail(name, f"a tensor on {device} (where the logits are)", _describe(x))
    return x


def check_row_tensors(
    B: int,
    T: int,
    device: torch.device,
    tokens: object,
    gen_logprobs: object,
    advantages: object,
    mask: object,
    old_logprobs: object,
    ref_logprobs: object,
    beta: float,
) -> None:
    """Shapes, dtypes and devices of everything but the logits (or hidden states): no sync."""
    check_tensor("tokens", tokens, (B, T), TOKEN_DTYPES, device)
    check_tensor("gen_logprobs", gen_logprobs, (B, T), None, device, floating=True)
    check_tensor("advantages", advantages, (B,), None, device, floating=True)
    if mask is not None:
        check_tensor("mask", mask, (B, T), None, device)
        if mask.is_complex():
            _fail("mask", "bool or 0/1 values", _describe(mask))
    for name, x in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
        if x is not None:
            check_tensor(name, x, (B, T), None, device, floating=True)
    if beta > 0 and ref_logprobs is None:
        _fail("ref_logprobs", "a (B, T) tensor when beta > 0", None)


def check_row_values(
    V: int,
    tokens: torch.Tensor,
    gen_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor],
    old_logprobs: Optional[torch.Tensor],
    ref_logprobs: Optional[torch.Tensor],
) -> None:
    """Values, with one synchronisation. Token ids are checked at every position (they index
    memory); gen/old/ref logprobs only at completion positions, where they are used (padding may
    hold anything there)."""
    keep = torch.ones((), dtype=torch.bool, device=tokens.device) if mask is None else mask != 0
    bad = [
        ("tokens", f"ids in [0, {V}) at every position (pad masked positions with a valid id)",
         ((tokens < 0) | (tokens >= V)).any()),
        ("gen_logprobs", "finite values <= 0 at completion positions",
         (~(torch.isfinite(gen_logprobs) & (gen_logprobs <= 0)) & keep).any()),
        ("advantages", "finite values", (~torch.isfinite(advantages)).any()),
    ]  # fmt: skip
    if mask is not None and mask.dtype != torch.bool:
        bad.append(("mask", "bool or 0/1 values", ((mask != 0) & (mask != 1)).any()))
    for name, x in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
        if x is not None:
            bad.append((name, "finite values at completion positions",
                        (~torch.isfinite(x) & keep).any()))  # fmt: skip
    flags = torch.stack([flag for _, _, flag in bad]).tolist()  # the one synchronisation
    for (name, expected, _), is_bad in zip(bad, flags):
        if is_bad:
            _fail(name, expected, "values outside that")
