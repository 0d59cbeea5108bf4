"""The ops' host time per call, without a GPU: `python -m bench.host_time [--profile]`.

On a GPU at small shapes the ops' Python, not their kernels, sets the pace (an H200 run on
2026-12-04: `ftis_loss` at 1k tokens x 151,936 took 1.2 ms fwd+bwd, its kernels 0.3 ms). This
measures that Python on the CPU: the Triton kernels run under the interpreter with their launches
replaced by no-ops, so what is timed is everything around them (validation, options, dispatch,
allocation, autograd) and no kernel work. The value check is deferred (a stubbed kernel writes no
record to read). Median of --reps calls of fwd+bwd (`torch.autograd.grad`, nothing accumulates)
and of the forward alone under no_grad; --profile prints cProfile's top functions by cumulative
time. Compare two versions of the code with the same arguments on an idle machine.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: the kernels are interpreted

import argparse  # noqa: E402
import cProfile  # noqa: E402
import pstats  # noqa: E402

import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from bench.profile_ops import median_ms  # noqa: E402


def _stub_launches() -> None:
    """Every interpreted kernel launch does nothing (the outputs keep what they were allocated
    with)."""
    InterpretedFunction.run = lambda self, *args, **kwargs: None  # type: ignore[method-assign]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--T", type=int, default=128)
    ap.add_argument("--V", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--grad-in-forward",
        choices=("auto", "on", "off"),
        default="auto",
        help="ftis_loss's grad_in_forward: None, True or False (default: auto, the op's default)",
    )
    args = ap.parse_args(argv)
    switch = {"auto": None, "on": True, "off": False}[args.grad_in_forward]
    _stub_launches()
    from ftis_kernels import ftis_loss
    from tests.cases import make_case

    case = make_case(args.B, args.T, args.V, seed=1)
    logits = case.logits.clone().requires_grad_()
    one = torch.ones(())

    def step():
        loss, _ = ftis_loss(logits, *case.inputs, value_check="deferred", grad_in_forward=switch)
        torch.autograd.grad(loss, logits, one)

    def forward():
        with torch.no_grad():
            ftis_loss(logits, *case.inputs, value_check="deferred")

    for _ in range(10):
        step()
    cpu = torch.device("cpu")
    fwd_bwd, fwd = median_ms(step, cpu, args.reps, 0), median_ms(forward, cpu, args.reps, 0)
    print(
        f"ftis_loss host time, kernels stubbed, B={args.B} T={args.T} V={args.V}, "
        f"grad_in_forward {args.grad_in_forward}: "
        f"fwd+bwd {fwd_bwd:.3f} ms, forward (no grad) {fwd:.3f} ms (median of {args.reps})"
    )
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            step()
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
