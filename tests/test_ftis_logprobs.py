"""`ftis_logprobs` against the float64 reference's log pi(token) and entropy (ref/ftis.py), from
logits and from hidden states, padded and packed, on both backends."""

from __future__ import annotations

import math

import pytest
import torch

from ftis_kernels import ftis_logprobs
from ftis_kernels.kernels import logp_lse, logp_lse_cpu
from ref import ref_ftis_loss
from tests import numerics
from tests.cases import backend, implementations, make_case


@pytest.fixture(autouse=True)
def small_vocab_blocks(monkeypatch):
    """Small blocks so that V = 37 still runs the multi-block loops."""
    monkeypatch.setattr(logp_lse, "MAX_BLOCK_V", 16)
    monkeypatch.setattr(logp_lse_cpu, "CPU_CHUNK_ELEMENTS", 64)


def oracle(logits64, tokens, mask, temperature):
    B, T, _ = logits64.shape
    gen = torch.zeros(B, T)
    _, metrics = ref_ftis_loss(
        logits64,
        tokens,
        gen,
        torch.zeros(B),
        mask,
        compute_dtype=torch.float64,
        temperature=temperature,
    )
    return metrics["logp"], metrics["entropy"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("from_hidden", [False, True])
def test_logprobs_and_entropy_match_the_reference(dtype, from_hidden, device):
    case = make_case(3, 5, 37, H=6, seed=1)
    want_logp, want_ent = oracle(case.logits, case.tokens, case.mask, 0.7)  # exact logits
    case = case.to(device)
    tokens, mask = case.tokens, case.mask
    hidden, weight, bias = case.hidden, case.weight, case.bias
    args = (
        (hidden.to(dtype), tokens, weight.to(dtype))
        if from_hidden
        else (case.logits.to(dtype), tokens)
    )
    kwargs = dict(mask=mask, temperature=0.7)
    if from_hidden:
        kwargs.update(bias=bias.to(dtype), chunk_size=4)
    # The Triton kernels where this machine runs them for the device (compiled on CUDA,
    # interpreted on CPU under TRITON_INTERPRET=1), and the PyTorch path.
    for impl in implementations(device):
        with backend(impl):
            logp, entropy = ftis_logprobs(*args, **kwargs)
        numerics.assert_close(f"{impl} logp", logp, want_logp)
        numerics.assert_close(f"{impl} entropy", entropy, want_ent)


def test_packed_rows_give_the_padded_values():
    case = make_case(2, 6, 29, H=5, seed=2, mask="none")
    tokens, hidden, weight = case.tokens, case.hidden.float(), case.weight.float()
    lengths = [6, 3]
    packed_h = torch.cat([hidden[b, :n] for b, n in enumerate(lengths)])
    packed_t = torch.cat([tokens[b, :n] for b, n in enumerate(lengths)])
    padded = ftis_logprobs(hidden, tokens, weight)
    packed = ftis_logprobs(packed_h, packed_t, weight)
    for p, q in zip(packed, padded):
        assert torch.equal(p, torch.cat([q[b, :n] for b, n in enumerate(lengths)]))


@pytest.mark.parametrize("garbage", [float("nan"), float("inf")])
def test_hidden_states_at_masked_positions_are_never_read(garbage, device):
    case = make_case(3, 5, 37, H=6, seed=3, mask="empty_row", device=device)
    hidden, mask = case.hidden.float(), case.mask
    dirty = hidden.clone()
    dirty[~mask] = garbage
    for impl in implementations(device):
        with backend(impl):
            want = ftis_logprobs(hidden, case.tokens, case.weight.float(), mask=mask, chunk_size=4)
            got = ftis_logprobs(dirty, case.tokens, case.weight.float(), mask=mask, chunk_size=4)
        for g, w in zip(got, want):
            assert torch.equal(g, w) and torch.count_nonzero(g[~mask]) == 0, impl


def test_logprobs_carry_no_graph_and_refuse_bad_tokens():
    logits = torch.randn(2, 3, 11, requires_grad=True)
    tokens = torch.randint(0, 11, (2, 3))
    logp, entropy = ftis_logprobs(logits, tokens)
    assert not logp.requires_grad and not entropy.requires_grad
    tokens[1, 2] = 11
    with pytest.raises(ValueError, match=r"^tokens: .*\[0, 11\).*\(1, 2\): 11"):
        ftis_logprobs(logits, tokens)
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1, 2] = False
    ftis_logprobs(logits, tokens, mask=mask)  # a masked position is never read
    with pytest.raises(ValueError, match="^weight: "):
        ftis_logprobs(torch.randn(2, 3, 4), tokens, torch.randn(11, 5))


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"weight": torch.randn(64)}, "weight"),
        ({"weight": torch.randn(64, 3, 1)}, "weight"),
    ],
)
def test_bad_arguments_raise_a_one_line_error_naming_them(kwargs, argument):
    """As the losses' options: temperature is a finite number > 0 (inf gave NaN log-probs, True
    passed as 1); a weight of the wrong rank is described by its shape, in one line."""
    hidden, tokens = torch.randn(2, 3, 4), torch.randint(0, 11, (2, 3))
    kwargs = {"weight": torch.randn(11, 4), **kwargs}
    with pytest.raises(ValueError, match=rf"^{argument}: expected") as error:
        ftis_logprobs(hidden, tokens, **kwargs)
    assert "\n" not in str(error.value)
