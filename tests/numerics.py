"""Tolerances and comparisons of the numerics tests, written down once.

The rule: against the float64 oracle (the reference computed in float64 on the same inputs), the
library's error may exceed the error of plain PyTorch (the reference computed in a lower precision)
only by a small margin, defined here per dtype.
- Loss and metrics are accumulated in fp32, so they are held to plain PyTorch in fp32 plus `FP32`
  whatever the logits dtype (the kernels read bf16/fp16 logits exactly and compute in fp32).
- d loss / d logits is written in the logits dtype: it is held to plain PyTorch in that dtype plus
  `GRAD_MARGIN[dtype]`, about one unit in the last place, because Triton's interpreter rounds
  fp32 -> bf16/fp16 toward zero where the GPU rounds to nearest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tol:
    rtol: float
    atol: float


FP32 = Tol(rtol=2e-5, atol=2e-6)
GRAD_MARGIN = {
    torch.float32: Tol(rtol=1e-5, atol=1e-7),
    torch.bfloat16: Tol(rtol=2.0**-7, atol=1e-6),
    torch.float16: Tol(rtol=2.0**-9, atol=1e-7),
}


def _worst(
    name: str, got: torch.Tensor, want: torch.Tensor, excess: torch.Tensor, k: int = 5
) -> str:
    flat = excess.flatten().nan_to_num(nan=float("inf"))
    idx = flat.topk(min(k, flat.numel())).indices
    rows = [f"{name}: worst mismatches (index, got, want, excess over the bound):"]
    for i in idx.tolist():
        pos = (
            tuple(int(p) for p in torch.unravel_index(torch.tensor(i), got.shape))
            if got.dim()
            else ()
        )
        rows.append(
            f"  {pos}: {got.flatten()[i].item():.9g} vs {want.flatten()[i].item():.9g}"
            f" (+{flat[i].item():.3g})"
        )
    return "\n".join(rows)


def _check_nonfinite(name: str, got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Non-finite values must agree exactly; returns the mask of positions to compare numerically."""  # noqa: E501
    same = (got == want) | (got.isnan() & want.isnan())
    finite = torch.isfinite(got) & torch.isfinite(want)
    bad = ~finite & ~same
    assert not bad.any(), _worst(name, got, want, bad.double())
    return finite


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, tol: Tol = FP32) -> float:
    """|got - want| <= atol + rtol |want| elementwise (NaN/inf-aware). Returns the max abs error."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    finite = _check_nonfinite(name, got, want)
    err = torch.where(finite, (got - want).abs(), 0.0)
    excess = err - (tol.atol + tol.rtol * want.abs())
    assert not (excess > 0).any(), _worst(name, got, want, excess)
    return float(err.max()) if err.numel() else 0.0


def assert_no_worse_than_plain(
    name: str, got: torch.Tensor, oracle: torch.Tensor, plain: torch.Tensor, margin: Tol
) -> float:
    """err(got) <= max err(plain) + margin, both against the float64 oracle (NaN/inf-aware)."""
    got, oracle, plain = (t.detach().double().cpu() for t in (got, oracle, plain))
    plain_err = torch.where(torch.isfinite(plain), (plain - oracle).abs(), 0.0)
    worst_plain = float(plain_err.max()) if plain_err.numel() else 0.0
    return assert_close(name, got, oracle, Tol(rtol=margin.rtol, atol=margin.atol + worst_plain))


# Largest error seen per (dtype, path, quantity) and the number of property examples, printed at
# the end of the run by conftest.py for the issue notes.
MAX_ERRORS: dict[tuple[str, str, str], float] = {}
EXAMPLES = {"count": 0}


def record(dtype: torch.dtype, impl: str, errors: dict[str, float]) -> None:
    for name, err in errors.items():
        key = (str(dtype).replace("torch.", ""), impl, name)
        MAX_ERRORS[key] = max(MAX_ERRORS.get(key, 0.0), err)


def count_example() -> None:
    EXAMPLES["count"] += 1
