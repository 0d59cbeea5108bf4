"""The filter's own effect: where it acts in the recorded runs, and the plan for testing it.

    python -m experiments.filter_effect           # writes results/filter_effect.md
    python -m experiments.filter_effect --check   # exit 1 if the committed table is out of date
    python -m experiments.filter_effect list --scale pilot        # the pilot's cells, commands
    python -m experiments.filter_effect estimate --scale pilot    # CPU-hours left, per chunk
    python -m experiments.filter_effect run --scale pilot --chunk 1 --jobs 1 [--until 22:00]
    python -m experiments.filter_effect report --scale pilot      # record; at its end freeze g
    python -m experiments.filter_effect run --scale confirm --chunk 1   # needs the frozen g

The runner (below `study_cells`) runs the pre-registration's cells through the confirmatory
round's machinery (`study.Cell`, `study.run_cell`, `confirm.run`: resumable, finished or
recorded cells skipped, CPU time and environment recorded per cell) into `runs-filter/` and
records them in `results/filter_effect/` (pilot.jsonl, cells.jsonl and their curves).
`report --scale pilot` applies the plan's rule (`choose_g`) once every pilot cell has run and
writes the frozen g and the confirmatory sample size to `results/filter_effect/frozen.json`;
`run --scale confirm` refuses to start without it. Where the rule found the test underpowered,
the confirmatory run takes the plan's cap of seeds and reports estimates only (`confirm_seeds`).

From recorded data only: the confirmatory round's cells (`results/confirm/cells.jsonl`: per
cell and node, each run metric's mean over its 30 rounds) and the first round's mechanism test
(`results/mechanism.jsonl`: batch gradients of one receiver under TIS and F-TIS on the same
peer batches). Nothing here trains.

What a cell records of the filter (`ftis_kernels.grpo.audit.defence_metrics`, per round, then
averaged): filtered_frac (samples the op filtered, of all the node trained on, zero-advantage ones
included), filter_changed_frac (those whose advantage it set to 0 from non-zero: by the filter's
rule all of them have a negative advantage), filter_changed_neg (that count among the received
samples with a negative advantage) and recv_kl_mean (the mean summed-k3 KL of all received
samples). Not recorded: any per-sample value (the run folders' `received.jsonl` were not kept),
so neither the filtered samples' own KL (above g by definition) nor their IS weights or gradients.

The share of a node's update the filter changes is estimated two ways:

- *samples*: the changed samples among the node's samples with a non-zero advantage (own groups
  with all-equal rewards have advantage 0: zero_adv_groups of the node; received ones: the peer's
  zero_adv_groups in the same cell, since the peer sends all its samples). With the `grpo`
  reduction and `reject_mode="advantage"` each sample's policy term is its own, so this is the
  share of the update's non-zero terms the filter removes, not of its norm.
- *gradient*: from the mechanism test, a lower bound on ||E g_TIS - E g_F-TIS|| / ||E g_TIS||,
  the share of the expected TIS gradient's norm the filtered samples carry: the larger of
  | ||E g_TIS|| - ||E g_F-TIS|| | (the recorded norms of the mean gradient less their noise) and
  the gap between the two modes' 95% intervals of ||E g - g*|| / ||g*||, times ||g*|| (triangle
  inequalities), over ||E g_TIS||. The first round's task and warm-ups, not the confirmatory
  round's; no upper bound below 1 follows from the records.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import scipy.stats as sps
import yaml
from scipy.optimize import brentq

from experiments import stats

HERE = Path(__file__).resolve().parent
CELLS = HERE / "results" / "confirm" / "cells.jsonl"
MECHANISM = HERE / "results" / "mechanism.jsonl"
PLAN = HERE / "configs" / "filter_effect.yaml"
OUT = HERE / "results" / "filter_effect.md"
G = 15  # the confirmatory round's g (summed k3), every config
PAIRS = ("size", "expertise", "lora", "stale")
FILTER_MODES = ("f-tis", "f-vis")
USED_SEEDS = frozenset([*range(0, 26), 100, 101, 102])  # first round, confirmatory, task pilot
FROZEN_PEERS = {("stale", 1)}  # the stale peer does not train (lr 1e-12): no update to change


def load_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _cell_index(rows: list[dict]) -> dict[tuple, dict]:
    return {(r["group"], r["variant"], r["seed"], r["node"]): r for r in rows}


def sample_figures(row: dict, peer: dict) -> dict[str, float]:
    """One cell's node: what its filter did, from the run metrics of the node and its peer."""
    m, pm = row["metrics"], peer["metrics"]
    trained, received = m["samples_trained"], m["samples_received"]
    own = trained - received
    changed = m.get("filter_changed_frac", 0.0) * trained
    nonzero = own * (1 - m["zero_adv_groups"]) + received * (1 - pm["zero_adv_groups"])
    filtered = m.get("filtered_frac", 0.0)
    return dict(
        filtered=filtered,
        changed=m.get("filter_changed_frac", 0.0),
        zero_filtered=filtered - m.get("filter_changed_frac", 0.0),
        changed_of_received=changed / received if received else math.nan,
        changed_of_negative=m.get("filter_changed_neg", math.nan),
        recv_kl=m.get("recv_kl_mean", math.nan),
        recv_truncated=m.get("recv_truncated_frac", math.nan),
        update_share=changed / nonzero if nonzero else math.nan,
    )


def _summary(vals: list[float]) -> dict[str, float]:
    x = np.asarray([v for v in vals if not math.isnan(v)], dtype=float)
    if not x.size:
        return dict(mean=math.nan, lo=math.nan, hi=math.nan)
    return dict(mean=float(x.mean()), lo=float(x.min()), hi=float(x.max()))


