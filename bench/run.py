"""Run the benchmark: `python -m bench.run --device cuda|cpu --out DIR`.

Writes DIR/results.json (every record with its device, versions, commit and date), DIR/results.md
(the tables, then the targets the run measured: `bench.report.targets`) and DIR/<family>.png
(drawn from the JSON by `bench.plot`). For each case x implementation x {fwd, fwd+bwd}: warm-up,
one call for the peak memory, then timed repetitions, and the loss against the eager reference in
fp32 (the implementations do the same work, or the comparison means nothing). The roofline
ceilings (copy bandwidth, matmul rates) are measured at the start of the same run.

On CUDA everything runs in this process. On CPU each measurement runs in a fresh subprocess
(`--worker`), which is what makes the resident-set peak honest (see `bench.measure`): the timed
calls first, with the default allocator, then the peak-memory call with large blocks mmapped;
the CPU path of the library is the chunked PyTorch one (TRITON_INTERPRET is removed from the
workers' environment).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from bench import measure
from bench.impls import IMPLS, MODES, prepare, unavailable
from bench.workload import CPU_CASES, CUDA_CASES, FTIS_OPTIONS, TIS_OPTIONS, Case, make_inputs

log = logging.getLogger("bench.run")

WORKER_TIMEOUT_S = 600


def reference_loss(case: Case, inputs: dict, options: dict) -> float:
    """The eager reference's loss in fp32 on the same inputs, without gradients."""
    from ref import ref_ftis_loss

    with torch.no_grad():
        logits = (
            inputs["logits"] if case.family == "logits" else inputs["hidden"] @ inputs["weight"].t()
        )
        loss, _ = ref_ftis_loss(
            logits,
            inputs["tokens"],
            inputs["gen_logprobs"],
            inputs["advantages"],
            inputs["mask"],
            **options,
        )
    return float(loss)


def measure_one(
    case: Case, impl: str, mode: str, device: torch.device, inputs: dict, reps: dict
) -> dict:
    """Raw measurements of one implementation on one case: time, peak memory, loss."""
    reason = unavailable(impl, case.family, mode, device)
    if reason is not None:
        return {"status": "unavailable", "reason": reason}
    prep = prepare(impl, case, inputs, mode)
    loss = None
    for _ in range(reps.get("warmup", 2)):  # the first call compiles (Triton, torch.compile)
        if prep.restore is not None:
            prep.restore()
        loss = float(prep.run())
    measure.sync(device)
    t = measure.time_fn(
        prep.run, device, prep.restore, **{k: v for k, v in reps.items() if k != "warmup"}
    )
    if device.type == "cpu":
        measure.mmap_large_blocks()
    peak = measure.peak_extra_bytes(prep.run, device, prep.restore)
    return {
        "status": "ok",
        "time_ms": t,
        "peak_extra_bytes": peak,
        "loss": loss,
        "options": prep.options,
        "note": prep.note,
        "loadavg_1min_after": os.getloadavg()[0],
    }


def finish_record(raw: dict, case: Case, impl: str, mode: str, ceilings: dict, meta: dict) -> dict:
    """A raw measurement plus the case, the roofline and the run's metadata."""
    rec = {"case": case.as_dict(), "impl": impl, "mode": mode, **raw, **meta}
    work = measure.work_model(case, mode)
    s = torch.empty((), dtype=case.torch_dtype).element_size()
    logits_bytes = case.tokens * case.V * s
    dtype = case.dtype if case.dtype in ceilings["matmul_TFLOPs"] else "float32"
    tflops = ceilings["matmul_TFLOPs"].get(dtype)
    roof = measure.roofline_ms(work, ceilings["copy_GBps"], tflops)
    rec.update(
        work_bytes=work["bytes"],
        work_flops=work["flops"],
        logits_bytes=logits_bytes,
        roofline_ms=roof,
        roofline_bound="matmul"
        if work["flops"] and work["flops"] / (tflops * 1e12) * 1e3 >= roof
        else "memory",
    )
    if raw.get("status") == "ok":
        med = raw["time_ms"]["median"]
        rec["roofline_fraction"] = roof / med
        rec["achieved_GBps"] = work["bytes"] / (med * 1e-3) / 1e9
        rec["achieved_TFLOPs"] = work["flops"] / (med * 1e-3) / 1e12 if work["flops"] else None
        rec["peak_over_logits"] = raw["peak_extra_bytes"] / logits_bytes
        if raw.get("loss_ref") is not None:
            rec["loss_rel_err"] = abs(raw["loss"] - raw["loss_ref"]) / max(
                abs(raw["loss_ref"]), 1e-30
            )
    return rec


def worker(spec: dict) -> dict:
    """One measurement in this (fresh) process; the CPU path's unit of work."""
    device = torch.device(spec["device"])
    case = Case.from_dict(spec["case"])
    inputs = make_inputs(case, device)
    options = FTIS_OPTIONS if spec["impl"] == "ftis_loss_filter" else TIS_OPTIONS
    # Before the measurement: its memory is freed (and unmapped) before the peak is reset.
    loss_ref = reference_loss(case, inputs, options)
    gc.collect()
    try:
        raw = measure_one(case, spec["impl"], spec["mode"], device, inputs, spec["reps"])
    except Exception as e:  # recorded, not fatal: one implementation failing must not end the run
        return {"status": "error", "reason": f"{type(e).__name__}: {e}"[:500]}
    raw["loss_ref"] = loss_ref
    return raw


