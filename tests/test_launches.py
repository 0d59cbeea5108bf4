"""What one call costs a GPU besides its bytes: kernel launches and host reads, counted on the CPU.

On a GPU an op's time is its launches, its host synchronisations and its bytes; the first two
are counted here (`bench/launch_counts.py`: every Triton launch, interpreted, and every aten op
that would be a kernel on a GPU; views, allocations and metadata are free on a GPU and are not
counted; a host read is an aten op that returns a Python scalar, `.item()`, `bool()`, or a
`.tolist()`). The budgets are the ones the op is designed to: the default F-TIS `ftis_loss`
forward and backward in at most 6 launches and 1 host read (none in the forward), and
`ftis_linear_loss` at most its matmuls and 3 more launches per chunk, with no host read unless
it checks its inputs in the backward. A change that brings small ops or synchronisations back
fails here.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from bench.launch_counts import (
    FREE,
    HOST_READS,
    counting,
    cuda_kernels,
    cuda_profile,
    host_syncs,
    launches,
)
from ftis_kernels import ftis_linear_loss, ftis_loss
from ftis_kernels.kernels import logp_lse
from tests.cases import make_case

interpreted = pytest.mark.skipif(
    not logp_lse.INTERPRETED, reason="counts the Triton path's launches under the interpreter"
)


@interpreted
@pytest.mark.parametrize(
    "grad_in_forward,triton", [(None, (4, 1)), (False, (3, 1))], ids=["default", "three_pass"]
)
def test_default_ftis_loss_forward_and_backward_fit_the_launch_and_read_budget(
    grad_in_forward, triton
):
    # Default: mask counts, the row pass writing the gradient, per-sample, reduction; then one
    # launch in the backward. Three-pass: row pass, per-sample, reduction; the backward row pass.
    case = make_case(4, 16, 1000, seed=0)
    logits = case.logits.float().requires_grad_()
    with counting() as forward:
        loss, _ = ftis_loss(logits, *case.inputs, grad_in_forward=grad_in_forward)
    one = torch.ones(())  # the caller's incoming gradient, not the op's launch
    with counting() as backward:
        loss.backward(one)
    assert forward.counts["reads"] == 0, forward.ops
    assert backward.counts["reads"] <= 1
    total = launches(forward) + launches(backward)
    assert total <= 6, (forward.counts, forward.ops, backward.counts, backward.ops)
    assert (forward.counts["triton"], backward.counts["triton"]) == triton


@interpreted
@pytest.mark.parametrize(
    "opts",
    [
        dict(loss_type="dapo", beta=0.04, entropy_coef=0.01),
        dict(ratio_level="sequence", is_level="sequence", kl_reduction="max"),
        dict(loss_type="vespo", is_mode="mask"),
    ],
    ids=["dapo_beta_entropy", "sequence_levels", "vespo"],
)
def test_every_option_keeps_the_launch_budget(opts):
    case = make_case(3, 8, 300, seed=1, with_ref=True, with_old=True)
    logits = case.logits.float().requires_grad_()
    one = torch.ones(())
    with counting() as work:
        loss, _ = ftis_loss(logits, *case.inputs, **opts)
        loss.backward(one)
    assert work.counts["reads"] <= 1
    assert launches(work) <= 6, (work.counts, work.ops)


@interpreted
def test_a_deferred_check_reads_nothing_and_raise_on_bad_values_reads_once():
    from ftis_kernels import raise_on_bad_values

    case = make_case(2, 6, 50, seed=2)
    logits = case.logits.float().requires_grad_()
    with counting() as work:
        loss, metrics = ftis_loss(logits, *case.inputs, value_check="deferred")
        loss.backward()
    assert work.counts["reads"] == 0
    with counting() as work:
        raise_on_bad_values(metrics)
    assert work.counts["reads"] == 1
    bad = case.gen_logprobs.clone()
    bad[1, 2] = 0.5
    inputs = (case.tokens, bad, *case.inputs[2:])
    _, metrics = ftis_loss(logits.detach(), *inputs, value_check="deferred")
    with pytest.raises(ValueError, match=r"^gen_logprobs: expected .* the first at \(1, 2\)"):
        raise_on_bad_values(metrics)


@interpreted
def test_the_check_in_the_backward_raises_the_named_error():
    case = make_case(2, 6, 50, seed=3, mask="none")
    tokens = case.tokens.clone()
    tokens[0, 1] = 50
    logits = case.logits.float().requires_grad_()
    loss, _ = ftis_loss(logits, tokens, *case.inputs[1:])  # no read in the forward
    with pytest.raises(
        ValueError, match=r"^tokens: expected ids in \[0, 50\).*the first at \(0, 1\)"
    ):
        loss.backward()
    with pytest.raises(ValueError, match=r"^tokens: expected ids in \[0, 50\)"):
        ftis_loss(logits, tokens, *case.inputs[1:], value_check="call")
    with torch.no_grad(), pytest.raises(ValueError, match=r"^tokens: "):
        ftis_loss(logits, tokens, *case.inputs[1:])  # no backward will come: read at once


@contextlib.contextmanager
def sequence():
    """The order of a block's host reads ("read"), Triton launches ("launch") and aten ops that
    launch a kernel on a GPU (their names)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction

    seq: list[str] = []
    run, tolist = InterpretedFunction.run, torch.Tensor.tolist

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = f"aten::{func.overloadpacket.__name__}"
            if name not in FREE and not name.startswith("aten::_to_copy"):
                seq.append(name)
            return func(*args, **(kwargs or {}))

    def logged_run(self, *args, **kwargs):
        seq.append("launch")
        return run(self, *args, **kwargs)

    def logged_tolist(self):
        seq.append("read")
        return tolist(self)

    InterpretedFunction.run, torch.Tensor.tolist = logged_run, logged_tolist
    try:
        with Ops():
            yield seq
    finally:
        InterpretedFunction.run, torch.Tensor.tolist = run, tolist


