"""Peak memory of `ftis_linear_loss` forward + backward against materialising the logits.

Three implementations of the same loss and gradients (hidden, weight) at Qwen2.5-1.5B's lm-head
shape (V = 151,936, H = 1536), B * T tokens in samples of T = 1024, every token a completion token
and no filter (every row carries a gradient: the worst case for the chunked op):

- "ftis_linear_loss": this library's chunked op, the logits never exist.
- "ftis_linear_loss_wacc": the same with grad_weight_accumulation="weight" (grad_weight summed in
  the weight's dtype: for bf16/fp16 no fp32 (V, H) accumulator).
- "ftis_loss": logits = hidden @ weight.T materialised once, then the fused row op.
- "reference": logits materialised, then `ref.ref_ftis_loss` (plain PyTorch, fp32 log-softmax,
  autograd): what a GRPO trainer without fused kernels does.
- "trl_fused": TRL 1.16's fused lm-head (`trl.kernels.ChunkedLogProbFunction`, what GRPOTrainer
  runs through `add_fused_lm_head` and `fused_lm_head=True`: log-probs and entropy, a tile of
  logits at a time), then TRL's GRPO formula with the same TIS weight (`bench.impls`).
- "trl_selective": logits materialised, then TRL's `selective_log_softmax` and the same formula:
  TRL's path before 1.16.

Memory is measured, not estimated. On CUDA: `torch.cuda.max_memory_allocated` above the inputs,
in process. On CPU: one subprocess per measurement; its resident-set high-water mark (VmHWM,
reset through /proc/self/clear_refs once the inputs exist, after a small warm-up run) is read
after forward + backward. The worker runs with a fixed glibc mmap threshold (64 KiB), so that
freed blocks go back to the OS and RSS follows the live tensors (what stays cached, e.g. BLAS
packing buffers, is counted against the op). It also runs under an address-space limit, so a
configuration that does not fit fails with an allocation error instead of waking the OOM killer;
such points are extrapolated from a least-squares affine fit of the measured ones (peak memory
of every implementation is affine in B * T) and marked "extrapolated".

"extra" = peak above the inputs minus the gradients returned (grad_hidden + grad_weight, the same
for every implementation): the op's working memory. It is compared to the fp32 logits,
B * T * V * 4 bytes.

    python -m bench.linear_memory                  # CPU sweep, 1k..16k tokens, fp32 (about 40 min
                                                   # on 2 cores): bench/results/linear_memory_cpu.json
    python -m bench.linear_memory --device cuda --dtype bfloat16   # on a GPU (in process)
    python -m bench.linear_memory --plot-only      # redraw the PNG from the JSON
    python -m bench.linear_memory --compare main --tokens 1024 --reps 3
        # time and peak memory of ftis_linear_loss against the materialised path (hidden @
        # weight.T, then ftis_loss), at this tree and at the revision main, in one run:
        # bench/results/linear_compare_cpu.json and .md
    python -m bench.linear_memory --trl --tokens 1024,2048,4096 --reps 2
        # time and peak memory of ftis_linear_loss against TRL's fused lm-head and its
        # materialised selective_log_softmax path, interleaved in one process per token count:
        # bench/results/linear_trl_cpu.json and .md

`--compare` and `--trl` run `bench.linear_compare`, at the default chunk size. `--compare BASE`
checks BASE out into a temporary worktree (this tree's bench/ copied over it, so both sides run
the same harness). Per token count and side, one process times both implementations, called in
turn (the order reversed every round) with the default allocator: their ratio is measured under
the same load. The sides run one after the other, the order alternating per token count. Peak
memory then comes from one `measure_one` process per implementation and side, as above.

`measure_one` measures one configuration and is what a benchmark suite imports.
"""  # noqa: E501

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
IMPLS = (
    "ftis_linear_loss",
    "ftis_linear_loss_wacc",
    "ftis_loss",
    "reference",
    "trl_fused",
    "trl_selective",
)
TRL_IMPLS = ("ftis_linear_loss", "trl_fused", "trl_selective")
VOCAB, HIDDEN, SEQ = 151_936, 1536, 1024
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The code a measurement depends on: "dirty" in a record means one of these differed from commit.
MEASURED_PATHS = (
    "ftis_kernels/ftis_linear_loss.py",
    "ftis_kernels/ftis_loss.py",
    "ftis_kernels/kernels",
    "ftis_kernels/per_sample.py",
    "ftis_kernels/validate.py",
    "ref",
    "bench/linear_memory.py",
    "bench/linear_compare.py",
)
# A CPU worker may use at most this much address space (the machine is shared: a configuration
# that needs more fails with an allocation error and is extrapolated).
CPU_ADDRESS_LIMIT = 16 << 30


