"""Run outputs: `metrics.jsonl` (one row per node and round), the reward/accuracy curves and the
summary table drawn from it, the run's config and tokenizer."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from ftis_kernels.grpo.checkpoint import write_json_atomic

# The per-node metrics of a round, in the order nodes gather them as one float64 vector.
METRIC_KEYS = (
    "reward_mean", "acc_id", "acc_ood", "kl_mean", "filtered_frac", "clip_frac", "is_weight_mean",
    "is_truncated_frac", "loss", "tokens_sent", "bytes_sent", "bytes_per_token",
    "samples_trained", "samples_received", "dropped", "seconds",
)
_INT_KEYS = ("tokens_sent", "bytes_sent", "samples_trained", "samples_received", "dropped")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _by_node(rows: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    nodes: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        nodes.setdefault(row["node"], []).append(row)
    return {k: sorted(v, key=lambda r: r["round"]) for k, v in sorted(nodes.items())}


def smooth(values: list[float], k: int) -> list[float]:
    """Trailing moving average over up to k values."""
    return [sum(values[max(0, i - k + 1): i + 1]) / len(values[max(0, i - k + 1): i + 1])
            for i in range(len(values))]


def plot_curves(rows: list[dict[str, Any]], path: Path) -> None:
    """curves.png: reward_mean (thin: per round, thick: 5-round mean), acc_id and acc_ood per
    node against the round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for node, series in _by_node(rows).items():
        label = f"{node}: {series[0].get('name', '')}"
        color = f"C{node % 10}"
        rounds = [r["round"] for r in series]
        reward = [r["reward_mean"] for r in series]
        axes[0].plot(rounds, reward, color=color, alpha=0.3, lw=0.8)
        axes[0].plot(rounds, smooth(reward, 5), color=color, lw=2, label=label)
        for ax, key in zip(axes[1:], ("acc_id", "acc_ood")):
            pts = [(r["round"], r[key]) for r in series if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), color=color, marker=".", label=label)
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


def _first_last(series: list[dict[str, Any]], key: str, k: int) -> tuple[Any, Any]:
    """Means of the first and of the last k recorded values (reward is noisy round to round)."""
    vals = [r[key] for r in series if r.get(key) is not None]
    if not vals:
        return None, None
    k = max(1, min(k, len(vals) // 2))
    return sum(vals[:k]) / k, sum(vals[-k:]) / k


def summary_table(rows: list[dict[str, Any]]) -> str:
    """Per node: first -> last reward (5-round means) and accuracies (first and last evaluation),
    mean KL and filtered share, traffic, time per round."""
    head = ("node", "name", "rounds", "reward (5-round mean)", "acc_id", "acc_ood", "kl_mean",
            "filtered",
            "MB_sent", "B/token", "s/round")
    lines = []
    for node, series in _by_node(rows).items():
        cells = [str(node), series[0].get("name", ""), str(len(series))]
        for key, k in (("reward_mean", 5), ("acc_id", 1), ("acc_ood", 1)):
            a, b = _first_last(series, key, k)
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


def metric_rows(round_: int, vectors: Sequence[Sequence[float]], names: Sequence[str], mode: str,
                collab: str) -> list[dict[str, Any]]:
    """The metrics.jsonl rows of one round from each node's `METRIC_KEYS` vector (NaN -> None)."""
    rows = []
    for node, (vec, name) in enumerate(zip(vectors, names)):
        row: dict[str, Any] = dict(round=round_, node=node, name=name, mode=mode, collab=collab)
        for key, x in zip(METRIC_KEYS, vec):
            row[key] = None if math.isnan(x) else (int(x) if key in _INT_KEYS else x)
        rows.append(row)
    return rows


def write_run_config(out: Path, config: dict[str, Any]) -> None:
    """`config.json` (atomic) and `config.yaml`: the run's effective configuration."""
    write_json_atomic(out / "config.json", config)
    (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def start_metrics(path: Path, kept: list[dict[str, Any]]) -> None:
    """Replace `path` atomically by the rows `kept` (a resumed run's completed rounds, or none)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)


def append_metrics(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def write_outputs(out: Path, tokenizer, metrics_path: Path) -> Optional[str]:
    """At the end of a run: the tokenizer, `curves.png` and `summary.txt`; returns the summary
    with the paths to print (None without any metrics)."""
    out.joinpath("tokenizer").mkdir(exist_ok=True)
    tokenizer.save_pretrained(out / "tokenizer")
    rows = read_metrics(metrics_path)
    if not rows:
        return None
    plot_curves(rows, out / "curves.png")
    table = summary_table(rows)
    (out / "summary.txt").write_text(table + "\n")
    return f"{table}\n\nmetrics: {metrics_path}\ncurves:  {out / 'curves.png'}"