def where_filter_acts(
    rows: list[dict], threshold: float = 0.10, modes: tuple[str, ...] = ("f-tis",)
) -> list[dict[str, Any]]:
    """Per pair, node and filtering mode: the filter's figures over seeds (mean, min, max), its
    outcome against the same node's run without the filter (F-TIS - TIS, or F-TIS - NoIS where
    the pair has no TIS arm: the cap and the filter together) in acc_late with a 95% t interval,
    and whether the mean update share reaches `threshold`."""
    cells = _cell_index(rows)
    out = []
    for pair in PAIRS:
        for mode in modes:
            for node in (0, 1):
                if (pair, node) in FROZEN_PEERS:
                    continue
                seeds = sorted(s for g, v, s, n in cells if (g, v, n) == (pair, mode, node))
                if not seeds:
                    continue
                figs = [
                    sample_figures(cells[pair, mode, s, node], cells[pair, mode, s, 1 - node])
                    for s in seeds
                ]
                base = "tis" if (pair, "tis", seeds[0], node) in cells else "nois"
                a = {s: cells[pair, mode, s, node]["acc_late"] for s in seeds}
                b = {
                    s: cells[pair, base, s, node]["acc_late"]
                    for s in seeds
                    if (pair, base, s, node) in cells
                }
                d = stats.paired(a, b)
                entry = dict(
                    pair=pair,
                    node=cells[pair, mode, seeds[0], node]["name"],
                    mode=mode,
                    seeds=len(seeds),
                    **{k: _summary([f[k] for f in figs]) for k in figs[0]},
                    baseline=base,
                    diff=stats.t_interval(d) if len(d) >= 2 else None,
                    diff_sd=float(np.std(d, ddof=1)) if len(d) >= 2 else math.nan,
                )
                entry["acts"] = entry["update_share"]["mean"] >= threshold
                entry["seeds_acting"] = sum(f["update_share"] >= threshold for f in figs)
                out.append(entry)
    return out


def _expected_norm(row: dict) -> float:
    """||E g|| of a mechanism row: its recorded ||mean of the batch gradients||, less the noise
    of the mean (trace of the batch covariance / batches)."""
    return math.sqrt(max(row["grad_norm"] ** 2 - row["var"] / row["batches"], 0.0))


def gradient_bounds(mech: list[dict]) -> list[dict[str, Any]]:
    """Per peer of the mechanism test: the lower bound (module docstring) on the share of the
    expected TIS gradient's norm that the filtered samples carry, and the figures it rests on."""
    target = next(r["target"]["grad_norm"] for r in mech if "target" in r)
    by = {(r["peer"], r["mode"]): r for r in mech}
    out = []
    for peer in dict.fromkeys(r["peer"] for r in mech):
        if (peer, "tis") not in by or (peer, "f-tis") not in by or peer == "on-policy":
            continue
        t, f = by[peer, "tis"], by[peer, "f-tis"]
        norm_t, norm_f = _expected_norm(t), _expected_norm(f)
        (tlo, thi), (flo, fhi) = t["rel_err_ci"], f["rel_err_ci"]
        by_norm = abs(norm_t - norm_f)
        by_error = max(0.0, flo - thi, tlo - fhi) * target
        out.append(
            dict(
                peer=peer,
                kl=t["kl_sample"],
                changed=f["filter_changed_frac"],
                changed_of_negative=f["filter_changed_of_negative"],
                norm_tis=norm_t,
                norm_ftis=norm_f,
                rel_err_tis=t["rel_err"],
                rel_err_ftis=f["rel_err"],
                lower=max(by_norm, by_error) / norm_t,
            )
        )
    return out


# The pre-registration (configs/filter_effect.yaml): its checks, cells, cost and analysis.
PLAN_KEYS = (
    "frozen",
    "metric",
    "mode",
    "baseline",
    "sign",
    "alpha",
    "power",
    "effect",
    "act_share",
    "family",
    "estimates",
    "pilot",
    "confirm",
)


def load_plan(path: Path = PLAN) -> dict[str, Any]:
    """The frozen plan, checked: every key there, frozen, pilot and confirmatory seeds fresh and
    disjoint, each grid entry a summed or mean k3 threshold > 0, the family non-empty."""
    plan = yaml.safe_load(Path(path).read_text())
    missing = [k for k in PLAN_KEYS if k not in plan]
    if missing:
        raise ValueError(f"{path}: missing {missing}")
    if plan["frozen"] is not True:
        raise ValueError(f"{path}: a pre-registration must be frozen")
    pilot = set(plan["pilot"]["seeds"])
    if pilot & USED_SEEDS or plan["confirm"]["seeds_from"] in USED_SEEDS | pilot:
        raise ValueError(f"{path}: seeds already used by an earlier round or by the pilot")
    if plan["confirm"]["seeds_from"] <= max(pilot):
        raise ValueError(f"{path}: confirmatory seeds must start above the pilot's")
    for g in plan["pilot"]["grid"]:
        if g["kl_reduction"] not in ("sum", "mean") or not g["kl_threshold"] > 0:
            raise ValueError(f"{path}: bad grid entry {g}")
    if not plan["family"]:
        raise ValueError(f"{path}: an empty family")
    return plan


def grid_flags(entry: dict) -> list[str]:
    """The `ftis-grpo` flags of one grid entry (`loss_options` carries the reduction)."""
    return [
        "--set",
        f"kl_threshold={entry['kl_threshold']}",
        "--set",
        f"loss_options.kl_reduction={entry['kl_reduction']}",
    ]


