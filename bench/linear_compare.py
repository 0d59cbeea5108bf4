"""`python -m bench.linear_memory --compare BASE` and `--trl` (`bench.linear_memory`'s docstring):
time and peak memory of `ftis_linear_loss` against the materialised path at this tree and at
revision BASE, or against TRL's fused lm-head and its materialised path, and their Markdown
tables. The measurements are `bench.linear_memory`'s: its `--time-worker` processes and
`measure_one`.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench.linear_memory import REPO, SEQ, TRL_IMPLS, _metadata, _worker_env, measure_one


def _record(peak: dict, timed: dict, impl: str, run: dict, **extra) -> dict:
    """One implementation's record: its peak memory (`measure_one`), `extra` fields, and the
    times of one timed run (`timed`, as the timing subprocess prints it) and the run's metadata."""
    ms = timed["ms"][impl]
    return dict(
        peak,
        **extra,
        time_ms=ms,
        min_ms=min(ms),
        median_ms=statistics.median(ms),
        loadavg_1min=timed["loadavg_1min"],
        run=run,
    )


def compare(
    base: str,
    tokens: list[int],
    reps: int,
    dtype: str,
    vocab: int,
    hidden_size: int,
    out: Path,
    seq: int = SEQ,
) -> list[dict]:
    """`--compare BASE` (`bench.linear_memory`'s docstring): records of time and peak memory per
    token count, side ("before" = BASE, "after" = this tree) and implementation; written to `out`
    (JSON) and its .md table as they come."""
    from bench.compare import _worktree

    impls = ["ftis_linear_loss", "ftis_loss"]
    run = _metadata("cpu")
    base_path, base_commit = _worktree(base)
    sides = [("after", REPO, run["commit"][:12]), ("before", base_path, base_commit)]
    records: list[dict] = []
    try:
        for i, n in enumerate(tokens):
            for version, repo, commit in sides if i % 2 == 0 else sides[::-1]:
                job = dict(impls=impls, n_tokens=n, vocab=vocab, hidden=hidden_size, dtype=dtype)
                job["seq"] = seq
                args = [sys.executable, "-m", "bench.linear_memory", "--time-worker"]
                args.append(json.dumps(dict(job, reps=reps)))
                proc = subprocess.run(
                    args, cwd=repo, env=_worker_env(repo), capture_output=True, text=True
                )
                if proc.returncode != 0:
                    raise RuntimeError(f"time worker failed for {job}:\n{proc.stderr[-4000:]}")
                timed = json.loads(proc.stdout.strip().splitlines()[-1])
                for impl in impls:
                    peak = measure_one(
                        impl,
                        n,
                        vocab=vocab,
                        hidden_size=hidden_size,
                        dtype=dtype,
                        repo=repo,
                        seq=seq,
                    )
                    records.append(_record(peak, timed, impl, run, version=version, commit=commit))
                    print(json.dumps(records[-1]), flush=True)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(dict(base=base, records=records), indent=1) + "\n")
                out.with_suffix(".md").write_text(compare_table(records, base) + "\n")
    finally:
        subprocess.run(
            ["git", "worktree", "remove", "--force", str(base_path)], cwd=REPO, capture_output=True
        )
    return records


