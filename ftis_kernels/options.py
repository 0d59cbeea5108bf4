"""The F-TIS hyperparameters, defined once.

`FTISOptions` carries every keyword option of the op contract (docs/method.md §2). The reference
(`ref/`), the kernels, the fused lm-head variant and the GRPO driver all take this one object, so a
new option touches the contract, the reference, the kernel and one test, and nothing else.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

IS_MODES = ("none", "vis", "tis")
IS_LEVELS = ("token", "sequence")
FILTERS = ("negative_offpolicy", "negative_or_offpolicy", "negative", "offpolicy", None)
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_REDUCTIONS = ("sum", "mean")
LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")

# The paper's ablation variants, by name, as option overrides (docs/method.md §1).
VARIANTS: dict[str, dict[str, Any]] = {
    "nois": dict(is_mode="none", filter=None),
    "vis": dict(is_mode="vis", filter=None),
    "tis": dict(is_mode="tis", filter=None),
    "f-nois": dict(is_mode="none", filter="negative_offpolicy"),
    "f-vis": dict(is_mode="vis", filter="negative_offpolicy"),
    "f-tis": dict(is_mode="tis", filter="negative_offpolicy"),
}


def _fail(name: str, expected: str, got: Any) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got!r}")


@dataclass(frozen=True)
class FTISOptions:
    """Keyword options of `ftis_loss` (docs/method.md §2); validated on construction.

    is_mode:      "none" (w = 1) | "vis" (w = pi_theta / pi_gen) | "tis" (w = min(ratio, is_cap)).
    is_level:     "token" (one weight per token) | "sequence" (w = exp(mean_t log ratio), same cap).
    is_cap:       C, the truncation of the IS weight (> 0; inf makes "tis" equal "vis").
    filter:       which samples get Ahat = 0. With KL_i > g called "off-policy":
                  "negative_offpolicy" A <= 0 AND off-policy (the paper) | "negative_or_offpolicy"
                  A <= 0 OR off-policy | "negative" A <= 0 | "offpolicy" | None.
    kl_threshold: g (>= 0).
    kl_estimator: "k1" d | "k2" d^2/2 | "k3" exp(-d) - 1 + d, with d = log pi_gen - log pi_theta.
    kl_reduction: "sum" | "mean" over the sample's masked tokens.
    epsilon, epsilon_high: PPO clip range [1 - epsilon, 1 + (epsilon_high or epsilon)], in (0, 1).
    beta:         weight of the per-token k3(ref_logprobs - logp) penalty (>= 0).
    temperature:  logits are divided by it before the softmax (> 0).
    loss_type:    "grpo" per-sample mean then mean | "bnpo"/"dapo" token mean | "dr_grpo" sum/(B*T).
    """

    is_mode: str = "tis"
    is_level: str = "token"
    is_cap: float = 2.0
    filter: Optional[str] = "negative_offpolicy"
    kl_threshold: float = 50.0
    kl_estimator: str = "k3"
    kl_reduction: str = "sum"
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None
    beta: float = 0.0
    temperature: float = 1.0
    loss_type: str = "grpo"

    def __post_init__(self) -> None:
        for name, allowed in (
            ("is_mode", IS_MODES),
            ("is_level", IS_LEVELS),
            ("filter", FILTERS),
            ("kl_estimator", KL_ESTIMATORS),
            ("kl_reduction", KL_REDUCTIONS),
            ("loss_type", LOSS_TYPES),
        ):
            if getattr(self, name) not in allowed:
                _fail(name, f"one of {allowed}", getattr(self, name))
        for name in ("is_cap", "kl_threshold", "epsilon", "beta", "temperature"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                _fail(name, "a real number", value)
        if not self.is_cap > 0:
            _fail("is_cap", "a number > 0 (math.inf for no truncation)", self.is_cap)
        if not self.kl_threshold >= 0:
            _fail("kl_threshold", "a number >= 0", self.kl_threshold)
        if not 0 < self.epsilon < 1:
            _fail("epsilon", "a number in (0, 1)", self.epsilon)
        if self.epsilon_high is not None:
            eh = self.epsilon_high
            if isinstance(eh, bool) or not isinstance(eh, (int, float)) or not 0 < eh < 1:
                _fail("epsilon_high", "None or a number in (0, 1)", eh)
        if not (0 <= self.beta < math.inf):
            _fail("beta", "a finite number >= 0", self.beta)
        if not (0 < self.temperature < math.inf):
            _fail("temperature", "a finite number > 0", self.temperature)

    @property
    def clip_high(self) -> float:
        """Upper clip offset: epsilon_high if set, else epsilon."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def as_kwargs(self) -> dict[str, Any]:
        """The options as keyword arguments of `ftis_loss` / `ftis_linear_loss`."""
        return asdict(self)

    @classmethod
    def for_variant(cls, variant: str, **overrides: Any) -> "FTISOptions":
        """Options of a paper ablation variant ("nois", "vis", "tis", "f-nois", "f-vis", "f-tis")."""
        key = variant.lower()
        if key not in VARIANTS:
            _fail("variant", f"one of {tuple(VARIANTS)}", variant)
        return cls(**{**VARIANTS[key], **overrides})


OPTION_NAMES = tuple(f.name for f in fields(FTISOptions))