def plan_cells(plan: dict, stage: str, n_seeds: Optional[int] = None) -> list[tuple]:
    """(pair, arm, grid entry name or None, seed): the pilot's cells, or the confirmatory run's at
    `n_seeds` seeds (its F-TIS arm at the frozen g, named "frozen")."""
    pairs = list(dict.fromkeys(u["pair"] for u in plan["family"] + plan["estimates"]))
    if stage == "pilot":
        seeds, arms = (
            plan["pilot"]["seeds"],
            [(plan["baseline"], None)] + [(plan["mode"], g["name"]) for g in plan["pilot"]["grid"]],
        )
    else:
        start = plan["confirm"]["seeds_from"]
        seeds = range(start, start + n_seeds)
        arms = [(plan["baseline"], None), (plan["mode"], "frozen")]
    return [(p, arm, g, s) for s in seeds for p in pairs for arm, g in arms]


def cell_cpu(rows: list[dict]) -> dict[str, float]:
    """Median CPU-s of a recorded cell per (pair, mode) (one row per node: each cell once), and
    `warmups`: the recorded per-seed cost of a fresh seed's warm-ups, the extra CPU-s of the
    cells that built them (size and expertise on-policy against TIS: small, tiny, add-expert;
    stale NoIS against F-TIS: the stale peer), medians over seeds. Those on-policy cells also
    evaluate the start: an overestimate."""
    per: dict[tuple, dict[int, float]] = {}
    for r in rows:
        per.setdefault((r["group"], r["variant"]), {})[r["seed"]] = r["cpu_seconds"]
    out = {f"{p}/{m}": float(np.median(list(v.values()))) for (p, m), v in per.items()}
    out["warmups"] = 0.0
    for pair, built, plain in (
        ("size", "on-policy", "tis"),
        ("expertise", "on-policy", "tis"),
        ("stale", "nois", "f-tis"),
    ):
        a, b = per.get((pair, built), {}), per.get((pair, plain), {})
        extra = [a[s] - b[s] for s in a if s in b]
        out["warmups"] += max(float(np.median(extra)), 0.0) if extra else 0.0
    return out


def cost(plan: dict, rows: list[dict], stage: str, n_seeds: Optional[int] = None) -> dict:
    """CPU-hours of a stage from recorded cell timings: a cell of a missing (pair, mode), the
    stale pair's TIS arm, is priced as the same pair's F-TIS cell; each seed pays `warmups`."""
    cpu = cell_cpu(rows)
    todo = plan_cells(plan, stage, n_seeds)
    total = sum(cpu.get(f"{p}/{arm}", cpu[f"{p}/{plan['mode']}"]) for p, arm, _, _ in todo)
    seeds = len({s for *_, s in todo})
    total += seeds * cpu["warmups"]
    return dict(cells=len(todo), seeds=seeds, cpu_h=total / 3600, wall_h_2cores=total / 3600 / 1.9)


def sd_upper(sd: float, n: int, level: float) -> float:
    """The one-sided upper `level` confidence bound of a normal SD estimated from n values."""
    return sd * math.sqrt((n - 1) / sps.chi2.ppf(1 - level, n - 1))


def sample_size(plan: dict, sd: float, n_pilot: int) -> Optional[int]:
    """The confirmatory seeds (the plan's rule): None when more than max_seeds are needed."""
    c = plan["confirm"]
    alpha = plan["alpha"] / len(plan["family"])
    n = stats.seeds_needed(
        sd_upper(sd, n_pilot, c["sd_level"]),
        plan["effect"],
        alpha,
        plan["power"],
        most=c["max_seeds"],
    )
    return None if n is None else max(n, c["min_seeds"])


def _variant(mode: str, grid: Optional[str]) -> str:
    return mode if grid is None else f"{mode}-{grid}"


def unit_diffs(rows: list[dict], plan: dict, units: list[dict], grid: Optional[str]) -> dict:
    """Per unit id: {seed: acc(mode at `grid`) - acc(baseline)} from cell rows whose `variant`
    is the arm's name (`f-tis-sum20`, `f-tis-frozen`, `tis`)."""
    cells = {(r["group"], r["variant"], r["name"], r["seed"]): r[plan["metric"]] for r in rows}
    out = {}
    for u in units:
        a = {
            s: v
            for (p, arm, n, s), v in cells.items()
            if (p, arm, n) == (u["pair"], _variant(plan["mode"], grid), u["node"])
        }
        b = {
            s: v
            for (p, arm, n, s), v in cells.items()
            if (p, arm, n) == (u["pair"], plan["baseline"], u["node"])
        }
        out[u["id"]] = {s: a[s] - b[s] for s in sorted(set(a) & set(b))}
    return out


def g_table(pilot_rows: list[dict], plan: dict) -> list[dict[str, Any]]:
    """Per grid entry: the pilot mean of the pooled family difference (F-TIS at g - TIS), the
    smallest family node's mean update share, the family's largest per-seed SD of the
    difference, and the fewest paired seeds of a family node."""
    table = []
    peers = {(r["group"], r["variant"], r["seed"], r["node"]): r for r in pilot_rows}
    for g in plan["pilot"]["grid"]:
        d = unit_diffs(pilot_rows, plan, plan["family"], g["name"])
        pooled = stats.pool(list(d.values()))
        shares = []
        for u in plan["family"]:
            sel = [
                r
                for r in pilot_rows
                if (r["group"], r["variant"], r["name"])
                == (u["pair"], _variant(plan["mode"], g["name"]), u["node"])
            ]
            figs = [
                sample_figures(r, peers[r["group"], r["variant"], r["seed"], 1 - r["node"]])
                for r in sel
                if (r["group"], r["variant"], r["seed"], 1 - r["node"]) in peers
            ]
            shares.append(_summary([f["update_share"] for f in figs])["mean"])
        sds = [float(np.std(list(v.values()), ddof=1)) for v in d.values() if len(v) >= 2]
        table.append(
            dict(
                name=g["name"],
                mean=float(np.mean(list(pooled.values()))) if pooled else math.nan,
                min_share=math.nan if any(math.isnan(x) for x in shares) else min(shares),
                shares={u["id"]: x for u, x in zip(plan["family"], shares)},
                sd=max(sds) if sds else math.nan,
                n=min(len(v) for v in d.values()),
            )
        )
    return table


