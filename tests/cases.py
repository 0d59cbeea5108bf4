"""What the tests of both ops share: one builder of random inputs (`make_case`, for `ftis_loss`
and, with H, for `ftis_linear_loss`), the hypothesis strategies, the one way to force a backend
(`backend`), and runners for the ops and the reference."""

from __future__ import annotations

import contextlib
import importlib
import math
from dataclasses import dataclass, replace
from typing import Optional
from unittest import mock

import torch
from hypothesis import strategies as st

from ftis_kernels import ftis_linear_loss, ftis_loss
from ftis_kernels.kernels import logp_lse
from ftis_kernels.options import (
    FILTERS,
    IS_LEVELS,
    IS_MODES,
    IS_SOURCES,
    KL_ESTIMATORS,
    KL_REDUCTIONS,
    LOSS_TYPES,
    RATIO_LEVELS,
    REJECT_MODES,
    FTISOptions,
)
from ftis_kernels.per_sample import METRIC_NAMES, PER_SAMPLE_METRICS, PER_TOKEN_METRICS
from ref import ref_ftis_loss

# The modules, not the functions of the same name.
ftis_loss_module = importlib.import_module("ftis_kernels.ftis_loss")
linear_module = importlib.import_module("ftis_kernels.ftis_linear_loss")
logprobs_module = importlib.import_module("ftis_kernels.ftis_logprobs")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# The 0-dim metrics of both ops, from the one list the ops return.
SCALAR_METRICS = tuple(n for n in METRIC_NAMES if n not in PER_TOKEN_METRICS + PER_SAMPLE_METRICS)


@dataclass(frozen=True)
class Case:
    logits: torch.Tensor  # (B, T, V); float64 in a linear case: hidden @ weight.T + bias, exact
    tokens: torch.Tensor  # (B, T)
    gen_logprobs: torch.Tensor  # (B, T) fp32
    advantages: torch.Tensor  # (B,) fp32
    mask: Optional[torch.Tensor] = None
    old_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    hidden: Optional[torch.Tensor] = None  # (B, T, H) float64, linear cases only
    weight: Optional[torch.Tensor] = None  # (V, H) float64
    bias: Optional[torch.Tensor] = None  # (V,) float64 or None

    @property
    def inputs(self) -> tuple:
        """The row inputs after the logits (or hidden and weight), in the ops' order."""
        return (
            self.tokens,
            self.gen_logprobs,
            self.advantages,
            self.mask,
            self.old_logprobs,
            self.ref_logprobs,
        )

    def to(self, device) -> Case:
        move = {
            k: (v.to(device) if isinstance(v, torch.Tensor) else v)
            for k, v in self.__dict__.items()
        }
        return replace(self, **move)


