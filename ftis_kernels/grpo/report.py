"""Run outputs: `metrics.jsonl` (one row per node and round), the reward/accuracy curves and the
summary table drawn from it, the run's config and tokenizer."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import yaml

from ftis_kernels.grpo.audit import DEFENCE_KEYS, json_line
from ftis_kernels.grpo.checkpoint import write_json_atomic

# The per-node metrics of a round, in the order nodes gather them as one float64 vector.
METRIC_KEYS = (
    "reward_mean",
    "acc_id",
    "acc_ood",
    "kl_mean",
    "filtered_frac",
    "clip_frac",
    "is_weight_mean",
    "is_truncated_frac",
    "loss",
    "tokens_sent",
    "bytes_sent",
    "bytes_per_token",
    "samples_trained",
    "samples_received",
    "dropped",
    "seconds",
    "grad_norm",
    "skipped",
    "sample_acc",
    "zero_adv_groups",
    *DEFENCE_KEYS,
    "staleness_mean",
    "samples_stale",
)
# The metrics that measure wall time: the only ones a rerun on the same machine may change.
WALL_TIME_KEYS = ("seconds",)
_INT_KEYS = (
    "tokens_sent",
    "bytes_sent",
    "samples_trained",
    "samples_received",
    "dropped",
    "skipped",
    *(k for k in DEFENCE_KEYS if k.startswith("dropped_")),
    "samples_stale",
)

log = logging.getLogger("ftis_kernels.grpo")


def _metrics_row(line: str) -> dict[str, Any]:
    row = json.loads(line)
    if not (
        isinstance(row, dict)
        and isinstance(row.get("round"), int)
        and isinstance(row.get("node"), int)
    ):
        raise ValueError("not a metrics row: a JSON object with integer 'round' and 'node'")
    return row


def without_wall_time(line: str) -> str:
    """A metrics.jsonl line without its `WALL_TIME_KEYS`, the rest as written: two runs of one
    command on one machine give the same such lines, byte for byte."""
    row = json.loads(line)
    return json.dumps({k: v for k, v in row.items() if k not in WALL_TIME_KEYS})


def read_metrics(path: Path, warn: bool = True) -> list[dict[str, Any]]:
    """The rows of `metrics.jsonl`. A torn or garbage last line (a run killed mid-write) is
    dropped (with a warning if `warn`); a bad line before it is a ValueError naming its line."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    numbered = [(i, line) for i, line in enumerate(lines, 1) if line.strip()]
    rows = []
    for k, (number, line) in enumerate(numbered):
        try:
            rows.append(_metrics_row(line))
        except ValueError as exc:
            if k < len(numbered) - 1:
                raise ValueError(f"{path}, line {number}: {exc}; fix or delete that line") from None
            if warn:
                log.warning(
                    "%s, line %d (the last): dropped a torn or garbage row (%s), as a "
                    "run killed mid-write leaves it",
                    path,
                    number,
                    exc,
                )
    return rows


