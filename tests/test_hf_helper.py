"""`integrations.hf.lm_head_inputs` on a tiny Qwen2 built from a config: `ftis_linear_loss` on what
it returns must equal `ftis_loss` on the model's own logits, in value and in the gradient of every
trainable parameter, plain or with LoRA adapters (on the lm-head or not, with dropout, merged,
disabled, several at once, modules_to_save)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from ftis_kernels import ftis_linear_loss, ftis_loss
from ftis_kernels.integrations.hf import lm_head_inputs
from tests import numerics

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

B, L, V, START = 3, 11, 97, 6
TOL = numerics.Tol(rtol=1e-4, atol=1e-7)


def tiny_qwen2(tied: bool = True, seed: int = 0, **config) -> nn.Module:
    cfg = transformers.Qwen2Config(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        **config,
    )
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(cfg).float()


def with_lora(model: nn.Module, targets=("q_proj", "v_proj", "lm_head"), **lora) -> nn.Module:
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), **lora)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's notice about tied lm-head adapters
        model = peft.get_peft_model(copy.deepcopy(model), config)
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # non-zero, so that the adapters change the logits
            nn.init.normal_(p, std=0.2)
    return model


def batch(seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, L), generator=g)
    attention = torch.ones(B, L, dtype=torch.long)
    attention[0, :2] = 0  # left padding
    completion = torch.zeros(B, L, dtype=torch.bool)
    completion[:, START:] = True
    completion[1, L - 2 :] = False  # right padding of one completion
    gen = -torch.rand(B, L, generator=g) * 3.0
    adv = torch.tensor([1.0, -0.5, 0.3])
    return ids, attention, completion, gen, adv


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def via_model_logits(model, ids, attention, completion, gen, adv, seed=3, **opts):
    """ftis_loss on the model's own logits, sliced to the completion: the ground truth."""
    torch.manual_seed(seed)
    logits = model(input_ids=ids, attention_mask=attention).logits
    mask = completion[:, START:] & (attention[:, START:] != 0)
    loss, metrics = ftis_loss(
        logits[:, START - 1 : L - 1], ids[:, START:], gen[:, START:], adv, mask, **opts
    )
    return loss, metrics, torch.autograd.grad(loss, trainable(model))


def via_helper(model, ids, attention, completion, gen, adv, seed=3, chunk_size=4, **opts):
    torch.manual_seed(seed)
    x = lm_head_inputs(model, ids, attention, completion)
    assert x.start == START and x.tokens.shape == (B, L - START) and x.mask.dtype == torch.bool
    loss, metrics = ftis_linear_loss(
        x.hidden,
        x.weight,
        x.tokens,
        gen[:, x.start :],
        adv,
        x.mask,
        bias=x.bias,
        chunk_size=chunk_size,
        **opts,
    )
    return loss, metrics, torch.autograd.grad(loss, trainable(model))


def assert_same(got, want):
    loss, metrics, grads = got
    w_loss, w_metrics, w_grads = want
    numerics.assert_close("loss", loss, w_loss, TOL)
    numerics.assert_close("logp", metrics["logp"], w_metrics["logp"], numerics.Tol(1e-4, 1e-5))
    assert torch.equal(metrics["filtered"], w_metrics["filtered"])
    assert len(grads) == len(w_grads) > 0
    for i, (g, w) in enumerate(zip(grads, w_grads)):
        numerics.assert_close(f"grad[{i}]", g, w, numerics.Tol(1e-3, 1e-6))


@pytest.mark.parametrize("tied", [True, False])
def test_plain_model_matches_its_own_logits(tied):
    model = tiny_qwen2(tied)
    data = batch()
    assert_same(via_helper(model, *data), via_model_logits(model, *data))


def test_lm_head_bias_is_returned_and_trained():
    model = tiny_qwen2(tied=False)
    model.lm_head = nn.Linear(32, V, bias=True)
    nn.init.normal_(model.lm_head.bias, std=0.5)
    data = batch()
    x = lm_head_inputs(model, *data[:3])
    assert x.bias is model.lm_head.bias
    assert_same(
        via_helper(model, *data, temperature=0.8), via_model_logits(model, *data, temperature=0.8)
    )


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), ("q_proj", "v_proj", "lm_head")])
@pytest.mark.parametrize("tied", [True, False])
def test_lora_model_matches_its_own_logits(targets, tied):
    model = with_lora(tiny_qwen2(tied), targets)
    data = batch()
    x = lm_head_inputs(model, *data[:3])
    rank = 4 if "lm_head" in targets else 0
    assert x.hidden.shape[-1] == x.weight.shape[1] == 32 + rank
    assert_same(via_helper(model, *data), via_model_logits(model, *data))


def test_lora_dropout_on_the_lm_head_draws_the_model_masks():
    """With dropout the effective weight W + s B A is wrong; the augmented map is exact."""
    model = with_lora(tiny_qwen2(), lora_dropout=0.3)
    model.train()
    data = batch()
    assert_same(via_helper(model, *data, seed=7), via_model_logits(model, *data, seed=7))


