"""The loss options, defined once: names, defaults, allowed values, help text and presets.

`FTISOptions` is the single definition of every keyword option of the ops (docs/method.md §2),
validated once, on construction (ValueError naming the option). The public ops (`ftis_loss`,
`ftis_linear_loss`) take it as `options=` (keywords over it make a new one, `resolve_options`);
their custom ops take it unpacked into plain scalars and put it back together inside without
validating it again (`custom_op.py`). `FTISGRPOConfig` (TRL) and the GRPO driver's
config read their fields, defaults and help from `OPTION_FIELDS`: adding an option is one
`_option(...)` line here, its typed line in `OptionKeywords` (what type checkers read; a test
checks the two agree), and its meaning in `per_sample.py` and `ref/`. Every enumerated option
dispatches through a table (`validate.dispatch`) that raises on an unknown value.

The menu covers the paper's F-TIS and its ablations, and what TRL 1.16's GRPOTrainer, Liger-Kernel
0.8.5's chunked GRPO loss and verl's rollout correction offer (loss types, sequence-level PPO
ratio, two-sided clip, IS weight from the current or the old policy, truncation or masking with
C_min, sample rejection, OPSM, entropy bonus); `PRESETS` names them with their sources.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, asdict, dataclass, field, fields, replace
from typing import Any, Literal, NoReturn, Optional, TypedDict, TypeVar

import torch

from ftis_kernels.validate import dispatch, refuse

IS_MODES = ("none", "vis", "tis", "mask")
IS_LEVELS = ("token", "sequence", "sequence_product")
IS_SOURCES = ("current", "old")
FILTERS = ("negative_offpolicy", "negative_or_offpolicy", "negative", "offpolicy", None)
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_REDUCTIONS = ("sum", "mean", "max")
REJECT_MODES = ("advantage", "mask")
RATIO_LEVELS = ("token", "sequence")
# The loss types' surrogates and reductions (`LossType`), named once: the PyTorch path's tables and
# the kernels' compile-time codes (`kernels/switches.py`) are keyed by these names.
CLIPPED, CISPO, SAPO, VESPO = "clipped", "cispo", "sapo", "vespo"
SURROGATES = (CLIPPED, CISPO, SAPO, VESPO)
REDUCTIONS = ("sample_mean", "batch_mean", "constant", "sample_sum")


def _fail(name: str, expected: str, got: Any) -> NoReturn:
    refuse(name, expected, repr(got))


@dataclass(frozen=True)
class LossType:
    """One value of `loss_type`: its surrogate, its reduction and its names in TRL and verl.

    surrogate: "clipped" (PPO's min(R A, clip(R) A), `delta` applies), "cispo", "sapo" or
    "vespo" (`per_sample.py` writes each out). reduction: "sample_mean" (per-sample token mean,
    then the mean over B), "batch_mean" (token sum over the batch's tokens in the loss: batch-
    normalised), "constant" (token sum / (B * L), L = max_completion_length or T) or
    "sample_sum" (per-sample token sum, mean over B). is_levels: the `is_level` values it takes
    with an IS weight. The name is TRL 1.16's loss_type; trl_global_tokens: whether TRL divides
    the token sum by the tokens of the whole generation batch (the op: of its own call). verl: the
    `loss_agg_mode` values that map to it.
    """

    name: str
    surrogate: str
    reduction: str
    help: str
    is_levels: tuple[str, ...] = IS_LEVELS
    trl_global_tokens: bool = False
    verl: tuple[str, ...] = ()

    @property
    def batch_normalised(self) -> bool:
        """Whether the normaliser counts the loss's tokens over the whole batch."""
        return self.reduction == "batch_mean"

    @property
    def clipped(self) -> bool:
        """Whether the surrogate is PPO's clipped min (TRL: the loss types `delta` applies to)."""
        return self.surrogate == CLIPPED

    @property
    def sequence_weighted(self) -> bool:
        """Whether the surrogate weighs every token by a weight of the whole sample (VESPO's phi,
        which takes the place of the token's IS weight)."""
        return self.surrogate == VESPO


# fmt: off
_LOSS_TYPE_LIST = (
    #        name       surrogate  reduction      help (docs, --help)
    LossType("grpo",    CLIPPED,   "sample_mean", "per-sample token mean, then mean",
             verl=("seq-mean-token-mean",)),
    LossType("bnpo",    CLIPPED,   "batch_mean",  "token mean"),
    LossType("dapo",    CLIPPED,   "batch_mean",  "token mean",
             trl_global_tokens=True, verl=("token-mean",)),
    LossType("dr_grpo", CLIPPED,   "constant",    "sum / (B * max_completion_length)",
             verl=("seq-mean-token-sum-norm",)),
    LossType("cispo",   CISPO,     "batch_mean",  "-sg(min(R, epsilon_high)) A logp, token mean",
             trl_global_tokens=True),
    LossType("sapo",    SAPO,      "sample_mean", "soft sigmoid gate, grpo's reduction"),
    LossType("luspo",   CLIPPED,   "sample_sum",  "per-sample token sum, mean over B",
             verl=("seq-mean-token-sum", "token-sum")),
    LossType("vespo",   VESPO,     "batch_mean",  "gamma-weighted -phi(w) A logp, token mean",
             is_levels=("token",), trl_global_tokens=True),
)
# fmt: on
assert {t.surrogate for t in _LOSS_TYPE_LIST} == set(SURROGATES)
assert {t.reduction for t in _LOSS_TYPE_LIST} == set(REDUCTIONS)
# The loss types by name: the one table the op, the reference, the driver, TRL and verl read.
LOSS_TYPE_TABLE: dict[str, LossType] = {t.name: t for t in _LOSS_TYPE_LIST}
LOSS_TYPES = tuple(LOSS_TYPE_TABLE)
CLIPPED_LOSS_TYPES = tuple(t.name for t in _LOSS_TYPE_LIST if t.clipped)


def loss_type(name: str) -> LossType:
    """The table's row of `name` (a ValueError naming loss_type for an unknown one)."""
    return dispatch(LOSS_TYPE_TABLE, name, "loss_type")


def _is_real(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and not math.isnan(v)


# Value checks by kind: (what is expected, predicate). None passes where the default is None.
CHECKS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "positive": ("a number > 0", lambda v: _is_real(v) and v > 0),
    "positive_finite": ("a finite number > 0", lambda v: _is_real(v) and 0 < v < math.inf),
    "non_negative": ("a number >= 0", lambda v: _is_real(v) and v >= 0),
    "non_negative_finite": ("a finite number >= 0", lambda v: _is_real(v) and 0 <= v < math.inf),
    "finite": ("a finite number", lambda v: _is_real(v) and abs(v) < math.inf),
    "unit_open": ("a number in (0, 1)", lambda v: _is_real(v) and 0 < v < 1),
    "count": ("an int >= 1", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1),
    "bool": ("True or False", lambda v: isinstance(v, bool)),
}


# The same kinds as the docs' option tables write them (docs/options.md, docs/method.md; a test
# keeps the tables to `option_allowed`).
ALLOWED_TEXT: dict[str, str] = {
    "positive": "> 0, `math.inf` allowed",
    "positive_finite": "finite, > 0",
    "non_negative": ">= 0",
    "non_negative_finite": "finite, >= 0",
    "finite": "finite",
    "unit_open": "(0, 1)",
    "count": "int >= 1",
    "bool": "bool",
}


def _option(default: Any, help: str, *, choices: Optional[tuple] = None, check: str = "") -> Any:
    """A field of `FTISOptions` with its help text and its allowed values (a tuple of choices or
    a CHECKS kind); a None default makes None allowed too."""
    if check and check not in CHECKS:
        raise KeyError(check)
    return field(default=default, metadata={"help": help, "choices": choices, "check": check})


@dataclass(frozen=True)
class FTISOptions:
    """Keyword options of `ftis_loss` / `ftis_linear_loss`; validated on construction
    (ValueError naming the option, or both options of a bad combination). Per field, `help` is
    in `OPTION_FIELDS[name].metadata`; the semantics are written in `per_sample.py`."""

    # --- IS weight w (detached) --------------------------------------------------------------
    is_mode: str = _option(
        "tis",
        "IS weight: 'none' (w = 1), 'vis' (w = ratio), 'tis' (w = clamp(ratio, is_cap_min, "
        "is_cap)), 'mask' (w = ratio inside [is_cap_min, is_cap], else 0: TRL's *_mask, IcePop).",
        choices=IS_MODES,
    )
    is_level: str = _option(
        "token",
        "'token' (one weight per token), 'sequence' (exp of the mean log ratio over the "
        "completion: ours) or 'sequence_product' (exp of the sum: the product of the token "
        "ratios, TRL's sequence_* and verl's rollout_is='sequence').",
        choices=IS_LEVELS,
    )
    is_source: str = _option(
        "current",
        "Policy of the IS ratio's numerator: 'current' (pi_theta / pi_gen, the paper) or 'old' "
        "(pi_old / pi_gen: decoupled PPO, trainer-vs-sampler TIS as in TRL and verl).",
        choices=IS_SOURCES,
    )
    is_cap: float = _option(
        2.0,
        "C (C_max): truncation of 'tis', upper band edge of 'mask' (inf: none).",
        check="positive",
    )
    is_cap_min: Optional[float] = _option(
        None,
        "C_min: lower truncation of 'tis', lower band edge of 'mask'; None: no lower bound.",
        check="non_negative_finite",
    )
    # --- sample rejection (the filter) -------------------------------------------------------
    filter: Optional[str] = _option(
        "negative_offpolicy",
        "Which samples are rejected, with 'off-policy' meaning KL_i > kl_threshold (or < "
        "kl_threshold_low): 'negative_offpolicy' A <= 0 AND off-policy (the paper), "
        "'negative_or_offpolicy', 'negative', 'offpolicy' (advantage-agnostic), or None.",
        choices=FILTERS,
    )
    kl_threshold: float = _option(50.0, "g, the upper KL_i threshold.", check="non_negative")
    kl_threshold_low: Optional[float] = _option(
        None,
        "Lower KL_i threshold (verl's k1 band: log of its lower bound); None: none.",
        check="finite",
    )
    kl_estimator: str = _option(
        "k3",
        "Per token, with d = log pi_gen - log pi_src: 'k1' d | 'k2' d^2/2 | 'k3' exp(-d) - 1 + d.",
        choices=KL_ESTIMATORS,
    )
    kl_reduction: str = _option(
        "sum",
        "KL_i over the sample's completion tokens: 'sum', 'mean' or 'max'.",
        choices=KL_REDUCTIONS,
    )
    kl_source: str = _option(
        "current",
        "Policy the filter's KL compares with pi_gen: 'current' (pi_theta, the paper "
        "and TRL's OPSM) or 'old' (pi_old, verl's rejection sampling).",
        choices=IS_SOURCES,
    )
    reject_mode: str = _option(
        "advantage",
        "What rejection does: 'advantage' (A = 0, the sample still counts in every "
        "normaliser: the paper, TRL's OPSM) or 'mask' (its tokens leave the completion mask: "
        "verl's rejection sampling).",
        choices=REJECT_MODES,
    )
    # --- policy loss -------------------------------------------------------------------------
    loss_type: str = _option(
        "grpo",
        "Surrogate and reduction, as TRL 1.16: "
        + ", ".join(f"'{t.name}' ({t.help})" for t in LOSS_TYPE_TABLE.values())
        + ".",
        choices=LOSS_TYPES,
    )
    ratio_level: str = _option(
        "token",
        "PPO ratio R = pi_theta / pi_old per 'token' or per 'sequence' (GSPO: exp of "
        "the mean log ratio, TRL's importance_sampling_level), for every loss type as TRL: "
        "cispo caps and sapo gates the sequence R; vespo's gamma weight is its own, the "
        "sequence R reaching only the bias-corrected KL term.",
        choices=RATIO_LEVELS,
    )
    epsilon: float = _option(0.2, "Lower clip: R >= 1 - epsilon.", check="unit_open")
    epsilon_high: Optional[float] = _option(
        None,
        "Upper clip 1 + epsilon_high (None: epsilon); for 'cispo' the cap on R itself.",
        check="positive_finite",
    )
    delta: Optional[float] = _option(
        None,
        "Two-sided clip (INTELLECT-2): R is also capped at delta in the unclipped branch; "
        "clipped loss types only.",
        check="positive_finite",
    )
    max_completion_length: Optional[int] = _option(
        None,
        "dr_grpo's constant L in sum / (B * L) (TRL: max_completion_length); None: T.",
        check="count",
    )
    sapo_temperature_pos: float = _option(
        1.0, "SAPO gate temperature for A > 0.", check="positive_finite"
    )
    sapo_temperature_neg: float = _option(
        1.05, "SAPO gate temperature for A <= 0.", check="positive_finite"
    )
    vespo_k_pos: float = _option(2.0, "VESPO gamma shape k for A >= 0.", check="finite")
    vespo_lambda_pos: float = _option(3.0, "VESPO gamma rate lambda for A >= 0.", check="finite")
    vespo_k_neg: float = _option(3.0, "VESPO gamma shape k for A < 0.", check="finite")
    vespo_lambda_neg: float = _option(2.0, "VESPO gamma rate lambda for A < 0.", check="finite")
    # --- penalties and bonus -----------------------------------------------------------------
    beta: float = _option(
        0.0, "Weight of the per-token k3(ref_logprobs - logp) penalty.", check="non_negative_finite"
    )
    use_bias_correction_kl: bool = _option(
        False,
        "Multiply the beta term by the PPO ratio exp(logp - log pi_old), with its "
        "gradient (TRL's default, DeepSeek-V3.2): same value on-policy, more gradient.",
        check="bool",
    )
    entropy_coef: float = _option(
        0.0,
        "Entropy bonus: loss -= entropy_coef * (mean per-token entropy over the tokens in the "
        "loss: completion tokens less those of samples rejected with reject_mode='mask'), as "
        "TRL's static entropy_coef.",
        check="non_negative_finite",
    )
    temperature: float = _option(
        1.0, "Logits are divided by it before the softmax.", check="positive_finite"
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if value is None and f.default is None:
                continue
            if meta["choices"] is not None and value not in meta["choices"]:
                _fail(f.name, f"one of {meta['choices']}", value)
            if meta["check"]:
                expected, ok = CHECKS[meta["check"]]
                if not ok(value):
                    _fail(f.name, expected + (" or None" if f.default is None else ""), value)
            if f.type in ("float", "Optional[float]") and type(value) is not float:
                # 50 -> 50.0: the ops read the options as they are (an int would make the
                # PyTorch path compute in int64 where the kernels compute in fp32).
                object.__setattr__(self, f.name, float(value))
        self._check_combinations()

    def _check_combinations(self) -> None:
        """Combinations the peers refuse or that have no meaning; the error names both options."""
        lt = self.loss_type
        if self.delta is not None and lt not in CLIPPED_LOSS_TYPES:
            _fail(
                "delta",
                f"None with loss_type={lt!r} (two-sided clipping applies to {CLIPPED_LOSS_TYPES})",
                self.delta,
            )
        levels = LOSS_TYPE_TABLE[lt].is_levels
        if self.is_level not in levels and self.is_mode != "none":
            # Only vespo narrows the levels.
            allowed = " or ".join(map(repr, levels))
            _fail(
                "is_level",
                f"{allowed} with loss_type={lt!r} (TRL: VESPO folds token-level IS "
                "weights into its sequence weight)",
                self.is_level,
            )
        if self.is_cap_min is not None and self.is_cap_min > self.is_cap:
            _fail("is_cap_min", f"a number <= is_cap = {self.is_cap}", self.is_cap_min)
        low = self.kl_threshold_low
        if low is not None and low > self.kl_threshold:
            _fail("kl_threshold_low", f"a number <= kl_threshold = {self.kl_threshold}", low)

    @property
    def clip_high(self) -> float:
        """Upper clip offset: epsilon_high if set, else epsilon."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def as_kwargs(self) -> dict[str, Any]:
        """The options as keyword arguments of `ftis_loss` / `ftis_linear_loss`."""
        return asdict(self)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> FTISOptions:
        """FTISOptions(**kwargs), with an unknown name refused as a ValueError naming it."""
        _check_names(kwargs)
        return cls(**kwargs)

    def replace(self, **overrides: Any) -> FTISOptions:
        """These options with `overrides` on top, validated once, as a whole: a combination is
        judged with the values it keeps (is_cap_min against this is_cap); an unknown name is
        refused naming it."""
        _check_names(overrides)
        return replace(self, **overrides)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> FTISOptions:
        """The options of a named method (`PRESETS`; docs/method.md lists each with its source),
        then `overrides`. Presets start from the defaults (F-TIS)."""
        key = name.lower()
        preset = dispatch(PRESETS, key, "preset")
        return cls.from_kwargs(**{**preset.options, **overrides})

    @classmethod
    def for_variant(cls, variant: str, **overrides: Any) -> FTISOptions:
        """Options of a paper ablation variant ("nois", "vis", "tis", "f-nois", "f-vis", "f-tis"),
        then `overrides` (an unknown name refused as a ValueError naming it, as `preset` does)."""
        key = variant.lower()
        if key not in VARIANTS:
            _fail("variant", f"one of {tuple(VARIANTS)}", variant)
        return cls.from_kwargs(**{**VARIANTS[key], **overrides})


OPTION_FIELDS: dict[str, Field] = {f.name: f for f in fields(FTISOptions)}
OPTION_NAMES = tuple(OPTION_FIELDS)
DEFAULTS = FTISOptions()


def _check_names(kwargs: Mapping[str, Any]) -> None:
    """An unknown option name refused, as a ValueError naming it."""
    for name in kwargs:
        if name not in OPTION_FIELDS:
            _fail(name, f"a keyword option, one of {tuple(OPTION_FIELDS)}", "an unknown option")


def option_default(name: str) -> Any:
    f = OPTION_FIELDS[name]
    return f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]


def option_help(name: str) -> str:
    return OPTION_FIELDS[name].metadata["help"]


def option_choices(name: str) -> Optional[tuple]:
    return OPTION_FIELDS[name].metadata["choices"]


def _shown(value: Any) -> str:
    return f"`{value!r}`".replace("'", '"')


def option_allowed(name: str) -> str:
    """The allowed values of option `name` as the docs' option tables write them: its choices
    (`"tis"`, `None`), or its kind (`ALLOWED_TEXT`) after "`None` or " where None is allowed.
    Combinations (`FTISOptions._check_combinations`) are not included."""
    f = OPTION_FIELDS[name]
    choices = f.metadata["choices"]
    if choices is not None:
        return ", ".join(_shown(c) for c in choices)
    text = ALLOWED_TEXT[f.metadata["check"]]
    return text if f.default is not None else f"`None` or {text}"


def option_default_text(name: str) -> str:
    """The default of option `name` as the docs' option tables write it: `"tis"`, `2.0`, `None`."""
    return _shown(option_default(name))


@dataclass(frozen=True)
class Preset:
    """A named method: its option overrides and where they come from."""

    options: dict[str, Any]
    source: str


# The paper's ablation variants (docs/method.md §1), as option overrides.
VARIANTS: dict[str, dict[str, Any]] = {
    "nois": dict(is_mode="none", filter=None),
    "vis": dict(is_mode="vis", filter=None),
    "tis": dict(is_mode="tis", filter=None),
    "f-nois": dict(is_mode="none", filter="negative_offpolicy"),
    "f-vis": dict(is_mode="vis", filter="negative_offpolicy"),
    "f-tis": dict(is_mode="tis", filter="negative_offpolicy"),
}
_PAPER = "F-TIS paper (arXiv 2605.22537), ablation"
_ON_POLICY = dict(is_mode="none", filter=None)
_VERL_RS = "verl rollout correction, rollout_rs="


def _verl_rs(reduction: str, estimator: str, threshold: float, low: Optional[float] = None):
    options = dict(
        is_mode="none",
        filter="offpolicy",
        kl_source="old",
        reject_mode="mask",
        kl_reduction=reduction,
        kl_estimator=estimator,
        kl_threshold=threshold,
        kl_threshold_low=low,
    )
    return Preset(options, f"{_VERL_RS}'seq_{reduction}_{estimator}' (threshold from its tests)")


PRESETS: dict[str, Preset] = {
    **{name: Preset(dict(v), f"{_PAPER} {name.upper()}") for name, v in VARIANTS.items()},
    "grpo": Preset(dict(_ON_POLICY), "GRPO (DeepSeekMath), on-policy: no IS weight, no filter"),
    "sampler-tis": Preset(
        dict(is_mode="tis", is_source="old", filter=None),
        "trainer-vs-sampler TIS (Yao et al. 2025; TRL vllm_importance_sampling_mode="
        "'token_truncate', verl rollout_is='token'): w = min(pi_old / pi_gen, C)",
    ),
    "icepop": Preset(
        dict(is_mode="mask", is_source="old", is_cap_min=0.5, is_cap=5.0, filter=None),
        "IcePop (Ring-1T): token weight pi_old / pi_gen kept inside [0.5, 5], else 0",
    ),
    "opsm": Preset(
        dict(
            is_mode="none",
            filter="negative_offpolicy",
            kl_estimator="k1",
            kl_reduction="mean",
            kl_threshold=0.5,
        ),
        "off-policy sequence masking (DeepSeek-V3.2 eq. 9; TRL off_policy_mask_threshold=0.5): "
        "A <= 0 and mean_t(log pi_gen - log pi_theta) > delta (TRL rejects A < 0 only: the loss is "
        "the same, `filtered` also counts the A = 0 samples)",
    ),
    "gspo": Preset(
        dict(_ON_POLICY, ratio_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
        "GSPO (Zheng et al. 2025; TRL importance_sampling_level='sequence'), eps 3e-4 / 4e-4",
    ),
    "dapo": Preset(
        dict(_ON_POLICY, loss_type="dapo", epsilon_high=0.28),
        "DAPO (Yu et al. 2025): token-mean loss, clip-higher 0.28",
    ),
    "dr_grpo": Preset(dict(_ON_POLICY, loss_type="dr_grpo"), "Dr. GRPO (Liu et al. 2025)"),
    "cispo": Preset(
        dict(_ON_POLICY, loss_type="cispo", epsilon_high=5.0),
        "CISPO (MiniMax-M1; ScaleRL's eps_max = 5.0, TRL docs)",
    ),
    "sapo": Preset(
        dict(_ON_POLICY, loss_type="sapo"), "SAPO (Gao et al. 2025), TRL's temperatures 1.0 / 1.05"
    ),
    "luspo": Preset(
        dict(_ON_POLICY, loss_type="luspo", ratio_level="sequence"),
        "LUSPO (TRL: loss_type='luspo' with importance_sampling_level='sequence')",
    ),
    "vespo": Preset(
        dict(_ON_POLICY, loss_type="vespo"), "VESPO (TRL 1.16 defaults k 2 / 3, lambda 3 / 2)"
    ),
    "seq_sum_k1": _verl_rs("sum", "k1", math.log(1.4), math.log(0.6)),
    "seq_sum_k2": _verl_rs("sum", "k2", 2.5),
    "seq_sum_k3": _verl_rs("sum", "k3", 2.5),
    "seq_mean_k1": _verl_rs("mean", "k1", math.log(1.5), math.log(0.5)),
    "seq_mean_k2": _verl_rs("mean", "k2", 2.0),
    "seq_mean_k3": _verl_rs("mean", "k3", 2.0),
    "seq_max_k2": _verl_rs("max", "k2", 2.0),
    "seq_max_k3": _verl_rs("max", "k3", 2.0),
}


# The options of recent calls, by (options, keywords): a training loop passes the same ones every
# step, and building and validating an FTISOptions is a good share of a call's host time.
_RESOLVED: dict[tuple, FTISOptions] = {}
_RESOLVED_MAX = 256


def resolve_options(options: Optional[FTISOptions], overrides: Mapping[str, Any]) -> FTISOptions:
    """What the public ops do with `options=` and their keyword options: the object (or the
    defaults) with the keywords on top; an unknown keyword is a ValueError naming it."""
    if options is not None and not isinstance(options, FTISOptions):
        _fail("options", "None or an FTISOptions", options)
    if options is not None and not overrides:
        return options
    key = None
    if not torch.compiler.is_compiling():  # traced code reads no module-level cache
        try:
            # The types too: True == 1 == 1.0, but only some of them are valid for an option.
            key = (options, tuple((k, type(v), v) for k, v in sorted(overrides.items())))
            return _RESOLVED[key]
        except (KeyError, TypeError):  # not seen yet, or a value that cannot be a key
            pass
    resolved = (
        FTISOptions.from_kwargs(**overrides) if options is None else options.replace(**overrides)
    )
    if key is not None:
        if len(_RESOLVED) >= _RESOLVED_MAX:
            _RESOLVED.clear()
        try:
            _RESOLVED[key] = resolved
        except TypeError:
            pass
    return resolved


_Op = TypeVar("_Op", bound=Callable[..., Any])


def with_option_keywords(func: _Op) -> _Op:
    """Give `func(..., **options)` a runtime signature listing every option keyword with its
    default and annotation (for help(), `inspect` and the drift test); the function itself is
    unchanged, and type checkers read its own signature, with `**option_keywords:
    Unpack[OptionKeywords]`."""
    sig = inspect.signature(func)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [
        inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type
        )
        for name, f in OPTION_FIELDS.items()
    ]
    func.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return func


class OptionKeywords(TypedDict, total=False):
    """The fields of `FTISOptions` as keyword arguments, for type checkers and IDEs: the public
    ops take `**option_keywords: Unpack[OptionKeywords]`, so a misspelt option or a value outside
    an option's choices is a type error. A TypedDict is read statically, so it repeats the
    fields: tests/test_options.py checks it against `OPTION_FIELDS` (names, types, choices)."""

    is_mode: Literal["none", "vis", "tis", "mask"]
    is_level: Literal["token", "sequence", "sequence_product"]
    is_source: Literal["current", "old"]
    is_cap: float
    is_cap_min: Optional[float]
    filter: Literal["negative_offpolicy", "negative_or_offpolicy", "negative", "offpolicy", None]
    kl_threshold: float
    kl_threshold_low: Optional[float]
    kl_estimator: Literal["k1", "k2", "k3"]
    kl_reduction: Literal["sum", "mean", "max"]
    kl_source: Literal["current", "old"]
    reject_mode: Literal["advantage", "mask"]
    loss_type: Literal["grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"]
    ratio_level: Literal["token", "sequence"]
    epsilon: float
    epsilon_high: Optional[float]
    delta: Optional[float]
    max_completion_length: Optional[int]
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    vespo_k_pos: float
    vespo_lambda_pos: float
    vespo_k_neg: float
    vespo_lambda_neg: float
    beta: float
    use_bias_correction_kl: bool
    entropy_coef: float
    temperature: float