def _by_node(rows: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    nodes: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        nodes.setdefault(row["node"], []).append(row)
    return {k: sorted(v, key=lambda r: r["round"]) for k, v in sorted(nodes.items())}


def skipped_in_a_row(rows: list[dict[str, Any]]) -> dict[int, int]:
    """Per node, how many of its last rounds in `rows` skipped their optimizer step."""
    out = {}
    for node, series in _by_node(rows).items():
        flags = [bool(r.get("skipped")) for r in series]
        out[node] = len(flags) - max((i + 1 for i, f in enumerate(flags) if not f), default=0)
    return out


def smooth(values: list[float], k: int) -> list[float]:
    """Trailing moving average over up to k values."""
    return [
        sum(values[max(0, i - k + 1) : i + 1]) / len(values[max(0, i - k + 1) : i + 1])
        for i in range(len(values))
    ]


def mean_window(n: int, k: int = 5) -> int:
    """The rounds averaged over in a run of `n` rounds: k, or fewer in a short run (at most
    half of it, so that a first and a last window do not overlap); 1 means no averaging."""
    return max(1, min(k, n // 2))


def _carries_signal(values: list[float]) -> bool:
    """A curve worth drawing: some recorded values, and not all of them the same."""
    return len(set(values)) > 1


def curves_plan(
    rows: list[dict[str, Any]], baseline: Optional[list[dict[str, Any]]] = None
) -> tuple[int, list[tuple[str, str, str]], list[str]]:
    """What `plot_curves` draws: the reward's averaging window (`mean_window`), the panels
    (metric key, title, y-axis label) and the caption's lines (`baseline`: the rows of the run
    drawn dashed beside this one, or None)."""
    nodes = _by_node(rows)
    k = mean_window(min(len(series) for series in nodes.values()))
    ood = [r["acc_ood"] for r in rows if r.get("acc_ood") is not None]
    panels = [
        ("reward_mean", "train reward (sampled completions)", "mean reward per round"),
        ("acc_id", "accuracy, in-distribution", "accuracy (greedy decoding)"),
    ]
    if _carries_signal(ood):
        panels.append(("acc_ood", "accuracy, out-of-distribution", "accuracy (greedy decoding)"))
    caption = [
        f"Reward: thin lines per round, thick lines the trailing mean of the last {k} rounds."
        if k > 1
        else "Reward: per round (too few rounds to average)."
    ]
    if any(r.get("skipped") for r in rows):
        caption.append("x: a round whose optimizer step was skipped (non-finite loss or gradient).")
    caption.append("Accuracy: greedy answers to held-out problems, at each evaluation (dots).")
    if baseline:
        caption.append(
            f"Dashed: the same nodes in the baseline run ({baseline[0]['mode']}, "
            f"{baseline[0].get('collab', 'vertical')}); the gap is what {rows[0]['mode']} changed."
        )
    else:
        caption.append(
            "No baseline drawn: a run alone does not show what its loss changed. Run the same "
            "command with another --loss (on-policy: isolated nodes) into another --out, then "
            "ftis-grpo report THIS_RUN --baseline OTHER_RUN draws it here, dashed."
        )
    if not ood:
        caption.append("No out-of-distribution evaluation.")
    elif not _carries_signal(ood):
        caption.append(
            f"Out-of-distribution accuracy was {ood[0]:.3f} at every evaluation of "
            f"every node (not drawn)."
        )
    return k, panels, caption


def y_limits(values: Sequence[float]) -> tuple[float, float]:
    """A reward or accuracy axis that fits `values` (all in [0, 1]): their range with a margin
    of a tenth of it (at least 0.05), within [-0.03, 1.03]."""
    lo, hi = min(values, default=0.0), max(values, default=1.0)
    pad = max(0.05, 0.1 * (hi - lo))
    return max(-0.03, lo - pad), min(1.03, hi + pad)


def plot_curves(
    rows: list[dict[str, Any]], path: Path, baseline: Optional[list[dict[str, Any]]] = None
) -> None:
    """curves.png: per node against the round, the train reward (thin: per round, thick: its
    trailing `mean_window`-round mean), the in-distribution accuracy and, where it carries any
    signal, the out-of-distribution accuracy; each axis fits its data. `baseline`, the rows of
    another run of the same nodes, is drawn dashed (its reward smoothed alike). One legend, and
    a caption that says what is drawn, or that there is no baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    k, panels, caption = curves_plan(rows, baseline)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.4), squeeze=False)
    axes = axes[0]
    handles = []
    nodes = _by_node(rows)
    drawn: dict[str, list[float]] = {key: [] for key, _, _ in panels}
    for node, series in _by_node(baseline or []).items():
        if node not in nodes:
            continue
        rounds = [r["round"] for r in series]
        reward = smooth([r["reward_mean"] for r in series], k)
        axes[0].plot(rounds, reward, color=f"C{node % 10}", lw=1.4, ls="--")
        drawn["reward_mean"] += reward
        for ax, (key, _, _) in zip(axes[1:], panels[1:]):
            pts = [(r["round"], r[key]) for r in series if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), color=f"C{node % 10}", ls="--", lw=1)
                drawn[key] += [y for _, y in pts]
    for node, series in nodes.items():
        color = f"C{node % 10}"
        rounds = [r["round"] for r in series]
        reward = [r["reward_mean"] for r in series]
        drawn["reward_mean"] += reward
        if k > 1:
            axes[0].plot(rounds, reward, color=color, alpha=0.35, lw=0.8)
        (line,) = axes[0].plot(
            rounds,
            smooth(reward, k),
            color=color,
            lw=2 if k > 1 else 1.2,
            marker="" if k > 1 else ".",
            label=f"{node}: {series[0]['name']}",
        )
        handles.append(line)
        skipped = [(r["round"], r["reward_mean"]) for r in series if r.get("skipped")]
        if skipped:
            axes[0].plot(*zip(*skipped), color=color, marker="x", ms=8, ls="")
        for ax, (key, _, _) in zip(axes[1:], panels[1:]):
            pts = [(r["round"], r[key]) for r in series if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), color=color, marker=".")
                drawn[key] += [y for _, y in pts]
    for ax, (key, title, ylabel) in zip(axes, panels):
        ax.set_title(title)
        ax.set_xlabel("round")
        ax.set_ylabel(ylabel)
        ax.set_ylim(*y_limits(drawn[key]))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    if baseline:
        (line,) = axes[0].plot(
            [], [], color="grey", ls="--", label=f"baseline: {baseline[0]['mode']}"
        )
        handles.append(line)
    first = rows[0]
    fig.suptitle(
        f"collaborative GRPO, {first['mode']} ({first.get('collab', 'vertical')}), "
        f"{len(nodes)} nodes",
        y=0.99,
    )
    fig.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, 0.935),
        ncol=len(handles),
        fontsize=9,
        frameon=False,
    )
    fig.text(0.01, 0.015, "\n".join(caption), fontsize=8.5, va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.02 + 0.03 * len(caption), 1, 0.88))
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def _fmt(x: Any) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def _first_last(series: list[dict[str, Any]], key: str, k: int) -> tuple[Any, Any]:
    """Means of the first and of the last k recorded values."""
    vals = [r[key] for r in series if r.get(key) is not None]
    if not vals:
        return None, None
    k = min(k, len(vals))
    return sum(vals[:k]) / k, sum(vals[-k:]) / k


def _mean(series: list[dict[str, Any]], key: str) -> Optional[float]:
    vals = [r[key] for r in series if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def summary_table(rows: list[dict[str, Any]]) -> str:
    """Per node: first -> last reward (means over `mean_window` rounds, named in the header) and
    accuracies (first and last evaluation), mean KL and filtered share, skipped optimizer steps,
    traffic, time per round; then the node's "peer" (its stable id) where some node's differs from
    its number (the peers of a swarm, a merged view)."""
    nodes = _by_node(rows)
    peers = _peers(nodes)
    with_peer = shows_peer(rows)
    k = mean_window(min(len(series) for series in nodes.values()))
    reward_head = f"reward ({k}-round means)" if k > 1 else "reward (first -> last round)"
    head = (
        "node",
        "name",
        "rounds",
        reward_head,
        "acc_id",
        "acc_ood",
        "kl_mean",
        "filtered",
        "skipped",
        "MB_sent",
        "B/token",
        "s/round",
    ) + (("peer",) if with_peer else ())
    lines = []
    for node, series in nodes.items():
        cells = [str(node), series[0].get("name", ""), str(len(series))]
        for key, window in (("reward_mean", k), ("acc_id", 1), ("acc_ood", 1)):
            a, b = _first_last(series, key, window)
            cells.append(f"{_fmt(a)} -> {_fmt(b)}")
        n = len(series)
        tokens = sum(r["tokens_sent"] for r in series)
        sent = sum(r["bytes_sent"] for r in series)
        cells += [
            _fmt(_mean(series, "kl_mean")),
            _fmt(_mean(series, "filtered_frac")),
            str(sum(r.get("skipped") or 0 for r in series)),
            f"{sent / 1e6:.3f}",
            _fmt(sent / tokens) if tokens else "-",
            f"{sum(r['seconds'] for r in series) / n:.2f}",
        ] + ([peers[node]] if with_peer else [])
        lines.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(cells, widths)) for cells in lines]
    return "\n".join(out)


PEER_LEGEND = "  peer      a swarm peer's stable id (its libp2p peer id), as in its metrics.jsonl"


def _peers(nodes: dict) -> dict:
    """Each node's peer id (its number where its rows name none), from `_by_node`'s series."""
    return {node: str(series[-1].get("peer", node)) for node, series in nodes.items()}


def shows_peer(rows: list[dict]) -> bool:
    """Whether the summary table has a "peer" column: some node's peer id is not its number."""
    return any(peer != str(node) for node, peer in _peers(_by_node(rows)).items())


def summary_legend(k: int, peer: bool = False) -> list[str]:
    """What the summary table's columns mean, one line each (`k`: the reward's window; `peer`:
    the table has the peer column)."""
    window = f"means of the first and of the last {k} rounds" if k > 1 else "first, last round"
    return [
        "columns:",
        f"  reward    mean reward of the node's own sampled completions ({window})",
        "  acc_id    greedy accuracy on held-out in-distribution problems (first, last evaluation)",
        "  acc_ood   the same on out-of-distribution problems (harder ones)",
        "  kl_mean   mean estimated KL(pi_theta || pi_gen) of the samples trained on, per round",
        "  filtered  mean share of them whose advantage the filter set to 0",
        "  skipped   optimizer steps skipped (non-finite loss or gradient)",
        "  MB_sent   megabytes of samples the node sent its peers; B/token: bytes per token",
        "  s/round   wall-clock seconds per round",
    ] + [PEER_LEGEND] * peer


def redraw(run: Path, baseline: Optional[Path] = None) -> Path:
    """Draw `run`'s curves.png again from its metrics.jsonl, with the run in `baseline` (another
    output folder) dashed beside it; returns the figure's path. ValueError naming what is
    missing."""
    rows = read_metrics(run / "metrics.jsonl")
    if not rows:
        raise ValueError(f"{run / 'metrics.jsonl'} holds no rounds")
    other = None
    if baseline is not None:
        other = read_metrics(baseline / "metrics.jsonl")
        if not other:
            raise ValueError(f"{baseline / 'metrics.jsonl'} holds no rounds")
    plot_curves(rows, run / "curves.png", other)
    return run / "curves.png"


def merge(runs: Sequence[Path], to: Path, baseline: Optional[Path] = None) -> tuple[Path, str]:
    """Several runs' metrics as one (the peers of a swarm, each with its own folder): each run's
    nodes numbered after the previous runs' ones. Writes `to`/curves.png (with the `baseline`
    run dashed beside it) and `to`/summary.txt; returns (the figure's path, the summary table).
    ValueError naming a run without rounds."""
    rows: list[dict[str, Any]] = []
    for run in runs:
        got = read_metrics(run / "metrics.jsonl")
        if not got:
            raise ValueError(f"{run / 'metrics.jsonl'} holds no rounds")
        first = len({r["node"] for r in rows})
        number = {n: first + i for i, n in enumerate(sorted({r["node"] for r in got}))}
        rows += [{**r, "node": number[r["node"]]} for r in got]
    other = None
    if baseline is not None:
        other = read_metrics(baseline / "metrics.jsonl")
        if not other:
            raise ValueError(f"{baseline / 'metrics.jsonl'} holds no rounds")
    to.mkdir(parents=True, exist_ok=True)
    plot_curves(rows, to / "curves.png", other)
    table = summary_table(rows)
    k = mean_window(min(len(series) for series in _by_node(rows).values()))
    text = [table, "", *summary_legend(k, shows_peer(rows)), "", "merged from, in node order:"]
    text += [f"  {run}" for run in runs]
    (to / "summary.txt").write_text("\n".join(text) + "\n")
    return to / "curves.png", table


def metric_rows(
    round_: int,
    vectors: Sequence[Sequence[float]],
    names: Sequence[str],
    mode: str,
    collab: str,
    peers: Optional[Sequence[str]] = None,
) -> list[dict[str, Any]]:
    """The metrics.jsonl rows of one round from each node's `METRIC_KEYS` vector (NaN and
    infinities -> None: strict JSON). `peers`: each node's stable id, its row's "peer" (the
    transport's `peer_id`: the rank under torch, the libp2p peer id of a swarm peer; default the
    node's index), kept as it is when `merge` renumbers the nodes."""
    rows = []
    peers = [str(node) for node in range(len(vectors))] if peers is None else peers
    for node, (vec, name, peer) in enumerate(zip(vectors, names, peers)):
        row: dict[str, Any] = dict(
            round=round_, node=node, name=name, peer=peer, mode=mode, collab=collab
        )
        for key, x in zip(METRIC_KEYS, vec):
            row[key] = None if not math.isfinite(x) else (int(x) if key in _INT_KEYS else x)
        rows.append(row)
    return rows


def write_run_config(out: Path, config: dict[str, Any]) -> None:
    """`config.json` (atomic) and `config.yaml`: the run's effective configuration."""
    write_json_atomic(out / "config.json", config)
    (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def start_metrics(path: Path, kept: list[dict[str, Any]]) -> None:
    """Replace `path` atomically by the rows `kept` (a resumed run's completed rounds, or none)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json_line(r) for r in kept))
    os.replace(tmp, path)


def append_metrics(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(json_line(r) for r in rows)


def write_outputs(
    out: Path, tokenizer, metrics_path: Path, notes: Sequence[str] = ()
) -> Optional[str]:
    """At the end of a run: the tokenizer, `curves.png` and `summary.txt` (the table, then the
    `notes` lines); returns the summary with the paths to print (None without any metrics)."""
    out.joinpath("tokenizer").mkdir(exist_ok=True)
    tokenizer.save_pretrained(out / "tokenizer")
    rows = read_metrics(metrics_path)
    if not rows:
        return None
    plot_curves(rows, out / "curves.png")
    table = summary_table(rows)
    k = mean_window(min(len(series) for series in _by_node(rows).values()))
    legend = summary_legend(k, shows_peer(rows))
    (out / "summary.txt").write_text("\n".join([table, "", *legend, "", *notes]) + "\n")
    return f"{table}\n\nmetrics: {metrics_path}\ncurves:  {out / 'curves.png'}"
