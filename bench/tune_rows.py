"""The row kernels' meta-parameters, timed: `python -m bench.tune_rows --out tune.json` (a GPU).

For the forward (`logp_lse_fwd`: one read of the logits), the backward (`logits_bwd`: one read
and one write) and the gradient-in-forward kernel (`logp_grad_fwd`: a read, a re-read that L2
should serve, a write) at each shape and dtype, every configuration in FWD_CONFIGS, BWD_CONFIGS
and GRAD_CONFIGS is checked against the default's results (the same numbers to a few ulp, every
element written) and timed (median of `triton.testing.do_bench`), beside a device copy of the
same logits measured in the same run. Each record gives the time, the bytes the kernel must move
over that time, and that rate as a fraction of the copy's (read + write) rate. The default
configuration is the first of each list. The run stops starting shapes after --budget-s and
writes what it measured.

On CPU (`--device cpu`, the interpreter) it checks the mechanics on a tiny shape; its times mean
nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

# (BLOCK_V, VEC, num_warps, num_stages or None: Triton's default)
FWD_CONFIGS = (
    (4096, 8, 8, None),
    (4096, 8, 4, None),
    (4096, 8, 16, None),
    (2048, 8, 4, None),
    (2048, 8, 8, None),
    (8192, 8, 8, None),
    (8192, 8, 16, None),
    (4096, 16, 8, None),
    (8192, 16, 16, None),
    (4096, 8, 8, 1),
)
# (BLOCK_V, num_warps, num_stages or None)
BWD_CONFIGS = (
    (4096, 16, None),
    (4096, 4, None),
    (4096, 8, None),
    (2048, 4, None),
    (2048, 8, None),
    (8192, 8, None),
    (8192, 16, None),
    (1024, 4, None),
    (4096, 8, 1),
)
# The gradient-in-forward kernel (`logp_grad_fwd`: one read from memory, one from L2, one write):
# (BLOCK_V, VEC, num_warps, num_stages or None). None first: `logp_grad.grad_meta`, the default.
# The others trade rows in flight (L2 hits of the second read) against programs per SM.
GRAD_CONFIGS = (
    None,
    (4096, 8, 8, None),  # the forward's configuration: 8 programs an SM
    (8192, 8, 16, None),  # 4 an SM (bf16)
    (4096, 8, 16, None),  # fp32: 2 programs of 16 warps an SM
    (8192, 8, 32, None),  # bf16: 16 bytes a thread
    (16384, 8, 32, None),  # fp32: 64 bytes a thread
    (8192, 4, 32, None),
    (4096, 4, 8, None),
    (16384, 16, 32, None),
)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _time_ms(fn, device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _fwd_meta(cfg) -> dict:
    block_v, vec, warps, stages = cfg
    meta = dict(BLOCK_V=block_v, VEC=vec, LANES=block_v // vec, num_warps=warps)
    if stages is not None:
        meta["num_stages"] = stages
    return meta


def _bwd_meta(cfg) -> dict:
    block_v, warps, stages = cfg
    meta = dict(BLOCK_V=block_v, num_warps=warps)
    if stages is not None:
        meta["num_stages"] = stages
    return meta


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(|b|, 1): the check's figure (a and b fp32)."""
    return float(((a - b).abs() / b.abs().clamp_min(1.0)).max())