def _inputs(
    n_tokens: int,
    vocab: int,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seq: int = SEQ,
):
    gen = torch.Generator(device="cpu").manual_seed(0)
    B, T = max(1, n_tokens // seq), min(seq, n_tokens)
    hidden = torch.randn(B, T, hidden_size, generator=gen).to(device=device, dtype=dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.02).to(device=device, dtype=dtype)
    tokens = torch.randint(0, vocab, (B, T), generator=gen).to(device)
    gen_logprobs = (-torch.rand(B, T, generator=gen) * 12.0 - 0.1).to(device)
    advantages = torch.randn(B, generator=gen).to(device)
    hidden.requires_grad_()
    weight.requires_grad_()
    return hidden, weight, tokens, gen_logprobs, advantages


def _loss(impl: str, inputs, chunk_size: Optional[int]) -> torch.Tensor:
    """The loss of one implementation; every row carries a gradient (filter=None)."""
    from ftis_kernels import ftis_linear_loss, ftis_loss
    from ref.ftis import ref_ftis_loss

    hidden, weight, tokens, gen_logprobs, advantages = inputs
    if impl in ("ftis_linear_loss", "ftis_linear_loss_wacc"):
        loss, _ = ftis_linear_loss(
            hidden,
            weight,
            tokens,
            gen_logprobs,
            advantages,
            filter=None,
            chunk_size=chunk_size,
            grad_weight_accumulation="weight" if impl.endswith("_wacc") else "fp32",
        )
    elif impl == "ftis_loss":
        loss, _ = ftis_loss(hidden @ weight.t(), tokens, gen_logprobs, advantages, filter=None)
    elif impl == "reference":
        loss, _ = ref_ftis_loss(hidden @ weight.t(), tokens, gen_logprobs, advantages, filter=None)
    else:
        loss = _trl_loss(impl, inputs)
    return loss


def _trl_loss(impl: str, inputs) -> torch.Tensor:
    """TRL's GRPO loss (`bench.impls`), log-probs from its fused lm-head or the materialised
    logits, with the op's default TIS weight min(pi_theta / pi_gen, 2) passed in as vLLM's
    importance_sampling_ratio: the op's work with filter=None."""
    from trl.trainer.utils import selective_log_softmax

    from bench.impls import _trl_grpo_formula, trl_fused_logprobs

    hidden, weight, tokens, gen_logprobs, advantages = inputs
    rows = dict(
        tokens=tokens, advantages=advantages, mask=torch.ones_like(tokens, dtype=torch.bool)
    )
    if impl == "trl_fused":
        logps = trl_fused_logprobs(hidden, weight, rows)
    else:
        logps = selective_log_softmax(hidden @ weight.t(), tokens)
    rows["is_weight"] = torch.exp(logps.detach() - gen_logprobs).clamp(max=2.0)
    return _trl_grpo_formula(logps, rows)


def _run(impl: str, inputs, chunk_size: Optional[int]) -> None:
    """Forward + backward of one implementation."""
    _loss(impl, inputs, chunk_size).backward()


def _proc_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _measure_here(
    impl: str,
    n_tokens: int,
    vocab: int,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
    chunk_size: Optional[int],
    seq: int = SEQ,
) -> dict:
    """Measures in this process: CUDA allocator peak, or the CPU resident-set high-water mark."""
    # Warm up first: imports, kernel libraries and autograd threads must not count as the op's.
    _run(impl, _inputs(8, 64, 16, dtype, device), chunk_size)
    inputs = _inputs(n_tokens, vocab, hidden_size, dtype, device, seq)
    hidden, weight = inputs[0], inputs[1]
    grad_bytes = (hidden.numel() + weight.numel()) * hidden.element_size()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        base = _proc_kib("VmRSS") * 1024
    start = time.perf_counter()
    _run(impl, inputs, chunk_size)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        peak = _proc_kib("VmHWM") * 1024 - base
    return dict(peak_bytes=peak, grad_bytes=grad_bytes, seconds=time.perf_counter() - start)


def _time_here(
    impls: list[str],
    n_tokens: int,
    vocab: int,
    hidden_size: int,
    dtype: torch.dtype,
    reps: int,
    seq: int = SEQ,
) -> dict:
    """fwd+bwd wall times (ms) of `impls` on CPU, called in turn `reps` times, the order reversed
    every other round, after a small warm-up of each; the load average after each round."""
    device = torch.device("cpu")
    for impl in impls:
        _run(impl, _inputs(8, 64, 16, dtype, device), None)
    inputs = _inputs(n_tokens, vocab, hidden_size, dtype, device, seq)
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    loads = []
    for r in range(reps):
        for impl in impls if r % 2 == 0 else impls[::-1]:
            inputs[0].grad = inputs[1].grad = (
                None  # the gradients are new each call, as in training
            )
            gc.collect()
            start = time.perf_counter()
            _run(impl, inputs, None)
            times[impl].append((time.perf_counter() - start) * 1e3)
        loads.append(os.getloadavg()[0])
    return dict(ms=times, loadavg_1min=loads)


def _worker_env(repo: Path) -> dict:
    """The environment of a CPU worker in `repo`: its code first on the path, no interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    return env


def measure_one(
    impl: str,
    n_tokens: int,
    *,
    vocab: int = VOCAB,
    hidden_size: int = HIDDEN,
    dtype: str = "float32",
    device: str = "cpu",
    chunk_size: Optional[int] = None,
    repo: Path = REPO,
    seq: int = SEQ,
) -> dict:
    """Peak memory of forward + backward of `impl` (one of IMPLS) on `n_tokens` tokens.

    Returns a record: impl, n_tokens, vocab, hidden, dtype, device, status ("measured" or "oom"),
    peak_bytes (above the inputs), grad_bytes (grad_hidden + grad_weight), extra_bytes
    (peak - grads), fp32_logits_bytes, extra_pct_of_fp32_logits, seconds (one untimed-quality run).
    On CPU the measurement runs in a fresh subprocess (Triton's interpreter off: the torch path)
    on the code of `repo`.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    record = dict(
        impl=impl,
        n_tokens=n_tokens,
        vocab=vocab,
        hidden=hidden_size,
        dtype=dtype,
        device=device,
        chunk_size=chunk_size,
        seq=seq,
    )
    if device.startswith("cuda"):
        try:
            result = _measure_here(
                impl,
                n_tokens,
                vocab,
                hidden_size,
                DTYPES[dtype],
                torch.device(device),
                chunk_size,
                seq,
            )
        except torch.OutOfMemoryError:
            result = None
        finally:
            gc.collect()
            torch.cuda.empty_cache()
    else:
        env = _worker_env(repo)
        # A fixed mmap threshold turns off glibc's adaptive one, under which freed blocks of up to
        # 32 MiB stay in the heap: RSS then follows the live tensors instead of the malloc cache.
        env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 16)
        job = dict(record, address_limit=CPU_ADDRESS_LIMIT)
        args = [sys.executable, "-m", "bench.linear_memory", "--worker", json.dumps(job)]
        proc = subprocess.run(args, cwd=repo, env=env, capture_output=True, text=True)
        if proc.returncode == 0:
            result = json.loads(proc.stdout.strip().splitlines()[-1])
        elif "can't allocate memory" in proc.stderr or "MemoryError" in proc.stderr:
            result = None
        else:
            raise RuntimeError(f"worker failed for {record}:\n{proc.stderr[-4000:]}")
    if device == "cpu":
        record["address_limit"] = CPU_ADDRESS_LIMIT
    logits_bytes = n_tokens * vocab * 4
    if result is None:
        return {**record, "status": "oom", "fp32_logits_bytes": logits_bytes}
    extra = result["peak_bytes"] - result["grad_bytes"]
    return {
        **record,
        **result,
        "status": "measured",
        "extra_bytes": extra,
        "fp32_logits_bytes": logits_bytes,
        "extra_pct_of_fp32_logits": 100.0 * extra / logits_bytes,
    }


def _worker(record_json: str) -> None:
    record = json.loads(record_json)
    resource.setrlimit(resource.RLIMIT_AS, (record["address_limit"], record["address_limit"]))
    result = _measure_here(
        record["impl"],
        record["n_tokens"],
        record["vocab"],
        record["hidden"],
        DTYPES[record["dtype"]],
        torch.device("cpu"),
        record["chunk_size"],
        record.get("seq", SEQ),
    )
    print(json.dumps(result))


def _extrapolate(records: list[dict]) -> list[dict]:
    """Replaces "oom" records by a least-squares affine fit of that implementation's measured
    peak over n_tokens (needs two measured points), marked status="extrapolated"."""
    out = []
    for rec in records:
        if rec["status"] != "oom":
            out.append(rec)
            continue
        pts = [
            (r["n_tokens"], r["peak_bytes"], r["grad_bytes"])
            for r in records
            if r["impl"] == rec["impl"] and r["status"] == "measured"
        ]
        if len(pts) < 2:
            out.append(rec)
            continue
        n = len(pts)
        mx = sum(p[0] for p in pts) / n
        my = sum(p[1] for p in pts) / n
        slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / sum((p[0] - mx) ** 2 for p in pts)
        peak = my + slope * (rec["n_tokens"] - mx)
        # grad_hidden + grad_weight, in the inputs' dtype
        grad = (rec["n_tokens"] + rec["vocab"]) * rec["hidden"] * DTYPES[rec["dtype"]].itemsize
        extra = peak - grad
        out.append(
            {
                **rec,
                "status": "extrapolated",
                "peak_bytes": int(peak),
                "grad_bytes": grad,
                "extra_bytes": int(extra),
                "extra_pct_of_fp32_logits": 100.0 * extra / rec["fp32_logits_bytes"],
                "fit": f"affine least squares over n_tokens={[p[0] for p in pts]}",
            }
        )
    return out


def _metadata(device: str) -> dict:
    import triton

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=REPO, capture_output=True, text=True
            ).stdout.strip()
        except OSError:
            return "unknown"

    meta = dict(
        date_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=git("rev-parse", "HEAD"),
        dirty=bool(git("status", "--porcelain", "--", *MEASURED_PATHS)),
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        machine=platform.node(),
        processor=platform.processor() or platform.machine(),
        cpu_count=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        memory_total_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        device=torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
        method=(
            "torch.cuda.max_memory_allocated above the inputs"
            if device.startswith("cuda")
            else "subprocess per measurement (MALLOC_MMAP_THRESHOLD_=65536), VmHWM after "
            "/proc/self/clear_refs, above the inputs' RSS"
        ),
    )
    return meta


