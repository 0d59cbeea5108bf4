"""The F-TIS claims study at CPU scale: every cell is one `ftis-grpo` run of the driver.

    python -m experiments.study run                      # the whole study (~40 min, 2 cores)
    python -m experiments.study run --only 'pairs/size/*' # some cells (glob over cell ids)
    python -m experiments.study run --scale smoke ...     # the smallest configuration (CI)
    python -m experiments.study report                    # tables and plots from finished runs

A cell id is `study/group/variant/sS` (S = seed). Studies:
  pairs    three heterogeneous pairs (configs/size, expertise, lora) x on-policy (isolated),
           NoIS, F-VIS, F-TIS
  collab   the size pair under F-TIS, horizontal (vertical is the pairs cell)
  g        the size pair under F-TIS with g = 5, 10, 100 (g = 50 is the pairs cell)
  badpeer  configs/badpeer (the size pair + a third node) under NoIS and F-TIS, the third node
           honest or hostile (forged_logprobs, flipped_rewards, random_tokens, malformed), and
           F-TIS with the receivers rescoring rewards (verify_rewards) against the well-formed
           attacks; the baseline without the third node is the pairs cell
`run` skips cells whose run finished (delete the cell's folder to redo it), then writes
`results/cells.jsonl` (one row per cell and node), `results/curves.jsonl` (per-round series),
`results/tables.md`, the plots, and the README's table section.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ftis_kernels.grpo.report import read_metrics, smooth

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SEEDS = (0, 1, 2)
PAIRS = ("size", "expertise", "lora")
MODES = ("on-policy", "nois", "f-vis", "f-tis")
G_VALUES = (5, 10, 50, 100)
ATTACKS = ("honest", "forged_logprobs", "flipped_rewards", "random_tokens", "malformed")
WELL_FORMED = ATTACKS[1:4]  # what the parser accepts: the verify_rewards cells
# The smallest configuration: one cell, a few rounds, a short warm-up (the CI test's scale).
SMOKE_FLAGS = (
    "--rounds",
    "3",
    "--set",
    "eval_size=8",
    "--set",
    "eval_every=2",
    "--set",
    "eval_max_new_tokens=16",
    "--set",
    "max_new_tokens=12",
    "--set",
    "nodes.0.warmup_steps=10",
    "--set",
    "nodes.1.warmup_steps=10",
)
# "early" accuracy is the first evaluation after round 0 (round 15); "early" and "late" rewards
# are the mean training reward over the first and the last third of the rounds.


@dataclass
class Cell:
    study: str
    group: str  # the pair, or the bad-peer mode
    variant: str  # the loss mode, collaboration, g or attack
    seed: int
    config: str  # a file under experiments/configs
    flags: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.study}/{self.group}/{self.variant}/s{self.seed}"

    def argv(self, work: Path, extra: tuple[str, ...] = ()) -> list[str]:
        out = work / self.study / self.group / self.variant / f"s{self.seed}"
        return [
            "ftis-grpo",
            "--config",
            f"experiments/configs/{self.config}.yaml",
            *self.flags,
            "--seed",
            str(self.seed),
            "--out",
            _rel(out),
            *extra,
        ]


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def cells(scale: str) -> list[Cell]:
    """Every cell of the study, in the order they run."""
    if scale == "smoke":
        return [Cell("pairs", "size", "f-tis", 0, "size", ["--loss", "f-tis"])]
    out: list[Cell] = []
    for seed in SEEDS:
        for pair in PAIRS:
            out += [Cell("pairs", pair, m, seed, pair, ["--loss", m]) for m in MODES]
        out.append(
            Cell(
                "collab",
                "size",
                "horizontal",
                seed,
                "size",
                [
                    "--loss",
                    "f-tis",
                    "--collab",
                    "horizontal",
                    # the same samples per node and round as vertical: 8 shared prompts x 4
                    "--set",
                    "prompts_per_node=8",
                ],
            )
        )
        out += [
            Cell("g", "size", f"g{g}", seed, "size", ["--loss", "f-tis", "--kl-threshold", str(g)])
            for g in G_VALUES
            if g != 50
        ]
        for mode in ("nois", "f-tis"):
            for attack in ATTACKS:
                flags = ["--loss", mode]
                if attack != "honest":
                    flags += ["--set", f"nodes.2.hostile={attack}"]
                out.append(Cell("badpeer", mode, attack, seed, "badpeer", flags))
        for attack in WELL_FORMED:
            out.append(
                Cell(
                    "badpeer",
                    "f-tis+verify",
                    attack,
                    seed,
                    "badpeer",
                    [
                        "--loss",
                        "f-tis",
                        "--set",
                        f"nodes.2.hostile={attack}",
                        "--set",
                        "verify_rewards=true",
                    ],
                )
            )
    return out


# -- running ---------------------------------------------------------------------------------------
def _finished(out: Path) -> bool:
    return (out / "summary.txt").exists() and (out / "cell.json").exists()


def run_cell(cell: Cell, work: Path, extra: tuple[str, ...]) -> tuple[str, float, int]:
    argv = cell.argv(work, extra)
    out = ROOT / argv[argv.index("--out") + 1]
    if _finished(out):
        return cell.id, 0.0, 0
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, FTIS_LOG_LEVEL=os.environ.get("FTIS_LOG_LEVEL", "WARNING"))
    t0 = time.time()
    with open(out / "log.txt", "w") as log:
        # argv[0] is the console script; run its module with this interpreter.
        # --overwrite: an unfinished cell's partial run is replaced (log.txt is not a run output).
        rc = subprocess.call(
            [sys.executable, "-m", "ftis_kernels.grpo", *argv[1:], "--overwrite"],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    seconds = time.time() - t0
    if rc == 0:
        (out / "cell.json").write_text(
            json.dumps(dict(id=cell.id, command=shlex.join(argv), seconds=round(seconds, 1)))
        )
    return cell.id, seconds, rc


def run(todo: list[Cell], work: Path, jobs: int, extra: tuple[str, ...]) -> int:
    t0, failed = time.time(), []
    bar = _progress(len(todo))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for cid, seconds, rc in pool.map(lambda c: run_cell(c, work, extra), todo):
            if rc:
                failed.append(cid)
            if bar is not None:
                bar.set_postfix_str(f"{cid} {seconds:.0f}s{' FAILED' if rc else ''}")
                bar.update(1)
    if bar is not None:
        bar.close()
    print(
        f"{len(todo)} cells in {(time.time() - t0) / 60:.1f} min"
        + (f"; FAILED (see each cell's log.txt): {failed}" if failed else ""),
        flush=True,
    )
    return 1 if failed else 0


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="study", unit="cell")


# -- results ---------------------------------------------------------------------------------------
def _mean(xs: list[Optional[float]]) -> Optional[float]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else None


def collect(todo: list[Cell], work: Path, extra: tuple[str, ...]):
    """(rows, curves) of the finished cells: one row per cell and node."""
    rows, curves = [], []
    for cell in todo:
        argv = cell.argv(work, extra)
        out = ROOT / argv[argv.index("--out") + 1]
        if not _finished(out):
            continue
        info = json.loads((out / "cell.json").read_text())
        metrics = read_metrics(out / "metrics.jsonl")
        for node in sorted({m["node"] for m in metrics}):
            series = sorted((m for m in metrics if m["node"] == node), key=lambda m: m["round"])
            evals = [m for m in series if m["acc_id"] is not None]
            reward = [m["reward_mean"] for m in series]
            early = [m for m in evals if m["round"] > 0][:1] or evals[-1:]
            third = len(series) // 3
            rows.append(
                dict(
                    id=cell.id,
                    study=cell.study,
                    group=cell.group,
                    variant=cell.variant,
                    seed=cell.seed,
                    node=node,
                    name=series[0]["name"],
                    rounds=len(series),
                    acc_id=evals[-1]["acc_id"],
                    acc_ood=evals[-1]["acc_ood"],
                    acc_id_start=evals[0]["acc_id"],
                    acc_ood_start=evals[0]["acc_ood"],
                    acc_id_early=early[0]["acc_id"],
                    early_round=early[0]["round"],
                    reward_early=_mean(reward[:third]),
                    reward_mid=_mean(reward[third : len(series) - third]),
                    reward_late=_mean(reward[len(series) - third :]),
                    reward_last5=_mean(reward[-5:]),
                    kl_mean=_mean([m["kl_mean"] for m in series]),
                    filtered_frac=_mean([m["filtered_frac"] for m in series]),
                    is_weight_mean=_mean([m["is_weight_mean"] for m in series]),
                    samples_received=sum(m["samples_received"] for m in series),
                    dropped=sum(m["dropped"] for m in series),
                    seconds=info["seconds"],
                    command=info["command"],
                )
            )
            curves.append(
                dict(
                    id=cell.id,
                    node=node,
                    name=series[0]["name"],
                    reward=reward,
                    eval_rounds=[m["round"] for m in evals],
                    acc_id=[m["acc_id"] for m in evals],
                    acc_ood=[m["acc_ood"] for m in evals],
                )
            )
    return rows, curves


def _stat(rows: list[dict], key: str) -> str:
    xs = [r[key] for r in rows if r.get(key) is not None]
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{statistics.fmean(xs):.3f} ± {statistics.stdev(xs):.3f}"


def _select(rows, **kw) -> list[dict]:
    return [r for r in rows if all(r[k] == v for k, v in kw.items())]


def _cmd(study: str, group: str, variant: str, scale: str) -> str:
    flag = " --scale smoke" if scale == "smoke" else ""
    return f"`python -m experiments.study run{flag} --only '{study}/{group}/{variant}/*'`"


def tables(rows: list[dict], scale: str) -> str:
    """The study's tables (markdown): mean ± standard deviation over seeds, per node."""
    parts = []
    n_seeds = len({r["seed"] for r in rows}) if rows else 0

    def node_cols(sel: list[dict], keys=("acc_id", "acc_ood")) -> list[str]:
        cols = []
        for node in sorted({r["node"] for r in sel}):
            mine = [r for r in sel if r["node"] == node]
            cols += [_stat(mine, k) for k in keys]
        return cols

    pairs = _select(rows, study="pairs")
    if pairs:
        parts.append(f"### 1. Heterogeneous pairs (final accuracy, {n_seeds} seeds)\n")
        parts.append(
            "| pair | mode | node A | A acc_id | A acc_ood | node B | B acc_id | B acc_ood "
            "| A reward, last third | B reward, last third | command |"
        )
        parts.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for pair in PAIRS:
            for mode in MODES:
                sel = _select(pairs, group=pair, variant=mode)
                if not sel:
                    continue
                a, b = _select(sel, node=0), _select(sel, node=1)
                parts.append(
                    f"| {pair} | {mode} | {a[0]['name']} | {_stat(a, 'acc_id')} | "
                    f"{_stat(a, 'acc_ood')} | {b[0]['name']} | {_stat(b, 'acc_id')} | "
                    f"{_stat(b, 'acc_ood')} | {_stat(a, 'reward_late')} | "
                    f"{_stat(b, 'reward_late')} | {_cmd('pairs', pair, mode, scale)} |"
                )
        parts.append("")
    collab = _select(rows, study="collab")
    if collab:
        parts.append("### 2. Vertical against horizontal collaboration (size pair, F-TIS)\n")
        parts.append(
            "| collaboration | tiny acc_id | tiny acc_ood | small acc_id | small acc_ood "
            "| command |"
        )
        parts.append("|---|---|---|---|---|---|")
        vertical = _select(rows, study="pairs", group="size", variant="f-tis")
        for name, sel, cmd in (
            ("vertical", vertical, _cmd("pairs", "size", "f-tis", scale)),
            ("horizontal", collab, _cmd("collab", "size", "horizontal", scale)),
        ):
            if sel:
                parts.append(f"| {name} | " + " | ".join(node_cols(sel)) + f" | {cmd} |")
        parts.append("")
    gsel = _select(rows, study="g")
    if gsel:
        parts.append("### 3. The filter threshold g (size pair, F-TIS)\n")
        parts.append(
            "| g | tiny acc_id @15 | tiny acc_id final | tiny reward, first third | "
            "tiny reward, last third | small acc_id @15 | small acc_id final | "
            "small reward, first third | small reward, last third | filtered | command |"
        )
        parts.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for g in G_VALUES:
            if g == 50:
                sel, cmd = (
                    _select(rows, study="pairs", group="size", variant="f-tis"),
                    _cmd("pairs", "size", "f-tis", scale),
                )
            else:
                sel, cmd = _select(gsel, variant=f"g{g}"), _cmd("g", "size", f"g{g}", scale)
            if sel:
                cols = node_cols(sel, ("acc_id_early", "acc_id", "reward_early", "reward_late"))
                parts.append(
                    f"| {g} | " + " | ".join(cols) + f" | {_stat(sel, 'filtered_frac')} | {cmd} |"
                )
        parts.append("")
    bad = _select(rows, study="badpeer")
    if bad:
        parts.append(
            "### 4. Bad peers (the honest nodes' final acc_id; the samples they received "
            "from both peers and dropped; filtered share and IS weight over all they "
            "trained on)\n"
        )
        parts.append(
            "| mode | third node | tiny acc_id | small acc_id | dropped / received | "
            "filtered | IS weight | command |"
        )
        parts.append("|---|---|---|---|---|---|---|---|")
        for mode in ("nois", "f-tis", "f-tis+verify"):
            base_mode = "f-tis" if mode == "f-tis+verify" else mode
            none = _select(rows, study="pairs", group="size", variant=base_mode)
            if none and mode != "f-tis+verify":
                parts.append(
                    f"| {mode} | none (2 nodes) | {_stat(_select(none, node=0), 'acc_id')} | "
                    f"{_stat(_select(none, node=1), 'acc_id')} | - | "
                    f"{_stat(none, 'filtered_frac')} | {_stat(none, 'is_weight_mean')} | "
                    f"{_cmd('pairs', 'size', base_mode, scale)} |"
                )
            for attack in ATTACKS:
                sel = _select(bad, group=mode, variant=attack)
                if not sel:
                    continue
                honest = [r for r in sel if r["node"] in (0, 1)]
                drop = sum(r["dropped"] for r in honest)
                recv = sum(r["samples_received"] + r["dropped"] for r in honest)
                parts.append(
                    f"| {mode} | {attack} | {_stat(_select(sel, node=0), 'acc_id')} | "
                    f"{_stat(_select(sel, node=1), 'acc_id')} | {drop} / {recv} | "
                    f"{_stat(honest, 'filtered_frac')} | "
                    f"{_stat(honest, 'is_weight_mean')} | "
                    f"{_cmd('badpeer', mode, attack, scale)} |"
                )
        parts.append("")
    if pairs:
        parts += paired_differences(pairs)
    return "\n".join(parts)


