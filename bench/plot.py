"""PNG plots drawn from a results.json: `python -m bench.plot DIR/results.json [--out DIR]`.

One figure per family: rows time (ms, log scale, with the roofline as a black tick per case) and
peak extra memory (MiB, log scale); columns fwd and fwd+bwd; grouped bars, one per implementation.
Each figure's title names the machine, the date and the commit.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MiB = 2**20


def _title(results: dict, family: str) -> str:
    m = results["meta"]
    return (
        f"F-TIS loss, {family} family: {m['device_name']}\n"
        f"torch {m['torch']}, triton {m['triton']}, commit {m['commit']}, {m['date']}"
    )


def plot_family(results: dict, family: str, path: Path) -> bool:
    recs = [r for r in results["records"] if r["case"]["family"] == family and r["status"] == "ok"]
    if not recs:
        return False
    labels = list(dict.fromkeys(r["case"]["label"] for r in recs))
    impls = list(dict.fromkeys(r["impl"] for r in recs))
    modes = ("fwd", "fwd+bwd")
    fig, axes = plt.subplots(2, 2, figsize=(max(8, 1.6 * len(labels) * 2), 8), squeeze=False)
    width = 0.8 / len(impls)
    for col, mode in enumerate(modes):
        for row, (key, unit) in enumerate((("time", "ms"), ("memory", "MiB"))):
            ax = axes[row][col]
            for i, impl in enumerate(impls):
                xs, ys, lo, hi = [], [], [], []
                for j, label in enumerate(labels):
                    r = next(
                        (
                            r
                            for r in recs
                            if r["impl"] == impl
                            and r["mode"] == mode
                            and r["case"]["label"] == label
                        ),
                        None,
                    )
                    if r is None:
                        continue
                    xs.append(j + (i - (len(impls) - 1) / 2) * width)
                    if key == "time":
                        t = r["time_ms"]
                        ys.append(t["median"])
                        lo.append(t["median"] - t["p20"])
                        hi.append(t["p80"] - t["median"])
                    else:
                        ys.append(max(r["peak_extra_bytes"], 1) / MiB)
                if xs:
                    err = [lo, hi] if key == "time" else None
                    # One colour per implementation across all four panels.
                    ax.bar(xs, ys, width, yerr=err, label=impl, capsize=2, color=f"C{i % 10}")
            if key == "time":
                for j, label in enumerate(labels):
                    r = next(
                        (r for r in recs if r["mode"] == mode and r["case"]["label"] == label), None
                    )
                    if r is not None:
                        ax.hlines(
                            r["roofline_ms"],
                            j - 0.45,
                            j + 0.45,
                            colors="black",
                            linewidth=2,
                            label="roofline" if j == 0 else None,
                        )
            ax.set_yscale("log")
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels(labels, rotation=15, fontsize=8)
            ax.set_ylabel(f"{'time' if key == 'time' else 'peak extra memory'} ({unit})")
            ax.set_title(
                f"{mode}: {'median time, p20-p80' if key == 'time' else 'peak memory over inputs'}",
                fontsize=10,
            )
            ax.grid(axis="y", alpha=0.3, which="both")
    handles = [plt.Rectangle((0, 0), 1, 1, color=f"C{i % 10}") for i in range(len(impls))]
    handles.append(plt.Line2D([0], [0], color="black", linewidth=2))
    fig.legend(
        handles, [*impls, "roofline"], loc="lower center", ncol=min(len(impls) + 1, 8), fontsize=8
    )
    fig.suptitle(_title(results, family), fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def plot_all(results: dict, out: Path) -> list[Path]:
    paths = []
    Path(out).mkdir(parents=True, exist_ok=True)
    for family in ("logits", "linear"):
        path = Path(out) / f"{family}.png"
        if plot_family(results, family, path):
            paths.append(path)
    return paths


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    with open(a.results) as f:
        res = json.load(f)
    for p in plot_all(res, Path(a.out) if a.out else Path(a.results).parent):
        print(p)