def make_case(
    B: int,
    T: int,
    V: int,
    dtype: torch.dtype = torch.float32,
    *,
    H: Optional[int] = None,
    exact: bool = True,
    with_bias: bool = True,
    seed: int = 0,
    mask: str = "random",  # "none" | "random" | "empty_row" | "all_off"
    scale: float = 2.0,
    offset: float = 0.0,
    gen_spread: float = 1.0,
    with_old: bool = True,
    with_ref: bool = False,
    zero_advantage: bool = False,
    device: str | torch.device = "cpu",
) -> Case:
    """A batch where gen/old/ref logprobs are the tokens' own log-probabilities plus noise, so
    the ratios, KL estimates and filter decisions land on both sides of their thresholds.

    Logits (H None): normal with std `scale`, in `dtype`, each row shifted by +-`offset` (large
    |logits| whose differences stay small: the test of digits kept relative to the row max).
    Linear (H given): float64 hidden (B, T, H), weight (V, H) and bias (V,) (or None), and
    logits = hidden @ weight.T + bias in float64. exact: hidden in {0, +-1/2, +-1}, weight and
    bias multiples of 1/4 in [-1, 1], so that with H <= 12 every logit is a multiple of 1/8 below
    16 in magnitude, exact in bf16 and fp16: an op reads the very logits of the oracle. Otherwise
    normal, as in a model (the logits then carry the dtype's rounding).
    """
    g = torch.Generator().manual_seed(seed)
    hidden = weight = bias = None
    if H is None:
        logits = torch.randn(B, T, V, generator=g) * scale
        if offset:
            g_sign = torch.Generator().manual_seed(seed + 2**32)
            logits = logits + (torch.randint(0, 2, (B, T, 1), generator=g_sign) * 2 - 1) * offset
        logits = logits.to(dtype)
    else:
        if exact:
            hidden = torch.randint(-2, 3, (B, T, H), generator=g).double() / 2
            weight = torch.randint(-4, 5, (V, H), generator=g).double() / 4
            bias = torch.randint(-4, 5, (V,), generator=g).double() / 4
        else:
            hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
            weight = torch.randn(V, H, generator=g, dtype=torch.float64) * (2.0 / math.sqrt(H))
            bias = torch.randn(V, generator=g, dtype=torch.float64)
        bias = bias if with_bias else None
        logits = hidden @ weight.T + (0 if bias is None else bias)
    tokens = torch.randint(0, V, (B, T), generator=g)
    logp = torch.log_softmax(logits.double(), dim=-1).gather(-1, tokens[..., None])[..., 0]
    noise = torch.rand(B, T, generator=g, dtype=torch.float64) * gen_spread
    gen = (logp - noise).clamp(max=0.0).float()
    adv = torch.randn(B, generator=g)
    if zero_advantage and B > 1:
        adv[0] = 0.0
    m = None
    if mask in ("random", "empty_row"):
        m = torch.rand(B, T, generator=g) < 0.75
        if mask == "empty_row":
            m[0] = False
    elif mask == "all_off":
        m = torch.zeros(B, T, dtype=torch.bool)
    old = None
    if with_old:
        old = (logp + 0.25 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    ref = None
    if with_ref:
        ref = logp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
        ref = ref.clamp(max=0).float()
    case = Case(logits, tokens, gen, adv, m, old, ref, hidden, weight, bias)
    return case.to(device)


# --- hypothesis strategies ---------------------------------------------------------------------


def _valid(opts: dict) -> bool:
    try:
        FTISOptions(**opts)
    except ValueError:
        return False
    return True


# Every option, drawn; the combinations FTISOptions refuses are filtered out.
options = st.fixed_dictionaries(
    {
        "is_mode": st.sampled_from(IS_MODES),
        "is_level": st.sampled_from(IS_LEVELS),
        "is_source": st.sampled_from(IS_SOURCES),
        "is_cap": st.sampled_from([2.0, 1.3, math.inf]),
        "is_cap_min": st.sampled_from([None, None, 0.5, 0.9]),
        "filter": st.sampled_from(FILTERS),
        "kl_threshold": st.sampled_from([0.0, 0.4, 2.0, 50.0]),
        "kl_threshold_low": st.sampled_from([None, None, -0.3]),
        "kl_estimator": st.sampled_from(KL_ESTIMATORS),
        "kl_reduction": st.sampled_from(KL_REDUCTIONS),
        "kl_source": st.sampled_from(IS_SOURCES),
        "reject_mode": st.sampled_from(REJECT_MODES),
        "loss_type": st.sampled_from(LOSS_TYPES),
        "ratio_level": st.sampled_from(RATIO_LEVELS),
        "epsilon": st.sampled_from([0.2, 0.1]),
        "epsilon_high": st.sampled_from([None, 0.28, 3.0]),
        "delta": st.sampled_from([None, None, 1.1]),
        "max_completion_length": st.sampled_from([None, 8]),
        "beta": st.sampled_from([0.0, 0.0, 0.04]),
        "use_bias_correction_kl": st.booleans(),
        "entropy_coef": st.sampled_from([0.0, 0.0, 0.05]),
        "temperature": st.sampled_from([1.0, 0.7, 1.6]),
    }
).filter(_valid)
dtypes = st.sampled_from(DTYPES)
masks = st.sampled_from(["none", "random", "empty_row"])
gen_spreads = st.sampled_from([0.05, 1.0, 4.0])
seeds = st.integers(0, 2**16)


# --- backends and runners ----------------------------------------------------------------------


@contextlib.contextmanager
def backend(name: Optional[str]):
    """Forces the ops' internal dispatch ("triton" or "torch"); None keeps the automatic choice.
    The one way the tests choose a backend: only among `implementations(device)`, since a CPU
    tensor given to "triton" where the kernels are compiled (a machine with CUDA) is a launch of a
    GPU kernel on host memory."""
    if name is None:
        yield
        return
    with contextlib.ExitStack() as stack:
        for module in (ftis_loss_module, linear_module, logprobs_module):
            stack.enter_context(mock.patch.object(module, "select_backend", lambda device: name))
        yield


def implementations(device: torch.device) -> list[str]:
    """The internal paths runnable here: Triton (compiled on CUDA, interpreted on CPU) and torch."""
    names = ["torch"]
    if device.type == "cuda" or logp_lse.triton_is_interpreted():
        names.insert(0, "triton")
    return names


def run_op(
    case: Case, impl: Optional[str] = None, *, logits: Optional[torch.Tensor] = None, **opts
):
    """ftis_loss on the case: (loss, metrics, d loss / d logits)."""
    x = (case.logits if logits is None else logits).detach().clone().requires_grad_()
    with backend(impl):
        loss, metrics = ftis_loss(x, *case.inputs, **opts)
        (grad,) = torch.autograd.grad(loss, x)
    return loss, metrics, grad


def run_ref(case: Case, compute_dtype: torch.dtype, **opts):
    """The reference on the case; compute_dtype float64 is the oracle, the logits' own dtype is
    plain PyTorch. The gradient comes back in float64 for the oracle."""
    leaf = case.logits.double() if compute_dtype == torch.float64 else case.logits.clone()
    x = leaf.detach().requires_grad_()
    loss, metrics = ref_ftis_loss(x, *case.inputs, compute_dtype=compute_dtype, **opts)
    (grad,) = torch.autograd.grad(loss, x)
    return loss, metrics, grad


def _linear_leaves(case: Case, dtype: torch.dtype, hidden: Optional[torch.Tensor] = None) -> dict:
    leaves = {"hidden": case.hidden if hidden is None else hidden, "weight": case.weight}
    if case.bias is not None:
        leaves["bias"] = case.bias
    return {k: v.to(dtype).detach().clone().requires_grad_() for k, v in leaves.items()}


def run_linear(case: Case, dtype, impl=None, *, hidden=None, chunk_size=None, **opts):
    """ftis_linear_loss on a linear case in `dtype`: (loss, metrics, {"hidden", "weight", "bias"}
    grads)."""
    leaves = _linear_leaves(case, dtype, hidden)
    with backend(impl):
        loss, metrics = ftis_linear_loss(
            leaves["hidden"],
            leaves["weight"],
            *case.inputs,
            bias=leaves.get("bias"),
            chunk_size=chunk_size,
            **opts,
        )
        grads = torch.autograd.grad(loss, list(leaves.values()))
    return loss, metrics, dict(zip(leaves, grads))


def run_linear_ref(case: Case, dtype, compute_dtype, **opts):
    """The reference on hidden @ weight.T + bias formed in `dtype` (float64: the oracle; the
    inputs' dtype with compute_dtype = dtype: plain PyTorch)."""
    leaves = _linear_leaves(case, dtype)
    logits = leaves["hidden"] @ leaves["weight"].T
    if "bias" in leaves:
        logits = logits + leaves["bias"]
    loss, metrics = ref_ftis_loss(logits, *case.inputs, compute_dtype=compute_dtype, **opts)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return loss, metrics, dict(zip(leaves, grads))
