"""One forward and backward of each op captured in a CUDA graph and replayed: the loss, metrics
and gradients of eager on the same inputs, for new values copied into the captured inputs (a
graph replays fixed addresses; a training loop copies each batch into them).

Capture needs an op without host synchronisation and with shapes fixed by the inputs' shapes:
no `.item()`, `.tolist()`, `bool(tensor)`, `nonzero()` or boolean-mask indexing on the way from
the inputs to the gradients. The ops then check the values on the device only
(value_check="deferred"); the verdict is a metric, `value_faults`, replayed like the others.
"""

from __future__ import annotations

import pytest
import torch

import ftis_kernels
from ftis_kernels import ftis_linear_loss, ftis_loss
from tests.cases import make_case

pytestmark = pytest.mark.cuda

B, T, V, H = 4, 16, 1000, 64
OPTIONS = dict(beta=0.04, entropy_coef=0.01, filter="negative_offpolicy", kl_threshold=0.5)
CHECK = dict(value_check="deferred")


ROWS = ("tokens", "gen_logprobs", "advantages", "mask", "old_logprobs", "ref_logprobs")
LEAVES = {"ftis_loss": ("logits",), "ftis_linear_loss": ("hidden", "weight", "bias")}


def _values(op: str, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """The inputs of one step: the leaves (in `dtype`) and the rows."""
    case = make_case(
        B, T, V, H=H, seed=seed, exact=False, mask="random", with_ref=True, device="cuda"
    )
    values = {name: getattr(case, name).to(dtype) for name in LEAVES[op]}
    values.update(zip(ROWS, case.inputs))
    return values


def _static(op: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The captured inputs, filled from seed 0; the leaves require grad."""
    static = {k: v.clone() for k, v in _values(op, dtype, 0).items()}
    for name in LEAVES[op]:
        static[name].requires_grad_()
    return static


def _refill(op: str, dtype: torch.dtype, static: dict[str, torch.Tensor], seed: int) -> None:
    """The inputs of `seed` into the captured inputs, at the same addresses."""
    with torch.no_grad():
        for name, value in _values(op, dtype, seed).items():
            static[name].copy_(value)


def _step(op: str, static: dict[str, torch.Tensor], **kw) -> tuple[torch.Tensor, ...]:
    """(loss, kl, filtered, entropy, value_faults, *gradients) of one forward and backward."""
    rows = [static[name] for name in ROWS]
    leaves = [static[name] for name in LEAVES[op]]
    if op == "ftis_loss":
        loss, metrics = ftis_loss(*leaves, *rows, **OPTIONS, **CHECK, **kw)
    else:
        h, w, b = leaves
        loss, metrics = ftis_linear_loss(
            h, w, *rows, bias=b, chunk_size=32, **OPTIONS, **CHECK, **kw
        )
    grads = torch.autograd.grad(loss, leaves)
    names = ("kl", "filtered", "entropy", "value_faults")
    return (loss, *(metrics[name] for name in names), *grads)


def _capture(op: str, static: dict[str, torch.Tensor], **kw):
    """(the graph, its output tensors): warm-up on a side stream (Triton's compile, cuBLAS's
    handles, the allocator's pools), then one captured step."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            _step(op, static, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = _step(op, static, **kw)
    return graph, outputs


@pytest.mark.parametrize(
    "op,dtype,kw",
    [
        ("ftis_loss", torch.float32, {}),
        ("ftis_loss", torch.bfloat16, {}),
        ("ftis_loss", torch.float32, {"inplace_backward": "force"}),
        ("ftis_linear_loss", torch.float32, {"grad_in_forward": False}),
        ("ftis_linear_loss", torch.float32, {"grad_in_forward": True}),
        ("ftis_linear_loss", torch.bfloat16, {"grad_in_forward": True}),
    ],
)
def test_a_captured_step_replays_with_the_eager_result(op, dtype, kw):
    static = _static(op, dtype)
    graph, outputs = _capture(op, static, **kw)
    # The same kernels on the same values: bitwise for the row kernels; the lm-head's matmuls
    # may take another cuBLAS algorithm inside a capture, so there the dtype's default closeness
    # (an ulp or so).
    tol = dict(rtol=0, atol=0) if op == "ftis_loss" else {}
    losses = []
    for seed in (1, 2):
        _refill(op, dtype, static, seed)
        graph.replay()
        got = [x.detach().clone() for x in outputs]
        _refill(op, dtype, static, seed)  # the in-place backward wrote its gradient there
        want = _step(op, static, **kw)
        names = ("loss", "kl", "filtered", "entropy", "value_faults")
        names += tuple(f"grad {k}" for k in LEAVES[op])
        for name, a, b in zip(names, got, want):
            torch.testing.assert_close(a, b, **tol, msg=lambda m: f"seed {seed} {name}: {m}")  # noqa: B023
        ftis_kernels.raise_on_bad_values({"value_faults": got[4]})  # valid inputs: none recorded
        losses.append(float(got[0]))
    assert losses[0] != losses[1], "the replay did not read the new inputs"