def choose_g(pilot_rows: list[dict], plan: dict) -> dict[str, Any]:
    """The plan's rule for the frozen g on the pilot's rows, and the confirmatory sample size
    from the pilot's SD at that g."""
    table = g_table(pilot_rows, plan)
    acting = [t for t in table if t["min_share"] >= plan["act_share"]]
    pick = (
        max(acting, key=lambda t: t["mean"]) if acting else max(table, key=lambda t: t["min_share"])
    )
    return dict(table=table, frozen=pick["name"], seeds=sample_size(plan, pick["sd"], pick["n"]))


def confirmatory(rows: list[dict], plan: dict) -> dict[str, Any]:
    """The pre-registered test: per family member a direction claim on F-TIS(frozen g) - TIS,
    Holm within the family; the estimates' intervals; leave-one-seed-out verdict counts."""

    def family(rs: list[dict]) -> list[stats.Result]:
        d = unit_diffs(rs, plan, plan["family"], "frozen")
        claims = [
            (
                stats.Claim(u["id"], "direction", plan["metric"], sign=plan["sign"]),
                list(d[u["id"]].values()),
                None,
            )
            for u in plan["family"]
        ]
        return stats.evaluate(claims)

    results = family(rows)
    seeds = sorted({r["seed"] for r in rows})
    loo: dict[str, dict[str, int]] = {u["id"]: {} for u in plan["family"]}
    for s in seeds if len(seeds) >= 3 else []:
        for r in family([x for x in rows if x["seed"] != s]):
            loo[r.claim.name][r.verdict] = loo[r.claim.name].get(r.verdict, 0) + 1
    est = unit_diffs(rows, plan, plan["estimates"], "frozen")
    return dict(
        results=results,
        leave_one_out=loo,
        estimates={k: stats.t_interval(list(v.values())) for k, v in est.items()},
    )


