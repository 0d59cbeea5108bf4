"""The F-TIS claims study at CPU scale: every cell is one `ftis-grpo` run of the driver.

    python -m experiments.study run                       # the whole study, resumable
    python -m experiments.study run --only 'pairs/size/*'  # some cells (glob over cell ids)
    python -m experiments.study run --scale smoke ...      # the smallest configuration (CI)
    python -m experiments.study estimate                   # what `run` would cost, in minutes
    python -m experiments.study report                     # claims, tables and plots again

The design, fixed before the numbers (`CLAIMS` and `experiments/stats.py` hold the tests):

- One receiver, `small`, meets peers that are a dose of off-policyness (`configs/`): `identical`
  (a twin: the negative control), `size` (tiny), `expertise` (warmed up on additions only),
  `lora` (the same model training an adapter) and `stale` (the receiver's recipe stopped at 100
  warm-up steps, frozen: the positive control, where NoIS is known to be biased). Every node's
  isolated on-policy baseline comes from one swarm that exchanges nothing
  (`configs/isolated.yaml`).
- Modes `nois`, `f-vis` (LoRA pair) and `f-tis`, with the filter at a threshold that acts.
- `SEEDS`: 10 seeds of 30 rounds. A seed moves the task draw, every node's initial weights,
  warm-up data and sampling, and is the unit of replication: claims are tested on the per-seed
  differences (mode minus baseline, same node and seed) with paired 95% intervals, TOST for
  "behaves like", Holm over the family, and the verdict rule `stats.RULES`.
- The bad-peer study (`badpeer/...`): the size pair with tiny turned hostile, each attack under
  NoIS, F-TIS and F-TIS with `verify_rewards`; the honest reference is the size pair's cell.

Cells run seed by seed, so a study stopped early holds the same seeds for every claim. `run`
skips finished cells (delete a cell's folder to redo it), then writes `results/cells.jsonl` (one
row per cell and node, with the command, its CPU time and the environment), `results/curves.jsonl`,
`results/claims.jsonl`, `results/tables.md`, the plots, and the README's results section.
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

from experiments import stats
from ftis_kernels.grpo import provenance
from ftis_kernels.grpo.exchange import DROP_KINDS
from ftis_kernels.grpo.report import read_metrics, smooth

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SEEDS = tuple(range(10))
BADPEER_SEEDS = (0, 1)
RECEIVER = "small"
# The pairs in order of dose (received KL, lowest first), and the modes each runs.
PAIR_MODES = {
    "identical": ("nois", "f-tis"),
    "size": ("nois", "f-tis"),
    "expertise": ("nois", "f-tis"),
    "lora": ("nois", "f-vis", "f-tis"),
    "stale": ("nois", "f-tis"),
}
HETERO = ("size", "expertise", "lora")
PEER = {"identical": "twin", "size": "tiny", "expertise": "add-expert", "lora": "lora"}
PEER["stale"] = "stale"
HOSTILE = 0  # the size pair's tiny turns hostile in the bad-peer cells
# Hostile kinds (`nodes.<HOSTILE>.hostile`) and the modes each runs under. The honest reference
# is the size pair's cell of the same mode and seed.
ATTACKS = {
    "malformed": ("f-tis",),  # the parser drops every record whatever the mode
    "forged_logprobs": ("nois", "f-tis"),  # rescoring cannot see logprobs
    "flipped_rewards": ("nois", "f-tis", "f-tis+verify"),
    "random_tokens": ("nois", "f-tis", "f-tis+verify"),
    # random tokens sold as correct, claiming log pi_gen = -30: the receiver's IS weight hits C
    "random_tokens_max_weight": ("nois", "f-tis", "f-tis+verify"),
    # last round's samples of a peer, sent again as its own (honest rewards: rescoring passes them)
    "replay": ("nois", "f-tis"),
}
# The metrics (per node and run). A run of R rounds: "late" is rounds R//2 .. R-1 (480 own
# samples at 4 prompts x 8), "last" the last third; accuracies are the final greedy evaluation of
# 128 problems. Sample accuracy is the share of right answers (reward 1) among the node's own
# training samples: the paper's binary reward, whatever format credit the run's reward adds.
METRICS = {
    "acc_late": "sample accuracy of the node's own training samples, second half of the rounds",
    "acc_last": "sample accuracy of the node's own training samples, last third of the rounds",
    "reward_late": "training reward of the node's own samples, second half of the rounds",
    "acc_id": "final in-domain accuracy (greedy, 128 problems)",
    "acc_ood": "final out-of-domain accuracy (greedy, 128 problems)",
}
MARGIN = 0.05  # "behaves like": |mean difference| < 0.05 (5 points of sample accuracy)
FLOOR = 0.05  # a baseline accuracy below this (fewer than 7 of 128 problems) is at its floor
EVAL_SIZE = 128
# CPU seconds per job on 2 idle cores (AMD EPYC, 1 thread per node), for the estimate. Loaded
# (load 8-14) this machine measured 43 for a 2-node cell of 30 rounds and 2 evaluations: 24 of
# start-up, 0.4 per round, 2.8 per evaluation; idle, the previous study's 2-node cells of 60
# rounds and 5 evaluations took 47, which puts start-up near 9 and this cell near 27. Warm-ups of
# 300 steps: small 45, tiny 15.
CPU_S = {"cell2": 27.0, "cell4": 50.0, "small": 45.0, "tiny": 15.0}
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


@dataclass
class Cell:
    study: str  # pairs, isolated, badpeer
    group: str  # the pair, or the bad-peer mode
    variant: str  # the loss mode, or the attack
    seed: int
    config: str  # a file under experiments/configs
    flags: list[str] = field(default_factory=list)
    nodes: int = 2

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


def _badpeer_cells(seed: int) -> list[Cell]:
    out = []
    for attack, modes in ATTACKS.items():
        for mode in modes:
            flags = ["--loss", mode.split("+")[0], "--set", f"nodes.{HOSTILE}.hostile={attack}"]
            if mode.endswith("+verify"):
                flags += ["--set", "verify_rewards=true"]
            out.append(Cell("badpeer", mode, attack, seed, "size", flags))
    return out


def cells(scale: str) -> list[Cell]:
    """Every cell of the study, seed by seed; the bad-peer cells of BADPEER_SEEDS[i] come after
    the main cells of seed SEEDS[2 i + 2], so that a study stopped early holds some."""
    if scale == "smoke":
        return [Cell("pairs", "size", "f-tis", 0, "size", ["--loss", "f-tis"])]
    out: list[Cell] = []
    for i, seed in enumerate(SEEDS):
        out.append(Cell("isolated", "all", "on-policy", seed, "isolated", nodes=4))
        for pair, modes in PAIR_MODES.items():
            out += [Cell("pairs", pair, m, seed, pair, ["--loss", m]) for m in modes]
        if i % 2 == 0 and 0 < i and i // 2 - 1 < len(BADPEER_SEEDS):
            out += _badpeer_cells(BADPEER_SEEDS[i // 2 - 1])
    return out


# -- running ---------------------------------------------------------------------------------------
def _finished(out: Path) -> bool:
    return (out / "summary.txt").exists() and (out / "cell.json").exists()


def _out(cell: Cell, work: Path, extra: tuple[str, ...]) -> Path:
    argv = cell.argv(work, extra)
    return ROOT / argv[argv.index("--out") + 1]


def environment() -> dict:
    """What a result depends on beyond its command: the driver's own record
    (`provenance.environment`), its commit marked dirty when experiments/configs differ too."""
    return provenance.environment(code=("ftis_kernels", "experiments/configs"))


def run_cell(cell: Cell, work: Path, extra: tuple[str, ...]):
    """(cell id, wall seconds, CPU seconds, exit code) of one run; a finished cell is skipped."""
    argv = cell.argv(work, extra)
    out = _out(cell, work, extra)
    if _finished(out):
        return cell.id, 0.0, 0.0, 0
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, FTIS_LOG_LEVEL=os.environ.get("FTIS_LOG_LEVEL", "WARNING"))
    env_info = environment()  # per cell: the code a cell ran is the commit when it started
    t0 = time.time()
    with open(out / "log.txt", "w") as log:
        # argv[0] is the console script; run its module with this interpreter.
        # --overwrite: an unfinished cell's partial run is replaced (log.txt is not a run output).
        proc = subprocess.Popen(
            [sys.executable, "-m", "ftis_kernels.grpo", *argv[1:], "--overwrite"],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        # wait4's usage covers the launcher and every process it waited for (torchrun, nodes).
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    seconds, cpu = time.time() - t0, usage.ru_utime + usage.ru_stime
    if proc.returncode == 0:
        info = dict(
            id=cell.id,
            command=shlex.join(argv),
            seconds=round(seconds, 1),
            cpu_seconds=round(cpu, 1),
            environment=env_info,
        )
        (out / "cell.json").write_text(json.dumps(info))
    return cell.id, seconds, cpu, proc.returncode


def estimate(todo: list[Cell], work: Path, extra: tuple[str, ...], cores: int = 2) -> str:
    """The CPU time of the cells not yet finished and of their seeds' warm-ups (a seed with no
    finished cell), and the wall time that is on `cores` idle cores."""
    left = [c for c in todo if not _finished(_out(c, work, extra))]
    started = {c.seed for c in todo if c not in left}
    cpu = sum(CPU_S["cell4" if c.nodes > 2 else "cell2"] for c in left)
    fresh = {c.seed for c in left} - started
    if any(c.study != "badpeer" or c.seed not in SEEDS for c in left):
        # per seed: the receiver's, add-expert's, tiny's and stale's (100 steps) warm-ups
        cpu += len(fresh) * (CPU_S["small"] * (2 + 100 / 300) + CPU_S["tiny"])
    minutes = cpu / cores / 60
    return (
        f"{len(left)} of {len(todo)} cells to run, {len(fresh)} seeds to warm up: "
        f"{cpu / 60:.0f} CPU-minutes, about {minutes:.0f} min on {cores} idle cores "
        f"(CPU seconds per job: {CPU_S})"
    )


def run(todo: list[Cell], work: Path, jobs: int, extra: tuple[str, ...]) -> int:
    print(estimate(todo, work, extra), flush=True)
    return run_cells(todo, work, jobs, extra)


def run_cells(todo: list[Cell], work: Path, jobs: int, extra: tuple[str, ...]) -> int:
    """Run the cells (finished ones are skipped), `jobs` at a time; 1 if any failed."""
    t0, failed, cpu_total = time.time(), [], 0.0
    bar = _progress(len(todo))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for cid, seconds, cpu, rc in pool.map(lambda c: run_cell(c, work, extra), todo):
            cpu_total += cpu
            if rc:
                failed.append(cid)
            if bar is not None:
                bar.set_postfix_str(f"{cid} {seconds:.0f}s{' FAILED' if rc else ''}")
                bar.update(1)
    if bar is not None:
        bar.close()
    print(
        f"{len(todo)} cells in {(time.time() - t0) / 60:.1f} min, {cpu_total / 60:.1f} CPU-min"
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
def _mean(xs: list) -> Optional[float]:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def _numbers(series: list[dict]) -> dict:
    """Every other numeric metric of a node's run: integers summed, floats averaged."""
    keys = {k for m in series for k, v in m.items() if isinstance(v, (int, float))}
    keys -= {"round", "node", "acc_id", "acc_ood", "reward_mean", "sample_acc"}
    out = {}
    for k in sorted(keys):
        vals = [m.get(k) for m in series]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in vals if v is not None):
            out[k] = sum(v for v in vals if v is not None)
        else:
            out[k] = _mean(vals)
    return out


