"""What is measured: the shapes, the options every implementation is configured to, and the inputs.

The common work is TIS (docs/method.md §1): token-level IS weight min(pi_theta / pi_gen, C = 2),
no filter, PPO clip eps = 0.2, "grpo" reduction, beta = 0, temperature 1, every position a
completion token. It is the F-TIS configuration that Liger-Kernel can express (its
`vllm_is_ratio` takes the truncated weight, computed by the caller); our filter runs as a separate
implementation (`ftis_loss_filter`) on the same inputs to show what it costs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch

# The work every implementation is configured to (keyword options of `ftis_loss`).
TIS_OPTIONS = dict(
    is_mode="tis", is_cap=2.0, filter=None, epsilon=0.2, loss_type="grpo", temperature=1.0, beta=0.0
)
# The paper's F-TIS (the library defaults: filter "negative_offpolicy", g = 50, k3 summed).
FTIS_OPTIONS = dict(TIS_OPTIONS, filter="negative_offpolicy", kl_threshold=50.0)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}

# Fewest logits an fp32 scratch chunk of the helpers below holds (rows x V), to bound their memory.
_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class Case:
    """One shape. family "logits": the op takes (B, T, V) logits; "linear": it takes hidden
    states (B, T, H) and the lm-head weight (V, H). impls: the implementations to run (None = all
    available); modes: "fwd" and/or "fwd+bwd"."""

    family: str
    B: int
    T: int
    V: int
    dtype: str
    H: int = 0
    impls: Optional[tuple[str, ...]] = None

    @property
    def tokens(self) -> int:
        return self.B * self.T

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def label(self) -> str:
        tok = f"{self.tokens // 1024}k" if self.tokens % 1024 == 0 else str(self.tokens)
        dt = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}[self.dtype]
        h = f" H{self.H}" if self.family == "linear" else ""
        return f"{tok}x{self.V} {dt}{h}"

    def as_dict(self) -> dict:
        d = asdict(self)
        d["impls"] = list(self.impls) if self.impls is not None else None
        d["tokens"] = self.tokens
        d["label"] = self.label
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Case:
        impls = d.get("impls")
        return cls(
            family=d["family"],
            B=d["B"],
            T=d["T"],
            V=d["V"],
            dtype=d["dtype"],
            H=d.get("H", 0),
            impls=tuple(impls) if impls is not None else None,
        )


def _logits_case(tokens: int, V: int, dtype: str, T: int = 1024, impls=None) -> Case:
    T = min(T, tokens)
    return Case("logits", tokens // T, T, V, dtype, impls=impls)


def _linear_case(
    tokens: int, V: int, H: int, dtype: str = "bfloat16", T: int = 1024, impls=None
) -> Case:
    T = min(T, tokens)
    return Case("linear", tokens // T, T, V, dtype, H=H, impls=impls)


_NO_COMPILE = (
    "ref_eager",
    "ftis_loss",
    "ftis_loss_inplace",
    "ftis_loss_filter",
    "ftis_loss_3pass",
    "liger_triton",
    "liger_triton_inplace",
    "ftis_linear_loss",
    "ftis_linear_loss_wacc",
    "trl_eager",
    "trl_fused",
    "liger_chunked",
)

# CUDA (the grid), in priority order: a run with a time budget measures the first ones and
# records the rest as skipped. torch.compile recompiles per shape (tens of seconds each), so the
# compiled reference runs on the headline shapes only.
CUDA_CASES: tuple[Case, ...] = (
    _logits_case(16384, 151936, "bfloat16"),
    _logits_case(1024, 151936, "bfloat16", impls=_NO_COMPILE),
    _logits_case(16384, 151936, "float32"),
    _linear_case(16384, 151936, 1536, impls=_NO_COMPILE),
    _linear_case(16384, 151936, 4096, impls=_NO_COMPILE),
    _logits_case(1024, 151936, "float32", impls=_NO_COMPILE),
    *(_logits_case(n, 151936, "bfloat16", impls=_NO_COMPILE) for n in (4096, 32768)),
    *(_logits_case(16384, v, "bfloat16", impls=_NO_COMPILE) for v in (32000, 128256)),
    *(_logits_case(n, 151936, "float32", impls=_NO_COMPILE) for n in (4096, 32768)),
    *(_logits_case(16384, v, "float32", impls=_NO_COMPILE) for v in (32000, 128256)),
    *(_linear_case(n, 151936, 4096, impls=_NO_COMPILE) for n in (4096, 32768)),
    *(_linear_case(16384, v, 4096, impls=_NO_COMPILE) for v in (32000, 128256)),
)

# CPU: small shapes, the same families; the chunked PyTorch path of the library (no interpreter).
CPU_CASES: tuple[Case, ...] = (
    _logits_case(1024, 32000, "float32", T=256),
    _logits_case(512, 151936, "float32", T=256),
    _logits_case(1024, 32000, "bfloat16", T=256),
    _logits_case(512, 151936, "bfloat16", T=256),
    _linear_case(1024, 32000, 256, "float32", T=256),
)

# pytest bench/: tiny on CPU (the whole suite well under two minutes), one real shape on CUDA.
TEST_CASES = {
    "cpu": (Case("logits", 2, 64, 4096, "float32"), Case("linear", 2, 64, 4096, "float32", H=64)),
    "cuda": (_logits_case(4096, 151936, "bfloat16"), _linear_case(4096, 151936, 1536)),
}


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[token] in fp32, (B, T), a bounded chunk of rows at a time."""
    B, T, V = logits.shape
    flat = logits.reshape(B * T, V)
    tok = tokens.reshape(B * T).long()
    out = torch.empty(B * T, dtype=torch.float32, device=logits.device)
    step = max(1, _CHUNK_ELEMENTS // V)
    for r0 in range(0, B * T, step):
        x = flat[r0 : r0 + step].float()
        out[r0 : r0 + step] = x.gather(1, tok[r0 : r0 + step, None])[:, 0] - torch.logsumexp(x, 1)
    return out.reshape(B, T)


def linear_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """token_logprobs(hidden @ weight.T), a bounded chunk of rows at a time."""
    B, T, H = hidden.shape
    V = weight.shape[0]
    flat = hidden.reshape(B * T, H)
    tok = tokens.reshape(B * T).long()
    out = torch.empty(B * T, dtype=torch.float32, device=hidden.device)
    step = max(1, _CHUNK_ELEMENTS // V)
    for r0 in range(0, B * T, step):
        x = (flat[r0 : r0 + step] @ weight.t()).float()
        out[r0 : r0 + step] = x.gather(1, tok[r0 : r0 + step, None])[:, 0] - torch.logsumexp(x, 1)
    return out.reshape(B, T)


def make_inputs(case: Case, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random inputs of a case, the same for every implementation (seeded).

    Logits have standard deviation 2; the generating policy's logprobs are the current policy's
    plus N(0, 0.3^2) noise (capped at 0), so the truncated IS weight is near 1 and some tokens are
    truncated; advantages are N(0, 1); the mask is all True.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    dt = case.torch_dtype
    B, T, V = case.B, case.T, case.V

    def randn(*shape, scale=1.0, dtype=torch.float32):
        # Drawn where they live: tens of GB of logits are not generated on a host CPU.
        return torch.randn(*shape, generator=g, device=device, dtype=dtype).mul_(scale)

    inputs: dict[str, torch.Tensor] = {}
    tokens = torch.randint(0, V, (B, T), generator=g, device=device)
    if case.family == "logits":
        inputs["logits"] = randn(B, T, V, scale=2.0, dtype=dt)
        logp = token_logprobs(inputs["logits"], tokens)
    else:
        inputs["hidden"] = randn(B, T, case.H, dtype=dt)
        inputs["weight"] = randn(V, case.H, scale=2.0 / math.sqrt(case.H), dtype=dt)
        logp = linear_token_logprobs(inputs["hidden"], inputs["weight"], tokens)
    inputs["tokens"] = tokens
    inputs["gen_logprobs"] = (logp + randn(B, T, scale=0.3)).clamp(max=0.0)
    inputs["advantages"] = randn(B)
    inputs["mask"] = torch.ones(B, T, dtype=torch.bool, device=device)
    # What a trainer hands Liger as `vllm_is_ratio` for TIS: min(pi_old / pi_gen, C) with
    # pi_old = the current policy (one update per batch), from an earlier no-grad pass.
    inputs["is_weight"] = torch.exp(logp - inputs["gen_logprobs"]).clamp(max=TIS_OPTIONS["is_cap"])
    return inputs