def plot(path: Path) -> Path:
    """Draws extra memory against B * T from the JSON at `path`; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    fig, ax = plt.subplots(figsize=(7, 4.5))
    gib = float(1 << 30)
    ns = sorted({r["n_tokens"] for r in data["records"]})
    ax.plot(
        ns, [n * data["config"]["vocab"] * 4 / gib for n in ns], "k:", label="fp32 logits (B*T*V*4)"
    )
    for impl in IMPLS:
        recs = sorted(
            (r for r in data["records"] if r["impl"] == impl and "extra_bytes" in r),
            key=lambda r: r["n_tokens"],
        )
        if not recs:
            continue
        xs, ys = [r["n_tokens"] for r in recs], [r["extra_bytes"] / gib for r in recs]
        line = ax.plot(xs, ys, "-", label=impl)[0]
        ext = [r for r in recs if r["status"] == "extrapolated"]
        ax.plot(
            [r["n_tokens"] for r in ext],
            [r["extra_bytes"] / gib for r in ext],
            "o",
            mfc="none",
            color=line.get_color(),
        )
        meas = [r for r in recs if r["status"] == "measured"]
        ax.plot(
            [r["n_tokens"] for r in meas],
            [r["extra_bytes"] / gib for r in meas],
            "o",
            color=line.get_color(),
        )
    cfg = data["config"]
    meta = max((r["run"] for r in data["records"]), key=lambda m: m["date_utc"])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("B * T tokens")
    ax.set_ylabel("extra memory, fwd + bwd (GiB)")
    ax.set_title(
        f"V={cfg['vocab']}, H={cfg['hidden']}, {cfg['dtype']}, {meta['device']} "
        f"(hollow: extrapolated)\n{meta['date_utc']} {meta['commit'][:8]} torch {meta['torch']}",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=tuple(DTYPES))
    parser.add_argument("--tokens", default="1024,2048,4096,8192,16384")
    # By default not the variant that differs from ftis_linear_loss in bf16/fp16 only.
    default = ",".join(i for i in IMPLS if i != "ftis_linear_loss_wacc")
    parser.add_argument("--impls", default=default)
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plot-only", action="store_true")
    parser.add_argument("--compare", metavar="BASE", help="time and memory against revision BASE")
    parser.add_argument(
        "--trl",
        action="store_true",
        help="time and memory against TRL's fused and materialised paths",
    )
    parser.add_argument("--reps", type=int, default=3, help="timed calls per implementation")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--seq", type=int, default=SEQ, help="tokens per sample (T)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--time-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.chunk_size is not None and (args.compare or args.trl):
        # Their workers time and measure ftis_linear_loss at its default chunk size only.
        parser.error("--chunk-size applies to the memory sweep, not to --compare or --trl")
    if args.worker:
        _worker(args.worker)
        return
    if args.time_worker:
        job = json.loads(args.time_worker)
        dtype = DTYPES[job["dtype"]]
        sizes = (job["n_tokens"], job["vocab"], job["hidden"], dtype, job["reps"], job["seq"])
        print(json.dumps(_time_here(job["impls"], *sizes)))
        return
    if args.compare or args.trl:
        from bench.linear_compare import compare, compare_table, trl_baselines, trl_table
    if args.compare:
        tokens = [int(x) for x in args.tokens.split(",")]
        out = args.out or RESULTS / "linear_compare_cpu.json"
        sizes = (args.dtype, args.vocab, args.hidden, out, args.seq)
        records = compare(args.compare, tokens, args.reps, *sizes)
        print(compare_table(records, args.compare))
        return
    if args.trl:
        tokens = [int(x) for x in args.tokens.split(",")]
        out = args.out or RESULTS / "linear_trl_cpu.json"
        records = trl_baselines(
            tokens, args.reps, args.dtype, args.vocab, args.hidden, out, args.seq
        )
        print(trl_table(records))
        return
    device_tag = "cpu" if args.device == "cpu" else "cuda"
    out = args.out or RESULTS / f"linear_memory_{device_tag}.json"
    if not args.plot_only:
        run = _metadata(args.device)
        config = dict(
            vocab=args.vocab,
            hidden=args.hidden,
            seq=args.seq,
            dtype=args.dtype,
            chunk_size=args.chunk_size,
            options="defaults with filter=None (every row carries a gradient)",
        )
        # Earlier measurements of the same configuration are kept unless measured again.
        old = json.loads(out.read_text()) if out.exists() else {}
        measurements = old.get("measurements", []) if old.get("config") == config else []
        for impl in args.impls.split(","):
            failed = False
            for n in (int(x) for x in args.tokens.split(",")):
                # Memory grows with n: once a size does not fit, larger ones are not attempted.
                rec = (
                    measure_one(
                        impl,
                        n,
                        vocab=args.vocab,
                        hidden_size=args.hidden,
                        seq=args.seq,
                        dtype=args.dtype,
                        device=args.device,
                        chunk_size=args.chunk_size,
                    )
                    if not failed
                    else dict(
                        impl=impl,
                        n_tokens=n,
                        vocab=args.vocab,
                        hidden=args.hidden,
                        dtype=args.dtype,
                        device=args.device,
                        chunk_size=args.chunk_size,
                        status="oom",
                        note="not attempted: a smaller size did not fit",
                        fp32_logits_bytes=n * args.vocab * 4,
                    )
                )
                failed = rec["status"] == "oom"
                rec["run"] = run
                measurements = [
                    m for m in measurements if (m["impl"], m["n_tokens"]) != (impl, n)
                ] + [rec]
                print(json.dumps(rec), flush=True)
                data = dict(
                    config=config, measurements=measurements, records=_extrapolate(measurements)
                )
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(data, indent=1) + "\n")
    print(plot(out))


if __name__ == "__main__":
    main()
