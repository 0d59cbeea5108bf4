"""TRL integration: `FTISGRPOTrainer`, TRL's `GRPOTrainer` with its loss replaced by F-TIS.

    from ftis_kernels.integrations.trl import FTISGRPOConfig, FTISGRPOTrainer
    args = FTISGRPOConfig(output_dir="out", is_mode="tis", filter="negative_offpolicy")
    trainer = FTISGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds)

Everything but the loss is TRL's: generation, rewards, group advantages, the reference model,
logging. The loss of each micro-batch is `ftis_loss` on the completion logits, or
`ftis_linear_loss` on the completion hidden states and the lm-head (`ftis_op`), with:

    pi_gen  = the generator's sampling logprobs when TRL has them (the vLLM path, or a custom
              `rollout_func`, which is how another node's completions and logprobs come in),
              else TRL's old logprobs, else the current policy (detached, from one extra
              gradient-free pass of the op): TRL generated the batch with this very model, so
              w = 1 and KL = 0;
    pi_old  = TRL's old logprobs when it computed them (num_iterations > 1, or generation not
              aligned with optimiser steps), else stop_grad(current), as in TRL;
    ref     = TRL's reference logprobs when beta > 0.

pi_gen must be the distribution the tokens were sampled from: with a vLLM server, start it with
`--logprobs-mode processed_logprobs` (after temperature and top-p/top-k), as TRL asks for its own
correction. Without generator logprobs, top_p/top_k/min_p/repetition_penalty are ignored in pi_gen,
as TRL ignores them in its ratio.

TRL's loss_type, beta, epsilon, epsilon_high and temperature keep their meaning, and the loss is
scaled exactly as TRL scales it (gradient accumulation; dapo's generation-batch token count;
dr_grpo's max_completion_length), so with is_mode="none" and filter=None the loss is TRL's own.
TRL options that would change the loss in a way F-TIS cannot reproduce are refused with a
ValueError naming them, at config and at trainer construction.

Tested with trl 1.11 to 1.16 (TESTED_TRL); other versions get a warning at import.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ftis_kernels._extras import require
from ftis_kernels.ftis_linear_loss import ftis_linear_loss
from ftis_kernels.ftis_loss import ftis_loss
from ftis_kernels.integrations.hf import lm_head_inputs
from ftis_kernels.options import LOSS_TYPES, FTISOptions

require("trl", "ftis_kernels.integrations.trl")

import trl  # noqa: E402
from packaging.specifiers import SpecifierSet  # noqa: E402
from packaging.version import Version  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

TESTED_TRL = ">=1.11,<1.17"
if Version(trl.__version__) not in SpecifierSet(TESTED_TRL):
    warnings.warn(f"ftis_kernels.integrations.trl is tested with trl{TESTED_TRL}, "
                  f"found trl {trl.__version__}", stacklevel=2)  # fmt: skip
FTIS_OPS = ("ftis_linear_loss", "ftis_loss")
LOGGED_METRICS = ("kl_mean", "filtered_frac", "is_weight_mean", "is_truncated_frac", "clip_frac")


@dataclass
class FTISGRPOConfig(GRPOConfig):
    """`GRPOConfig` plus the F-TIS options (docs/method.md §2; see `FTISOptions`).

    TRL's own `loss_type` ("grpo" | "bnpo" | "dapo" | "dr_grpo"), `beta`, `epsilon`,
    `epsilon_high` and `temperature` are the op's options of the same names.
    Two TRL defaults change to False, as F-TIS cannot honour them: `vllm_importance_sampling_correction`
    (on the vLLM path F-TIS's own weight min(pi_theta / pi_gen, is_cap), with pi_gen = vLLM's
    logprobs, is the correction) and `use_bias_correction_kl` (the beta * k3 term is not weighted).
    """

    is_mode: str = field(
        default="tis",
        metadata={"help": "IS weight: 'none' (w = 1), 'vis' (pi_theta / pi_gen), 'tis' (capped at is_cap)."},
    )
    is_level: str = field(
        default="token", metadata={"help": "'token' or 'sequence' (w = exp(mean_t log pi_theta / pi_gen))."}
    )
    is_cap: float = field(default=2.0, metadata={"help": "C, the truncation of the 'tis' weight."})
    filter: Optional[str] = field(
        default="negative_offpolicy",
        metadata={
            "help": "Which samples get advantage 0: 'negative_offpolicy' (A <= 0 and KL > g, the paper), "
            "'negative_or_offpolicy', 'negative', 'offpolicy', or None ('none' on the command line)."
        },
    )
    kl_threshold: float = field(default=50.0, metadata={"help": "g, the KL(pi_theta || pi_gen) threshold."})
    kl_estimator: str = field(default="k3", metadata={"help": "'k1', 'k2' or 'k3', per token."})
    kl_reduction: str = field(default="sum", metadata={"help": "'sum' or 'mean' over the completion tokens."})
    ftis_op: str = field(
        default="ftis_linear_loss",
        metadata={
            "help": "'ftis_linear_loss' (fused with the lm-head: the logits are never materialised; "
            "single-process) or 'ftis_loss' (from the completion logits of the model's forward)."
        },
    )
    vllm_importance_sampling_correction: bool = field(
        default=False,
        metadata={"help": "Must stay False: F-TIS's weight replaces TRL's vLLM importance sampling."},
    )
    use_bias_correction_kl: bool = field(
        default=False,
        metadata={"help": "Must stay False when beta > 0: the reference KL term of F-TIS is not weighted."},
    )

    def __post_init__(self):
        if isinstance(self.filter, str) and self.filter.lower() in ("none", "null"):
            self.filter = None  # the command line passes None as a string
        super().__post_init__()
        check_trl_options(self)
        self.ftis_options()

    def ftis_options(self) -> FTISOptions:
        """The op's options: the F-TIS fields plus TRL's loss_type, beta, epsilons, temperature."""
        return FTISOptions(
            is_mode=self.is_mode, is_level=self.is_level, is_cap=self.is_cap, filter=self.filter,
            kl_threshold=self.kl_threshold, kl_estimator=self.kl_estimator,
            kl_reduction=self.kl_reduction, epsilon=self.epsilon, epsilon_high=self.epsilon_high,
            beta=self.beta, temperature=self.temperature, loss_type=self.loss_type,
        )  # fmt: skip


def _refuse(option: str, value: Any, why: str) -> None:
    raise ValueError(f"{option}={value!r} is not supported by FTISGRPOTrainer: {why}")


def check_trl_options(args: GRPOConfig) -> None:
    """ValueError naming the first TRL option whose effect on the loss F-TIS cannot honour."""
    if args.loss_type not in LOSS_TYPES:
        _refuse("loss_type", args.loss_type, f"F-TIS reduces its loss as one of {LOSS_TYPES}")
    if args.importance_sampling_level != "token":
        _refuse("importance_sampling_level", args.importance_sampling_level,
                "the PPO ratio is per token in F-TIS; for a sequence-level IS weight, "
                "set is_level='sequence'")  # fmt: skip
    if args.delta is not None:
        _refuse("delta", args.delta, "F-TIS clips the PPO ratio to [1 - epsilon, 1 + epsilon_high] only")
    if args.off_policy_mask_threshold is not None:
        _refuse("off_policy_mask_threshold", args.off_policy_mask_threshold,
                "the F-TIS filter replaces it: set filter='negative_offpolicy' and kl_threshold")  # fmt: skip
    if args.top_entropy_quantile < 1.0:
        _refuse("top_entropy_quantile", args.top_entropy_quantile, "F-TIS trains on every completion token")
    if args.entropy_coef != 0.0 or args.use_adaptive_entropy:
        option = "use_adaptive_entropy" if args.use_adaptive_entropy else "entropy_coef"
        _refuse(option, getattr(args, option), "F-TIS has no entropy bonus")
    if args.beta != 0.0 and args.use_bias_correction_kl:
        _refuse("use_bias_correction_kl", True, "the reference KL term of F-TIS is not importance-weighted")
    if args.use_vllm and args.vllm_importance_sampling_correction:
        _refuse("vllm_importance_sampling_correction", True,
                "F-TIS's weight min(pi_theta / pi_gen, is_cap), with pi_gen = vLLM's logprobs, is the "
                "correction; set it to False (and choose is_mode / is_cap)")  # fmt: skip
    if args.ftis_op not in FTIS_OPS:
        _refuse("ftis_op", args.ftis_op, f"expected one of {FTIS_OPS}")


class FTISGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` whose loss is F-TIS (module docstring). Takes `GRPOTrainer`'s arguments,
    with `args` an `FTISGRPOConfig`. Logs TRL's metrics plus ftis/kl_mean, ftis/filtered_frac,
    ftis/is_weight_mean, ftis/is_truncated_frac and ftis/clip_frac (and `kl`, the reference KL,
    when beta > 0); TRL's entropy and clip_ratio/* are not computed."""

    def __init__(self, model, reward_funcs=None, args: Optional[FTISGRPOConfig] = None, *pos, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = FTISGRPOConfig(f"{str(name).split('/')[-1] or 'model'}-FTIS-GRPO")
        if not isinstance(args, FTISGRPOConfig):
            raise TypeError(f"args: expected an FTISGRPOConfig, got {type(args).__name__}")
        check_trl_options(args)  # again: the config may have been changed after construction
        self.ftis = args.ftis_options()
        super().__init__(model, reward_funcs, args, *pos, **kwargs)
        if self._is_vlm:
            raise ValueError("processing_class: FTISGRPOTrainer supports text-only causal LMs, "
                             "got a multimodal processor")
        if args.ftis_op == "ftis_linear_loss" and self.accelerator.num_processes > 1:
            _refuse("ftis_op", args.ftis_op,
                    "it runs the decoder outside the distributed wrapper, so is single-process only; "
                    "use ftis_op='ftis_loss' with several processes")  # fmt: skip
        if self.aux_loss_enabled:
            _refuse("router_aux_loss_coef", self.router_aux_loss_coef,
                    "F-TIS adds no MoE load-balancing loss; set router_aux_loss_coef=0.0")  # fmt: skip

    def _policy_head(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int) -> Callable:
        """The F-TIS op bound to the policy's completion positions: `head(tokens, gen, adv, mask,
        old, ref, **options)`. Row t of what it scores predicts completion token t."""
        if self.args.ftis_op == "ftis_loss":
            with self.accelerator.autocast():
                out = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=T + 1,
                            use_cache=False)  # fmt: skip
            return functools.partial(ftis_loss, out.logits[:, :-1])
        # Every completion column, so that the columns are TRL's; the loss mask goes to the op.
        columns = torch.ones(input_ids.shape[0], T, dtype=torch.bool, device=input_ids.device)
        with self.accelerator.autocast():
            x = lm_head_inputs(self.accelerator.unwrap_model(model), input_ids, attention_mask, columns)
        return functools.partial(ftis_linear_loss, x.hidden, x.weight, bias=x.bias)

    def _compute_loss(self, model, inputs):
        completion_ids = inputs["completion_ids"]
        B, T = completion_ids.shape
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        mask = inputs["completion_mask"].bool()
        if "tool_mask" in inputs:  # tool outputs inside a completion are not the policy's tokens
            mask = mask & inputs["tool_mask"].bool()
        advantages = inputs["advantages"]
        if advantages.dim() != 1:
            raise ValueError(f"advantages: expected one per completion, shape ({B},), "
                             f"got {tuple(advantages.shape)}")
        old = inputs.get("old_per_token_logps")
        ref = inputs.get("ref_per_token_logps") if self.ftis.beta > 0 else None

        head = self._policy_head(model, input_ids, attention_mask, T)
        sampling = inputs.get("sampling_per_token_logps")
        if sampling is not None:
            gen = sampling
            unscored = torch.isnan(sampling) & mask
            if unscored.any():
                # Tokens vLLM could not score: no correction there (w = 1, no KL), as in TRL.
                fallback = old
                if fallback is None:
                    fallback = self._current_logprobs(head, completion_ids, advantages, mask)
                gen = torch.where(unscored, fallback, sampling)
        elif old is not None:
            gen = old
        else:
            gen = self._current_logprobs(head, completion_ids, advantages, mask)
        loss, metrics = head(completion_ids, gen, advantages, mask, old, ref, **self.ftis.as_kwargs())

        mode = "train" if self.model.training else "eval"
        loss = loss * self._trl_scale(mode, mask, T, inputs)
        self._log_ftis_metrics(mode, metrics, mask, ref)
        return loss

    def _current_logprobs(self, head: Callable, tokens, advantages, mask) -> torch.Tensor:
        """log pi_theta(tokens) at the loss's temperature, detached, from the same op and inputs
        as the loss, so that log pi_theta / pi_gen is exactly 0: w = 1, KL = 0."""
        with torch.no_grad():
            neutral = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
            _, metrics = head(tokens, neutral, advantages, mask, is_mode="none", filter=None,
                              temperature=self.ftis.temperature)  # fmt: skip
        return metrics["logp"]

    def _trl_scale(self, mode: str, mask: torch.Tensor, T: int, inputs) -> Any:
        """Factor that turns the op's reduction into TRL's (`GRPOTrainer._compute_loss`)."""
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if self.loss_type == "dapo":
            # TRL: token sum / (tokens of the generation batch per process, per accumulation window);
            # the op: token sum / tokens of this micro-batch.
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * accumulation / self.args.steps_per_generation
            return mask.sum() / normalizer
        if self.loss_type == "dr_grpo":
            # TRL divides by B * max_completion_length, the op by B * T (the padded completion length).
            return T / self.max_completion_length / accumulation
        return 1.0 / accumulation

    def _log_ftis_metrics(self, mode: str, metrics: dict[str, torch.Tensor], mask, ref) -> None:
        values = [metrics[name] for name in LOGGED_METRICS]
        names = [f"ftis/{name}" for name in LOGGED_METRICS]
        if ref is not None:
            # TRL's `kl` metric: the per-token k3 to the reference model, averaged over completion tokens.
            d = torch.where(mask, ref.float() - metrics["logp"], 0.0)
            values.append((torch.expm1(d) - d).sum() / mask.sum().clamp(min=1))
            names.append("kl")
        gathered = self.accelerator.gather(torch.stack(values).float()[None]).nanmean(dim=0).tolist()
        for name, value in zip(names, gathered):
            self._metrics[mode][name].append(value)

