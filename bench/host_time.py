"""The ops' host time per call beside Liger's, without a GPU: `python -m bench.host_time`.

On a GPU at small shapes the Python around the kernels, not the kernels, sets the pace (an H200
on 2026-12-04: `ftis_loss` at 1k tokens x 151,936 took 1.21 ms fwd+bwd, its kernels 0.3 ms;
Liger's `triton_grpo_loss` 0.78 ms). This measures that host work on the CPU, for our ops and for
Liger's side by side, each wired by `bench.impls.prepare` as `bench.run` times them: the Triton
kernels run under the interpreter with each launch replaced by what Triton's launcher does on the
host before the driver call (`--launch binder`, default: `JITFunction.run`'s binder for sm_90,
which turns every argument into its type and specialisation, and the cache key; `--launch none`:
nothing). So what is timed is everything around the kernels (validation, options, allocation,
autograd, the launches' argument handling) and no kernel work. Not modelled: the driver's launch
call (the same few microseconds a launch for everyone) and the waits for the device (our default
reads the value check once in the backward; this stub writes a record with no fault, read on the
host like any other).

The implementations are timed in turn, `--rounds` rounds of `--reps` calls each (the inputs of
the in-place ones restored between calls, untimed); each figure is the median over all its calls,
so that a machine's drift falls on every implementation alike. Compare two versions of the code
with the same arguments on an idle machine, and their ratios to Liger from the same run.
`--profile IMPL` prints cProfile's top functions of one implementation's calls. `--json PATH`
writes the records.

`--device cuda` measures the same on a GPU, kernels compiled and launched (default shape 8 x 128
tokens x 151,936, bf16): per call, the host's time from the call to its return (the launches
queued; our default's one read of the value check included) beside the device's time from the
call to the end of its work (CUDA events), the device idle before each call. Where the two are
close, the host sets the pace.
"""

from __future__ import annotations

import os
import sys


def _on_cuda(argv: list[str]) -> bool:
    return "--device=cuda" in argv or any(
        a == "--device" and b == "cuda" for a, b in zip(argv, argv[1:])
    )


if not _on_cuda(sys.argv[1:]):
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: the kernels are interpreted

import argparse  # noqa: E402
import cProfile  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Optional  # noqa: E402

import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from bench.impls import prepare, unavailable  # noqa: E402
from bench.launch_counts import counting, cuda_kernels, cuda_profile, host_syncs  # noqa: E402
from bench.workload import Case, make_inputs  # noqa: E402
from ftis_kernels.kernels.value_checks import N_CHECKS, RECORD_COLUMNS  # noqa: E402

HOST_IMPLS = (
    "ftis_loss",
    "ftis_loss_filter",
    "ftis_loss_3pass",
    "ftis_loss_inplace",
    "liger_triton",
    "liger_triton_inplace",
)
BASELINE = {"ftis_loss_inplace": "liger_triton_inplace"}  # else "liger_triton"
RECORD_SHAPE = (N_CHECKS.value, RECORD_COLUMNS.value)


