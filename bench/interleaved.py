"""Time ratios on a shared machine: `python -m bench.interleaved --reps 7 --out FILE.json`.

All implementations of a CPU case run in one process, one call each per round, the order
reversed every other round, so that other work on the machine slows them alike; the minimum over
rounds estimates each one's undisturbed time. No memory is measured here (`bench.run` and
`bench.compare` do, one process per measurement). Prints and writes, per case, every
implementation's min and median fwd+bwd time and its min against `ftis_loss`'s.

The copy roofline is timed in the same rounds (`copy`, unless --impls leaves it out): one
`copy_` of 1.5x the logits' bytes, which reads and writes 3x them, the roofline's bytes for
fwd+bwd (`measure.work_model`); each implementation's "of roofline" is copy's min over its min,
so the ceiling is measured under the same load as the work. `copy_fresh` moves the same bytes with
the backward's share written to a new allocation, as an out-of-place gradient in a new buffer is
(TRL's, the reference's; `ftis_loss` reuses its buffer on the CPU, ftis_kernels/grad_buffer.py):
its page faults (one per 4 KiB page with the default allocator, unless PyTorch's
THP_MEM_ALLOC_ENABLE=1 asks for huge pages) are part of that ceiling; "of fresh roofline" is
copy_fresh's min over each implementation's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench import measure
from bench.impls import IMPLS, prepare, unavailable
from bench.workload import CPU_CASES, make_inputs

IMPLS_TIMED = (
    "ref_eager",
    "ref_compile",
    "trl_eager",
    "ftis_loss",
    "ftis_loss_inplace",
    "ftis_linear_loss",
)


class _Copy:
    """The copy roofline as a timed 'implementation': reads and writes 3x the logits' bytes."""

    restore = None

    def __init__(self, logits: torch.Tensor):
        n = 3 * logits.numel() * logits.element_size() // 2
        self.src = torch.randint(0, 255, (n,), dtype=torch.uint8)
        self.dst = torch.empty_like(self.src)

    def run(self):
        self.dst.copy_(self.src)


class _CopyFresh:
    """The first-touch roofline: the forward's read (N bytes, into a preallocated buffer with
    half of them), then the backward's read and write of N bytes into a fresh allocation."""

    restore = None

    def __init__(self, logits: torch.Tensor):
        n = logits.numel() * logits.element_size()
        self.src = torch.randint(0, 255, (n,), dtype=torch.uint8)
        self.dst = torch.empty(n // 2, dtype=torch.uint8)

    def run(self):
        self.dst.copy_(self.src[: self.dst.numel()])
        torch.empty_like(self.src).copy_(self.src)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.interleaved", description=__doc__.splitlines()[0]
    )
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--impls",
        type=lambda v: v.split(","),
        default=[*IMPLS_TIMED, "copy", "copy_fresh"],
        help="a subset, a,b,c (default: all, and both copy rooflines)",
    )
    args = p.parse_args(argv)
    device = torch.device("cpu")
    results = {
        "meta": measure.metadata(device),
        "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE", ""),
        "cases": [],
    }
    for case in CPU_CASES:
        inputs = make_inputs(case, device)
        names = [
            n
            for n in IMPLS[case.family]
            if n in IMPLS_TIMED
            and n in args.impls
            and unavailable(n, case.family, "fwd+bwd", device) is None
        ]
        preps = {n: prepare(n, case, inputs, "fwd+bwd") for n in names}
        for name, roofline in (("copy", _Copy), ("copy_fresh", _CopyFresh)):
            if name in args.impls and case.family == "logits":
                names.append(name)
                preps[name] = roofline(inputs["logits"])
        for prep in preps.values():  # warm-up: compiles
            if prep.restore is not None:
                prep.restore()
            prep.run()
        times: dict[str, list[float]] = {n: [] for n in names}
        loads = []
        for r in range(args.reps):
            for n in names if r % 2 == 0 else names[::-1]:
                if preps[n].restore is not None:
                    preps[n].restore()
                t0 = time.perf_counter()
                preps[n].run()
                times[n].append((time.perf_counter() - t0) * 1e3)
            loads.append(os.getloadavg()[0])
        base = min(times["ftis_loss"])
        row = {
            "case": case.label,
            "loadavg_1min": loads,
            "ms": {n: {"min": min(t), "median": statistics.median(t)} for n, t in times.items()},
        }
        work = [n for n in times if not n.startswith("copy")]
        for roofline, key in (("copy", "of_copy_roofline"), ("copy_fresh", "of_fresh_roofline")):
            if roofline in times:
                row[key] = {n: min(times[roofline]) / min(times[n]) for n in work}
        results["cases"].append(row)
        roof, fresh = row.get("of_copy_roofline", {}), row.get("of_fresh_roofline", {})
        cells = "  ".join(
            f"{n} {min(t):.0f}/{statistics.median(t):.0f} ({min(t) / base:.2f}x"
            + (f", {roof[n]:.0%} of roofline" if n in roof else "")
            + (f", {fresh[n]:.0%} of fresh" if n in fresh else "")
            + ")"
            for n, t in times.items()
        )
        print(
            f"{case.label}: min/median ms (min vs ftis_loss): {cells}; load {min(loads):.1f}-"
            f"{max(loads):.1f}",
            flush=True,
        )
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