def _read_comes_first(seq: list[str]) -> None:
    """One read of the check, and no launch, matmul, in-place scaling or other host read
    before it."""
    assert seq.count("read") == 1, seq
    before = seq[: seq.index("read")]
    heavy = {"launch", "aten::mm", "aten::addmm", "aten::addmm_", "aten::mul_", "aten::copy_"}
    assert not (heavy | HOST_READS) & set(before), seq


@interpreted
@pytest.mark.parametrize(
    "op_opts",
    [{}, {"grad_in_forward": False}, {"grad_in_forward": False, "inplace_backward": True}],
    ids=["default", "three_pass", "three_pass_inplace"],
)
def test_the_backward_reads_the_check_before_it_launches_anything(op_opts):
    """The backward's one synchronisation waits for the forward's kernels only: the backward's
    own kernels, queued after it, run while the host goes on."""
    case = make_case(2, 8, 300, seed=6)
    logits = case.logits.float().requires_grad_()
    x = logits * 1.0 if op_opts.get("inplace_backward") else logits  # in place: not on a leaf
    loss, _ = ftis_loss(x, *case.inputs, **op_opts)
    with sequence() as seq:
        loss.backward(torch.ones(()))
    _read_comes_first(seq)
    assert "launch" in seq


@interpreted
@pytest.mark.parametrize("grad_in_forward", [True, False], ids=["forward_order", "backward_order"])
def test_the_linear_backward_reads_the_check_before_its_gemms(grad_in_forward):
    case = make_case(2, 5, 40, H=8, seed=5)
    hidden = case.hidden.float().requires_grad_()
    weight = case.weight.float().requires_grad_()
    loss, _ = ftis_linear_loss(
        hidden, weight, *case.inputs, chunk_size=5, grad_in_forward=grad_in_forward
    )
    with sequence() as seq:
        loss.backward(torch.full((), 2.0))  # not 1: the forward order scales its gradients
    _read_comes_first(seq)
    if grad_in_forward:  # the gradients scaled in one launch, by the factor read on the device
        assert seq.count("launch") == 1 and "aten::mul_" not in seq, seq
    else:
        assert any(op in seq for op in ("aten::mm", "aten::addmm", "aten::addmm_")), seq


@interpreted
@pytest.mark.parametrize("grad_in_forward", [True, False])
def test_linear_loss_launches_per_chunk_its_matmuls_and_three_kernels(grad_in_forward):
    B, T, V, H = 4, 6, 200, 16
    case = make_case(B, T, V, H=H, seed=4)
    hidden = case.hidden.float().requires_grad_()
    weight = case.weight.float().requires_grad_()
    runs = {}
    one = torch.ones(())
    for chunk_size in (T, 2 * T):  # 4 chunks, then 2: the per-chunk cost is the difference
        with counting() as work:
            loss, _ = ftis_linear_loss(
                hidden,
                weight,
                *case.inputs,
                chunk_size=chunk_size,
                grad_in_forward=grad_in_forward,
                value_check="deferred",
            )
            loss.backward(one)
        assert work.counts["reads"] == 0, work.ops
        runs[B * T // chunk_size] = work
    per_chunk = {
        key: (runs[4].counts[key] - runs[2].counts[key]) / 2 for key in ("matmuls", "triton")
    }
    other = (launches(runs[4]) - launches(runs[2])) / 2 - per_chunk["matmuls"]
    matmuls = 3 if grad_in_forward else 4  # the logits once (twice in the backward order)
    assert per_chunk["matmuls"] == matmuls, runs[4].ops
    assert other <= 3, (runs[4].ops, runs[2].ops)
    # No add_ of a partial product: the matmul accumulates grad_weight.
    assert not any("add_" in op or "add.Tensor" in op for op in runs[4].ops), runs[4].ops


@interpreted
def test_linear_loss_checks_its_inputs_with_one_read_in_the_backward():
    case = make_case(2, 5, 40, H=8, seed=5)
    hidden = case.hidden.float().requires_grad_()
    with counting() as work:
        loss, _ = ftis_linear_loss(hidden, case.weight.float(), *case.inputs, chunk_size=5)
        loss.backward()
    assert work.counts["reads"] == 1


@pytest.mark.cuda
def test_on_cuda_the_profiler_sees_the_same_budget():
    """The same budget from the CUDA profiler: kernels launched and host synchronisations of one
    default F-TIS forward + backward, beyond those of profiling an empty step (the test's own
    synchronize, and whatever the profiler adds: on an H200 with torch 2.11, one
    cudaDeviceSynchronize of its own)."""
    case = make_case(4, 64, 32000, seed=6, device=torch.device("cuda"))
    logits = case.logits.to(torch.bfloat16).requires_grad_()
    one = torch.ones((), device="cuda")

    def step():
        loss, _ = ftis_loss(logits, *case.inputs)
        loss.backward(one)

    for _ in range(2):  # compiled and warm
        step()
    torch.cuda.synchronize()
    baseline = host_syncs(cuda_profile(lambda: None))
    events = cuda_profile(step)
    kernels = cuda_kernels(events)
    # 4 of the op, and the accumulation into logits.grad.
    assert len(kernels) <= 6, sorted(e.name for e in kernels)
    syncs = host_syncs(events)
    # At most the backward's read of the value checks.
    assert len(syncs) - len(baseline) <= 1, (syncs, baseline)