def compare_table(records: list[dict], base: str) -> str:
    """Markdown: per token count and side, both implementations' min / median fwd+bwd time, the
    linear op's time over the materialised path's (same process), and the peaks."""
    by = {(r["n_tokens"], r["version"], r["impl"]): r for r in records}
    head = (
        "| tokens | side (commit) | ftis_linear_loss ms min / median | materialised ms min / "
        "median | linear / materialised (of mins, of medians) | peak MiB linear | extra MiB "
        "linear | peak MiB materialised | load |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    mib = float(1 << 20)
    for n in sorted({r["n_tokens"] for r in records}):
        for version in ("before", "after"):
            lin, mat = by.get((n, version, "ftis_linear_loss")), by.get((n, version, "ftis_loss"))
            if lin is None or mat is None:
                continue
            loads = lin["loadavg_1min"]

            def peak(r: dict, key: str) -> str:
                return f"{r[key] / mib:.0f}" if key in r else r["status"]

            lines.append(
                f"| {n} | {version} ({lin['commit'][:8]}) | {lin['min_ms']:.0f} / "
                f"{lin['median_ms']:.0f} | {mat['min_ms']:.0f} / {mat['median_ms']:.0f} | "
                f"{lin['min_ms'] / mat['min_ms']:.2f}x, "
                f"{lin['median_ms'] / mat['median_ms']:.2f}x | {peak(lin, 'peak_bytes')} | "
                f"{peak(lin, 'extra_bytes')} | {peak(mat, 'peak_bytes')} | "
                f"{min(loads):.1f}-{max(loads):.1f} |"
            )
    return f"Before = {base}, after = this tree; fwd+bwd, filter=None.\n\n" + "\n".join(lines)


def trl_baselines(
    tokens: list[int],
    reps: int,
    dtype: str,
    vocab: int,
    hidden_size: int,
    out: Path,
    seq: int = SEQ,
) -> list[dict]:
    """`--trl`: per token count, one process times ftis_linear_loss, TRL's fused lm-head and its
    materialised path called in turn (`_time_here`: the ratios are measured under one load), then
    one `measure_one` process per implementation measures its peak. Records written to `out`
    (JSON) and its .md table as they come."""
    run = _metadata("cpu")
    records: list[dict] = []
    for n in tokens:
        job = dict(impls=list(TRL_IMPLS), n_tokens=n, vocab=vocab, hidden=hidden_size, dtype=dtype)
        args = [sys.executable, "-m", "bench.linear_memory", "--time-worker"]
        args.append(json.dumps(dict(job, seq=seq, reps=reps)))
        proc = subprocess.run(args, cwd=REPO, env=_worker_env(REPO), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"time worker failed for {job}:\n{proc.stderr[-4000:]}")
        timed = json.loads(proc.stdout.strip().splitlines()[-1])
        for impl in TRL_IMPLS:
            peak = measure_one(impl, n, vocab=vocab, hidden_size=hidden_size, dtype=dtype, seq=seq)
            records.append(_record(peak, timed, impl, run))
            print(json.dumps(records[-1]), flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(impls=TRL_IMPLS, records=records), indent=1) + "\n")
        out.with_suffix(".md").write_text(trl_table(records) + "\n")
    return records


def trl_table(records: list[dict]) -> str:
    """Markdown: per token count, each implementation's min / median fwd+bwd time and its min
    over ftis_linear_loss's (same process), its peak and extra memory."""
    by = {(r["n_tokens"], r["impl"]): r for r in records}
    head = (
        "| tokens | implementation | ms min / median | min / ftis_linear_loss's | peak MiB | "
        "extra MiB | load |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    mib = float(1 << 20)
    for n in sorted({r["n_tokens"] for r in records}):
        base = by.get((n, "ftis_linear_loss"))
        for impl in TRL_IMPLS:
            r = by.get((n, impl))
            if r is None or base is None:
                continue
            peak, extra = (
                (f"{r['peak_bytes'] / mib:.0f}", f"{r['extra_bytes'] / mib:.0f}")
                if "peak_bytes" in r
                else (r["status"], r["status"])
            )
            loads = r["loadavg_1min"]
            lines.append(
                f"| {n} | {impl} | {r['min_ms']:.0f} / {r['median_ms']:.0f} | "
                f"{r['min_ms'] / base['min_ms']:.2f}x | {peak} | {extra} | "
                f"{min(loads):.1f}-{max(loads):.1f} |"
            )
    return (
        "fwd+bwd at the lm-head shape, filter=None, the TIS weight on; times from one process "
        "per token count, the implementations called in turn.\n\n" + "\n".join(lines)
    )