def _paired(
    rows: list[dict],
    pair: str,
    node: int,
    mode: str,
    key: str,
    base: str = "on-policy",
    base_key: Optional[str] = None,
) -> str:
    """mean ± std over seeds of (mode's key) - (base's base_key), paired by seed."""
    diffs = []
    for seed in sorted({r["seed"] for r in rows}):
        a = _select(rows, group=pair, node=node, variant=mode, seed=seed)
        b = _select(rows, group=pair, node=node, variant=base, seed=seed)
        if a and b and a[0][key] is not None and b[0][base_key or key] is not None:
            diffs.append(a[0][key] - b[0][base_key or key])
    if not diffs:
        return "-"
    if len(diffs) == 1:
        return f"{diffs[0]:+.3f}"
    return f"{statistics.fmean(diffs):+.3f} ± {statistics.stdev(diffs):.3f}"


def paired_differences(pairs: list[dict]) -> list[str]:
    """The claims' numbers: each mode against isolated on-policy training, paired by seed."""
    out = [
        "### 5. Against isolated training, paired by seed (mean ± std of the differences)\n",
        "Training reward over the last third of the rounds (640 samples per node and run, the "
        "least noisy figure) and final in-domain accuracy, each minus the same node's isolated "
        "on-policy run of the same seed; then the late trend (reward of the last third minus "
        "the middle third) and the out-of-domain change.\n",
        "| pair | node | Δ reward NoIS | Δ reward F-VIS | Δ reward F-TIS | Δ acc_id NoIS | "
        "Δ acc_id F-VIS | Δ acc_id F-TIS | late trend on-policy | late trend F-VIS | "
        "late trend F-TIS | Δ acc_ood F-TIS vs on-policy | acc_ood F-TIS end - start |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for pair in PAIRS:
        for node in (0, 1):
            sel = _select(pairs, group=pair, node=node)
            if not sel:
                continue
            cells = [_paired(pairs, pair, node, m, "reward_late") for m in MODES[1:]]
            cells += [_paired(pairs, pair, node, m, "acc_id") for m in MODES[1:]]
            cells += [
                _paired(pairs, pair, node, m, "reward_late", base=m, base_key="reward_mid")
                for m in ("on-policy", "f-vis", "f-tis")
            ]
            cells.append(_paired(pairs, pair, node, "f-tis", "acc_ood"))
            cells.append(
                _paired(
                    pairs, pair, node, "f-tis", "acc_ood", base="f-tis", base_key="acc_ood_start"
                )
            )
            out.append(f"| {pair} | {sel[0]['name']} | " + " | ".join(cells) + " |")
    out.append("")
    return out


# -- plots -----------------------------------------------------------------------------------------
def _mean_curve(curves: list[dict], key: str) -> list[float]:
    series = [c[key] for c in curves]
    n = min(len(s) for s in series)
    return [statistics.fmean(s[i] for s in series) for i in range(n)]


def plots(curves: list[dict], results: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def pick(prefix: str, node: int) -> list[dict]:
        return [c for c in curves if c["id"].startswith(prefix) and c["node"] == node]

    def draw(path: Path, panels: list[tuple[str, list[tuple[str, str]]]], key: str, ylabel: str):
        """panels: (title, [(label, cell-id prefix)]) on one row per node 0/1."""
        fig, axes = plt.subplots(2, len(panels), figsize=(4.6 * len(panels), 7), squeeze=False)
        drawn = False
        for col, (title, lines) in enumerate(panels):
            for node in (0, 1):
                ax = axes[node][col]
                for i, (label, prefix) in enumerate(lines):
                    sel = pick(prefix, node)
                    if not sel:
                        continue
                    drawn = True
                    name = sel[0]["name"]
                    if key == "reward":
                        ax.plot(smooth(_mean_curve(sel, "reward"), 5), color=f"C{i}", label=label)
                    else:
                        ax.plot(
                            sel[0]["eval_rounds"][: len(_mean_curve(sel, key))],
                            _mean_curve(sel, key),
                            "o-",
                            color=f"C{i}",
                            label=label,
                        )
                    ax.set_title(f"{title}: node {node} ({name})", fontsize=10)
                ax.set_xlabel("round")
                ax.set_ylabel(ylabel)
                ax.grid(alpha=0.3)
                if ax.lines:
                    ax.legend(fontsize=8)
        fig.tight_layout()
        if drawn:
            fig.savefig(path, dpi=110)
        plt.close(fig)
        return drawn

    made = []
    pairs = [(pair, [(m, f"pairs/{pair}/{m}/") for m in MODES]) for pair in PAIRS]
    for key, ylabel, name in (
        ("reward", "train reward (5-round mean, mean of seeds)", "pairs_reward"),
        ("acc_id", "in-domain accuracy (mean of seeds)", "pairs_acc_id"),
        ("acc_ood", "out-of-domain accuracy (mean of seeds)", "pairs_acc_ood"),
    ):
        if draw(results / f"{name}.png", pairs, key, ylabel):
            made.append(results / f"{name}.png")
    g_lines = [(f"g={g}", "pairs/size/f-tis/" if g == 50 else f"g/size/g{g}/") for g in G_VALUES]
    collab = [("vertical", "pairs/size/f-tis/"), ("horizontal", "collab/size/horizontal/")]
    bad = {m: [(f"{m}: {a}", f"badpeer/{m}/{a}/") for a in ATTACKS] for m in ("nois", "f-tis")}
    for name, panels in (
        ("g_ablation", [("g, reward", g_lines)]),
        ("collab", [("collaboration", collab)]),
        (
            "badpeer",
            [
                ("NoIS", bad["nois"]),
                ("F-TIS", bad["f-tis"]),
                (
                    "F-TIS + verify",
                    [(f"f-tis+verify: {a}", f"badpeer/f-tis+verify/{a}/") for a in WELL_FORMED],
                ),
            ],
        ),
    ):
        if draw(results / f"{name}.png", panels, "reward", "train reward (5-round mean)"):
            made.append(results / f"{name}.png")
    return made


BEGIN, END = "<!-- study:begin -->", "<!-- study:end -->"


def report(
    todo: list[Cell],
    work: Path,
    results: Path,
    readme: Optional[Path],
    extra: tuple[str, ...],
    scale: str,
) -> str:
    rows, curves = collect(todo, work, extra)
    results.mkdir(parents=True, exist_ok=True)
    (results / "cells.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (results / "curves.jsonl").write_text("".join(json.dumps(c) + "\n" for c in curves))
    table = tables(rows, scale)
    (results / "tables.md").write_text(table + "\n")
    if rows:
        plots(curves, results)
    if readme is not None and readme.exists():
        text = readme.read_text()
        if BEGIN in text and END in text:
            head, rest = text.split(BEGIN, 1)
            readme.write_text(f"{head}{BEGIN}\n{table}\n{END}{rest.split(END, 1)[1]}")
    return table


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.study", description=__doc__.split("\n")[0]
    )
    p.add_argument("action", choices=("run", "report", "list"))
    p.add_argument("--scale", choices=("full", "smoke"), default="full")
    p.add_argument(
        "--only",
        action="append",
        metavar="GLOB",
        help="cell ids to run, e.g. 'pairs/size/*' (repeatable; default: all)",
    )
    p.add_argument("--jobs", type=int, default=2, help="cells run at once (default 2)")
    p.add_argument("--work", type=Path, default=None, help="run folders (default experiments/runs)")
    p.add_argument(
        "--results",
        type=Path,
        default=None,
        help="tables, plots, jsonl (default experiments/results)",
    )
    p.add_argument(
        "--readme",
        default=None,
        help="markdown file whose study section is rewritten ('none' to skip; "
        "default experiments/README.md at full scale)",
    )
    args = p.parse_args(argv)
    smoke = args.scale == "smoke"
    work = args.work or HERE / ("runs-smoke" if smoke else "runs")
    results = args.results or HERE / ("results-smoke" if smoke else "results")
    readme = (
        None
        if args.readme == "none" or (smoke and args.readme is None)
        else Path(args.readme or HERE / "README.md")
    )
    extra = SMOKE_FLAGS + ("--set", f"warmup_cache={_rel(work / 'cache')}") if smoke else ()
    todo = cells(args.scale)
    if args.only:
        todo = [c for c in todo if any(fnmatch.fnmatchcase(c.id, g) for g in args.only)]
        if not todo:
            raise SystemExit(f"--only: no cell matches {args.only}; see `list`")
    if args.action == "list":
        for c in todo:
            print(f"{c.id:40s} {shlex.join(c.argv(work, extra))}")
        return 0
    rc = run(todo, work, args.jobs, extra) if args.action == "run" else 0
    table = report(cells(args.scale), work, results, readme, extra, args.scale)
    print(table)
    return rc


if __name__ == "__main__":
    sys.exit(main())
