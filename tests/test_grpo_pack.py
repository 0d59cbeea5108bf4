"""The GRPO driver on packed micro-batches: the padded layout's logits, loss, metrics and gradients.

Tolerances, float32: logits and gradients rtol 1.3e-6, atol 1e-5 (logits, magnitude ~1) and 1e-6
(gradients, magnitude <= 0.3); the step's scalars rel 1e-5. The layouts differ in matmul shapes
and summation order only, so they agree to a few float32 ulps; a sequence that sees another one
moves its logits by ~0.1.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ftis_kernels.grpo.config import build_config, describe_keys
from ftis_kernels.grpo.exchange import Sample
from ftis_kernels.grpo.models import apply_lora, build_model
from ftis_kernels.grpo.task import ArithmeticTask, format_prompt, make_prompt_id
from ftis_kernels.grpo.tokenizer import build_tokenizer
from ftis_kernels.grpo.train import (
    build_batch,
    build_packed_batch,
    completion_logits,
    grpo_update,
    pack_rows,
    packed_completion_logits,
    packing_keeps_sequences_apart,
)
from ftis_kernels.options import FTISOptions

TASK = ArithmeticTask(seed=0)
TOKENIZER = build_tokenizer(TASK.vocabulary_text())
V = len(TOKENIZER)
PAD = TOKENIZER.pad_token_id
CPU = torch.device("cpu")
# Completion lengths: a one-token completion, unequal lengths; prompts differ in length too.
LENGTHS = (1, 7, 3, 12, 5, 2)
ROW_TOKENS = 100  # prompts are 39-48 tokens: rows of one and two sequences, most with a pad tail
LOGITS_TOL = dict(rtol=1.3e-6, atol=1e-5)
GRAD_TOL = dict(rtol=1.3e-6, atol=1e-6)


def _prompt(pid: int) -> list[int]:
    return TOKENIZER(format_prompt(TASK.problem(pid).question))["input_ids"]


def _samples() -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    return [
        Sample(
            make_prompt_id("train", i),
            0,
            torch.randint(3, V, (n,), generator=g, dtype=torch.int32),
            -torch.rand(n, generator=g) * 8,  # IS weights above the cap, KL above the threshold
            float(i % 2),
            float(i) - 2.5,
        )
        for i, n in enumerate(LENGTHS)
    ]


def _model(kind: str, attn: str = "sdpa"):
    model = build_model("tiny", TOKENIZER, seed=0)
    model.set_attn_implementation(attn)
    if kind == "lora":
        model = apply_lora(model, r=4, alpha=8.0, seed=0)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():  # peft starts B at 0: make the adapter change the logits
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _real_token_logits_packed(logits: torch.Tensor, batch, samples) -> torch.Tensor:
    """Logits (R, W, V) of a packed batch at every real token, sample after sample."""
    flat = logits.reshape(-1, logits.shape[-1])
    firsts = batch["scored"][batch["cu_seqlens"][:-1]].tolist()
    out = []
    for s, first in zip(samples, firsts):
        start = first - len(_prompt(s.prompt_id)) + 1
        out.append(flat[start : start + len(_prompt(s.prompt_id)) + s.n_tokens])
    return torch.cat(out)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_packed_forward_gives_the_padded_logits_at_every_real_token(kind, attn):
    model, samples = _model(kind, attn), _samples()
    padded = build_batch(samples, _prompt, PAD, CPU)
    packed = build_packed_batch(samples, _prompt, PAD, CPU, ROW_TOKENS)
    assert 1 < packed["input_ids"].shape[0] < len(samples)  # several rows, some shared
    assert int((packed["position_ids"] == 0).sum()) > len(samples)  # and pad tails
    with torch.no_grad():
        out_padded = model(
            input_ids=padded["input_ids"],
            attention_mask=padded["attention_mask"],
            position_ids=padded["position_ids"],
            use_cache=False,
        ).logits
        out_packed = model(
            input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False
        ).logits
        scored_padded = completion_logits(model, padded)[padded["mask"]]
        scored_packed = packed_completion_logits(model, packed)
    torch.testing.assert_close(
        _real_token_logits_packed(out_packed, packed, samples),
        out_padded[padded["attention_mask"].bool()],
        **LOGITS_TOL,
    )
    assert scored_packed.shape == (sum(LENGTHS), V)
    torch.testing.assert_close(scored_packed, scored_padded, **LOGITS_TOL)
    torch.testing.assert_close(packed["tokens"], padded["tokens"][padded["mask"]])


def _step(model, samples, options, pack_row_tokens):
    """grpo_update's stats and the gradient it stepped with (SGD; no clipping)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=1.0)
    grads = []
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: grads.extend(p.grad.clone() for p in params)
    )
    stats = grpo_update(
        model,
        optimizer,
        samples,
        _prompt,
        options,
        micro_batch=4,
        pad_id=PAD,
        grad_clip=1e9,
        device=CPU,
        pack_row_tokens=pack_row_tokens,
    )
    return stats, grads


@pytest.mark.parametrize(
    ("kind", "loss_type"), [("full", "grpo"), ("full", "dr_grpo"), ("lora", "dapo")]
)
def test_packed_step_gives_the_padded_loss_metrics_and_gradients(kind, loss_type):
    samples = _samples()
    options = FTISOptions.preset("f-tis", loss_type=loss_type, kl_threshold=5.0)
    padded, padded_grads = _step(_model(kind), samples, options, None)
    packed, packed_grads = _step(_model(kind), samples, options, ROW_TOKENS)
    assert 0 < padded["filtered_frac"] < 1 and padded["is_truncated_frac"] > 0
    assert padded["skipped"] == packed["skipped"] == 0
    assert packed == pytest.approx(padded, rel=1e-5)
    assert len(packed_grads) == len(padded_grads) > 0
    assert max(float(g.abs().max()) for g in padded_grads) > 1e-3
    for a, b in zip(packed_grads, padded_grads):
        torch.testing.assert_close(a, b, **GRAD_TOL)


@given(
    st.lists(st.integers(1, 60), min_size=1, max_size=30),
    st.integers(1, 100),
)
def test_pack_rows_places_every_sequence_once_within_the_row_length(lengths, row_tokens):
    rows = pack_rows(lengths, row_tokens)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    for row in rows:
        assert row == sorted(row)
        assert len(row) == 1 or sum(lengths[i] for i in row) <= row_tokens


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packing_check_accepts_the_preset_models_and_refuses_one_that_mixes_sequences(attn):
    assert packing_keeps_sequences_apart(_model("full", attn), V)
    assert packing_keeps_sequences_apart(_model("lora", attn), V)

    class IgnoresPositions(torch.nn.Module):
        """A model whose attention does not see restarting positions: one causal sequence."""

        def __init__(self, model):
            super().__init__()
            self.model = model

        def get_input_embeddings(self):
            return self.model.get_input_embeddings()

        def forward(self, input_ids, position_ids=None, **kwargs):
            return self.model(input_ids=input_ids, **kwargs)

    assert not packing_keeps_sequences_apart(IgnoresPositions(_model("full", attn)), V)


def test_pack_is_a_described_config_key_on_by_default():
    cfg = build_config(preset="demo")
    assert cfg.pack is True and cfg.pack_row_tokens >= 1
    keys = {key: meaning for key, _, _, meaning in describe_keys()}
    assert "packed" in keys["pack"] and "row" in keys["pack_row_tokens"]
