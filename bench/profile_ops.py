"""Where the ops' time goes: `python -m bench.profile_ops` (a GPU; `--device cpu` for small shapes).

For `ftis_loss` at each token count: the median time of the forward and of forward + backward,
each with the value checks read by the host in the backward (the default) and with
value_check="deferred" (no host read: "no check"), then torch.profiler's top rows of three
fwd+bwd calls by device time and by CPU time, and the operators that synchronise or copy
(Synchronize, Memcpy, item, _local_scalar_dense). Then `ftis_linear_loss`'s fwd+bwd time and its
top rows. The inputs and the options are the benchmark's (`bench/workload.py`: TIS, bf16 by
default).

`bench/results/h200-2026-12-04/profile.txt` is its output on an NVIDIA H200 (2026-12-04, commit
ad17f8a, the default arguments).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from bench.workload import TIS_OPTIONS, Case, make_inputs
from ftis_kernels import ftis_linear_loss, ftis_loss

SYNC_NAMES = ("Synchronize", "Memcpy", "item", "_local_scalar_dense")
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def median_ms(fn: Callable[[], None], device: torch.device, reps: int, warmup: int = 3) -> float:
    """Median time of fn() in ms: CUDA events around each call on a GPU, a host clock on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _activities(device: torch.device) -> list:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def _sort_key(device: torch.device) -> str:
    return "cuda_time_total" if device.type == "cuda" else "cpu_time_total"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def profile_logits(device: torch.device, tokens: int, V: int, dtype: str, reps: int) -> None:
    case = Case("logits", max(1, tokens // 1024), min(tokens, 1024), V, dtype)
    x = make_inputs(case, device)
    logits = x["logits"].requires_grad_(True)
    args = (logits, x["tokens"], x["gen_logprobs"], x["advantages"], x["mask"])

    def fwd(value_check: str = "backward") -> None:
        ftis_loss(*args, value_check=value_check, **TIS_OPTIONS)

    def fwd_bwd(value_check: str = "backward") -> None:
        loss, _ = ftis_loss(*args, value_check=value_check, **TIS_OPTIONS)
        torch.autograd.grad(loss, logits)

    t_fb, t_f = median_ms(fwd_bwd, device, reps), median_ms(fwd, device, reps)
    # "no check": the values are still checked by the kernels, the host never reads the verdict.
    deferred = functools.partial(fwd_bwd, "deferred"), functools.partial(fwd, "deferred")
    t_fb_nc, t_f_nc = (median_ms(fn, device, reps) for fn in deferred)
    print(
        f"N={tokens} V={V} {SHORT[dtype]}: fwd {t_f:.2f} ms (no check {t_f_nc:.2f}); "
        f"fwd+bwd {t_fb:.2f} ms (no check {t_fb_nc:.2f})",
        flush=True,
    )
    with profile(activities=_activities(device)) as prof:
        for _ in range(3):
            fwd_bwd()
        _synchronize(device)
    averages = prof.key_averages()
    print(averages.table(sort_by=_sort_key(device), row_limit=12, max_name_column_width=60))
    print(averages.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
    for e in averages:
        if any(name in e.key for name in SYNC_NAMES):
            print("SYNC-ish", e.key, e.count, f"{e.cpu_time_total / 1e3:.2f} ms cpu")


def profile_linear(
    device: torch.device, tokens: int, V: int, H: int, dtype: str, reps: int
) -> None:
    case = Case("linear", max(1, tokens // 1024), min(tokens, 1024), V, dtype, H=H)
    x = make_inputs(case, device)
    hidden, weight = x["hidden"].requires_grad_(True), x["weight"].requires_grad_(True)
    rows = (x["tokens"], x["gen_logprobs"], x["advantages"], x["mask"])

    def fwd_bwd() -> None:
        loss, _ = ftis_linear_loss(hidden, weight, *rows, **TIS_OPTIONS)
        torch.autograd.grad(loss, [hidden, weight])

    label = f"{tokens // 1024}k" if tokens >= 1024 else str(tokens)
    print(
        f"linear {label} x {V} H{H} fwd+bwd {median_ms(fwd_bwd, device, reps):.1f} ms", flush=True
    )
    with profile(activities=_activities(device)) as prof:
        fwd_bwd()
        _synchronize(device)
    print(
        prof.key_averages().table(sort_by=_sort_key(device), row_limit=15, max_name_column_width=60)
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.profile_ops", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 16384])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1536, help="H of the ftis_linear_loss case")
    ap.add_argument("--linear-tokens", type=int, default=16384)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--linear-reps", type=int, default=8)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    for tokens in args.tokens:
        profile_logits(device, tokens, args.vocab, args.dtype, args.reps)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    profile_linear(
        device, args.linear_tokens, args.vocab, args.hidden, args.dtype, args.linear_reps
    )


if __name__ == "__main__":
    main()
