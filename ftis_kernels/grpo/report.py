"""Run outputs drawn from `metrics.jsonl`: the reward/accuracy curves and the summary table."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _by_node(rows: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    nodes: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        nodes.setdefault(row["node"], []).append(row)
    return {k: sorted(v, key=lambda r: r["round"]) for k, v in sorted(nodes.items())}


def plot_curves(rows: list[dict[str, Any]], path: Path) -> None:
    """curves.png: reward_mean, acc_id and acc_ood per node against the round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for node, series in _by_node(rows).items():
        label = f"{node}: {series[0].get('name', '')}"
        for ax, key in zip(axes, ("reward_mean", "acc_id", "acc_ood")):
            pts = [(r["round"], r[key]) for r in series if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="." if key != "reward_mean" else None, label=label)
    mode = rows[0]["mode"] if rows else ""
    for ax, title in zip(axes, ("train reward (sampled)", "accuracy, in-distribution (greedy)",
                                "accuracy, out-of-distribution (greedy)")):
        ax.set_title(title)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"collaborative GRPO, {mode}")
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def _fmt(x: Any) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def _first_last(series: list[dict[str, Any]], key: str) -> tuple[Any, Any]:
    vals = [r[key] for r in series if r.get(key) is not None]
    return (vals[0], vals[-1]) if vals else (None, None)


def summary_table(rows: list[dict[str, Any]]) -> str:
    """Per node: first -> last reward and accuracies, mean KL / filtered share, traffic, time."""
    head = ("node", "name", "rounds", "reward", "acc_id", "acc_ood", "kl_mean", "filtered",
            "MB_sent", "B/token", "s/round")
    lines = []
    for node, series in _by_node(rows).items():
        cells = [str(node), series[0].get("name", ""), str(len(series))]
        for key in ("reward_mean", "acc_id", "acc_ood"):
            a, b = _first_last(series, key)
            cells.append(f"{_fmt(a)} -> {_fmt(b)}")
        n = len(series)
        tokens = sum(r["tokens_sent"] for r in series)
        sent = sum(r["bytes_sent"] for r in series)
        cells += [
            _fmt(sum(r["kl_mean"] for r in series) / n),
            _fmt(sum(r["filtered_frac"] for r in series) / n),
            f"{sent / 1e6:.3f}",
            _fmt(sent / tokens) if tokens else "-",
            f"{sum(r['seconds'] for r in series) / n:.2f}",
        ]
        lines.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(cells, widths)) for cells in lines]
    return "\n".join(out)
