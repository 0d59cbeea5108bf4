"""The Triton row kernels (`ftis_kernels/kernels/logp_lse.py`) as the test matrix sees them; their
numerics are tested through the ops (tests/test_ftis_loss.py, test_ftis_linear_loss.py)."""

from __future__ import annotations

import pytest
import torch

from ftis_kernels.kernels import logp_lse
from tests.cases import implementations


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_the_backward_copies_the_hidden_states_of_rows_with_gradient_zeros_elsewhere(
    dtype, entropy_grad, monkeypatch, device
):
    # The lm-head ops' weight gradient reads a chunk's hidden states through this copy: a row
    # without gradient (masked, filtered) is zeros there whatever it holds, and is not read.
    if "triton" not in implementations(device):
        pytest.skip("the Triton kernel runs compiled on CUDA or under the interpreter")
    monkeypatch.setattr(logp_lse, "MAX_BLOCK_V", 16)  # H = 37 takes three blocks
    R, V, H = 6, 20, 37
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, R, V, generator=gen).to(device, dtype)
    tokens = torch.randint(0, V, (1, R), generator=gen).to(device)
    row_max = x.float().amax(-1)
    log_sum = torch.logsumexp(x.float() - row_max[..., None], -1)
    coef = torch.tensor([[0.5, 0.0, -1.0, 0.0, 0.0, 2.0]], device=device)
    ecoef = torch.tensor([[0.0, 0.0, 0.0, 0.3, 0.0, 0.0]], device=device) if entropy_grad else None
    entropy = torch.ones(1, R, device=device) if entropy_grad else None
    live = (coef[0] != 0) | (ecoef[0] != 0 if entropy_grad else False)
    rows = torch.randn(H, R, generator=gen).to(device, dtype).t()  # strides (1, R)
    rows[~live] = float("nan")
    args = (x, tokens, row_max, log_sum, coef, 0.7)
    want = logp_lse.logits_bwd(*args, torch.empty_like(x), entropy, ecoef)
    out = torch.full((R, H), 7.0, dtype=dtype, device=device)
    got = logp_lse.logits_bwd(*args, torch.empty_like(x), entropy, ecoef, rows=rows, rows_out=out)
    assert torch.equal(got, want)
    assert torch.equal(out[live], rows[live]) and torch.count_nonzero(out[~live]) == 0
    with pytest.raises(ValueError, match="rows and rows_out"):
        logp_lse.logits_bwd(*args, torch.empty_like(x), rows=rows)


def test_triton_interpreter_is_detected_through_the_kernels_heuristics():
    # Guards the CPU test matrix: a wrapper (triton.heuristics) around the kernels must not hide
    # the interpreter, or every "triton" case would silently run nothing but the torch path.
    if torch.cuda.is_available():
        pytest.skip("compiled Triton on CUDA")
    assert logp_lse.triton_is_interpreted()
    assert implementations(torch.device("cpu")) == ["triton", "torch"]
