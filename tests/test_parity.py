"""Parity with the peers' own code, executed: TRL 1.16's `GRPOTrainer._compute_loss` and
Liger-Kernel 0.8.5's `LigerFusedLinearGRPOLoss` run on the same inputs as our ops, in fp32, and the
loss and the gradients agree to 1e-5 relative, for every setting they can express (loss types,
token / sequence ratio, delta, beta with and without the bias-corrected KL, the entropy bonus,
OPSM, TRL's four vLLM IS modes, temperature).

TRL's loss is its real method, called on a stand-in for the trainer that carries the attributes it
reads; log pi_theta and the entropies come from TRL's own `selective_log_softmax_and_entropy`. TRL
computes its vLLM IS ratio while generating (`_generate_and_score_completions`), a step that needs a
model and a vLLM: `trl_vllm_is_ratio` transcribes those lines (clip / mask of pi_old / pi_sampler)
and hands the ratio to TRL's loss and to Liger's, as TRL does.
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl")
liger_grpo = pytest.importorskip("liger_kernel.chunked_loss.grpo_loss")

from trl import GRPOTrainer  # noqa: E402
from trl.trainer.utils import selective_log_softmax_and_entropy  # noqa: E402

from ftis_kernels import FTISOptions, ftis_linear_loss, ftis_loss  # noqa: E402

B, T, V, H = 4, 6, 29, 8
REL_TOL = 1e-5
MAX_COMPLETION_LENGTH = 9

TRL_DEFAULTS = dict(
    loss_type="grpo",
    importance_sampling_level="token",
    epsilon=0.2,
    epsilon_high=None,
    delta=None,
    beta=0.0,
    use_bias_correction_kl=False,
    entropy_coef=0.0,
    temperature=1.0,
    off_policy_mask_threshold=None,
    vllm_importance_sampling_mode=None,
    vllm_importance_sampling_clip_min=None,
    vllm_importance_sampling_clip_max=3.0,
    sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05,
    vespo_k_pos=2.0,
    vespo_lambda_pos=3.0,
    vespo_k_neg=3.0,
    vespo_lambda_neg=2.0,
)


def _settings() -> dict[str, dict]:
    s = {}
    for lt in ("grpo", "bnpo", "dapo", "dr_grpo", "luspo", "cispo", "sapo", "vespo"):
        s[lt] = dict(loss_type=lt)
        s[f"{lt}/sequence"] = dict(loss_type=lt, importance_sampling_level="sequence")
    s["cispo/sequence/eps_high=1.02"] = dict(
        loss_type="cispo", importance_sampling_level="sequence", epsilon_high=1.02
    )
    s["sapo/sequence/beta/bias_corrected_kl"] = dict(
        loss_type="sapo",
        importance_sampling_level="sequence",
        beta=0.04,
        use_bias_correction_kl=True,
    )
    s["vespo/sequence/beta/bias_corrected_kl"] = dict(
        loss_type="vespo",
        importance_sampling_level="sequence",
        beta=0.04,
        use_bias_correction_kl=True,
    )
    s["cispo/eps_high=1.1"] = dict(loss_type="cispo", epsilon_high=1.1)
    s["grpo/delta"] = dict(loss_type="grpo", delta=1.15, epsilon_high=0.1)
    s["dapo/sequence/delta"] = dict(
        loss_type="dapo", importance_sampling_level="sequence", delta=1.05
    )
    s["grpo/beta"] = dict(loss_type="grpo", beta=0.04)
    s["dapo/beta/bias_corrected_kl"] = dict(
        loss_type="dapo", beta=0.04, use_bias_correction_kl=True
    )
    s["grpo/sequence/beta/bias_corrected_kl"] = dict(
        importance_sampling_level="sequence", beta=0.04, use_bias_correction_kl=True
    )
    s["grpo/entropy_coef"] = dict(loss_type="grpo", entropy_coef=0.05)
    s["dapo/entropy_coef/temperature"] = dict(loss_type="dapo", entropy_coef=0.05, temperature=0.7)
    s["grpo/opsm"] = dict(loss_type="grpo", off_policy_mask_threshold=0.02)
    s["dapo/opsm/beta"] = dict(loss_type="dapo", off_policy_mask_threshold=0.005, beta=0.04)
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        s[f"grpo/vllm_is/{mode}"] = dict(
            vllm_importance_sampling_mode=mode,
            vllm_importance_sampling_clip_min=0.8,
            vllm_importance_sampling_clip_max=1.3,
        )
    s["dapo/vllm_is/token_truncate/no_min"] = dict(
        loss_type="dapo", vllm_importance_sampling_mode="token_truncate"
    )
    s["vespo/vllm_is/token_mask"] = dict(
        loss_type="vespo",
        vllm_importance_sampling_mode="token_mask",
        vllm_importance_sampling_clip_min=0.8,
    )
    s["sapo/vllm_is/token_truncate/beta"] = dict(
        loss_type="sapo", beta=0.04, vllm_importance_sampling_mode="token_truncate"
    )
    return s


SETTINGS = _settings()
# Liger has no entropy bonus and no OPSM; at the token level its luspo multiplies unmasked
# positions too (TRL masks them): there we follow TRL. Liger refuses a sequence-level ratio with
# cispo, sapo and vespo, which TRL runs.
LIGER_SETTINGS = {
    k: v
    for k, v in SETTINGS.items()
    if "entropy" not in k
    and "opsm" not in k
    and k != "luspo"
    and not (k.split("/")[0] in ("cispo", "sapo", "vespo") and "/sequence" in k)
}


def our_options(trl_kwargs: dict) -> FTISOptions:
    """The op's options for a TRL setting: no F-TIS weight or filter, TRL's loss options by name,
    OPSM and the vLLM IS modes by their presets and mapping."""
    c = {**TRL_DEFAULTS, **trl_kwargs}
    opts = dict(
        is_mode="none",
        filter=None,
        loss_type=c["loss_type"],
        ratio_level=c["importance_sampling_level"],
        epsilon=c["epsilon"],
        epsilon_high=c["epsilon_high"],
        delta=c["delta"],
        beta=c["beta"],
        use_bias_correction_kl=c["use_bias_correction_kl"],
        entropy_coef=c["entropy_coef"],
        temperature=c["temperature"],
        max_completion_length=MAX_COMPLETION_LENGTH,
        sapo_temperature_pos=c["sapo_temperature_pos"],
        sapo_temperature_neg=c["sapo_temperature_neg"],
        **{k: c[k] for k in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")},
    )
    if c["off_policy_mask_threshold"] is not None:
        opsm = FTISOptions.preset("opsm", kl_threshold=c["off_policy_mask_threshold"]).as_kwargs()
        opts.update(
            {k: opsm[k] for k in ("filter", "kl_estimator", "kl_reduction", "kl_threshold")}
        )
    mode = c["vllm_importance_sampling_mode"]
    if mode is not None:
        kind, level = {"token": "token", "sequence": "sequence_product"}, mode.split("_")[0]
        opts.update(
            is_mode="tis" if mode.endswith("truncate") else "mask",
            is_level=kind[level],
            is_source="old",
            is_cap=c["vllm_importance_sampling_clip_max"],
            is_cap_min=c["vllm_importance_sampling_clip_min"],
        )
    return FTISOptions(**opts)


def make_inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.7
    logits = hidden @ weight.t()
    tokens = torch.randint(0, V, (B, T), generator=g)
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    return dict(
        hidden=hidden,
        weight=weight,
        logits=logits,
        tokens=tokens,
        mask=mask,
        advantages=torch.tensor([1.2, -0.7, 0.4, -1.5]),
        old=logp + 0.15 * torch.randn(B, T, generator=g),
        sampling=logp + 0.1 * torch.rand(B, T, generator=g) - 0.05 * torch.randn(B, T, generator=g),
        ref=logp + 0.3 * torch.randn(B, T, generator=g),
    )


def trl_vllm_is_ratio(x: dict, c: dict) -> torch.Tensor | None:
    """TRL 1.16 `_generate_and_score_completions`: the vLLM IS ratio of pi_old over pi_sampler,
    per token or per sequence (sum), truncated or masked to [clip_min, clip_max]."""
    mode = c["vllm_importance_sampling_mode"]
    if mode is None:
        return None
    diff = torch.nan_to_num((x["old"] - x["sampling"]) * x["mask"], nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    lo, hi = c["vllm_importance_sampling_clip_min"], c["vllm_importance_sampling_clip_max"]
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=lo, max=hi)
    lo = -math.inf if lo is None else lo
    hi = math.inf if hi is None else hi
    return ratio.masked_fill((ratio < lo) | (ratio > hi), value=0.0)


def run_trl(x: dict, trl_kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's `GRPOTrainer._compute_loss` on the logits: (loss, d loss / d logits)."""
    c = {**TRL_DEFAULTS, **trl_kwargs}
    logits = x["logits"].clone().requires_grad_()
    vllm = c["vllm_importance_sampling_mode"] is not None

    def logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        logps, entropies = selective_log_softmax_and_entropy(
            logits, x["tokens"], temperature=c["temperature"]
        )
        return logps, entropies, None

    accelerator = SimpleNamespace(
        num_processes=1,
        sync_gradients=True,
        gather=lambda t: t,
        gather_for_metrics=lambda t: t,
        reduce=lambda t, reduction="sum": t,
    )
    args = SimpleNamespace(
        steps_per_generation=1,
        **{
            k: c[k]
            for k in (
                "use_bias_correction_kl",
                "delta",
                "sapo_temperature_pos",
                "sapo_temperature_neg",
                "vespo_k_pos",
                "vespo_lambda_pos",
                "vespo_k_neg",
                "vespo_lambda_neg",
            )
        },
    )
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=logps_and_entropies,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=c["off_policy_mask_threshold"],
        importance_sampling_level=c["importance_sampling_level"],
        beta=c["beta"],
        args=args,
        loss_type=c["loss_type"],
        epsilon_low=c["epsilon"],
        epsilon_high=c["epsilon"] if c["epsilon_high"] is None else c["epsilon_high"],
        use_vllm=vllm,
        vllm_importance_sampling_correction=vllm,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=MAX_COMPLETION_LENGTH,
        accelerator=accelerator,
        _metrics=defaultdict(lambda: defaultdict(list)),
        _entropy_bonus_enabled=c["entropy_coef"] != 0.0,
        use_adaptive_entropy=False,
        entropy_coef=c["entropy_coef"],
        aux_loss_enabled=False,
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
    )
    inputs = dict(
        prompt_ids=torch.zeros(B, 0, dtype=torch.long),
        prompt_mask=torch.zeros(B, 0, dtype=torch.long),
        completion_ids=x["tokens"],
        completion_mask=x["mask"],
        advantages=x["advantages"],
        old_per_token_logps=x["old"],
        num_items_in_batch=x["mask"].sum().float(),
    )
    if c["beta"] != 0.0:
        inputs["ref_per_token_logps"] = x["ref"]
    if vllm or c["off_policy_mask_threshold"] is not None:
        inputs["sampling_per_token_logps"] = x["sampling"]
    if vllm:
        inputs["importance_sampling_ratio"] = trl_vllm_is_ratio(x, c)
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.detach(), grad


