"""Cost of the entropy's running sum in the row kernels on CPU: the forward row pass with and
without it, the backward with and without the entropy gradient, side by side in one run
(alternating rounds, so that a busy machine slows both variants alike), on the PyTorch CPU path
and on the Triton kernels under the interpreter (TRITON_INTERPRET=1; the interpreter's times say
little about a GPU).

    python -m bench.entropy_cost [--rows 512] [--vocab 32000] [--rounds 7] [--interpreter-vocab 2048]
"""  # noqa: E501

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.utils.benchmark as benchmark

from ftis_kernels.kernels import logp_lse, logp_lse_cpu


def _measure(fns: dict, rounds: int) -> dict[str, float]:
    """Median seconds of each fn over `rounds` alternating rounds, on torch's threads (the count
    the report names; `benchmark.Timer` alone runs on 1)."""
    threads = torch.get_num_threads()
    times: dict[str, list[float]] = {label: [] for label in fns}
    for _ in range(rounds):
        for label, fn in fns.items():
            timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=threads)
            times[label].append(timer.timeit(1).median)
    return {label: statistics.median(t) for label, t in times.items()}


def _variants(fwd, bwd, logits, tokens):
    B, T, _ = logits.shape
    logp, row_max, log_sum, entropy = fwd(logits, tokens, None, 1.0, with_entropy=True)
    coef = torch.randn(B, T) / (B * T)
    ecoef = torch.randn(B, T) / (B * T)
    out = torch.empty_like(logits)
    return {
        "fwd with the entropy sum": lambda: fwd(logits, tokens, None, 1.0, with_entropy=True),
        "fwd without": lambda: fwd(logits, tokens, None, 1.0, with_entropy=False),
        "bwd with the entropy gradient": lambda: bwd(
            logits, tokens, row_max, log_sum, coef, 1.0, out, entropy, ecoef
        ),
        "bwd without": lambda: bwd(logits, tokens, row_max, log_sum, coef, 1.0, out),
    }


def _report(title: str, medians: dict[str, float], rounds: int) -> None:
    print(f"{title}, median of {rounds}:")
    labels = list(medians)
    for with_label, without_label in (labels[0:2], labels[2:4]):
        w, wo = medians[with_label], medians[without_label]
        print(f"  {with_label:32s} {1e3 * w:9.2f} ms")
        print(f"  {without_label:32s} {1e3 * wo:9.2f} ms   ratio {w / wo:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=512, help="B * T (B = 8)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--interpreter-vocab", type=int, default=2048)
    parser.add_argument("--interpreter-rows", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    B, T, V = 8, args.rows // 8, args.vocab
    logits, tokens = torch.randn(B, T, V), torch.randint(0, V, (B, T))
    fns = _variants(logp_lse_cpu.logp_lse_fwd_torch, logp_lse_cpu.logits_bwd_torch, logits, tokens)
    title = f"PyTorch CPU path, {B * T} x {V} fp32 logits, {threads} threads"
    _report(title, _measure(fns, args.rounds), args.rounds)
    if logp_lse.triton_is_interpreted():
        B, T, V = 2, args.interpreter_rows // 2, args.interpreter_vocab
        logits, tokens = torch.randn(B, T, V), torch.randint(0, V, (B, T))
        fns = _variants(logp_lse.logp_lse_fwd, logp_lse.logits_bwd, logits, tokens)
        title = f"Triton kernels under the interpreter, {B * T} x {V} fp32"
        _report(title, _measure(fns, max(3, args.rounds // 2)), max(3, args.rounds // 2))
    else:
        print(
            f"(Triton interpreter not active: TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')})"  # noqa: E501
        )


if __name__ == "__main__":
    main()
