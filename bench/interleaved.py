"""Time ratios on a shared machine: `python -m bench.interleaved --reps 7 --out FILE.json`.

All implementations of a CPU case run in one process, one call each per round, the order
reversed every other round, so that other work on the machine slows them alike; the minimum over
rounds estimates each one's undisturbed time. No memory is measured here (`bench.run` and
`bench.compare` do, one process per measurement). Prints and writes, per case, every
implementation's min and median fwd+bwd time and its min against `ftis_loss`'s.

The copy roofline is timed in the same rounds (`copy`, unless --impls leaves it out): one
`copy_` of 1.5x the logits' bytes, which reads and writes 3x them, the roofline's bytes for
fwd+bwd (`measure.work_model`); each implementation's "of roofline" is copy's min over its min,
so the ceiling is measured under the same load as the work.
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.interleaved", description=__doc__.splitlines()[0]
    )
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--impls",
        type=lambda v: v.split(","),
        default=[*IMPLS_TIMED, "copy"],
        help="a subset, a,b,c (default: all, and the copy roofline)",
    )
    args = p.parse_args(argv)
    device = torch.device("cpu")
    results = {"meta": measure.metadata(device), "cases": []}
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
        if "copy" in args.impls and case.family == "logits":
            names.append("copy")
            preps["copy"] = _Copy(inputs["logits"])
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
        if "copy" in times:
            copy = min(times["copy"])
            row["of_copy_roofline"] = {n: copy / min(t) for n, t in times.items() if n != "copy"}
        results["cases"].append(row)
        roof = row.get("of_copy_roofline", {})
        cells = "  ".join(
            f"{n} {min(t):.0f}/{statistics.median(t):.0f} ({min(t) / base:.2f}x"
            + (f", {roof[n]:.0%} of roofline)" if n in roof else ")")
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