def run_ours_on_logits(x: dict, trl_kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    logits = x["logits"].clone().requires_grad_()
    loss, _ = ftis_loss(
        logits,
        x["tokens"],
        x["sampling"],
        x["advantages"],
        x["mask"],
        x["old"],
        x["ref"],
        options=our_options(trl_kwargs),
    )
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.detach(), grad


def run_liger(x: dict, trl_kwargs: dict) -> tuple[torch.Tensor, ...]:
    c = {**TRL_DEFAULTS, **trl_kwargs}
    module = liger_grpo.LigerFusedLinearGRPOLoss(
        beta=c["beta"],
        compiled=False,
        use_ref_model=c["beta"] != 0.0,
        chunk_size=1,
        epsilon_low=c["epsilon"],
        epsilon_high=c["epsilon"] if c["epsilon_high"] is None else c["epsilon_high"],
        loss_type=c["loss_type"],
        max_completion_length=MAX_COMPLETION_LENGTH,
        importance_sampling_level=c["importance_sampling_level"],
        sapo_temperature_pos=c["sapo_temperature_pos"],
        sapo_temperature_neg=c["sapo_temperature_neg"],
        temperature=c["temperature"],
        delta=c["delta"],
        use_bias_correction_kl=c["use_bias_correction_kl"],
        **{k: c[k] for k in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")},
    )
    hidden, weight = (x[k].clone().requires_grad_() for k in ("hidden", "weight"))
    loss, _ = module(
        hidden,
        weight,
        x["tokens"],
        x["mask"],
        x["advantages"],
        ref_per_token_logps=x["ref"] if c["beta"] != 0.0 else None,
        old_per_token_logps=x["old"],
        vllm_is_ratio=trl_vllm_is_ratio(x, c),
        num_items_in_batch=x["mask"].sum(),
    )
    return (loss.detach(), *torch.autograd.grad(loss, (hidden, weight)))


def run_ours_on_hidden(x: dict, trl_kwargs: dict) -> tuple[torch.Tensor, ...]:
    hidden, weight = (x[k].clone().requires_grad_() for k in ("hidden", "weight"))
    loss, _ = ftis_linear_loss(
        hidden,
        weight,
        x["tokens"],
        x["sampling"],
        x["advantages"],
        x["mask"],
        x["old"],
        x["ref"],
        options=our_options(trl_kwargs),
    )
    return (loss.detach(), *torch.autograd.grad(loss, (hidden, weight)))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (the loss or a whole gradient)."""
    return ((got - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()


def parity_errors(peer: str, setting: str) -> dict[str, float]:
    x = make_inputs()
    kwargs = SETTINGS[setting]
    if peer == "trl":
        theirs, ours = run_trl(x, kwargs), run_ours_on_logits(x, kwargs)
        names = ("loss", "grad_logits")
    else:
        theirs, ours = run_liger(x, kwargs), run_ours_on_hidden(x, kwargs)
        names = ("loss", "grad_hidden", "grad_weight")
    return {n: relative_error(o, t) for n, o, t in zip(names, ours, theirs)}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_loss_and_gradient_equal_trl_grpo_trainers_own_loss(setting):
    errors = parity_errors("trl", setting)
    assert max(errors.values()) <= REL_TOL, errors


@pytest.mark.parametrize("setting", list(LIGER_SETTINGS))
def test_fused_linear_loss_and_gradients_equal_liger_fused_linear_grpo(setting):
    errors = parity_errors("liger", setting)
    assert max(errors.values()) <= REL_TOL, errors


def test_the_settings_are_not_degenerate():
    # Every mechanism must act on these inputs, or agreeing would prove nothing: some ratios
    # clip, OPSM rejects a sample, the vLLM modes truncate and mask.
    x = make_inputs()
    _, metrics = ftis_loss(
        x["logits"],
        x["tokens"],
        x["sampling"],
        x["advantages"],
        x["mask"],
        x["old"],
        options=our_options(SETTINGS["grpo/opsm"]),
    )
    assert 0 < metrics["filtered_frac"] < 1
    for mode, metric in (("token_truncate", "is_truncated_frac"), ("token_mask", "is_masked_frac")):
        _, metrics = ftis_loss(
            x["logits"],
            x["tokens"],
            x["sampling"],
            x["advantages"],
            x["mask"],
            x["old"],
            options=our_options(SETTINGS[f"grpo/vllm_is/{mode}"]),
        )
        assert 0 < metrics[metric] < 1, (mode, metrics[metric])
    _, metrics = ftis_loss(
        x["logits"],
        x["tokens"],
        x["sampling"],
        x["advantages"],
        x["mask"],
        x["old"],
        options=our_options(SETTINGS["grpo"]),
    )
    assert metrics["clip_frac"] > 0


@pytest.mark.parametrize(
    "setting",
    ["cispo/sequence/eps_high=1.02", "sapo/sequence", "vespo/sequence/beta/bias_corrected_kl"],
)
def test_a_sequence_level_ratio_changes_trls_own_loss_so_the_parity_proves_it(setting):
    # Agreeing at the sequence level proves the sequence ratio only where TRL's result differs
    # from its token-level one (vespo: only through the bias-corrected KL term).
    x = make_inputs()
    token = {**SETTINGS[setting], "importance_sampling_level": "token"}
    (seq_loss, seq_grad), (tok_loss, tok_grad) = run_trl(x, SETTINGS[setting]), run_trl(x, token)
    assert relative_error(seq_grad, tok_grad) > 1e-3 or relative_error(seq_loss, tok_loss) > 1e-3