def run_worker_subprocess(spec: dict, repo: Path = measure.REPO) -> dict:
    """One measurement in a fresh process, with the library (and harness) of `repo`."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    # The default allocator for the timed calls (measure_one switches it for the peak call).
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "bench.run", "--worker", json.dumps(spec)]
    try:
        proc = subprocess.run(
            cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return {"status": "error", "reason": f"worker timed out after {WORKER_TIMEOUT_S} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {
            "status": "error",
            "reason": f"worker exit {proc.returncode}: {proc.stderr.strip()[-400:]}",
        }
    return json.loads(lines[-1])


def measure_in_process(
    case: Case,
    impl: str,
    mode: str,
    device: torch.device,
    inputs: dict,
    reps: dict,
    ref_cache: dict,
) -> dict:
    try:
        raw = measure_one(case, impl, mode, device, inputs, reps)
    except torch.cuda.OutOfMemoryError as e:
        raw = {"status": "oom", "reason": str(e).splitlines()[0][:300]}
    except Exception as e:  # recorded, not fatal
        raw = {"status": "error", "reason": f"{type(e).__name__}: {e}"[:500]}
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if raw["status"] == "ok":
        key = json.dumps(raw["options"], sort_keys=True)
        if key not in ref_cache:
            try:
                ref_cache[key] = reference_loss(case, inputs, raw["options"])
            except torch.cuda.OutOfMemoryError:
                ref_cache[key] = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        raw["loss_ref"] = ref_cache[key]
    return raw


def measure_ceilings(device: torch.device) -> dict:
    bw = measure.copy_bandwidth(device)
    rates = {}
    for name, dt in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        rates[name] = measure.matmul_rate(device, dt)["TFLOPs"]
    return {
        "copy_GBps": bw["GBps"],
        "copy_bytes": bw["bytes"],
        "matmul_TFLOPs": rates,
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
    }


def select(
    cases: tuple[Case, ...],
    impls: Optional[list[str]],
    families: Optional[list[str]],
    limit: Optional[int],
):
    out = []
    for case in cases:
        if families and case.family not in families:
            continue
        names = [n for n in IMPLS[case.family] if (case.impls is None or n in case.impls)]
        if impls:
            names = [n for n in names if n in impls]
        out.append((case, names))
    return out[:limit] if limit else out


def run(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = measure.metadata(device)
    log.info(
        "device %s, torch %s, triton %s, commit %s",
        meta["device_name"],
        meta["torch"],
        meta["triton"],
        meta["commit"],
    )
    ceilings = measure_ceilings(device)
    log.info(
        "copy %.1f GB/s, matmul bf16 %.1f / fp32 %.1f TFLOP/s",
        ceilings["copy_GBps"],
        ceilings["matmul_TFLOPs"]["bfloat16"],
        ceilings["matmul_TFLOPs"]["float32"],
    )
    cases = CUDA_CASES if device.type == "cuda" else CPU_CASES
    plan = select(cases, args.impls, args.families, args.max_cases)
    reps = {
        "warmup": args.warmup,
        "min_reps": args.min_reps,
        "max_reps": args.max_reps,
        "min_time_s": args.min_time_s,
    }
    start = time.monotonic()
    records = []

    def save() -> dict:
        results = {
            "meta": meta,
            "ceilings": ceilings,
            "workload": TIS_OPTIONS,
            "elapsed_s": time.monotonic() - start,
            "records": records,
        }
        (out / "results.json").write_text(json.dumps(results, indent=1))
        return results

    for case, names in plan:
        inputs = None
        ref_cache: dict = {}
        for impl in names:
            for mode in MODES:
                reason = unavailable(impl, case.family, mode, device)
                if reason is not None:
                    raw = {"status": "unavailable", "reason": reason}
                elif args.budget_s and time.monotonic() - start > args.budget_s:
                    raw = {"status": "skipped", "reason": f"time budget of {args.budget_s} s spent"}
                elif device.type == "cpu":
                    spec = {
                        "device": "cpu",
                        "case": case.as_dict(),
                        "impl": impl,
                        "mode": mode,
                        "reps": reps,
                    }
                    raw = run_worker_subprocess(spec)
                else:
                    if inputs is None:
                        inputs = make_inputs(case, device)
                    raw = measure_in_process(case, impl, mode, device, inputs, reps, ref_cache)
                records.append(finish_record(raw, case, impl, mode, ceilings, meta))
                save()  # after every record: a run killed by a time limit keeps what it measured
                t = raw.get("time_ms", {}).get("median")
                log.info(
                    "%-24s %-20s %-7s %s",
                    case.label,
                    impl,
                    mode,
                    f"{t:9.3f} ms  peak {raw['peak_extra_bytes'] / 2**20:9.1f} MiB"
                    if raw["status"] == "ok"
                    else f"{raw['status']}: {raw.get('reason', '')}",
                )
        del inputs
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results = save()
    from bench import plot, report

    (out / "results.md").write_text(report.markdown(results) + "\n" + report.targets(results))
    plot.plot_all(results, out)
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--out", default="bench/results/latest")
    p.add_argument(
        "--impls", type=lambda s: s.split(","), default=None, help="comma-separated subset"
    )
    p.add_argument("--families", type=lambda s: s.split(","), default=None, help="logits,linear")
    p.add_argument("--max-cases", type=int, default=None, help="only the first N cases of the grid")
    p.add_argument(
        "--budget-s", type=float, default=None, help="record the rest as skipped after this"
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first (the first compiles)")
    p.add_argument("--min-reps", type=int, default=5)
    p.add_argument("--max-reps", type=int, default=50)
    p.add_argument("--min-time-s", type=float, default=1.0)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    results = run(args)
    print((Path(args.out) / "results.md").read_text())
    bad = [r for r in results["records"] if r["status"] in ("error", "oom")]
    if bad:
        log.warning("%d measurement(s) failed: see 'reason' in results.json", len(bad))


if __name__ == "__main__":
    main()