def test_several_active_adapters_are_summed():
    model = with_lora(tiny_qwen2())
    model.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=2, target_modules=["lm_head"]))
    for name, p in model.named_parameters():
        if "lora_B.second" in name:
            nn.init.normal_(p, std=0.2)
    model.base_model.set_adapter(["default", "second"])
    data = batch()
    assert lm_head_inputs(model, *data[:3]).weight.shape[1] == 32 + 4 + 2
    assert_same(via_helper(model, *data), via_model_logits(model, *data))


def test_disabled_and_merged_adapters_are_the_base_layer():
    model = with_lora(tiny_qwen2())
    data = batch()

    def head_logits_match_model_logits() -> torch.Tensor:
        x = lm_head_inputs(model, *data[:3])
        assert x.hidden.shape[-1] == 32  # no LoRA columns: the base layer alone
        want = model(input_ids=data[0], attention_mask=data[1]).logits[:, START - 1 : L - 1]
        numerics.assert_close("logits", x.hidden @ x.weight.T, want, numerics.Tol(1e-5, 1e-5))
        return want

    with model.disable_adapter():
        base = head_logits_match_model_logits()
    model.merge_adapter()
    merged = head_logits_match_model_logits()
    assert not torch.allclose(base, merged)  # the merged adapter is in the weight


def test_modules_to_save_lm_head_follows_the_trained_copy():
    model = tiny_qwen2(tied=False)
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    model = peft.get_peft_model(model, config)
    head = model.base_model.model.lm_head
    with torch.no_grad():
        head.modules_to_save["default"].weight.add_(0.5)
    data = batch()
    assert lm_head_inputs(model, *data[:3]).weight is head.modules_to_save["default"].weight
    assert_same(via_helper(model, *data), via_model_logits(model, *data))


def test_trl_layout_completion_mask_over_the_last_columns():
    model = tiny_qwen2()
    ids, attention, completion, gen, adv = batch()
    full = lm_head_inputs(model, ids, attention, completion)
    trl = lm_head_inputs(model, ids, attention, completion[:, START:])
    assert trl.start == full.start == START
    assert torch.equal(trl.mask, full.mask) and torch.equal(trl.tokens, full.tokens)
    assert torch.equal(trl.hidden, full.hidden)


def test_dora_on_the_lm_head_is_refused():
    model = with_lora(tiny_qwen2(), use_dora=True)
    with pytest.raises(ValueError, match="^model: .*variant"):
        lm_head_inputs(model, *batch()[:3])


def test_softcapped_logits_are_refused():
    model = tiny_qwen2()
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="^model: .*final_logit_softcapping"):
        lm_head_inputs(model, *batch()[:3])


@pytest.mark.parametrize(
    "arch, field, config",
    [
        (
            "RecurrentGemma",
            "logits_soft_cap",
            dict(num_hidden_layers=3, lru_width=32, attention_window_size=16, head_dim=16),
        ),
        (
            "FalconH1",
            "lm_head_multiplier",
            dict(
                num_hidden_layers=2,
                mamba_d_ssm=32,
                mamba_n_heads=2,
                mamba_d_head=16,
                mamba_d_state=8,
                mamba_chunk_size=8,
                lm_head_multiplier=3.0,
            ),
        ),
    ],
)
def test_architectures_that_transform_the_lm_head_output_are_refused(arch, field, config):
    """RecurrentGemma soft-caps its logits, Falcon-H1 scales them: not the lm-head's output."""
    if not hasattr(transformers, f"{arch}ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no {arch}")
    cfg = getattr(transformers, f"{arch}Config")(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        **config,
    )
    model = getattr(transformers, f"{arch}ForCausalLM")(cfg)
    with pytest.raises(ValueError, match=f"^model: .*{field}"):
        lm_head_inputs(model, *batch()[:3])


@pytest.mark.parametrize(
    "arch, match",
    [
        ("Dory", "logit_scale"),  # learned per-token scale inside its nn.Linear lm-head
        ("Roberta", "inside another module"),  # dense, gelu, norm before lm_head.decoder
        # dense, gelu, norm before generator_lm_head: named as generator_predictions, or (where
        # transformers 4.x finds no decoder inside it) as the electra module beside the head
        ("Electra", "holds parameters beside the decoder and the lm-head"),
    ],
)
def test_heads_that_are_not_one_linear_map_on_the_decoder_output_are_refused(arch, match):
    """Their logits differ from hidden @ weight.T with the output embedding the helper found."""
    if not hasattr(transformers, f"{arch}ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no {arch}")
    config = dict(
        vocab_size=V,
        hidden_size=32,
        embedding_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        is_decoder=True,
        pad_token_id=0,
    )
    cfg = getattr(transformers, f"{arch}Config")(**config)
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")(cfg)
    with pytest.raises(ValueError, match=f"^model: .*{match}"):
        lm_head_inputs(model, *batch()[:3])


def test_completion_in_column_zero_is_refused():
    model = tiny_qwen2()
    ids, attention, completion, _, _ = batch()
    completion[2, 0] = True
    with pytest.raises(ValueError, match="^completion_mask: "):
        lm_head_inputs(model, ids, attention, completion)
    with pytest.raises(ValueError, match="^completion_mask: "):
        lm_head_inputs(model, ids, attention, torch.zeros_like(completion))