class Launches:
    """Replaces every interpreted kernel launch by `mode`'s host work: "binder" (what Triton's
    `JITFunction.run` computes from the arguments for sm_90 before it launches: the binder's
    specialisation of each argument and the cache key) or "none"; counts the launches and their
    arguments. The ops' value-check record (a float64 tensor of `RECORD_SHAPE`) is zeroed: no
    fault."""

    def __init__(self, mode: str) -> None:
        self.mode, self.launches, self.arguments = mode, 0, 0
        self._binders: dict = {}
        self._keys: dict = {}

    def _binder(self, kernel: InterpretedFunction) -> Callable:
        binder = self._binders.get(kernel)
        if binder is None:
            from triton.compiler import make_backend
            from triton.runtime.jit import JITFunction, create_function_from_signature

            from bench.sm90 import TARGET

            # The same decorator arguments (do_not_specialize...) as the kernel compiled for a GPU.
            jit = JITFunction(kernel.fn, **kernel.kwargs)
            binder = create_function_from_signature(jit.signature, jit.params, make_backend(TARGET))
            self._binders[kernel] = binder
        return binder

    def install(self) -> None:
        from triton.runtime.jit import compute_cache_key

        def run(kernel, *args, grid, warmup, **kwargs):
            self.launches += 1
            self.arguments += len(args) + len(kwargs)
            for a in (*args, *kwargs.values()):
                if (
                    isinstance(a, torch.Tensor)
                    and a.dtype == torch.float64
                    and a.shape == RECORD_SHAPE
                ):
                    a.numpy()[:] = 0  # not an aten op: nothing for `device_work` to count
            if self.mode == "binder":
                kwargs.setdefault("debug", False)
                _, specialization, options = self._binder(kernel)(*args, **kwargs)
                compute_cache_key(self._keys, specialization, options)

        InterpretedFunction.run = run  # type: ignore[method-assign]


def _restored(prep) -> None:
    """The inputs of an in-place implementation as they were (nothing for the others)."""
    if prep.restore is not None:
        prep.restore()


def _prepared(name: str, case: Case, mode: str, device: torch.device):
    """`bench.impls.prepare`'s wiring, as `bench.run` calls them."""
    return prepare(name, case, make_inputs(case, device), mode)


def time_impls(preps: dict, rounds: int, reps: int, device: torch.device) -> dict[str, list]:
    """{name: [(host ms, device ms or None) of each call]}, the implementations taken in turn,
    `rounds` x `reps` calls each; restores untimed. On CUDA the device is idle before each call
    and its time runs from the call to the end of its work."""
    cuda = device.type == "cuda"
    samples: dict[str, list] = {name: [] for name in preps}
    for _ in range(rounds):
        for name, prep in preps.items():
            for _ in range(reps):
                _restored(prep)
                if cuda:
                    torch.cuda.synchronize()
                    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    start.record()
                t0 = time.perf_counter()
                prep.run()
                host = 1e3 * (time.perf_counter() - t0)
                if cuda:
                    end.record()
                    end.synchronize()
                samples[name].append((host, start.elapsed_time(end) if cuda else None))
    return samples


def device_work(run: Callable[[], object], cuda: bool) -> tuple[int, int]:
    """(device kernels, host reads) of one call of run() (`bench.launch_counts`): on the CPU the
    interpreted Triton launches and the aten ops that would launch a kernel on a GPU, and the
    reads of a tensor's value; on CUDA the profiler's kernels and the host's waits (beyond those
    of profiling nothing)."""
    if not cuda:
        with counting() as work:
            run()
        return work.counts["triton"] + work.counts["kernels"], work.counts["reads"]
    torch.cuda.synchronize()
    baseline = len(host_syncs(cuda_profile(lambda: None)))
    events = cuda_profile(run)
    return len(cuda_kernels(events)), len(host_syncs(events)) - baseline


def triton_launches(run: Callable[[], object]) -> tuple[int, int]:
    """(Triton launches, their arguments) of one call of run() with compiled kernels."""
    from triton.runtime.jit import JITFunction

    counts = [0, 0]
    original = JITFunction.run

    def counting_run(self, *args, grid, warmup, **kwargs):
        counts[0] += 1
        counts[1] += len(args) + len(kwargs)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    JITFunction.run = counting_run  # type: ignore[method-assign]
    try:
        run()
    finally:
        JITFunction.run = original  # type: ignore[method-assign]
    return counts[0], counts[1]


def _print_rows(records: list[dict]) -> None:
    for r in records:
        if "skipped" in r:
            print(f"| {r['impl']} | {r['mode']} | ({r['skipped']}) | | | | | |", flush=True)
            continue
        ratio = f"{r['ratio']:.2f}x {r['vs']}" if r["ratio"] is not None else "-"
        dev = f"{r['device_ms']:.3f}" if "device_ms" in r else "-"
        print(
            f"| {r['impl']} | {r['mode']} | {r['host_ms']:.3f} | {dev} | {r['kernels']} "
            f"({r['triton_launches']}) | {r['launch_arguments']} | {r['host_reads']} | {ratio} |",
            flush=True,
        )


