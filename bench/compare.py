"""Before / after on CPU in one run: `python -m bench.compare --base main --out DIR`.

Measures the CPU cases (`workload.CPU_CASES`) at this working tree ("after") and at the git
revision BASE ("before"), in one invocation: BASE is checked out into a temporary worktree and
this tree's `bench/` is copied over it, so both sides run the same harness and only the library
differs. The library's own implementations are measured on both sides, one right after the
other, the order alternating, so that the load of a shared machine falls on both alike; the
references (eager, torch.compile, TRL) are the same code on both sides and run once. Every
record carries the load average after it.

Writes DIR/results.json (the "after" records in `bench.run`'s format, with the tables in
DIR/results.md and the plots), DIR/compare.json (every record, tagged "after" or "before") and
DIR/compare.md (the side-by-side table).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench import measure
from bench.impls import IMPLS, MODES, unavailable
from bench.run import finish_record, measure_ceilings, run_worker_subprocess
from bench.workload import CPU_CASES, TIS_OPTIONS

log = logging.getLogger("bench.compare")

# The library's implementations: measured at both revisions.
OURS = ("ftis_loss", "ftis_loss_inplace", "ftis_linear_loss")
# What each of ours is compared against, in the table.
BASELINES = ("ref_eager", "trl_eager", "ref_compile", "ftis_loss")


def _worktree(base: str) -> tuple[Path, str]:
    """A temporary detached worktree of `base` with this tree's bench/ copied in."""
    path = Path(tempfile.mkdtemp(prefix="ftis-bench-base-"))
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(path), base],
        cwd=measure.REPO,
        check=True,
        capture_output=True,
    )
    shutil.copytree(measure.REPO / "bench", path / "bench", dirs_exist_ok=True)
    commit = subprocess.run(
        ["git", "rev-parse", base], cwd=measure.REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    return path, commit[:12]


def _table(records: list[dict]) -> str:
    """One row per (case, ours, mode): before, after, and after against each baseline."""
    ok = {
        (r["case"]["label"], r["impl"], r["mode"], r["version"]): r
        for r in records
        if r["status"] == "ok"
    }

    def ms(key, stat="median"):
        r = ok.get(key)
        return None if r is None else r["time_ms"][stat]

    head = (
        "| shape | implementation | mode | before ms median (min) | after ms median (min) | "
        "after / before (of mins) | "
        + " | ".join(f"after / {b} (of mins)" for b in BASELINES)
        + " | after of roofline (of min) | peak MiB before | peak MiB after | load after |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        if r["version"] != "after" or r["impl"] not in OURS or r["status"] != "ok":
            continue
        label, impl, mode = r["case"]["label"], r["impl"], r["mode"]
        before, after = ms((label, impl, mode, "before")), ms((label, impl, mode, "after"))
        bmin = ms((label, impl, mode, "before"), "min")
        amin = ms((label, impl, mode, "after"), "min")
        rb = ok.get((label, impl, mode, "before"))
        cells = [
            label,
            impl,
            mode,
            f"{before:.0f} ({bmin:.0f})" if before else "",
            f"{after:.0f} ({amin:.0f})",
            f"{after / before:.2f}x ({amin / bmin:.2f}x)" if before else "",
        ]
        for b in BASELINES:
            t, tmin = ms((label, b, mode, "after")), ms((label, b, mode, "after"), "min")
            cells.append(f"{after / t:.2f}x ({amin / tmin:.2f}x)" if t and b != impl else "")
        cells += [
            f"{r['roofline_fraction']:.0%} ({r['roofline_ms'] / amin:.0%})",
            f"{rb['peak_extra_bytes'] / 2**20:.0f}" if rb else "",
            f"{r['peak_extra_bytes'] / 2**20:.0f}",
            f"{r['loadavg_1min_after']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.splitlines()[0])
    p.add_argument("--base", default="main", help="git revision measured as 'before'")
    p.add_argument("--out", default="bench/results/cpu")
    p.add_argument("--impls", type=lambda s: s.split(","), default=None, help="a subset, a,b,c")
    p.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES), help="fwd,fwd+bwd")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--min-reps", type=int, default=5)
    p.add_argument("--max-reps", type=int, default=20)
    p.add_argument("--min-time-s", type=float, default=1.0)
    p.add_argument("--table", help="only print the table of an earlier run's compare.json")
    args = p.parse_args(argv)
    if args.table:
        print(_table(json.loads(Path(args.table).read_text())["records"]))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu")
    meta = measure.metadata(device)
    ceilings = measure_ceilings(device)
    base_path, base_commit = _worktree(args.base)
    reps = {
        "warmup": args.warmup,
        "min_reps": args.min_reps,
        "max_reps": args.max_reps,
        "min_time_s": args.min_time_s,
    }
    start = time.monotonic()
    records: list[dict] = []
    flip = False
    try:
        for case in CPU_CASES:
            for impl in IMPLS[case.family]:
                if args.impls and impl not in args.impls:
                    continue
                for mode in args.modes:
                    if unavailable(impl, case.family, mode, device) is not None:
                        continue
                    spec = {
                        "device": "cpu",
                        "case": case.as_dict(),
                        "impl": impl,
                        "mode": mode,
                        "reps": reps,
                    }
                    sides = [("after", measure.REPO, meta["commit"])]
                    if impl in OURS:
                        sides.append(("before", base_path, base_commit))
                        flip = not flip
                        if flip:
                            sides.reverse()
                    for version, repo, commit in sides:
                        raw = run_worker_subprocess(spec, repo)
                        rec = finish_record(raw, case, impl, mode, ceilings, meta)
                        rec.update(version=version, commit=commit)
                        records.append(rec)
                        t = raw.get("time_ms", {}).get("median")
                        log.info(
                            "%-22s %-18s %-7s %-6s %s  load %.1f",
                            case.label,
                            impl,
                            mode,
                            version,
                            f"{t:9.1f} ms" if t else raw["status"],
                            os.getloadavg()[0],
                        )
                    common = {
                        "meta": meta,
                        "ceilings": ceilings,
                        "workload": TIS_OPTIONS,
                        "elapsed_s": time.monotonic() - start,
                    }
                    (out / "compare.json").write_text(
                        json.dumps(dict(common, base=base_commit, records=records), indent=1)
                    )
    finally:
        subprocess.run(
            ["git", "worktree", "remove", "--force", str(base_path)],
            cwd=measure.REPO,
            capture_output=True,
        )
    from bench import plot, report

    after = [r for r in records if r["version"] == "after"]
    results = dict(common, records=after)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(report.markdown(results))
    plot.plot_all(results, out)
    table = _table(records)
    (out / "compare.md").write_text(
        f"Before = {args.base} ({base_commit}), after = {meta['commit']}, measured alternately "
        f"in one run; load average {meta['loadavg_1min']:.1f} at the start.\n\n{table}\n"
    )
    print(table)


if __name__ == "__main__":
    main()
