"""Cost of the value check of `ftis_loss` on the CPU PyTorch path (validate.fault_record: every
input value and the logits' row statistics, then validate.raise_on_faults: one synchronisation,
in the backward): fwd+bwd with and without it, side by side in one run, and the check alone. On
the Triton path the checks are part of the per-sample kernel (`kernels/per_sample.py`).

    python -m bench.check_cost [--rows 1024] [--vocab 32000] [--rounds 10]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
from unittest import mock

import torch
import torch.utils.benchmark as benchmark

from ftis_kernels import ftis_loss
from ftis_kernels.validate import Rows, fault_record, raise_on_faults

ftis_loss_module = importlib.import_module("ftis_kernels.ftis_loss")
custom_op_module = importlib.import_module("ftis_kernels.custom_op")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1024, help="B * T (B = 8)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=10, help="alternating measurements")
    args = parser.parse_args()
    torch.manual_seed(0)
    B, T, V = 8, args.rows // 8, args.vocab
    logits = torch.randn(B, T, V).requires_grad_()
    tokens = torch.randint(0, V, (B, T))
    gen = -torch.rand(B, T) * 5 - 5
    adv = torch.randn(B)
    mask = torch.rand(B, T) < 0.9
    old = gen + 0.1
    inputs = (tokens, gen, adv, mask, old)

    def step():
        with mock.patch.object(ftis_loss_module, "select_backend", lambda device: "torch"):
            loss, _ = ftis_loss(logits, *inputs)
            torch.autograd.grad(loss, logits)

    def step_unchecked():
        clean = torch.zeros(7, 7, dtype=torch.float64)
        with (
            mock.patch.object(custom_op_module, "fault_record", lambda *a, **k: clean),
            mock.patch.object(ftis_loss_module, "raise_on_faults", lambda *a, **k: None),
        ):
            step()

    def check(V, inputs, stats):
        tokens, gen, adv, mask, old = inputs
        raise_on_faults(fault_record(V, Rows(tokens, gen, adv, mask, old, None), stats))

    # Alternating rounds, so that a busy machine slows both variants alike.
    times = {"with the check": [], "without the check": []}
    fns = {"with the check": step, "without the check": step_unchecked}
    for _ in range(args.rounds):
        for label, fn in fns.items():
            times[label].append(benchmark.Timer("fn()", globals={"fn": fn}).timeit(1).median)
    stats = tuple(torch.randn(B, T) for _ in range(3))
    alone = benchmark.Timer(
        "check(V, inputs, stats)",
        globals={"check": check, "V": V, "inputs": inputs, "stats": stats},
    ).blocked_autorange(min_run_time=1.0)
    with_check, without = (statistics.median(times[label]) for label in fns)
    print(f"ftis_loss fwd+bwd, torch path, {B * T} x {V} fp32, 1 thread, median of {args.rounds}:")
    print(f"  with the check     {1e3 * with_check:9.2f} ms")
    print(f"  without the check  {1e3 * without:9.2f} ms")
    print(
        f"  difference         {1e3 * (with_check - without):+9.2f} ms "
        f"({100 * (with_check / without - 1):+.2f}%)"
    )
    print(
        f"  the check alone    {1e3 * alone.median:9.3f} ms ({100 * alone.median / without:.3f}%)"
    )


if __name__ == "__main__":
    main()