def tune_shape(
    n_tokens: int,
    V: int,
    dtype: str,
    device: torch.device,
    fit_v: bool,
    kernels: tuple = ("fwd", "bwd", "grad"),
) -> list:
    from ftis_kernels.kernels import logp_lse

    T = min(1024, n_tokens)
    B = n_tokens // T
    dt = DTYPES[dtype]
    g = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(B, T, V, device=device, generator=g) * 2.0).to(dt)
    tokens = torch.randint(0, V, (B, T), device=device, generator=g)
    es = logits.element_size()
    dst = torch.empty_like(logits)
    copy_ms = _time_ms(lambda d=dst: d.copy_(logits), device)
    del dst
    copy_GBps = 2 * logits.numel() * es / copy_ms / 1e6
    records = []

    def record(kernel, cfg, ms, nbytes, err, written):
        rate = nbytes / ms / 1e6
        records.append(
            dict(
                kernel=kernel,
                tokens=n_tokens,
                V=V,
                dtype=dtype,
                config=list(cfg),
                ms=ms,
                GBps=rate,
                of_copy=rate / copy_GBps,
                copy_ms=copy_ms,
                copy_GBps=copy_GBps,
                max_rel_diff_vs_default=err,
                every_element_written=written,
            )
        )
        print(
            f"{kernel} {n_tokens}x{V} {dtype} {cfg}: {ms:.3f} ms {rate:.0f} GB/s "
            f"({rate / copy_GBps:.0%} of copy {copy_GBps:.0f}) diff {err:.1e} written {written}",
            flush=True,
        )

    if "grad" in kernels:
        _tune_grad(logits, tokens, device, fit_v, record)
    if "fwd" not in kernels and "bwd" not in kernels:
        return records
    fwd_cfgs = [c for c in FWD_CONFIGS if not fit_v or c[0] <= _pow2(V)]
    base = None
    for cfg in fwd_cfgs:
        meta = _fwd_meta(cfg)
        outs = tuple(torch.full((B, T), float("nan"), device=device) for _ in range(4))
        try:
            logp_lse.logp_lse_fwd(logits, tokens, None, 1.0, True, out=outs, meta=meta)
        except Exception as e:  # recorded: one configuration failing to compile ends nothing
            print(f"fwd {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        written = all(bool(torch.isfinite(o).all()) for o in outs)
        if base is None:
            base = tuple(o.clone() for o in outs)
        if "fwd" not in kernels:
            break  # the backward needs only the default's statistics
        err = max(_rel_diff(o, b) for o, b in zip(outs, base))
        ms = _time_ms(
            lambda m=meta, o=outs: logp_lse.logp_lse_fwd(
                logits, tokens, None, 1.0, True, out=o, meta=m
            ),
            device,
        )
        record("fwd", cfg, ms, logits.numel() * es, err, written)
    if "bwd" not in kernels:
        return records
    logp, row_max, log_sum, entropy = base
    coef = torch.randn(B, T, device=device, generator=g)
    ecoef = torch.randn(B, T, device=device, generator=g) * 0.01
    bwd_cfgs = [c for c in BWD_CONFIGS if not fit_v or c[0] <= _pow2(V)]
    ref = None
    for cfg in bwd_cfgs:
        meta = _bwd_meta(cfg)
        out = torch.full_like(logits, float("nan"))
        args = (logits, tokens, row_max, log_sum, coef, 1.0, out, entropy, ecoef)
        try:
            logp_lse.logits_bwd(*args, meta=meta)
        except Exception as e:
            print(f"bwd {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        written = bool(torch.isfinite(out).all())
        o32 = out.float()
        if ref is None:
            ref = o32
        err = _rel_diff(o32, ref)
        del o32
        ms = _time_ms(lambda m=meta, a=args: logp_lse.logits_bwd(*a, meta=m), device)
        record("bwd", cfg, ms, 2 * logits.numel() * es, err, written)
        del out
    return records


def _tune_grad(logits, tokens, device, fit_v: bool, record) -> None:
    """The gradient-in-forward kernel over GRAD_CONFIGS, the default F-TIS work (TIS, the grpo
    reduction, no mask, half the advantages positive): its bytes from memory are one read and
    one write, so `of_copy` near 1 means the second read came from L2."""
    from ftis_kernels.kernels import logp_grad
    from ftis_kernels.options import FTISOptions
    from ftis_kernels.validate import Rows

    B, T, V = logits.shape
    g = torch.Generator(device=device).manual_seed(1)
    gen = -torch.rand(B, T, device=device, generator=g) * 3.0
    adv = torch.randn(B, device=device, generator=g)
    rows = Rows(tokens, gen, adv, None, None, None)
    opt = FTISOptions()
    es = logits.element_size()
    base = None
    for cfg in GRAD_CONFIGS:
        if cfg is not None and fit_v and cfg[0] > _pow2(V):
            continue
        meta = None if cfg is None else _fwd_meta(cfg)
        out = torch.full_like(logits, float("nan"))
        try:
            stats = logp_grad.logp_grad_fwd(logits, out, rows, opt, T, meta=meta)
        except Exception as e:
            print(f"grad_fwd {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        written = bool(torch.isfinite(out).all())
        o32 = out.float()
        if base is None:
            base = (o32, stats[0].clone())
        # The gradient's entries are tiny (c_r / N): differences relative to its largest entry.
        scale = float(base[0].abs().max().clamp_min(1e-30))
        err = max(float((o32 - base[0]).abs().max()) / scale, _rel_diff(stats[0], base[1]))
        del o32
        ms = _time_ms(
            lambda m=meta, o=out: logp_grad.logp_grad_fwd(logits, o, rows, opt, T, meta=m),
            device,
        )
        d = logp_grad.grad_meta(V, es)
        shown = (
            cfg if cfg is not None else ("default", d["BLOCK_V"], d["VEC"], d["num_warps"], None)
        )
        record("grad_fwd", shown, ms, 2 * logits.numel() * es, err, written)
        del out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--shapes",
        default="16384x151936:bf16,1024x151936:bf16,16384x151936:fp32",
        help="tokens x V : dtype, comma-separated, in priority order",
    )
    ap.add_argument("--budget-s", type=float, default=90.0)
    ap.add_argument(
        "--kernels",
        default="grad,fwd,bwd",
        help="which kernels' configurations to time, of grad, fwd, bwd (the gradient-in-forward "
        "kernel first)",
    )
    ap.add_argument("--out", default=None, help="JSON file for the records")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    start = time.monotonic()
    meta = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    kernels = tuple(k for k in args.kernels.split(",") if k)
    unknown = set(kernels) - {"fwd", "bwd", "grad"}
    if unknown or not kernels:
        ap.error(f"--kernels: expected some of fwd, bwd, grad, got {args.kernels!r}")
    records: list = []
    for spec in args.shapes.split(","):
        if time.monotonic() - start > args.budget_s:
            print(f"{spec}: skipped (budget of {args.budget_s} s spent)", flush=True)
            continue
        size, dtype = spec.split(":")
        n, V = (int(x) for x in size.split("x"))
        records += tune_shape(n, V, dtype, device, device.type == "cpu", kernels)
        if args.out:
            Path(args.out).write_text(json.dumps({"meta": meta, "records": records}, indent=1))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"tune_rows: {len(records)} records in {time.monotonic() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