def _f(x: float, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _span(s: dict, digits: int = 3) -> str:
    return f"{_f(s['mean'], digits)} ({_f(s['lo'], digits)}-{_f(s['hi'], digits)})"


def _seeds(plan: dict, sd: float, n: int = 16) -> str:
    k = sample_size(plan, sd, n)
    return f"{k} seeds" if k else f"more than {plan['confirm']['max_seeds']} seeds (underpowered)"


def report(
    rows: list[dict],
    mech: list[dict],
    plan: dict,
    pilot_rows: tuple = (),
    frozen: Optional[dict] = None,
    confirm_rows: tuple = (),
) -> str:
    acts = where_filter_acts(rows, plan["act_share"], FILTER_MODES)
    lines = [
        "### Where the filter acts (confirmatory round, g = 15 summed k3; recorded data only)",
        "",
        "`python -m experiments.filter_effect`, from `results/confirm/cells.jsonl` (per cell and "
        "node, each metric's mean over 30 rounds) and `results/mechanism.jsonl`. Each figure: the "
        "mean over seeds, (min-max) over seeds. *filtered*: of all samples the node trains on; "
        "*changed*: of those, the ones whose advantage the filter zeroed (all negative); "
        "*of received*, *of negative*: the changed share of the received samples and of the "
        "received negative-advantage ones; *received KL*: mean summed k3 of all received "
        "samples (the filtered ones' own KL is not recorded: above 15 by the rule); *update "
        "share*: the changed share of the node's non-zero-advantage samples (a count, not a "
        "norm); *F - base*: acc_late of the mode minus the same node's run without the filter "
        "(TIS; NoIS for the stale pair, which has no TIS arm: cap and filter together), 95% t "
        "interval over the seeds.",
        "",
        "| pair | node | mode | seeds | filtered | changed | of received | of negative "
        "| received KL | update share | F - base (acc_late) | acts (>= "
        f"{plan['act_share']:.2f}; seeds) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a in acts:
        diff = "-" if a["diff"] is None else f"{a['mode']} - {a['baseline']}: {a['diff']}"
        lines.append(
            f"| {a['pair']} | {a['node']} | {a['mode']} | {a['seeds']} | {_span(a['filtered'])} "
            f"| {_span(a['changed'])} | {_span(a['changed_of_received'])} "
            f"| {_span(a['changed_of_negative'])} | {_span(a['recv_kl'], 1)} "
            f"| {_span(a['update_share'])} | {diff} "
            f"| {'yes' if a['acts'] else 'no'}; {a['seeds_acting']} of {a['seeds']} |"
        )
    lines += [
        "",
        "### The share of the gradient's norm (the mechanism test; the first round's task, "
        "warm-ups and g = 15)",
        "",
        "Lower bound on ||E g_TIS - E g_F-TIS|| / ||E g_TIS||: what the filtered samples carry of "
        "the expected TIS gradient at the receiver's warmed-up weights (100 batches of 32 of the "
        "peer's samples): the larger of the gap between the two norms (the recorded norm of the "
        "mean gradient less its noise) and the gap between the two modes' 95% intervals of the "
        "relative error (point estimates shown). No upper bound the records support is below 1: "
        "the cross term of the two modes' gradients was not stored.",
        "",
        "| peer | KL / sample | changed (of negative) | norm TIS | norm F-TIS | rel. error TIS "
        "| rel. error F-TIS | share of the norm, at least |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for b in gradient_bounds(mech):
        lines.append(
            f"| {b['peer']} | {b['kl']:.2f} | {b['changed']:.3f} ({b['changed_of_negative']:.3f}) "
            f"| {b['norm_tis']:.3f} | {b['norm_ftis']:.3f} | {b['rel_err_tis']:.3f} "
            f"| {b['rel_err_ftis']:.3f} | {b['lower']:.3f} |"
        )
    lines += ["", "### The pre-registered next step: what it costs (from the recorded timings)", ""]
    pilot = cost(plan, rows, "pilot")
    cpu = cell_cpu(rows)
    lines.append(
        f"Pilot: {pilot['cells']} cells on {pilot['seeds']} seeds, {pilot['cpu_h']:.2f} CPU-h "
        f"(about {pilot['wall_h_2cores']:.1f} h wall on 2 idle cores); a fresh seed's warm-ups "
        f"and start evaluation {cpu['warmups']:.0f} CPU-s, a cell {cpu['stale/f-tis']:.0f} "
        f"(stale) to {cpu['expertise/f-tis']:.0f} (expertise) CPU-s (medians)."
    )
    lines += [
        "",
        "| confirmatory seeds | cells | CPU-h | wall h, 2 idle cores |",
        "|---|---|---|---|",
    ]
    for n in (16, 32, 64, 96):
        c = cost(plan, rows, "confirm", n)
        lines.append(f"| {n} | {c['cells']} | {c['cpu_h']:.2f} | {c['wall_h_2cores']:.1f} |")
    sd = {a["node"] + "/" + a["pair"]: a["diff_sd"] for a in acts if a["mode"] == "f-tis"}
    lines += [
        "",
        "Seeds the rule would ask at the recorded spreads (an illustration; the rule uses the "
        "pilot's): expertise receiver, SD of F-TIS - TIS "
        f"{sd['small/expertise']:.4f} over 16 seeds -> "
        f"{_seeds(plan, sd['small/expertise'])}; stale receiver, SD of F-TIS - NoIS "
        f"{sd['small/stale']:.4f} (cap and filter together) -> {_seeds(plan, sd['small/stale'])}.",
        "",
    ]
    lines += pilot_section(plan, list(pilot_rows), frozen)
    if confirm_rows:
        lines += confirm_section(plan, list(confirm_rows), frozen)
    return "\n".join(lines)


def pilot_complete(plan: dict, rows: list[dict]) -> bool:
    """Every pilot cell recorded, both nodes."""
    ids = {c.id for c in study_cells(plan, "pilot")}
    have: dict[str, int] = {}
    for r in rows:
        have[r["id"]] = have.get(r["id"], 0) + 1
    return all(have.get(i, 0) >= 2 for i in ids)


def pilot_section(plan: dict, rows: list[dict], frozen: Optional[dict]) -> list[str]:
    """The pilot's record: cells run, per grid entry what the rule reads, and the frozen g and
    sample size once the pilot is complete (`frozen`, from `frozen.json`)."""
    lines = ["### The pilot (seeds 200-207): the g sweep", ""]
    if not rows:
        return lines + ["No pilot cell has run.", ""]
    todo = study_cells(plan, "pilot")
    ids = {r["id"] for r in rows}
    seeds = [s for s in plan["pilot"]["seeds"] if all(c.id in ids for c in todo if c.seed == s)]
    cpu = sorted(r["cpu_seconds"] for r in {r["id"]: r for r in rows}.values())
    lines.append(
        f"`python -m experiments.filter_effect run --scale pilot --chunk K`, recorded in "
        f"`results/filter_effect/pilot.jsonl`: {len(ids)} of {len(todo)} cells; seeds complete: "
        f"{', '.join(map(str, seeds)) or 'none'}. CPU-s per cell (one core, both nodes): "
        f"median {np.median(cpu):.0f} ({cpu[0]:.0f}-{cpu[-1]:.0f})."
    )
    lines += [
        "",
        "Per grid entry, over the seeds with both arms: the mean update share (the changed share "
        "of the node's non-zero-advantage samples) of each family node, the pilot mean of the "
        "pooled family difference F-TIS(g) - TIS in acc_late, the family's largest per-seed SD "
        "of that difference, and the paired seeds.",
        "",
        "| entry | reduction | g | "
        + " | ".join(f"share {u['id']}" for u in plan["family"])
        + f" | acts (every node >= {plan['act_share']:.2f}) | pooled F-TIS - TIS | largest SD "
        "| seeds |",
        "|---|---|---|" + "---|" * len(plan["family"]) + "---|---|---|---|",
    ]
    for t in g_table(rows, plan):
        g = _entry(plan, t["name"])
        lines.append(
            f"| {t['name']} | {g['kl_reduction']} | {g['kl_threshold']:g} | "
            + " | ".join(_f(t["shares"][u["id"]]) for u in plan["family"])
            + f" | {'yes' if t['min_share'] >= plan['act_share'] else 'no'} "
            f"| {'-' if math.isnan(t['mean']) else format(t['mean'], '+.4f')} "
            f"| {_f(t['sd'], 4)} | {t['n']} |"
        )
    lines.append("")
    if frozen is not None:
        n = frozen["seeds"]
        lines.append(
            f"**Frozen by the plan's rule on the complete pilot: g = {frozen['frozen']} "
            f"({frozen['entry']['kl_reduction']} k3, threshold {frozen['entry']['kl_threshold']:g})"
            f"; confirmatory seeds: "
            + (
                f"{n} (from {plan['confirm']['seeds_from']}).**"
                if n
                else f"more than {plan['confirm']['max_seeds']}: underpowered for "
                f"{plan['effect']}, so estimates only, at the cap's {plan['confirm']['max_seeds']} "
                f"seeds (from {plan['confirm']['seeds_from']}).**"
            )
            + f" Per-seed SD {frozen['sd']:.4f} at {frozen['n']} seeds, upper "
            f"{plan['confirm']['sd_level']:.0%} bound "
            f"{sd_upper(frozen['sd'], frozen['n'], plan['confirm']['sd_level']):.4f} "
            "(`results/filter_effect/frozen.json`)."
        )
    else:
        lines.append(
            "**Partial: the pilot is not complete, so no g is frozen** (the rule runs on all "
            f"{len(todo)} cells; the figures above are the pilot's so far and choose nothing)."
        )
    return lines + [""]


def detectable(sd: float, n: int, alpha: float, power: float) -> float:
    """The smallest true mean difference a two-sided paired t-test at level `alpha` over n seeds
    of per-seed SD `sd` detects with probability `power`."""
    crit = sps.t.ppf(1 - alpha / 2, n - 1)
    se = sd / math.sqrt(n)
    if se == 0.0:
        return 0.0
    return float(
        brentq(lambda e: sps.nct.sf(crit, n - 1, e / se) - power, 1e-12 * se, 20 * se + 1e-12)
    )


def estimates_section(plan: dict, rows: list[dict], frozen: Optional[dict]) -> list[str]:
    """The underpowered plan's confirmatory answer: per family member and estimate, F-TIS - TIS
    with its 95% interval, the effects it rules out, and the smallest effect the seeds had 80%
    power for at the observed SD (Holm's level for the family), no verdict."""
    d = unit_diffs(rows, plan, plan["family"] + plan["estimates"], "frozen")
    level = plan["alpha"] / len(plan["family"])
    seeds = sorted(set().union(*(set(v) for v in d.values())))  # those with a paired difference
    n_plan = confirm_seeds(plan, frozen)[0] if frozen else len(seeds)
    lines = [
        f"### The confirmatory estimates (g = {frozen['frozen'] if frozen else '?'}; seeds "
        f"{seeds[0]}-{seeds[-1]}, {len(seeds)} of {n_plan}; underpowered for "
        f"{plan['effect']} by the plan's rule, so no verdict)",
        "",
        "| id | seeds | mean F-TIS - TIS (acc_late) | 95% interval | rules out (95%) "
        f"| 80% power at (level {level:.3g}) |",
        "|---|---|---|---|---|---|",
    ]
    for u in plan["family"] + plan["estimates"]:
        v = list(d[u["id"]].values())
        if len(v) < 3:
            lines.append(f"| {u['id']} | {len(v)} | - | - | - | - |")
            continue
        ci = stats.t_interval(v)
        sd = float(np.std(v, ddof=1))
        lines.append(
            f"| {u['id']} | {ci.n} | {ci.mean:+.4f} | [{ci.lo:+.4f}, {ci.hi:+.4f}] "
            f"| below {ci.lo:+.4f} and above {ci.hi:+.4f} "
            f"| {detectable(sd, ci.n, level, plan['power']):.4f} |"
        )
    return lines + [""]


def confirm_section(plan: dict, rows: list[dict], frozen: Optional[dict]) -> list[str]:
    """The confirmatory test's verdicts at the frozen g (`results/filter_effect/cells.jsonl`);
    the estimates only when the plan's rule found the test underpowered."""
    if frozen is not None and not confirm_seeds(plan, frozen)[1]:
        return estimates_section(plan, rows, frozen)
    out = confirmatory(rows, plan)
    lines = [
        f"### The confirmatory test (g = {frozen['frozen'] if frozen else '?'}; seeds "
        f"{min(r['seed'] for r in rows)}-{max(r['seed'] for r in rows)})",
        "",
        "| id | mean F-TIS - TIS (acc_late) | 95% interval | p | p (Holm) | verdict "
        "| leave one seed out |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in out["results"]:
        loo = out["leave_one_out"][r.claim.name]
        lines.append(
            f"| {r.claim.name} | {r.ci.mean:+.4f} | [{r.ci.lo:+.4f}, {r.ci.hi:+.4f}] | {r.p:.3g} "
            f"| {r.p_holm:.3g} | {r.verdict} | "
            + ", ".join(f"{k} {v}" for k, v in sorted(loo.items()))
            + " |"
        )
    for k, v in out["estimates"].items():
        lines.append(f"| {k} (estimate) | {v} | | | | | |")
    return lines + [""]


# -- the runner: the pilot's and the confirmatory run's cells --------------------------------------
# Each cell is one `ftis-grpo` run of a pair's confirmatory config (`configs/confirm/<pair>.yaml`:
# the receiver `small` is rank 0, so its prompts, sampling seed and warm-up are the same in every
# arm of a seed), run, timed and recorded by `study.run_cell` / `confirm.run`. The TIS arm is
# `--loss tis` over the same config (the stale pair's TIS arm is new; the config needs no change:
# the mode is a flag); an F-TIS arm adds its grid entry's `grid_flags`. Every cell's final greedy
# evaluation is `confirm.SMALL_EVAL` problems per split: no comparison of this study reads it.
WORK = HERE / "runs-filter"
RESULTS = HERE / "results" / "filter_effect"
FROZEN = RESULTS / "frozen.json"
STUDY = {"pilot": "filter-pilot", "confirm": "filter-confirm"}
CHUNK_SEEDS = {"pilot": 2, "confirm": 6}  # about half an hour of one core a chunk (`estimate`)


def confirm_seeds(plan: dict, frozen: dict) -> tuple[int, bool]:
    """(seeds, powered): the confirmatory seed count, and whether the plan's rule found it enough
    for `effect`. When the rule needs more than `max_seeds` (frozen `seeds: null`), the plan says
    the study "reports estimates only": it runs the cap's `max_seeds` fresh seeds, its family
    members reported with their intervals, the effects those rule out and the smallest effect
    the seeds had 80% power for, and no verdict (fixed here before any confirmatory cell ran)."""
    n = frozen.get("seeds")
    return (n, True) if n else (plan["confirm"]["max_seeds"], False)


def load_frozen(path: Path = FROZEN) -> Optional[dict]:
    """The pilot's frozen choice (`report --scale pilot` writes it once the pilot is complete)."""
    return json.loads(Path(path).read_text()) if Path(path).is_file() else None


def _entry(plan: dict, name: str) -> dict:
    return next(g for g in plan["pilot"]["grid"] if g["name"] == name)


def study_cells(plan: dict, stage: str, frozen: Optional[dict] = None) -> list:
    """The stage's cells as `study.Cell`s, seed by seed, the TIS arm first in each pair. The
    confirmatory stage needs the pilot's frozen choice: its grid entry and its seed count."""
    from experiments.confirm import SMALL_EVAL
    from experiments.study import Cell

    if stage == "confirm":
        if frozen is None:
            raise SystemExit(
                f"the confirmatory run needs the pilot's frozen g: {_rel(FROZEN)} is missing "
                "(`python -m experiments.filter_effect report --scale pilot` writes it once every "
                "pilot cell has run)"
            )
        entry = _entry(plan, frozen["frozen"])
        todo = plan_cells(plan, "confirm", confirm_seeds(plan, frozen)[0])
    else:
        todo = plan_cells(plan, "pilot")
    out = []
    for pair, arm, g, seed in todo:
        flags = ["--loss", arm, "--set", f"eval_size={SMALL_EVAL}"]
        if g is not None:
            flags += grid_flags(entry if g == "frozen" else _entry(plan, g))
        out.append(Cell(STUDY[stage], pair, _variant(arm, g), seed, f"confirm/{pair}", flags))
    return out


def stage_seeds(plan: dict, stage: str, frozen: Optional[dict] = None) -> list[int]:
    if stage == "pilot":
        return list(plan["pilot"]["seeds"])
    return list(dict.fromkeys(c.seed for c in study_cells(plan, stage, frozen)))


def stage_chunks(plan: dict, stage: str, frozen: Optional[dict] = None) -> list[list[int]]:
    seeds, k = stage_seeds(plan, stage, frozen), CHUNK_SEEDS[stage]
    return [seeds[i : i + k] for i in range(0, len(seeds), k)]


def _rel(path: Path) -> str:
    from experiments.study import _rel as rel

    return rel(path)


def _files(stage: str) -> tuple[str, str]:
    from experiments.confirm import _result_files

    return _result_files("pilot" if stage == "pilot" else "full")


def recorded(stage: str, results: Path = RESULTS) -> tuple[list[dict], list[dict]]:
    from experiments.confirm import recorded as rec

    return rec(results, "pilot" if stage == "pilot" else "full")


def record(plan: dict, stage: str, work: Path, results: Path, frozen=None) -> list[dict]:
    """Write the stage's finished cells (run folders under `work`, and rows recorded before whose
    run folders are elsewhere) to `results` (as `confirm.report` does); returns the rows."""
    from experiments import confirm

    todo = study_cells(plan, stage, frozen)
    rows, curves = confirm.with_recorded(todo, work, recorded(stage, results))
    results.mkdir(parents=True, exist_ok=True)
    for name, items in zip(_files(stage), (rows, curves)):
        (results / name).write_text("".join(json.dumps(x) + "\n" for x in items))
    return rows


def cell_seconds(cell, cpu: dict[str, float]) -> float:
    """A cell's CPU-s from the confirmatory round's recorded medians (`cell_cpu`): an F-TIS arm
    at any g as that pair's F-TIS cell, the stale pair's TIS arm (none recorded) as its F-TIS
    cell too. Those cells' final evaluation was 128 or 512 problems; these evaluate 128."""
    mode = "f-tis" if cell.variant.startswith("f-tis") else cell.variant
    return cpu.get(f"{cell.group}/{mode}", cpu[f"{cell.group}/f-tis"])


def _left(todo: list, work: Path, done: set) -> list:
    from experiments.study import _finished, _out

    return [c for c in todo if c.id not in done and not _finished(_out(c, work, ()))]


def estimate_chunks(plan: dict, stage: str, work: Path, results: Path, frozen=None) -> str:
    """Per chunk: the cells left (not finished here nor recorded under `results`) and their
    CPU-hours (a fresh seed also pays its warm-ups), i.e. the wall hours on one idle core."""
    cpu = cell_cpu(load_jsonl(CELLS))
    done = {r["id"] for r in recorded(stage, results)[0]}
    todo = study_cells(plan, stage, frozen)
    lines, total = [], 0.0
    for k, seeds in enumerate(stage_chunks(plan, stage, frozen), 1):
        chunk = [c for c in todo if c.seed in seeds]
        left = _left(chunk, work, done)
        fresh = {c.seed for c in left} - {c.seed for c in chunk if c not in left}
        sec = sum(cell_seconds(c, cpu) for c in left) + len(fresh) * cpu["warmups"]
        total += sec
        lines.append(
            f"chunk {k} (seeds {seeds[0]}-{seeds[-1]}): {len(left)} of {len(chunk)} cells to run, "
            f"{sec / 3600:.2f} CPU-h (about {sec / 60:.0f} min on one idle core)"
        )
    lines.append(
        f"all: {total / 3600:.2f} CPU-h; per cell (CPU-s, the confirmatory round's medians): "
        + ", ".join(f"{k} {v:.0f}" for k, v in sorted(cpu.items()))
    )
    return "\n".join(lines)


def _deadline(until: Optional[str], now: Optional[float] = None) -> Optional[float]:
    """--until HH:MM (UTC) as a time stamp: its next occurrence after `now` (a run started at
    23:30 with --until 01:40 stops tomorrow at 01:40)."""
    if until is None:
        return None
    import datetime as dt

    t = dt.datetime.fromtimestamp(time.time() if now is None else now, dt.timezone.utc)
    h, m = (int(x) for x in until.split(":"))
    stop = t.replace(hour=h, minute=m, second=0, microsecond=0)
    return (stop + dt.timedelta(days=1) if stop <= t else stop).timestamp()


def run_stage(
    plan: dict,
    stage: str,
    todo: list,
    work: Path,
    jobs: int,
    results: Path,
    frozen=None,
    until: Optional[str] = None,
) -> int:
    """Run `todo` (finished and recorded cells skipped), `jobs` cells at a time, recording after
    each batch; with `until`, a batch starts only if its estimated CPU time (x1.5, warm-ups
    included) ends before then: a run stopped so holds finished cells only."""

    from experiments import confirm

    cpu = cell_cpu(load_jsonl(CELLS))
    stop = _deadline(until)
    done = {r["id"] for r in recorded(stage, results)[0]}
    left = _left(todo, work, done)
    warmed = {c.seed for c in todo if c not in left}
    t0, rc, ran = time.time(), 0, 0
    for i in range(0, len(left), jobs):
        batch = left[i : i + jobs]
        need = max(
            cell_seconds(c, cpu) + (cpu["warmups"] if c.seed not in warmed else 0.0) for c in batch
        )
        if stop is not None and time.time() + 1.5 * need > stop:
            print(f"--until {until}: stopping before {batch[0].id} ({len(left) - i} cells left)")
            break
        rc |= confirm.run(batch, work, jobs, results)
        warmed |= {c.seed for c in batch}
        ran += len(batch)
        record(plan, stage, work, results, frozen)
    print(f"{ran} cells run in {(time.time() - t0) / 60:.1f} min wall", flush=True)
    return rc


def freeze(plan: dict, rows: list[dict], path: Path) -> dict:
    """The plan's rule on the complete pilot, written to `path` once: a second call must find
    the same choice (the pilot's rows cannot change it after the fact)."""
    pick = choose_g(rows, plan)
    row = next(t for t in pick["table"] if t["name"] == pick["frozen"])
    frozen = dict(
        frozen=pick["frozen"],
        entry=_entry(plan, pick["frozen"]),
        seeds=pick["seeds"],
        sd=row["sd"],
        n=row["n"],
        pilot_seeds=list(plan["pilot"]["seeds"]),
        table=pick["table"],
    )
    old = load_frozen(path)
    if old is not None:
        if (old["frozen"], old["seeds"]) != (frozen["frozen"], frozen["seeds"]):
            raise SystemExit(
                f"{path} froze {old['frozen']} at {old['seeds']} seeds; the pilot "
                f"rows now give {frozen['frozen']} at {frozen['seeds']}"
            )
        return old
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(frozen, indent=1) + "\n")
    return frozen


def report_stage(plan: dict, args: argparse.Namespace) -> int:
    """Record the stage's finished cells; at the pilot's end freeze g; write `--out`."""
    if args.check:
        return write_table(args, plan)
    path = args.results / FROZEN.name
    frozen = load_frozen(path)
    rows = record(plan, args.scale, args.work, args.results, frozen)
    if args.scale == "pilot" and pilot_complete(plan, rows):
        frozen = freeze(plan, rows, path)
    return write_table(args, plan)


def write_table(args: argparse.Namespace, plan: dict) -> int:
    """The results markdown from every recorded file; --check compares instead of writing."""
    pilot_rows = recorded("pilot", args.results)[0]
    confirm_rows = recorded("confirm", args.results)[0]
    frozen = load_frozen(args.results / FROZEN.name)
    text = report(
        load_jsonl(args.cells), load_jsonl(args.mechanism), plan, pilot_rows, frozen, confirm_rows
    )
    if args.check:
        same = args.out.is_file() and args.out.read_text() == text
        print("up to date" if same else f"{args.out} differs from the recorded data's table")
        return 0 if same else 1
    args.out.write_text(text)
    print(text)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.filter_effect", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "action",
        nargs="?",
        default="table",
        choices=("table", "cells", "list", "estimate", "run", "report"),
        help="table (default): write --out; cells/list: a stage's cells and commands; estimate: "
        "CPU-hours per chunk; run: a chunk (resumable); report: record the finished cells, at the "
        "pilot's end freeze g, and write --out",
    )
    p.add_argument("--scale", choices=("pilot", "confirm"), default="pilot")
    p.add_argument("--chunk", type=int, metavar="K", help="run the K-th chunk of seeds only")
    p.add_argument("--only", action="append", metavar="GLOB", help="cell ids to run (repeatable)")
    p.add_argument("--jobs", type=int, default=1, help="cells run at once (default 1)")
    p.add_argument("--until", metavar="HH:MM", help="run: start no cell that would end after (UTC)")
    p.add_argument("--work", type=Path, default=WORK, help="run folders (not in git)")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--cells", type=Path, default=CELLS)
    p.add_argument("--mechanism", type=Path, default=MECHANISM)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--check", action="store_true", help="compare with --out, write nothing")
    args = p.parse_args(argv)
    plan = load_plan()
    if args.action != "table":
        import fnmatch
        import shlex

        frozen = load_frozen(args.results / FROZEN.name)
        if args.action == "estimate":
            print(estimate_chunks(plan, args.scale, args.work, args.results, frozen))
            return 0
        if args.action == "report":
            return report_stage(plan, args)
        todo = study_cells(plan, args.scale, frozen)
        if args.chunk is not None:
            chunks = stage_chunks(plan, args.scale, frozen)
            if not 1 <= args.chunk <= len(chunks):
                raise SystemExit(f"--chunk: expected 1-{len(chunks)}, got {args.chunk}")
            todo = [c for c in todo if c.seed in chunks[args.chunk - 1]]
        if args.only:
            todo = [c for c in todo if any(fnmatch.fnmatchcase(c.id, g) for g in args.only)]
        if args.action in ("cells", "list"):
            for c in todo:
                print(f"{c.id:40s} {shlex.join(c.argv(args.work))}")
            return 0
        return run_stage(
            plan, args.scale, todo, args.work, args.jobs, args.results, frozen, args.until
        )
    return write_table(args, plan)


if __name__ == "__main__":
    sys.exit(main())