def main(argv: Optional[list[str]] = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--T", type=int, default=128)
    ap.add_argument("--V", type=int, default=None, help="default 1,000; on CUDA 151,936")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--impls", nargs="+", default=list(HOST_IMPLS), choices=HOST_IMPLS)
    ap.add_argument("--launch", choices=("binder", "none"), default="binder")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--profile", choices=HOST_IMPLS)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda != _on_cuda(sys.argv[1:] if argv is None else argv):
        raise SystemExit("--device cuda must be on the command line (it decides the interpreter)")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    from ftis_kernels.kernels.logp_lse import INTERPRETED

    if cuda and INTERPRETED:
        raise SystemExit("--device cuda with TRITON_INTERPRET=1: the kernels would not compile")
    V = args.V if args.V is not None else (151936 if cuda else 1000)
    stub = None
    if not cuda:
        stub = Launches(args.launch)
        stub.install()
    case = Case("logits", args.B, args.T, V, args.dtype)
    shape = {"B": args.B, "T": args.T, "V": V, "dtype": args.dtype}
    model = "compiled" if cuda else args.launch
    records: list[dict] = []
    where = "kernels compiled" if cuda else f"kernels stubbed (launch model: {args.launch})"
    print(
        f"host time a call, {where}, B={args.B} T={args.T} V={V} {args.dtype}, "
        f"median of {args.rounds} x {args.reps}"
    )
    print(
        "| impl | mode | host ms | device ms | kernels (Triton) | Triton launch arguments | "
        "host reads | host vs Liger |"
    )
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for mode in ("fwd+bwd", "fwd"):
        first = len(records)
        preps, skipped = {}, {}
        for name in args.impls:
            why = unavailable(name, "logits", mode, device)
            if why is None:
                preps[name] = _prepared(name, case, mode, device)
            else:
                skipped[name] = why
        counts = {}
        for name, prep in preps.items():
            for _ in range(5):  # warm: compiled kernels, the options' cache, the allocator
                _restored(prep)
                prep.run()
            _restored(prep)
            if cuda:
                counts[name] = triton_launches(prep.run)
            else:
                stub.launches = stub.arguments = 0
                prep.run()
                counts[name] = (stub.launches, stub.arguments)
            _restored(prep)
            counts[name] += device_work(prep.run, cuda)
        samples = time_impls(preps, args.rounds, args.reps, device)
        host = {name: statistics.median(h for h, _ in s) for name, s in samples.items()}
        for name in args.impls:
            record = {"impl": name, "mode": mode, "device": args.device, **shape}
            record["launch_model"] = model
            if name in skipped:
                records.append({**record, "skipped": skipped[name]})
                continue
            base = BASELINE.get(name, "liger_triton")
            ratio = host[name] / host[base] if base in host else None
            record.update(host_ms=host[name], calls=len(samples[name]))
            if cuda:
                record["device_ms"] = statistics.median(d for _, d in samples[name])
            launches, arguments, kernels, reads = counts[name]
            record.update(triton_launches=launches, launch_arguments=arguments)
            record.update(kernels=kernels, host_reads=reads)
            record.update(vs=base if ratio is not None else None, ratio=ratio)
            records.append(record)
        del preps  # on a GPU, each held its own logits
        _print_rows(records[first:])
        if args.json:  # after each mode: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump(records, f, indent=1)
    if args.profile:
        prep = _prepared(args.profile, case, "fwd+bwd", device)
        prof = cProfile.Profile()
        for _ in range(300):
            _restored(prep)
            prof.enable()
            prep.run()
            prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(40)
    return records


if __name__ == "__main__":
    main()
