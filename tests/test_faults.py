"""The driver's promises under faults (issue 13), one test per promise, grouped by what fails."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ftis_kernels.grpo.exchange import Sample
from ftis_kernels.grpo.models import build_model
from ftis_kernels.grpo.task import ArithmeticTask, format_prompt, make_prompt_id
from ftis_kernels.grpo.tokenizer import build_tokenizer
from ftis_kernels.grpo.train import grpo_update, skip_cause
from ftis_kernels.options import FTISOptions

TASK = ArithmeticTask(seed=0)
TOKENIZER = build_tokenizer(TASK.vocabulary_text())


def _prompt(pid: int) -> list[int]:
    return TOKENIZER(format_prompt(TASK.problem(pid).question))["input_ids"]


# -- poisoned updates: a non-finite loss or gradient never reaches the weights (issue 13.5) -------
def _batch(poisoned: bool) -> list[Sample]:
    """Three peer samples with positive advantages; `poisoned`: the first claims log pi_gen =
    -100 at one token (the issue's sample: the parser accepts it, VIS's weight overflows)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(3):
        tokens = torch.randint(3, len(TOKENIZER), (5,), generator=g, dtype=torch.int32)
        out.append(Sample(make_prompt_id("train", i), 1, tokens, -torch.rand(5, generator=g) * 3,
                          1.0, 1.0 + i))
    if poisoned:
        out[0].logprobs[2] = -100.0
    return out


def _update(model, optimizer, samples, loss: str) -> dict[str, float]:
    return grpo_update(model, optimizer, samples, _prompt, FTISOptions.for_variant(loss),
                       micro_batch=2, pad_id=TOKENIZER.pad_token_id, grad_clip=1.0,
                       device=torch.device("cpu"))


@pytest.mark.parametrize("loss", ["vis", "f-vis"])
def test_poisoned_peer_sample_skips_the_step_and_changes_no_parameter_or_optimizer_state(loss):
    model = build_model("tiny", TOKENIZER, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert _update(model, optimizer, _batch(poisoned=False), loss)["skipped"] == 0.0
    params = {k: v.clone() for k, v in model.state_dict().items()}
    state = {i: {k: v.clone() for k, v in s.items()} for i, s in
             enumerate(optimizer.state_dict()["state"].values())}
    stats = _update(model, optimizer, _batch(poisoned=True), loss)
    assert stats["skipped"] == 1.0
    assert skip_cause(stats) == "non-finite loss (-inf)"
    assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())
    after = list(optimizer.state_dict()["state"].values())
    assert all(torch.equal(state[i][k], v) for i, s in enumerate(after) for k, v in s.items())
    assert all(p.grad is None for p in model.parameters())
    assert _update(model, optimizer, _batch(poisoned=False), loss)["skipped"] == 0.0
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_non_finite_gradient_with_a_finite_loss_skips_the_step():
    model = build_model("tiny", TOKENIZER, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    next(model.parameters()).register_hook(lambda grad: grad * math.nan)
    stats = _update(model, optimizer, _batch(poisoned=False), "f-tis")
    assert math.isfinite(stats["loss"]) and stats["skipped"] == 1.0
    assert skip_cause(stats) == "non-finite gradient norm (nan)"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
