"""`FTISGRPOTrainer`: TRL's `GRPOTrainer` whose loss of each micro-batch is F-TIS, from the
completion logits (`ftis_loss`) or from the hidden states and the lm-head (`ftis_linear_loss`),
under one process, DDP, FSDP2 or DeepSpeed ZeRO (how the engine holds the lm-head: `_sharding`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn
from trl import GRPOTrainer

from ftis_kernels.ftis_linear_loss import ftis_linear_loss
from ftis_kernels.ftis_logprobs import ftis_logprobs
from ftis_kernels.ftis_loss import ftis_loss
from ftis_kernels.integrations.hf import _active_module, _unwrap_peft, lm_head_inputs
from ftis_kernels.integrations.trl.config import FTISGRPOConfig, _refuse, check_trl_options
from ftis_kernels.options import FTISOptions, loss_type
from ftis_kernels.per_sample import REJECT_RULES
from ftis_kernels.validate import dispatch, raise_on_bad_values

logger = logging.getLogger("ftis_kernels.integrations.trl")

LOGGED_METRICS = (
    "kl_mean",
    "filtered_frac",
    "is_weight_mean",
    "is_truncated_frac",
    "is_masked_frac",
    "is_ratio_mean",
    "is_ratio_max",
    "is_ratio_min",
    "clip_frac",
)


def _refuse_fsdp1() -> None:
    _refuse(
        "ftis_op",
        "ftis_linear_loss",
        "FSDP1 flattens the lm-head weight into a FlatParameter; use FSDP2 (fsdp_config "
        "version 2), DDP or DeepSpeed, or ftis_op='ftis_loss'",
    )


def _lm_head_module(unwrapped: nn.Module) -> nn.Module:
    return _unwrap_peft(unwrapped).get_output_embeddings()


def _is_fsdp1(model: nn.Module, unwrapped: nn.Module) -> bool:
    """Whether FSDP1 (`FullyShardedDataParallel`) wraps `model` or a module of it."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in [model, *unwrapped.modules()])


def _sharding(model: nn.Module, unwrapped: nn.Module) -> Optional[str]:
    """How the engine holds the lm-head weight on this process: None, whole (one process, DDP,
    DeepSpeed ZeRO-1/2); "fsdp2", sharded by torch's `fully_shard` (accelerate's FSDP2);
    "zero3", partitioned by DeepSpeed ZeRO-3. FSDP1 is refused. Read from the modules, not from
    accelerate's flags, so that it holds for however the model was wrapped."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule

    if _is_fsdp1(model, unwrapped):
        _refuse_fsdp1()
    modules = [model, *unwrapped.modules()]
    if any(isinstance(m, FSDPModule) for m in modules):
        return "fsdp2"
    if any(hasattr(p, "ds_id") for p in _lm_head_module(unwrapped).parameters()):
        return "zero3"  # deepspeed.zero's partitioned parameters carry a ds_id
    return None


def _unshard_lm_head(unwrapped: nn.Module) -> None:
    """FSDP2: all-gathers the groups that hold the lm-head's parameters (`FSDPModule.unshard`,
    a no-op where the forward left them gathered, as it does the root's and accelerate's
    [norm, lm_head] group). FSDP's post-backward then reduce-scatters their gradients into the
    shards: the root runs it, at the end of the backward, for every group whose forward inputs
    got no gradient, and the fused loss is outside any group's forward."""
    from torch.distributed.fsdp import FSDPModule

    head = _lm_head_module(unwrapped)
    name = next(n for n, m in unwrapped.named_modules() if m is head)
    parts = name.split(".") if name else []
    ancestors = [unwrapped.get_submodule(".".join(parts[:i])) for i in range(len(parts) + 1)]
    owners = [m for m in ancestors if isinstance(m, FSDPModule)][-1:]
    owners += [m for m in head.modules() if isinstance(m, FSDPModule) and m is not head]
    for owner in owners:
        owner.unshard()


def _zero3_lm_head(unwrapped: nn.Module) -> nn.Module:
    head = _active_module(_lm_head_module(unwrapped))
    if not isinstance(head, nn.Linear):
        _refuse(
            "ftis_op",
            "ftis_linear_loss",
            "under DeepSpeed ZeRO-3 the fused loss needs a plain nn.Linear lm-head, whose "
            f"parameters ZeRO gathers as one module, got {type(head).__name__}; "
            "use ftis_op='ftis_loss'",
        )
    return head