def collect(todo: list[Cell], work: Path, extra: tuple[str, ...]):
    """(rows, curves) of the finished cells: one row per cell and node."""
    rows, curves = [], []
    for cell in todo:
        out = _out(cell, work, extra)
        if not _finished(out):
            continue
        info = json.loads((out / "cell.json").read_text())
        env = info.get("environment") or {}
        if (out / "environment.json").exists():  # the driver's own record (CPU capability...)
            env = dict(env, run=json.loads((out / "environment.json").read_text()))
        metrics = read_metrics(out / "metrics.jsonl")
        for node in sorted({m["node"] for m in metrics}):
            series = sorted((m for m in metrics if m["node"] == node), key=lambda m: m["round"])
            evals = [m for m in series if m["acc_id"] is not None]
            reward = [m["reward_mean"] for m in series]
            # sample_acc: recorded by runs with format credit; without, the reward is binary
            acc = [m.get("sample_acc", m["reward_mean"]) for m in series]
            n = len(series)
            rows.append(
                dict(
                    id=cell.id,
                    study=cell.study,
                    group=cell.group,
                    variant=cell.variant,
                    seed=cell.seed,
                    node=node,
                    name=series[0]["name"],
                    rounds=n,
                    acc_id=evals[-1]["acc_id"],
                    acc_ood=evals[-1]["acc_ood"],
                    acc_id_start=evals[0]["acc_id"],
                    acc_ood_start=evals[0]["acc_ood"],
                    reward_early=_mean(reward[: max(1, n // 3)]),
                    reward_late=_mean(reward[n // 2 :]),
                    reward_last=_mean(reward[n - max(1, n // 3) :]),
                    acc_late=_mean(acc[n // 2 :]),
                    acc_last=_mean(acc[n - max(1, n // 3) :]),
                    metrics=_numbers(series),
                    seconds=info["seconds"],
                    cpu_seconds=info.get("cpu_seconds"),
                    command=info["command"],
                    environment=env,
                )
            )
            curves.append(
                dict(
                    id=cell.id,
                    node=node,
                    name=series[0]["name"],
                    reward=reward,
                    sample_acc=acc,
                    eval_rounds=[m["round"] for m in evals],
                    acc_id=[m["acc_id"] for m in evals],
                    acc_ood=[m["acc_ood"] for m in evals],
                )
            )
    return rows, curves


# -- the claims ------------------------------------------------------------------------------------
# A unit of a claim: (pair, node name, mode) against (baseline pair, baseline mode), same node
# and seed. The baseline pair "isolated" is the on-policy swarm.
Unit = tuple[str, str, str, str, str]


def _units(pairs, modes_vs: tuple[str, str, str], nodes: str = "both") -> tuple[Unit, ...]:
    """(mode, baseline pair, baseline mode) for each pair's receiver and/or peer."""
    mode, base_pair, base_mode = modes_vs
    out = []
    for pair in pairs:
        names = {"both": (RECEIVER, PEER[pair]), "receiver": (RECEIVER,)}[nodes]
        out += [(pair, name, mode, base_pair or pair, base_mode) for name in names]
    return tuple(out)


@dataclass(frozen=True)
class ClaimSpec:
    id: str
    text: str  # the claim, as the paper makes it (or the control's expectation)
    test: stats.Claim
    units: tuple[Unit, ...]
    control: Optional[str] = None  # the id of the positive control it needs
    floor: bool = False  # untestable if the baseline metric's mean is below FLOOR


_ISO = (None, "isolated", "on-policy")
CLAIMS = (
    ClaimSpec(
        "N",
        "negative control: with an identical peer, F-TIS trains like NoIS (nothing to correct)",
        stats.Claim("N", "equivalence", "acc_late", margin=MARGIN),
        _units(("identical",), ("f-tis", None, "nois")),
    ),
    ClaimSpec(
        "P",
        "positive control: NoIS with the stale peer trains the receiver worse than "
        "isolated training",
        stats.Claim("P", "direction", "acc_late", sign=-1),
        _units(("stale",), ("nois", "isolated", "on-policy"), "receiver"),
    ),
    *(
        ClaimSpec(
            f"C1-{pair}",
            f"F-TIS trains like isolated on-policy training ({pair} pair, both nodes)",
            stats.Claim(f"C1-{pair}", "equivalence", "acc_late", margin=MARGIN),
            _units((pair,), ("f-tis", "isolated", "on-policy")),
        )
        for pair in HETERO
    ),
    ClaimSpec(
        "C2",
        "NoIS (no importance sampling) trains worse than isolated on-policy training "
        "(pooled over the 6 nodes of the heterogeneous pairs)",
        stats.Claim("C2", "direction", "acc_late", sign=-1),
        _units(HETERO, ("nois", "isolated", "on-policy")),
        control="P",
    ),
    ClaimSpec(
        "C3",
        "F-TIS trains better than NoIS (pooled over the 6 nodes of the heterogeneous pairs)",
        stats.Claim("C3", "direction", "acc_late", sign=+1),
        _units(HETERO, ("f-tis", None, "nois")),
        control="P",
    ),
    ClaimSpec(
        "C4",
        "F-TIS removes the harm of a stale peer: F-TIS above NoIS with the stale peer",
        stats.Claim("C4", "direction", "acc_late", sign=+1),
        _units(("stale",), ("f-tis", None, "nois"), "receiver"),
        control="P",
    ),
    ClaimSpec(
        "C5",
        "F-VIS (uncapped IS weights) falls below F-TIS late in training (LoRA pair, both nodes)",
        stats.Claim("C5", "direction", "acc_last", sign=-1),
        _units(("lora",), ("f-vis", None, "f-tis")),
    ),
    ClaimSpec(
        "C6",
        "F-TIS collaboration raises out-of-domain accuracy over isolated training (pooled over "
        "the 6 nodes of the heterogeneous pairs)",
        stats.Claim("C6", "direction", "acc_ood", sign=+1),
        _units(HETERO, ("f-tis", "isolated", "on-policy")),
        floor=True,
    ),
)


def _value(rows: list[dict], pair: str, name: str, mode: str, seed: int, metric: str):
    study, group = ("isolated", "all") if pair == "isolated" else ("pairs", pair)
    for r in rows:
        if (r["study"], r["group"], r["variant"], r["name"], r["seed"]) == (
            study,
            group,
            mode,
            name,
            seed,
        ):
            return r[metric]
    return None


def unit_differences(rows: list[dict], spec: ClaimSpec) -> list[dict[int, float]]:
    """Per unit, {seed: mode - baseline} over the seeds where both ran."""
    metric, out = spec.test.metric, []
    seeds = sorted({r["seed"] for r in rows})
    for pair, name, mode, base_pair, base_mode in spec.units:
        d = {}
        for s in seeds:
            a = _value(rows, pair, name, mode, s, metric)
            b = _value(rows, base_pair, name, base_mode, s, metric)
            if a is not None and b is not None:
                d[s] = a - b
        out.append(d)
    return out


def _baseline_mean(rows: list[dict], spec: ClaimSpec) -> Optional[float]:
    vals = [
        _value(rows, bp, name, bm, s, spec.test.metric)
        for _, name, _, bp, bm in spec.units
        for s in {r["seed"] for r in rows}
    ]
    return _mean(vals)


def _claim_fields(spec) -> dict:
    """The fields of a claim's row that its spec fixes: id, text, kind of test and metric."""
    return dict(id=spec.id, claim=spec.text, kind=spec.test.kind, metric=spec.test.metric)


def tested_fields(spec, res: stats.Result, d: list[float]) -> dict:
    """The fields of a tested claim's row from its result: margin and sign, the mean, the 95% t,
    90% t and bootstrap intervals, p before and after Holm, verdict and why."""
    ci90 = stats.t_interval(d, 0.90)
    return dict(
        margin=spec.test.margin,
        sign=spec.test.sign,
        mean=res.ci.mean,
        ci=[res.ci.lo, res.ci.hi],
        ci90=[ci90.lo, ci90.hi],
        bootstrap=[res.boot.lo, res.boot.hi],
        p=res.p,
        p_holm=res.p_holm,
        verdict=res.verdict,
        why=res.why,
    )


def analyse(rows: list[dict]) -> list[dict]:
    """Every claim's per-seed pooled differences, interval, p-values and verdict (rows of
    `results/claims.jsonl`). Claims with fewer than `stats.MIN_SEEDS` complete seeds (the rules'
    minimum) are "pending"; Holm runs over the others."""
    pooled = {spec.id: stats.pool(unit_differences(rows, spec)) for spec in CLAIMS}
    ready = [spec for spec in CLAIMS if len(pooled[spec.id]) >= stats.MIN_SEEDS]
    data = [list(pooled[spec.id].values()) for spec in ready]
    # The positive control's verdict decides whether its dependants can be untestable.
    first = stats.evaluate([(spec.test, d, None) for spec, d in zip(ready, data)])
    control = {spec.id: res.verdict for spec, res in zip(ready, first)}
    reasons = []
    for spec in ready:
        why = None
        if spec.control and control.get(spec.control) != "reproduced":
            why = (
                f"its positive control {spec.control} has not shown harm "
                f"({control.get(spec.control, 'pending')})"
            )
        if spec.floor:
            base = _baseline_mean(rows, spec)
            if base is not None and base < FLOOR:
                why = f"the baseline {spec.test.metric} is at its floor ({base:.3f} < {FLOOR})"
        reasons.append(why)
    results = stats.evaluate([(s.test, d, w) for s, d, w in zip(ready, data, reasons)])
    out = []
    for spec, d, res in zip(ready, data, results):
        row = dict(**_claim_fields(spec), n=res.ci.n, **tested_fields(spec, res, d))
        out.append(dict(row, per_seed={str(k): v for k, v in pooled[spec.id].items()}))
    for spec in CLAIMS:
        if spec not in ready:
            out.append(
                dict(
                    **_claim_fields(spec),
                    n=len(pooled[spec.id]),
                    verdict="pending",
                    why=f"fewer than {stats.MIN_SEEDS} seeds with every cell of the claim "
                    "finished (the rules' minimum)",
                )
            )
    order = [s.id for s in CLAIMS]
    return sorted(out, key=lambda e: order.index(e["id"]))


# -- tables ----------------------------------------------------------------------------------------
def _stat(rows: list[dict], key: str, metrics: bool = False) -> str:
    xs = [(r["metrics"] if metrics else r).get(key) for r in rows]
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{statistics.fmean(xs):.3f} ± {statistics.stdev(xs):.3f}"


def _select(rows, **kw) -> list[dict]:
    return [r for r in rows if all(r[k] == v for k, v in kw.items())]


def _cmd(cell_glob: str, scale: str) -> str:
    flag = " --scale smoke" if scale == "smoke" else ""
    return f"`python -m experiments.study run{flag} --only '{cell_glob}'`"


def _fmt_claim(c: dict) -> str:
    if c["verdict"] == "pending":
        return (
            f"| {c['id']} | {c['claim']} | {c['metric']} | {c['kind']} | {c['n']} | - | - | - "
            f"| - | - | **pending** |"
        )
    test = (
        f"TOST ±{c['margin']:g}"
        if c["kind"] == "equivalence"
        else ("t, predicted " + ("+" if c["sign"] > 0 else "−"))
    )
    return (
        f"| {c['id']} | {c['claim']} | {c['metric']} | {test} | {c['n']} | {c['mean']:+.3f} | "
        f"[{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}] | [{c['bootstrap'][0]:+.3f}, "
        f"{c['bootstrap'][1]:+.3f}] | {c['p']:.3g} | {c['p_holm']:.3g} | **{c['verdict']}** |"
    )


# Per-node run metrics shown beside the rewards, where the driver records them.
FILTER_KEYS = (
    "recv_kl_mean",  # the received samples' KL (kl_mean mixes in the node's own, KL ~ 0)
    "kl_mean",
    "filtered_frac",  # the op's count: also samples whose advantage was 0 already
    "filter_changed_frac",  # of all trained samples, those the filter set to 0 from non-zero
    "filter_changed_neg",  # of the received negative-advantage samples, those it changed
    "is_weight_mean",
    "is_truncated_frac",
    "recv_truncated_frac",
    "clip_frac",
)


def tables(rows: list[dict], claims: list[dict], scale: str) -> str:
    parts = []
    if claims:
        n_max = max(c["n"] for c in claims)
        if n_max < len(SEEDS):
            parts.append(
                f"**Provisional: at most {n_max} of the {len(SEEDS)} seeds have finished every "
                "cell of a claim.** `python -m experiments.study run` runs the rest (finished "
                "cells are kept) and rewrites these tables.\n"
            )
        parts += [
            f"### Claims (up to {n_max} seeds; 95% intervals of the per-seed difference)\n",
            "| id | claim | primary metric | test | seeds | mean diff | 95% t interval "
            "| bootstrap 95% | p | p Holm | verdict |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        parts += [_fmt_claim(c) for c in claims]
        parts.append("")
    pairs = [r for r in rows if r["study"] in ("pairs", "isolated")]
    if pairs:
        parts += [
            "### Per node and mode (mean ± sd over seeds)\n",
            "`isolated` is the node's on-policy run in the swarm that exchanges nothing.\n",
            "| pair | node | mode | seeds | sample acc, 2nd half | sample acc, last third "
            "| reward, 2nd half | acc_id | acc_ood | command |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        shown = set()
        for pair, modes in PAIR_MODES.items():
            for name in (RECEIVER, PEER[pair]):
                base = [] if name in shown else _select(rows, study="isolated", name=name)
                shown.add(name)
                sels = [("isolated", base, "isolated/all/on-policy/*")] if base else []
                sels += [
                    (
                        m,
                        _select(rows, study="pairs", group=pair, variant=m, name=name),
                        f"pairs/{pair}/{m}/*",
                    )
                    for m in modes
                ]
                for mode, sel, glob in sels:
                    if sel:
                        parts.append(
                            f"| {pair} | {name} | {mode} | {len(sel)} | "
                            f"{_stat(sel, 'acc_late')} | {_stat(sel, 'acc_last')} | "
                            f"{_stat(sel, 'reward_late')} | "
                            f"{_stat(sel, 'acc_id')} | {_stat(sel, 'acc_ood')} | "
                            f"{_cmd(glob, scale)} |"
                        )
        parts.append("")
        keys = [k for k in FILTER_KEYS if any(k in r["metrics"] for r in pairs)]
        parts += [
            "### What the filter and the IS weights did (per-round means over the run)\n",
            "| pair | node | mode | " + " | ".join(keys) + " |",
            "|---|---|---|" + "---|" * len(keys),
        ]
        for pair, modes in PAIR_MODES.items():
            for name in (RECEIVER, PEER[pair]):
                for m in modes:
                    sel = _select(rows, study="pairs", group=pair, variant=m, name=name)
                    if sel:
                        cols = [_stat(sel, k, metrics=True) for k in keys]
                        parts.append(f"| {pair} | {name} | {m} | " + " | ".join(cols) + " |")
        parts.append("")
    bad = _select(rows, study="badpeer", name=RECEIVER)
    if bad:
        # each parser check's and verify_rewards' drops, as the driver names them
        counters = [
            k
            for k in (f"dropped_{kind}" for kind in DROP_KINDS)
            if any(k in r["metrics"] for r in bad)
        ]
        parts += [
            "### Bad peers: the receiver (small) with tiny turned hostile\n",
            "Sample accuracy over the second half and its difference from the honest size pair's "
            "run of the same mode and seed; what the receiver dropped, and each defence's counters "
            "summed over the run.\n",
            "| attack | mode | seeds | sample acc, 2nd half | Δ vs honest | dropped / received | "
            "IS weight | received tokens truncated | filter changed | "
            + " | ".join(counters)
            + " | command |",
            "|---|---|---|---|---|---|---|---|---|" + "---|" * len(counters) + "---|",
        ]
        for attack, modes in ATTACKS.items():
            for mode in modes:
                sel = _select(bad, group=mode, variant=attack)
                if not sel:
                    continue
                honest_mode = mode.split("+")[0]
                diffs = []
                for r in sel:
                    h = _select(
                        rows,
                        study="pairs",
                        group="size",
                        variant=honest_mode,
                        name=RECEIVER,
                        seed=r["seed"],
                    )
                    if h:
                        diffs.append(r["acc_late"] - h[0]["acc_late"])
                delta = f"{statistics.fmean(diffs):+.3f}" if diffs else "-"
                drop = sum(r["metrics"].get("dropped", 0) for r in sel)
                recv = drop + sum(r["metrics"].get("samples_received", 0) for r in sel)
                cols = [
                    str(int(sum(r["metrics"].get(k, 0) or 0 for r in sel)))
                    if all(isinstance(r["metrics"].get(k, 0), int) for r in sel)
                    else _stat(sel, k, metrics=True)
                    for k in counters
                ]
                parts.append(
                    f"| {attack} | {mode} | {len(sel)} | {_stat(sel, 'acc_late')} | {delta} "
                    f"| {drop} / {recv} | {_stat(sel, 'is_weight_mean', True)} | "
                    f"{_stat(sel, 'recv_truncated_frac', True)} | "
                    f"{_stat(sel, 'filter_changed_frac', True)} | "
                    + " | ".join(cols)
                    + f" | {_cmd(f'badpeer/{mode}/{attack}/*', scale)} |"
                )
        parts.append("")
    return "\n".join(parts)


# -- plots -----------------------------------------------------------------------------------------
# Every mode its colour, dash, marker, width and marker offset: curves that coincide (the
# identical pair's modes do, bit for bit) stay visible, the wider one beneath.
MODE_STYLE = {
    "isolated": dict(color="black", linestyle="--", marker="s", lw=2.0, markevery=(0, 5)),
    "nois": dict(color="C3", linestyle="-", marker="x", lw=4.0, markevery=(1, 5)),
    "f-vis": dict(color="C2", linestyle="-.", marker="^", lw=2.5, markevery=(2, 5)),
    "f-tis": dict(color="C0", linestyle=":", marker="o", lw=2.0, markevery=(3, 5)),
}
SMOOTH = 5


def _curves_of(curves, prefix: str, name: str) -> list[dict]:
    return [c for c in curves if c["id"].startswith(prefix) and c["name"] == name]


def plot_rewards(curves: list[dict], path: Path, key: str = "sample_acc") -> bool:
    """Sample accuracy (or `key`) per round, one panel per pair and node: each seed a thin line,
    the mean of the seeds thick with markers; the same y-range in every panel."""
    import matplotlib.pyplot as plt

    panels = [(pair, name) for pair in PAIR_MODES for name in (RECEIVER, PEER[pair])]
    fig, axes = plt.subplots(
        len(PAIR_MODES), 2, figsize=(11, 3.0 * len(PAIR_MODES)), sharex=True, sharey=True
    )
    drawn = False
    for ax, (pair, name) in zip(axes.flat, panels):
        lines = [("isolated", "isolated/all/on-policy/")] + [
            (m, f"pairs/{pair}/{m}/") for m in PAIR_MODES[pair]
        ]
        for mode, prefix in lines:
            sel = _curves_of(curves, prefix, name)
            if not sel:
                continue
            drawn = True
            style = MODE_STYLE[mode]
            for c in sel:
                ax.plot(smooth(c[key], SMOOTH), color=style["color"], lw=0.5, alpha=0.25)
            n = min(len(c[key]) for c in sel)
            mean = [statistics.fmean(smooth(c[key], SMOOTH)[i] for c in sel) for i in range(n)]
            ax.plot(mean, label=f"{mode} (mean of {len(sel)})", **style)
        # One round's reward averages 32 samples; a 5-round mean 160: its standard error is at
        # most 0.5 / sqrt(160) = 0.04 (a reward in [0, 1]).
        ax.errorbar([1], [0.9], yerr=[0.5 / math.sqrt(32 * SMOOTH)], color="grey", capsize=3)
        ax.set_title(f"{pair} pair: {name}", fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower right")
    for ax in axes[-1]:
        ax.set_xlabel("round")
    for ax in axes[:, 0]:
        ax.set_ylabel(f"{key} ({SMOOTH}-round mean)")
    fig.suptitle(
        "Thin: one seed; thick: mean of seeds. Grey bar: the largest standard error of one "
        f"{SMOOTH}-round mean (160 samples). Coinciding curves: the wider lies beneath",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    if drawn:
        fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


def plot_final(rows: list[dict], path: Path, key: str = "acc_id") -> bool:
    """Final accuracy per pair, node and mode: one dot per seed, the mean with the 95% binomial
    error of one evaluation of EVAL_SIZE problems at that mean."""
    import matplotlib.pyplot as plt

    panels = [(pair, name) for pair in PAIR_MODES for name in (RECEIVER, PEER[pair])]
    fig, axes = plt.subplots(1, len(panels), figsize=(1.6 * len(panels) + 1, 3.6), sharey=True)
    drawn = False
    for ax, (pair, name) in zip(axes, panels):
        has_base = bool(_select(rows, study="isolated", name=name))
        modes = (["isolated"] if has_base else []) + list(PAIR_MODES[pair])
        for i, mode in enumerate(modes):
            if mode == "isolated":
                sel = _select(rows, study="isolated", name=name)
            else:
                sel = _select(rows, study="pairs", group=pair, variant=mode, name=name)
            vals = [r[key] for r in sel if r[key] is not None]
            if not vals:
                continue
            drawn = True
            style = MODE_STYLE[mode]
            jitter = [i + 0.25 * ((k % 5) - 2) / 4 for k in range(len(vals))]
            ax.scatter(jitter, vals, s=8, color=style["color"], alpha=0.5, marker=style["marker"])
            m = statistics.fmean(vals)
            err = 1.96 * math.sqrt(max(m * (1 - m), 1e-9) / EVAL_SIZE)
            ax.errorbar(
                [i + 0.35], [m], yerr=[err], color=style["color"], marker="_", ms=12, capsize=3
            )
        ax.set_xticks(range(len(modes)), modes, rotation=60, fontsize=7)
        ax.set_title(f"{pair}:\n{name}", fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel(f"final {key}")
    fig.suptitle(
        f"Dots: seeds; bar: the mean ± the 95% binomial error of one evaluation "
        f"({EVAL_SIZE} problems)",
        fontsize=9,
    )
    fig.tight_layout()
    if drawn:
        fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


def plot_claims(claims: list[dict], path: Path) -> bool:
    """Each claim's mean per-seed difference with its 95% t interval (and the 90% interval of an
    equivalence test against its shaded margin)."""
    import matplotlib.pyplot as plt

    done = [c for c in claims if c["verdict"] != "pending"]
    if not done:
        return False
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(done) + 1.5))
    colors = {"reproduced": "C2", "contradicted": "C3", "inconclusive": "C7"}
    for y, c in enumerate(reversed(done)):
        color = colors.get(c["verdict"], "C1")
        if c["kind"] == "equivalence":
            ax.fill_betweenx([y - 0.4, y + 0.4], -c["margin"], c["margin"], color="C0", alpha=0.08)
            ax.plot(c["ci90"], [y + 0.15] * 2, color=color, lw=4, alpha=0.5)
        ax.errorbar(
            [c["mean"]],
            [y],
            xerr=[[c["mean"] - c["ci"][0]], [c["ci"][1] - c["mean"]]],
            fmt="o",
            color=color,
            capsize=4,
        )
        ax.annotate(
            f"{c['verdict']} (n={c['n']})", (max(c["ci"][1], 0) + 0.005, y), fontsize=7, va="center"
        )
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(
        range(len(done)), [f"{c['id']}: {c['metric']}" for c in reversed(done)], fontsize=8
    )
    ax.set_xlabel(
        "mean per-seed difference (mode − baseline), 95% t interval; "
        "thick: 90% interval, shaded: the margin"
    )
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_badpeer(curves: list[dict], path: Path, key: str = "sample_acc") -> bool:
    """The receiver's sample accuracy under each attack and mode (mean of seeds, seeds thin),
    against the honest pair's."""
    import matplotlib.pyplot as plt

    modes = ("nois", "f-tis", "f-tis+verify")
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 3.8), sharey=True)
    drawn = False
    styles = ["-", "--", "-.", ":"]
    markers = ["o", "x", "^", "s", "v", "D"]
    for ax, mode in zip(axes, modes):
        lines = [("honest", f"pairs/size/{mode.split('+')[0]}/")]
        lines += [(a, f"badpeer/{mode}/{a}/") for a, ms in ATTACKS.items() if mode in ms]
        for i, (label, prefix) in enumerate(lines):
            sel = _curves_of(curves, prefix, RECEIVER)
            if not sel:
                continue
            drawn = True
            color = "black" if label == "honest" else f"C{i}"
            for c in sel:
                ax.plot(smooth(c[key], SMOOTH), color=color, lw=0.5, alpha=0.25)
            n = min(len(c[key]) for c in sel)
            mean = [statistics.fmean(smooth(c[key], SMOOTH)[k] for c in sel) for k in range(n)]
            ax.plot(
                mean,
                color=color,
                lw=2,
                linestyle=styles[i % 4],
                marker=markers[i % 6],
                markevery=5,
                label=f"{label} ({len(sel)})",
            )
        ax.set_title(f"receiver under {mode}", fontsize=10)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    axes[0].set_ylabel(f"{key} ({SMOOTH}-round mean)")
    fig.tight_layout()
    if drawn:
        fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


def plots(rows: list[dict], curves: list[dict], claims: list[dict], results: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    made = []
    for name, draw in (
        ("claims", lambda p: plot_claims(claims, p)),
        ("pairs_sample_acc", lambda p: plot_rewards(curves, p)),
        ("final_acc_id", lambda p: plot_final(rows, p, "acc_id")),
        ("final_acc_ood", lambda p: plot_final(rows, p, "acc_ood")),
        ("badpeer", lambda p: plot_badpeer(curves, p)),
    ):
        if draw(results / f"{name}.png"):
            made.append(results / f"{name}.png")
    return made


BEGIN, END = "<!-- study:begin -->", "<!-- study:end -->"
RULES_BEGIN, RULES_END = "<!-- rules:begin -->", "<!-- rules:end -->"
# The mechanism test's section (`python -m experiments.mechanism` writes it) goes in as written.
MECH_BEGIN, MECH_END = "<!-- mechanism:begin -->", "<!-- mechanism:end -->"


def rules_section() -> str:
    """The claims and the rules, as the code states them (the README's rules section)."""
    lines = [
        stats.RULES,
        "",
        f'Margin of "behaves like": ±{MARGIN} in sample accuracy. Floor of an accuracy: a baseline '
        f"mean below {FLOOR}. Seeds: {SEEDS[0]}-{SEEDS[-1]} ({len(SEEDS)}). All claims below form "
        "one Holm family.",
        "",
        "| id | claim | primary metric | test | compared (pair: node, mode − baseline) "
        "| precondition |",
        "|---|---|---|---|---|---|",
    ]
    for spec in CLAIMS:
        test = (
            f"TOST ±{spec.test.margin:g}"
            if spec.test.kind == "equivalence"
            else f"paired t, predicted sign {'+' if spec.test.sign > 0 else '−'}"
        )
        units = "; ".join(
            f"{pair}: {name}, {mode} − {bm if bp in (pair, None) else bp}"
            for pair, name, mode, bp, bm in spec.units
        )
        pre = []
        if spec.control:
            pre.append(f"control {spec.control} reproduced")
        if spec.floor:
            pre.append(f"baseline mean ≥ {FLOOR}")
        lines.append(
            f"| {spec.id} | {spec.text} | {spec.test.metric} ({METRICS[spec.test.metric]}) "
            f"| {test} | {units} | {', '.join(pre) or '-'} |"
        )
    return "\n".join(lines)


def _replace(text: str, begin: str, end: str, body: str) -> str:
    if begin not in text or end not in text:
        return text
    head, rest = text.split(begin, 1)
    return f"{head}{begin}\n{body}\n{end}{rest.split(end, 1)[1]}"


def report(
    todo: list[Cell],
    work: Path,
    results: Path,
    readme: Optional[Path],
    extra: tuple[str, ...],
    scale: str,
) -> str:
    rows, curves = collect(todo, work, extra)
    claims = analyse(rows) if rows else []
    results.mkdir(parents=True, exist_ok=True)
    for name, items in (("cells", rows), ("curves", curves), ("claims", claims)):
        (results / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items))
    table = tables(rows, claims, scale)
    (results / "tables.md").write_text(table + "\n")
    if rows:
        plots(rows, curves, claims, results)
    if readme is not None and readme.exists():
        text = _replace(readme.read_text(), BEGIN, END, table)
        text = _replace(text, RULES_BEGIN, RULES_END, rules_section())
        mechanism = results / "mechanism.md"
        if mechanism.exists():  # its figure lies beside it: the path from the README's folder
            png = Path(os.path.relpath(results / "mechanism.png", readme.parent)).as_posix()
            body = mechanism.read_text().strip().replace("](mechanism.png)", f"]({png})")
            text = _replace(text, MECH_BEGIN, MECH_END, body)
        readme.write_text(text)
    return table


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.study", description=__doc__.split("\n")[0]
    )
    p.add_argument("action", choices=("run", "report", "list", "estimate"))
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
    if args.action == "estimate":
        print(estimate(todo, work, extra))
        return 0
    rc = run(todo, work, args.jobs, extra) if args.action == "run" else 0
    table = report(cells(args.scale), work, results, readme, extra, args.scale)
    print(table)
    return rc


if __name__ == "__main__":
    sys.exit(main())
