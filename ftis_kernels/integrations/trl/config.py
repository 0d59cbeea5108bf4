"""`FTISGRPOConfig`: TRL's `GRPOConfig` plus the options of `FTISOptions` TRL does not have, and
the mapping of TRL's own loss options and corrections onto the op's options.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any

from trl import GRPOConfig

from ftis_kernels.options import DEFAULTS, OPTION_FIELDS, OPTION_NAMES, FTISOptions
from ftis_kernels.validate import dispatch

FTIS_OPS = ("ftis_linear_loss", "ftis_loss")
# Options TRL has under another name: ours -> TRL's. Every other option TRL has (loss_type, beta,
# epsilon, epsilon_high, delta, temperature, max_completion_length, sapo_*, vespo_*,
# use_bias_correction_kl, entropy_coef) is TRL's field, with TRL's default and meaning.
TRL_NAMES = {"ratio_level": "importance_sampling_level"}
_TRL_FIELDS = {f.name for f in dataclasses.fields(GRPOConfig)}
OWN_OPTIONS = tuple(n for n in OPTION_NAMES if n not in _TRL_FIELDS and n not in TRL_NAMES)
"""The options FTISGRPOConfig adds to GRPOConfig, with the defaults and help of `FTISOptions`."""

# TRL's vLLM importance-sampling modes as op options (pi_old / pi_gen, truncated or masked).
VLLM_IS_MODES = {
    "token_truncate": dict(is_mode="tis", is_level="token"),
    "token_mask": dict(is_mode="mask", is_level="token"),
    "sequence_truncate": dict(is_mode="tis", is_level="sequence_product"),
    "sequence_mask": dict(is_mode="mask", is_level="sequence_product"),
}
IS_OPTIONS = ("is_mode", "is_level", "is_source", "is_cap", "is_cap_min")
FILTER_OPTIONS = (
    "filter",
    "kl_threshold",
    "kl_threshold_low",
    "kl_estimator",
    "kl_reduction",
    "kl_source",
    "reject_mode",
)


def _option_field(name: str) -> tuple:
    f = OPTION_FIELDS[name]
    hint = typing.get_type_hints(FTISOptions)[name]
    return name, hint, field(default=f.default, metadata={"help": f.metadata["help"]})


FTISOptionFields = dataclasses.make_dataclass(
    "FTISOptionFields", [_option_field(name) for name in OWN_OPTIONS]
)


@dataclass
class FTISGRPOConfig(GRPOConfig, FTISOptionFields):
    """`GRPOConfig` plus the options of `FTISOptions` that TRL does not have (OWN_OPTIONS: the IS
    weight, the filter, ...), with their defaults and help from that one definition.

    TRL's own loss options keep their names, defaults and meaning and are the op's options of the
    same names (`importance_sampling_level` is `ratio_level`). TRL's corrections are mapped:
    `off_policy_mask_threshold` is the OPSM preset of the filter, and on the vLLM path
    `vllm_importance_sampling_correction` with its mode and clip bounds is the IS weight
    pi_old / pi_gen (is_source="old"); these replace the filter and the IS weight options, and
    refuse a `filter` / `is_mode` set to anything but its default or off. One TRL default
    changes to False:
    `vllm_importance_sampling_correction` (F-TIS's own weight min(pi_theta / pi_gen, is_cap), with
    pi_gen = vLLM's logprobs, is the correction).
    """

    ftis_op: str = field(
        default="ftis_linear_loss",
        metadata={
            "help": "'ftis_linear_loss' (fused with the lm-head: the logits are never "
            "materialised; one process, DDP, FSDP2 or DeepSpeed ZeRO, not FSDP1) or 'ftis_loss' "
            "(from the completion logits of the model's forward)."
        },
    )
    vllm_importance_sampling_correction: bool = field(
        default=False,
        metadata={
            "help": "TRL's vLLM IS correction, mapped onto the op's IS weight (is_source='old'); "
            "False by default: F-TIS's weight with pi_gen = vLLM's logprobs is the correction."
        },
    )

    def __post_init__(self):
        for name in OWN_OPTIONS:  # the command line passes None as a string
            value = getattr(self, name)
            if OPTION_FIELDS[name].default is None or name == "filter":
                if isinstance(value, str) and value.lower() in ("none", "null"):
                    setattr(self, name, None)
        super().__post_init__()
        check_trl_options(self)
        self.ftis_options()

    def ftis_options(self) -> FTISOptions:
        """The op's options: the fields of FTISOptions by their name here, with TRL's OPSM and
        vLLM IS correction mapped onto the filter and the IS weight."""
        values = {name: getattr(self, TRL_NAMES.get(name, name)) for name in OPTION_NAMES}
        if self.off_policy_mask_threshold is not None:
            opsm = FTISOptions.preset("opsm", kl_threshold=self.off_policy_mask_threshold)
            _replace(values, FILTER_OPTIONS, "off_policy_mask_threshold", opsm.as_kwargs())
        if self.use_vllm and self.vllm_importance_sampling_correction:
            mode = self.vllm_importance_sampling_mode
            mapped = dict(dispatch(VLLM_IS_MODES, mode, "vllm_importance_sampling_mode"))
            cap = self.vllm_importance_sampling_clip_max
            mapped.update(
                is_source="old",
                is_cap=math.inf if cap is None else cap,
                is_cap_min=self.vllm_importance_sampling_clip_min,
            )
            _replace(values, IS_OPTIONS, "vllm_importance_sampling_correction", mapped)
        return FTISOptions(**values)


def _replace(values: dict, names: tuple, trl_option: str, mapped: dict) -> None:
    """values[names] = mapped[names]. The first name (filter, is_mode) is the user's choice that
    TRL's option replaces: refused unless left at its default or off (None, "none")."""
    key = names[0]
    if values[key] not in (getattr(DEFAULTS, key), None, "none"):
        _refuse(key, values[key], f"{trl_option} replaces it; leave it at its default or off")
    values.update({name: mapped[name] for name in names})


def _refuse(option: str, value: Any, why: str) -> None:
    raise ValueError(f"{option}={value!r} is not supported by FTISGRPOTrainer: {why}")


def check_trl_options(args: GRPOConfig) -> None:
    """ValueError naming the first TRL option whose effect on the loss F-TIS cannot honour."""
    if args.top_entropy_quantile < 1.0:
        _refuse(
            "top_entropy_quantile",
            args.top_entropy_quantile,
            "F-TIS trains on every completion token",
        )
    if args.ftis_op not in FTIS_OPS:
        _refuse("ftis_op", args.ftis_op, f"expected one of {FTIS_OPS}")
