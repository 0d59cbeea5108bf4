"""`ftis_linear_loss`'s chunk size, timed: `python -m bench.linear_chunks --out c.json` (a GPU).

Forward + backward of the benchmark's linear case (`bench/workload.py`: B * T tokens in samples of
1024, bf16, the TIS options) at each hidden size, each chunk size and each way of summing the
weight gradient over the chunks (`grad_weight_accumulation`: "fp32", the default, re-reads and
re-writes a (V, H) fp32 accumulator per chunk; "weight" sums in the weight's dtype, half those
bytes and no accumulator), in one process: the median time (CUDA events) and the peak memory above
the inputs, beside the matmul roofline of the three GEMMs the op does (6 N H V flops at the bf16
rate measured in the same run). The default chunk (`chunks.auto_chunk_size`) is marked. On CPU
(`--device cpu`) it checks the mechanics on a tiny shape; its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench import measure
from bench.profile_ops import median_ms
from bench.workload import TIS_OPTIONS, Case, make_inputs
from ftis_kernels import chunks, ftis_linear_loss


def sweep(
    tokens: int,
    V: int,
    H: int,
    sizes: list[int],
    device: torch.device,
    reps: int,
    accumulations: tuple[str, ...] = ("fp32",),
):
    T = min(1024, tokens)
    case = Case("linear", tokens // T, T, V, "bfloat16", H=H)
    inputs = make_inputs(case, device)
    h = inputs["hidden"].detach().requires_grad_()
    w = inputs["weight"].detach().requires_grad_()
    rows = [inputs[k] for k in ("tokens", "gen_logprobs", "advantages", "mask")]
    auto = chunks.auto_chunk_size(V, T)
    records = []
    for accumulation, size in [(a, s) for a in accumulations for s in [None, *sizes]]:

        def step(size=size, accumulation=accumulation):
            loss, _ = ftis_linear_loss(
                h,
                w,
                *rows,
                chunk_size=size,
                grad_weight_accumulation=accumulation,
                **TIS_OPTIONS,
            )
            torch.autograd.grad(loss, (h, w))

        ms = median_ms(step, device, reps, warmup=2)
        peak = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        rec = dict(
            tokens=tokens,
            V=V,
            H=H,
            chunk_size=size or auto,
            default=size is None,
            grad_weight_accumulation=accumulation,
            ms=ms,
            peak_extra_bytes=peak,
            logits_bf16_bytes=tokens * V * 2,
        )
        records.append(rec)
        print(
            f"{tokens}x{V} H{H} chunk {rec['chunk_size']}"
            f"{' (default chunk)' if size is None else ''}"
            f", weight gradient summed in {accumulation}: {ms:.2f} ms,"
            f" peak {'' if peak is None else f'{peak / 2**20:.0f} MiB'}",
            flush=True,
        )
    return records


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, nargs="+", default=[1536, 4096])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument(
        "--accumulation",
        nargs="+",
        choices=("fp32", "weight"),
        default=["fp32", "weight"],
        help="grad_weight_accumulation values to time (default: both)",
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    meta = measure.metadata(device)
    rate = measure.matmul_rate(device, torch.bfloat16)["TFLOPs"] if device.type == "cuda" else None
    records = []
    for H in args.hidden:
        for rec in sweep(
            args.tokens, args.vocab, H, args.sizes, device, args.reps, tuple(args.accumulation)
        ):
            if rate:
                rec["matmul_roofline_ms"] = 6 * rec["tokens"] * H * rec["V"] / rate / 1e9
                rec["of_roofline"] = rec["matmul_roofline_ms"] / rec["ms"]
            records.append(rec)
        if args.out:
            Path(args.out).write_text(
                json.dumps({"meta": meta, "bf16_TFLOPs": rate, "records": records}, indent=1)
            )
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