def _call_as_forward(module: nn.Module, fn: Callable, hidden: torch.Tensor) -> tuple:
    """fn(hidden), run as `module`'s forward so that the engine's hooks on `module` apply to it.
    DeepSpeed ZeRO-3 gathers the module's parameters before the call and releases them after;
    when the backward reaches the returned tensor (fn's first result) it gathers them again,
    their gradients are reduce-scattered into the partitions, and they are released once
    `hidden` has its gradient. Returns fn's results."""
    results = []

    def forward(h):
        results.append(fn(h))
        return results[0][0]

    saved = module.__dict__.get("forward")
    module.forward = forward
    try:
        first = module(hidden)
    finally:
        if saved is None:
            del module.forward
        else:
            module.forward = saved
    return (first, *results[0][1:])


def _call(fn: Callable, hidden: torch.Tensor) -> Any:
    return fn(hidden)


class FTISGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` whose loss is F-TIS (module docstring). Takes `GRPOTrainer`'s arguments,
    with `args` an `FTISGRPOConfig`. Logs TRL's metrics, TRL's `entropy` (the per-token entropy
    over completion tokens) and ftis/<name> for each name of `LOGGED_METRICS` (and `kl`, TRL's
    k3 to the reference, times R with use_bias_correction_kl, when beta > 0; `policy_loss` and
    `entropy_coef` with an entropy bonus); TRL's clip_ratio/*, cispo_clip_ratio and
    vespo/phi_seq_mean are not computed.

    Several processes: with ftis_op="ftis_linear_loss" it runs under accelerate's DDP, FSDP2 and
    DeepSpeed ZeRO-1/2/3. The decoder runs through the engine's wrapper; the fused loss and the
    pi_old / reference passes take the lm-head weight whole, which under FSDP2 is an explicit
    `unshard` of its groups (FSDP's post-backward reduce-scatters the gradient) and under ZeRO-3
    a call as the lm-head module's forward (ZeRO's hooks gather the weight, again in the
    backward, and reduce-scatter the gradient); see `_sharding`. Tied embeddings work; FSDP1,
    and a LoRA lm-head under ZeRO-3, are refused with a ValueError naming ftis_op. Tested with
    2 gloo processes on CPU against one process on the same global batch (loss, pi_old
    logprobs, SGD-updated weights; tests/test_trl_ddp.py, tests/test_trl_fsdp.py): DDP; FSDP2
    by `fully_shard` and by accelerate's `fsdp2_prepare_model`, as accelerate enables FSDP on
    GPUs only; ZeRO-2/3 through accelerate where deepspeed is installed. Untested: ZeRO-1,
    GPUs."""

    def __init__(
        self, model, reward_funcs=None, args: Optional[FTISGRPOConfig] = None, *pos, **kwargs
    ):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = FTISGRPOConfig(f"{str(name).split('/')[-1] or 'model'}-FTIS-GRPO")
        if not isinstance(args, FTISGRPOConfig):
            raise TypeError(f"args: expected an FTISGRPOConfig, got {type(args).__name__}")
        check_trl_options(args)  # again: the config may have been changed after construction
        self.ftis = args.ftis_options()
        super().__init__(model, reward_funcs, args, *pos, **kwargs)
        if self._is_vlm:
            raise ValueError(
                "processing_class: FTISGRPOTrainer supports text-only causal LMs, "
                "got a multimodal processor"
            )
        if args.ftis_op == "ftis_linear_loss" and self.is_fsdp_enabled:
            if not self.accelerator.is_fsdp2:
                _refuse_fsdp1()
        if self.aux_loss_enabled:
            _refuse(
                "router_aux_loss_coef",
                self.router_aux_loss_coef,
                "F-TIS adds no MoE load-balancing loss; set router_aux_loss_coef=0.0",
            )
        self._on_policy_noticed = False

    def _policy_head(
        self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int
    ) -> Callable:
        """The F-TIS op bound to the policy's completion positions: `head(tokens, gen, adv, mask,
        old, ref, **options)`. Row t of what it scores predicts completion token t."""
        if self.args.ftis_op == "ftis_loss":
            with self.accelerator.autocast():
                out = model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    logits_to_keep=T + 1,
                    use_cache=False,
                )
            return functools.partial(ftis_loss, out.logits[:, :-1])
        # Every completion column, so that the columns are TRL's; the loss mask goes to the op.
        columns = torch.ones(input_ids.shape[0], T, dtype=torch.bool, device=input_ids.device)
        with self.accelerator.autocast():
            x, run = self._lm_head_inputs(model, input_ids, attention_mask, columns, grad=True)

        def head(*args, **kwargs):
            def loss(hidden):
                return ftis_linear_loss(hidden, x.weight, *args, bias=x.bias, **kwargs)

            return run(loss, x.hidden)

        return head

    def _lm_head_inputs(self, model, input_ids, attention_mask, columns, grad: bool) -> tuple:
        """`lm_head_inputs` of the policy or reference `model` as prepared by accelerate, and
        `run(fn, hidden)`, which calls fn(hidden) while the lm-head weight is whole on this
        process and makes its gradient reach the parameter the engine holds (see `_sharding`).

        The decoder runs through the wrapper when there is one that must see the forward (DDP's
        arms the gradient all-reduce; grad=False skips it) and always under FSDP2 and ZeRO-3,
        whose hooks gather the other parameters; one position of logits is computed and dropped.
        """
        unwrapped = self.accelerator.unwrap_model(model)
        sharding = _sharding(model, unwrapped)
        states = None
        if sharding is not None or (grad and model is not unwrapped):
            out = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                logits_to_keep=1,
                output_hidden_states=True,
                use_cache=False,
            )
            states = out.hidden_states[-1]
        if sharding == "fsdp2":
            _unshard_lm_head(unwrapped)
        x = lm_head_inputs(unwrapped, input_ids, attention_mask, columns, states=states)
        if sharding == "zero3":
            return x, functools.partial(_call_as_forward, _zero3_lm_head(unwrapped))
        return x, _call

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
            raise ValueError(
                f"advantages: expected one per completion, shape ({B},), "
                f"got {tuple(advantages.shape)}"
            )
        old = inputs.get("old_per_token_logps")
        ref = inputs.get("ref_per_token_logps") if self.ftis.beta > 0 else None

        head = self._policy_head(model, input_ids, attention_mask, T)
        sampling = inputs.get("sampling_per_token_logps")
        if sampling is not None:
            gen = sampling
            unscored = torch.isnan(sampling) & mask
            if unscored.any():
                # Tokens vLLM could not score: no correction there (w = 1, no KL), as in TRL:
                # there pi_gen is the pi_src the IS weight reads (the filter's KL without one),
                # pi_old or the current policy (not pi_old: it moves after the first iteration).
                ftis = self.ftis
                source = ftis.is_source if ftis.is_mode != "none" else ftis.kl_source
                fallback = old if source == "old" else None
                if fallback is None:
                    fallback = self._current_logprobs(head, completion_ids, advantages, mask)
                gen = torch.where(unscored, fallback, sampling)
        elif old is not None:
            gen = old
        else:
            gen = self._current_logprobs(head, completion_ids, advantages, mask)
        mode = "train" if self.model.training else "eval"
        scale = self._trl_scale(mode, mask, inputs)
        options = self.ftis
        coef = self._entropy_coef_to_apply()
        if coef > 0:
            # TRL's bonus is coef * mean entropy / accumulation whatever the loss type's scale.
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            options = options.replace(entropy_coef=coef / (accumulation * float(scale)))
        elif options.entropy_coef > 0:
            options = options.replace(entropy_coef=0.0)
        # The value checks are read with the metrics below (a synchronisation this step makes
        # anyway), not in the backward: the backward then reads nothing from the device.
        # The factor applied below, announced to ftis_loss: where it writes the gradient in its
        # forward, it writes it scaled, and its backward has nothing to rescale.
        announced = {}
        if self.args.ftis_op == "ftis_loss" and isinstance(scale, float):
            announced["grad_scale"] = scale
        loss, metrics = head(
            completion_ids,
            gen,
            advantages,
            mask,
            old,
            ref,
            options=options,
            value_check="deferred",
            **announced,
        )
        if not self._on_policy_noticed:
            self._notice_on_policy(gen, old, metrics["logp"], mask)
        loss = loss * scale
        policy_loss = None
        if self.use_adaptive_entropy or self.entropy_coef != 0.0:  # TRL's entropy bonus is on
            policy_loss = self._policy_loss(loss, coef, metrics, mask, mode)
            if self.use_adaptive_entropy and mode == "train":
                self._update_entropy_coef(metrics["entropy"], mask)
            if mode == "train" and self.accelerator.sync_gradients:
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        faults = self._log_ftis_metrics(mode, metrics, mask, old, ref, policy_loss)
        raise_on_bad_values(metrics)  # a bad input raises here, before the backward and the step
        if faults:  # another process's input: it raises there, and here too, so that no process
            # waits for it in the backward's all-reduce
            raise ValueError(
                f"value check: another process's batch failed it ({faults:.0f} failing "
                "positions in all; that process raises its error)"
            )
        return loss

    def _policy_loss(self, loss, coef: float, metrics, mask, mode: str) -> torch.Tensor:
        """TRL's `policy_loss` metric: the loss without the entropy bonus (which is coef / the
        accumulation times the op's mean entropy over the loss's tokens) and, but for the loss
        types TRL normalises by the generation batch's tokens, before the accumulation scaling."""
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        policy_loss = loss.detach()
        if coef > 0:
            kept = dispatch(REJECT_RULES, self.ftis.reject_mode, "reject_mode")(
                mask, metrics["filtered"]
            )
            entropy = torch.where(kept, metrics["entropy"].float(), 0.0).sum()
            policy_loss = policy_loss + coef / accumulation * entropy / kept.sum().clamp(min=1)
        if not loss_type(self.loss_type).trl_global_tokens:
            policy_loss = policy_loss * accumulation
        return policy_loss

    def _notice_on_policy(self, gen, old, logp, mask) -> None:
        """Logs once per trainer (on the main process) the first batch whose pi_gen is pi_old on
        every completion token: then F-TIS has no generator to correct (w is pi_theta / pi_old,
        1 on the first iteration, the filter's KL measures only the policy's own drift) and the
        loss is plain GRPO's. It is so whenever TRL has no sampler log-probs (no vLLM and no
        `rollout_func`): TRL sampled with the policy itself."""
        pi_old = logp if old is None else old
        zero = torch.zeros((), dtype=gen.dtype, device=gen.device)
        if not torch.equal(torch.where(mask, gen, zero), torch.where(mask, pi_old.to(gen), zero)):
            return
        self._on_policy_noticed = True
        if self.accelerator.is_main_process:
            logger.warning(
                "FTISGRPOTrainer: pi_gen equals pi_old on every completion token of this batch "
                "(no sampler log-probs: TRL generated it with the policy being trained), so F-TIS "
                "corrects nothing here and the loss is GRPO's. F-TIS acts on samples from another "
                "policy: a rollout_func returning their log-probs (e.g. PeerRollout) or vLLM's "
                "sampler log-probs. Logged once."
            )

    def _entropy_coef_to_apply(self) -> float:
        """TRL's rule: the static entropy_coef, or with use_adaptive_entropy the current
        coefficient while the last window's entropy is at most entropy_target, else 0."""
        if not self.use_adaptive_entropy:
            return self.entropy_coef
        return self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0

    def _update_entropy_coef(self, entropy: torch.Tensor, mask: torch.Tensor) -> None:
        """TRL's adaptive controller (GRPOTrainer._compute_loss), fed by the op's per-token
        entropy: sums over the accumulation window, and at its end the coefficient moves by
        entropy_coef_delta towards more entropy below entropy_target, less above it."""
        stats = torch.stack([(entropy * mask).sum(), mask.sum().float()]).detach()
        window = self._entropy_window_stats
        self._entropy_window_stats = stats if window is None else window + stats
        if not self.accelerator.sync_gradients:
            return
        totals = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
        args = self.args
        if world_entropy <= args.entropy_target:
            self.entropy_coef = min(
                self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max
            )
        else:
            self.entropy_coef = max(
                self.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min
            )
        self._last_world_entropy = world_entropy
        self._entropy_window_stats = None

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """TRL's pi_old and reference passes (no grad: the F-TIS loss computes its own log pi_theta)
        with `ftis_logprobs` from the hidden states and the lm-head, the row kernels of the loss:
        (B, logits_to_keep) log-probabilities at the temperature, 0 at padding. TRL's own pass
        under FSDP1 (ftis_op="ftis_loss"), for an MoE aux loss or multimodal inputs."""
        # FSDP1 (with ftis_op="ftis_loss"; the fused loss refuses it) leaves no lm-head weight
        # to read whole: TRL's own pass, from the logits.
        fsdp1 = self.args.ftis_op == "ftis_loss" and _is_fsdp1(
            model, self.accelerator.unwrap_model(model)
        )
        if fsdp1 or compute_aux_loss or any(v is not None for v in multimodal.values()):
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size,
                compute_entropy,
                compute_aux_loss,
                **multimodal,
            )
        B = input_ids.shape[0]
        batch_size = batch_size or B
        columns = torch.ones(B, logits_to_keep, dtype=torch.bool, device=input_ids.device)
        logps, entropies = [], []
        with torch.no_grad(), self.accelerator.autocast():
            for b0 in range(0, B, batch_size):
                rows = slice(b0, b0 + batch_size)
                x, run = self._lm_head_inputs(
                    model, input_ids[rows], attention_mask[rows], columns[rows], grad=False
                )
                logprobs = functools.partial(
                    ftis_logprobs,
                    tokens=x.tokens,
                    weight=x.weight,
                    bias=x.bias,
                    mask=x.mask,
                    temperature=self.temperature,
                )
                logp, entropy = run(logprobs, x.hidden)
                logps.append(logp)
                entropies.append(entropy)
        entropy = torch.cat(entropies) if compute_entropy else None
        return torch.cat(logps), entropy, None

    def _current_logprobs(self, head: Callable, tokens, advantages, mask) -> torch.Tensor:
        """log pi_theta(tokens) at the loss's temperature, detached, from the same op and inputs
        as the loss, so that log pi_theta / pi_gen is exactly 0: w = 1, KL = 0."""
        with torch.no_grad():
            neutral = FTISOptions(is_mode="none", filter=None, temperature=self.ftis.temperature)
            zeros = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
            _, metrics = head(tokens, zeros, advantages, mask, options=neutral)
        return metrics["logp"]

    def _trl_scale(self, mode: str, mask: torch.Tensor, inputs) -> Any:
        """Factor that turns the op's reduction into TRL's (`GRPOTrainer._compute_loss`)."""
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if loss_type(self.loss_type).trl_global_tokens:
            # TRL: token sum / (tokens of the generation batch per process, per accumulation window);  # noqa: E501
            # the op: token sum / tokens of this micro-batch.
            normalizer = (
                inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            )
            if mode == "train":
                normalizer = normalizer * accumulation / self.args.steps_per_generation
            return mask.sum().clamp(min=1.0) / normalizer
        # dr_grpo: the op divides by B * max_completion_length itself (an option).
        return 1.0 / accumulation

    def _log_ftis_metrics(self, mode: str, metrics: dict, mask, old, ref, policy_loss) -> float:
        """ftis/<name> for LOGGED_METRICS and TRL's `policy_loss` (when not None), averaged over
        the processes, and TRL's `entropy` and, with beta > 0, `kl`: token means over every
        process's completion tokens, as TRL's `global_masked_mean` takes them, the k3 to the
        reference times the PPO ratio R with use_bias_correction_kl (as TRL logs it). Returns the
        value checks' failing positions over all processes (read in the same gather)."""
        values = [metrics[name] for name in LOGGED_METRICS]
        names = [f"ftis/{name}" for name in LOGGED_METRICS]
        if policy_loss is not None:
            values.append(policy_loss)
            names.append("policy_loss")
        logp = metrics["logp"].float()
        token_sums = {"entropy": torch.where(mask, metrics["entropy"].float(), 0.0).sum()}
        if ref is not None:
            d = torch.where(mask, ref.float() - logp, 0.0)
            kl = torch.expm1(d) - d
            if self.ftis.use_bias_correction_kl:
                kl = kl * self._ppo_ratio(logp, old, mask)
            token_sums["kl"] = torch.where(mask, kl, 0.0).sum()
        faults = metrics["value_faults"][:, 0].sum()
        row = torch.stack([*values, *token_sums.values(), mask.sum(), faults]).float()
        gathered = self.accelerator.gather(row[None])
        per_process = gathered[:, : len(values)].nanmean(dim=0).tolist()
        totals = gathered[:, len(values) :].sum(dim=0)
        token_means = (totals[:-2] / totals[-2].clamp(min=1.0)).tolist()
        for name, value in zip([*names, *token_sums], per_process + token_means):
            self._metrics[mode][name].append(value)
        return float(totals[-1])

    def _ppo_ratio(self, logp: torch.Tensor, old, mask: torch.Tensor) -> torch.Tensor:
        """R = pi_theta / pi_old per token, or exp(mean log ratio) per sample (B, 1) with
        importance_sampling_level="sequence"; 1 without TRL's old logprobs. Detached."""
        if old is None:
            return torch.ones_like(logp)
        log_r = torch.where(mask, logp - old.float(), 0.0)
        if self.ftis.ratio_level == "sequence":
            log_r = log_r.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
        return torch.exp(log_r)
