"""The Triton row kernels (`ftis_kernels/kernels/logp_lse.py`) as the test matrix sees them; their
numerics are tested through the ops (tests/test_ftis_loss.py, test_ftis_linear_loss.py)."""

from __future__ import annotations

import pytest
import torch

from ftis_kernels.kernels import logp_lse
from tests.cases import implementations


def test_triton_interpreter_is_detected_through_the_kernels_heuristics():
    # Guards the CPU test matrix: a wrapper (triton.heuristics) around the kernels must not hide
    # the interpreter, or every "triton" case would silently run nothing but the torch path.
    if torch.cuda.is_available():
        pytest.skip("compiled Triton on CUDA")
    assert logp_lse.triton_is_interpreted()
    assert implementations(torch.device("cpu")) == ["triton", "torch"]
