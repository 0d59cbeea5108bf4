"""Random inputs of the F-TIS op and runners for the op and the reference, shared by the tests."""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, replace
from typing import Optional
from unittest import mock

import torch

from ftis_kernels import ftis_loss
from ftis_kernels.kernels import logp_lse
from ref import ref_ftis_loss

# The modules, not the functions of the same name.
ftis_loss_module = importlib.import_module("ftis_kernels.ftis_loss")
linear_module = importlib.import_module("ftis_kernels.ftis_linear_loss")


@dataclass(frozen=True)
class Case:
    logits: torch.Tensor  # (B, T, V)
    tokens: torch.Tensor  # (B, T)
    gen_logprobs: torch.Tensor  # (B, T) fp32
    advantages: torch.Tensor  # (B,) fp32
    mask: Optional[torch.Tensor] = None
    old_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None

    @property
    def inputs(self) -> tuple:
        return (self.tokens, self.gen_logprobs, self.advantages, self.mask, self.old_logprobs,
                self.ref_logprobs)  # fmt: skip

    def to(self, device) -> "Case":
        move = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return replace(self, **move)


def make_case(
    B: int,
    T: int,
    V: int,
    dtype: torch.dtype = torch.float32,
    *,
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
    the ratios, KL estimates and filter decisions land on both sides of their thresholds. The
    logits are normal with std `scale`, each row shifted by +-`offset` (large |logits| whose
    differences stay small: the test of digits kept relative to the row max)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * scale
    if offset:
        g_sign = torch.Generator().manual_seed(seed + 2**32)
        logits = logits + (torch.randint(0, 2, (B, T, 1), generator=g_sign) * 2 - 1) * offset
    logits = logits.to(dtype)
    tokens = torch.randint(0, V, (B, T), generator=g)
    logp = torch.log_softmax(logits.double(), dim=-1).gather(-1, tokens[..., None])[..., 0]
    noise = torch.rand(B, T, generator=g, dtype=torch.float64) * gen_spread
    gen = (logp - noise).clamp(max=0.0).float()
    adv = torch.randn(B, generator=g)
    if zero_advantage and B > 1:
        adv[0] = 0.0
    m = None
    if mask == "random":
        m = torch.rand(B, T, generator=g) < 0.75
    elif mask == "empty_row":
        m = torch.rand(B, T, generator=g) < 0.75
        m[0] = False
    elif mask == "all_off":
        m = torch.zeros(B, T, dtype=torch.bool)
    old = (logp + 0.25 * torch.randn(B, T, generator=g, dtype=torch.float64)).float() if with_old else None
    ref = (logp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0).float() if with_ref else None
    return Case(logits, tokens, gen, adv, m, old, ref).to(device)


@contextlib.contextmanager
def backend(name: Optional[str]):
    """Forces both ops' internal dispatch ("triton" or "torch"); None keeps the automatic choice.
    The one way the tests choose a backend."""
    if name is None:
        yield
        return
    with contextlib.ExitStack() as stack:
        for module in (ftis_loss_module, linear_module):
            stack.enter_context(mock.patch.object(module, "select_backend", lambda device: name))
        yield


def run_op(case: Case, impl: Optional[str] = None, *, logits: Optional[torch.Tensor] = None, **opts):
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


def implementations(device: torch.device) -> list[str]:
    """The internal paths runnable here: Triton (compiled on CUDA, interpreted on CPU) and torch."""
    names = ["torch"]
    if device.type == "cuda" or logp_lse.triton_is_interpreted():
        names.insert(0, "triton")
    return names
