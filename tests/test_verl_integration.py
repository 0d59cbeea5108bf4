"""F-TIS as a verl policy loss, called through verl's own entry point (core_algos.get_policy_loss_fn)
with verl's own config objects (FSDPActorConfig, PolicyLossConfig)."""  # noqa: E501

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl.trainer.ppo.core_algos")

from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config import FSDPActorConfig, PolicyLossConfig  # noqa: E402

from ftis_kernels import ftis_loss  # noqa: E402
from ftis_kernels.integrations.verl import FTISPolicyLossConfig  # noqa: E402

AGG_MODES = [
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "token-sum",
]


def actor_config(policy_loss, agg_mode, clip_ratio_c=3.0, **global_batch_info):
    config = FSDPActorConfig(
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=2,
        rollout_n=1,
        clip_ratio=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=agg_mode,
        policy_loss=policy_loss,
    )
    config.global_batch_info.update(global_batch_info)
    return config


def batch(B=3, T=6, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = torch.arange(T)[None] < torch.tensor([T, 4, 2][:B])[:, None]
    old = torch.log_softmax(logits + 0.3 * torch.randn(B, T, V, generator=g), -1)
    old = old.gather(-1, tokens[..., None])[..., 0]
    adv = torch.randn(B, generator=g)
    return logits, tokens, mask, old, adv


def verl_loss(mode, config, logits, tokens, mask, old, adv):
    logits = logits.clone().requires_grad_()
    log_prob = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    token_adv = adv[:, None].expand_as(old) * mask
    fn = core_algos.get_policy_loss_fn(mode)
    loss, metrics = fn(
        old_log_prob=old,
        log_prob=log_prob,
        advantages=token_adv,
        response_mask=mask.float(),
        loss_agg_mode=config.loss_agg_mode,
        config=config,
        rollout_is_weights=None,
    )
    (grad,) = torch.autograd.grad(loss, logits)
    return loss, grad, metrics


@pytest.mark.parametrize("agg_mode", AGG_MODES)
@pytest.mark.parametrize(
    "global_info", [{}, {"dp_size": 2, "batch_num_tokens": 30, "global_batch_size": 5}]
)
def test_reduction_setting_equals_verls_vanilla_loss(agg_mode, global_info):
    data = batch()
    vanilla = actor_config(PolicyLossConfig(loss_mode="vanilla"), agg_mode, **global_info)
    ours = actor_config(
        FTISPolicyLossConfig(ftis={"is_mode": "none", "filter": None}), agg_mode, **global_info
    )
    want, want_grad, _ = verl_loss("vanilla", vanilla, *data)
    got, got_grad, metrics = verl_loss("ftis", ours, *data)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-6, atol=1e-7)
    assert "actor/pg_clipfrac" in metrics


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_dual_clip_equals_verls(agg_mode):
    # A < 0 with R = e^2 > clip_ratio_c = 3 on one token: verl's vanilla loss caps it (dual-clip).
    logits, tokens, mask, old, adv = batch(seed=1)
    log_prob = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    adv[0] = -1.0
    old[0, 0] = log_prob[0, 0] - 2.0
    vanilla = actor_config(PolicyLossConfig(loss_mode="vanilla"), agg_mode)
    ours = actor_config(FTISPolicyLossConfig(ftis={"is_mode": "none", "filter": None}), agg_mode)
    want, want_grad, _ = verl_loss("vanilla", vanilla, logits, tokens, mask, old, adv)
    got, got_grad, _ = verl_loss("ftis", ours, logits, tokens, mask, old, adv)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-6, atol=1e-7)


def test_settings_verl_decides_or_the_op_cannot_express_are_refused():
    from ftis_kernels.integrations.verl import ftis_options

    for name, value in [
        ("delta", 2.0),
        ("entropy_coef", 0.01),
        ("beta", 0.1),
        ("temperature", 0.7),
    ]:
        config = actor_config(FTISPolicyLossConfig(ftis={name: value}), "token-mean")
        with pytest.raises(ValueError, match=f"^policy_loss.ftis.{name}: set by verl"):
            ftis_options(config, "token-mean", T=4)
    config = actor_config(FTISPolicyLossConfig(), "token-mean", clip_ratio_c=1.1)  # < 1.28
    with pytest.raises(ValueError, match="^clip_ratio_c: "):
        ftis_options(config, "token-mean", T=4)


def test_filter_and_tis_on_equal_our_op():
    logits, tokens, mask, old, adv = batch(seed=3)
    opts = {"is_mode": "tis", "is_cap": 1.5, "filter": "negative_offpolicy", "kl_threshold": 0.05}
    config = actor_config(FTISPolicyLossConfig(ftis=opts), "seq-mean-token-mean")
    got, got_grad, metrics = verl_loss("ftis", config, logits, tokens, mask, old, adv)
    x = logits.clone().requires_grad_()
    want, want_metrics = ftis_loss(
        x,
        tokens,
        old,
        adv,
        mask,
        old,
        loss_type="grpo",
        epsilon=0.2,
        epsilon_high=0.28,
        delta=3.0,
        **opts,
    )
    (want_grad,) = torch.autograd.grad(want, x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-7)
    assert metrics["actor/ftis_filtered_frac"] == pytest.approx(
        float(want_metrics["filtered_frac"])
    )
    assert (
        0 < metrics["actor/ftis_filtered_frac"] < 1
    )  # the filter took one side and left the other


def test_varying_token_advantages_and_rollout_weights_are_refused():
    logits, tokens, mask, old, adv = batch()
    config = actor_config(FTISPolicyLossConfig(), "token-mean")
    log_prob = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    fn = core_algos.get_policy_loss_fn("ftis")
    token_adv = torch.randn_like(old)
    with pytest.raises(ValueError, match="^advantages: "):
        fn(old, log_prob, token_adv, mask.float(), "token-mean", config)
    with pytest.raises(ValueError, match="^rollout_is_weights: "):
        fn(
            old,
            log_prob,
            adv[:, None].expand_as(old),
            mask.float(),
            "token-mean",
            config,
            rollout_is_weights=torch.ones_like(old),
        )


def test_example_config_builds_the_policy_loss_and_its_options():
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    from ftis_kernels.integrations.verl import ftis_options

    example = OmegaConf.load("examples/verl_ftis.yaml").actor_rollout_ref.actor
    policy_loss = omega_conf_to_dataclass(example.policy_loss)
    assert isinstance(policy_loss, FTISPolicyLossConfig) and policy_loss.loss_mode == "ftis"
    config = actor_config(policy_loss, example.loss_agg_mode)
    opt = ftis_options(config, config.loss_agg_mode, T=8)
    assert (opt.loss_type, opt.filter, opt.is_cap) == ("grpo", "negative_offpolicy", 2.0)
