"""torch.compile(fullgraph=True) of a whole training step's forward that ends in `ftis_loss` or
`ftis_linear_loss`: one graph, no graph break, the eager losses, metrics and weights.

The step runs a small language model (embedding, one hidden layer, lm-head) on a batch of
completions, calls the op with every optional input and the F-TIS filter on, and returns the loss
and metrics; backward goes through the compiled graph (AOTAutograd and the ops' registered
autograd) and SGD updates the weights, three times. Proof of no graph break is twofold:
fullgraph=True raises on any break, and `torch._dynamo.explain` counts graphs and breaks. The
same steps also may not recompile: the options are runtime scalars and only values change.
The choice of backend inside the traced region traces too, on CPU and as Dynamo sees Triton's
kernels on a machine with a GPU.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch import nn

import ftis_kernels
from ftis_kernels.kernels import logp_lse, select_backend
from tests.cases import backend as force_backend
from tests.cases import implementations, make_case

OPTIONS = dict(
    is_mode="tis",
    is_cap=2.0,
    filter="negative_offpolicy",
    kl_threshold=0.5,
    epsilon=0.2,
    epsilon_high=0.28,
    beta=0.04,
    temperature=0.9,
    loss_type="grpo",
)
STEPS = 3
CUDA = torch.cuda.is_available()
B, T, V, H = 4, 6, 37, 16


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.proj = nn.Linear(H, H)
        self.lm_head = nn.Linear(H, V, bias=False)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(self.embed(ids)))


def _batch(device, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (B, T), generator=g)
    logp = -torch.rand(B, T, generator=g) * 3 - 1.5  # near log(1/V)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[:, 0] = True
    batch = dict(
        inputs=torch.randint(0, V, (B, T), generator=g),
        tokens=tokens,
        gen_logprobs=logp - torch.rand(B, T, generator=g),
        advantages=torch.randn(B, generator=g),
        mask=mask,
        old_logprobs=logp + 0.1 * torch.randn(B, T, generator=g),
        ref_logprobs=logp + 0.1 * torch.randn(B, T, generator=g),
    )
    return {k: v.to(device) for k, v in batch.items()}


def _rows(batch):
    return (
        batch["tokens"],
        batch["gen_logprobs"],
        batch["advantages"],
        batch["mask"],
        batch["old_logprobs"],
        batch["ref_logprobs"],
    )


def step_ftis_loss(model: TinyLM, batch):
    logits = model.lm_head(model.hidden(batch["inputs"]))
    loss, metrics = ftis_kernels.ftis_loss(logits, *_rows(batch), **OPTIONS)
    return loss, metrics["kl"], metrics["filtered_frac"], metrics["is_weight_mean"]


def step_ftis_linear_loss(model: TinyLM, batch):
    linear = getattr(ftis_kernels, "ftis_linear_loss", None)
    loss, metrics = linear(
        model.hidden(batch["inputs"]), model.lm_head.weight, *_rows(batch), chunk_size=7, **OPTIONS
    )
    return loss, metrics["kl"], metrics["filtered_frac"], metrics["is_weight_mean"]


STEP_FNS = {"ftis_loss": step_ftis_loss, "ftis_linear_loss": step_ftis_linear_loss}


def _train(step_fn, model: TinyLM, device) -> list[tuple[torch.Tensor, ...]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    outputs = []
    for k in range(STEPS):
        out = step_fn(model, _batch(device, seed=k))
        optimizer.zero_grad()
        out[0].backward()
        optimizer.step()
        outputs.append(tuple(x.detach() for x in out))
    return outputs


def _skip_if_missing(op: str) -> None:
    if not hasattr(ftis_kernels, op):
        pytest.skip(f"ftis_kernels.{op} is not in this tree")


@pytest.mark.parametrize("op", list(STEP_FNS))
def test_compiled_training_step_has_one_graph_and_no_graph_break(op, device):
    _skip_if_missing(op)
    torch._dynamo.reset()
    torch.manual_seed(0)
    explanation = torch._dynamo.explain(STEP_FNS[op])(TinyLM().to(device), _batch(device))
    custom_ops = [
        str(node.target)
        for graph in explanation.graphs
        for node in graph.graph.nodes
        if "ftis_kernels" in str(node.target)
    ]
    print(
        f"\n{op}: graph_count={explanation.graph_count} "
        f"graph_break_count={explanation.graph_break_count} op_count={explanation.op_count} "
        f"break_reasons={explanation.break_reasons} custom_ops={custom_ops}"
    )
    # A break after the last op leaves one graph and a count of 0, but still a reason.
    assert explanation.graph_break_count == 0 and not explanation.break_reasons, (
        explanation.break_reasons
    )
    assert explanation.graph_count == 1
    assert len(custom_ops) == 1, f"expected the op as one opaque node, got {custom_ops}"


@pytest.mark.parametrize("impl", implementations(torch.device("cuda" if CUDA else "cpu")))
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("op", list(STEP_FNS))
def test_compiled_training_steps_match_eager_and_compile_once(op, backend, impl, device):
    _skip_if_missing(op)
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager_model = TinyLM().to(device)
    compiled_model = copy.deepcopy(eager_model)
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled_step = torch.compile(STEP_FNS[op], backend=counter, fullgraph=True)

    with force_backend(impl):
        want = _train(STEP_FNS[op], eager_model, device)
        got = _train(compiled_step, compiled_model, device)

    assert counter.frame_count == 1, f"{counter.frame_count} compilations for {STEPS} steps"
    # aot_eager runs the same kernels: bitwise. Inductor fuses the model's elementwise ops.
    tol = dict(rtol=0, atol=0) if backend == "aot_eager" else dict(rtol=1e-5, atol=1e-6)
    names = ("loss", "kl", "filtered_frac", "is_weight_mean")
    for k, (w, g) in enumerate(zip(want, got)):
        for name, a, b in zip(names, w, g):
            torch.testing.assert_close(b, a, **tol, msg=lambda m: f"step {k} {name}: {m}")  # noqa: B023
    assert any(float(w[2]) > 0 for w in want) and any(float(w[2]) < 1 for w in want), (
        "filter never decided"
    )
    for (name, a), b in zip(eager_model.named_parameters(), compiled_model.parameters()):
        torch.testing.assert_close(
            b,
            a,
            **tol,
            msg=lambda m: f"weight {name} after {STEPS} steps: {m}",  # noqa: B023
        )


def _backend_choice(x: torch.Tensor) -> torch.Tensor:
    """x plus a code of what `select_backend` chose for a CPU (1 or 2) and a CUDA (10 or 20)
    device: called inside the traced region, as the ops call it."""
    cpu = select_backend(torch.device("cpu"))
    cuda = select_backend(torch.device("cuda"))
    return x + (1 if cpu == "triton" else 2) + (10 if cuda == "triton" else 20)


# The same in a process whose kernels are compiled Triton `JITFunction`s (no TRITON_INTERPRET), with
# Dynamo told that Triton has a GPU (`has_triton()`, False on a machine without one): Dynamo then
# wraps the kernels as it does on a CUDA machine, as TritonKernelVariable, and an isinstance() or
# hasattr() on one inside the traced region is a graph break (under torch 2.11 on an H200,
# 2026-12-04: "isinstance() cannot determine type of argument TritonKernelVariable()").
AS_ON_A_GPU = """
import torch, torch.utils._triton
torch.utils._triton.has_triton = lambda: True
from tests.test_compile import _backend_choice
print(torch.compile(_backend_choice, fullgraph=True, backend="eager")(torch.zeros(1)).item())
"""


def test_backend_choice_traces_without_a_graph_break():
    torch._dynamo.reset()
    compiled = torch.compile(_backend_choice, fullgraph=True, backend="eager")
    assert compiled(torch.zeros(1)).item() == (11 if logp_lse.triton_is_interpreted() else 12)
    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", AS_ON_A_GPU],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # The kernels are compiled there: CPU tensors take the PyTorch path.
    assert done.stdout.split()[-1] == "12.0", done.stdout


def test_fake_tensors_take_the_custom_op_and_its_fake_implementation():
    """Eager calls on plain tensors run an autograd.Function; tensor subclasses (here
    FakeTensor, as torch.export and shape analysis use) take the custom op, whose fake
    implementation gives the outputs' shapes without running a kernel."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    case = make_case(2, 8, 50, seed=1)
    with FakeTensorMode() as mode:
        logits = mode.from_tensor(case.logits).requires_grad_()
        rows = [None if x is None else mode.from_tensor(x) for x in case.inputs]
        loss, metrics = ftis_kernels.ftis_loss(logits, *rows, value_check="deferred")
        (grad,) = torch.autograd.grad(loss, logits)
    assert isinstance(loss, FakeTensor) and loss.shape == ()
    assert metrics["kl"].shape == (2,) and metrics["logp"].shape == (2, 8)
    assert isinstance(grad, FakeTensor) and grad.shape == logits.shape
