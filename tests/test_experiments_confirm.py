"""The confirmatory study's design, checked from its code and configs before any of its data: the
cells, the pairing of each baseline with its modes, the claim family, and the task it runs on."""

from __future__ import annotations

import json
import math
import re
import shlex
import statistics
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from experiments import confirm, stats, study
from ftis_kernels.grpo.config import build_config
from ftis_kernels.grpo.node import sampler_seed
from ftis_kernels.grpo.task import (
    HELD_OUT,
    ITEMS,
    NAMES,
    OOD_ITEMS,
    OOD_NAMES,
    ArithmeticTask,
    Difficulty,
    Problems,
    make_prompt_id,
)

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "experiments" / "runs-confirm"


def _config(cell):
    """The run config a cell's command builds, as the driver builds it."""
    argv = cell.argv(WORK)
    sets = tuple(argv[i + 1] for i, a in enumerate(argv) if a == "--set")
    overrides = {"loss": argv[argv.index("--loss") + 1], "seed": cell.seed}
    return build_config(config_file=str(ROOT / argv[2]), overrides=overrides, sets=sets)


def test_every_cell_is_unique_seed_by_seed_on_fresh_seeds_in_chunks():
    full = confirm.cells("full")
    per_seed = sum(len(m) for m in confirm.PAIR_MODES.values())
    assert per_seed == 18
    assert len({c.id for c in full}) == len(full) == per_seed * len(confirm.SEEDS)
    assert [c.seed for c in full] == sorted(c.seed for c in full)
    # Fresh seeds: not the first round's 0-9, not the pilot's.
    assert not set(confirm.SEEDS) & set(range(10)) and not set(confirm.SEEDS) & set(
        confirm.PILOT_SEEDS
    )
    chunks = confirm.chunks()
    assert [s for chunk in chunks for s in chunk] == list(confirm.SEEDS)
    assert all(len(chunk) == confirm.CHUNK_SEEDS for chunk in chunks)
    for c in full:
        argv = c.argv(WORK)
        assert argv[:3] == ["ftis-grpo", "--config", f"experiments/configs/{c.config}.yaml"]
        assert (ROOT / argv[2]).exists()
    # A seed's on-policy cells come first: they evaluate the shared start.
    first = confirm.cells("full", (confirm.SEEDS[0],))
    assert [c.variant for c in first[: len(confirm.HETERO)]] == ["on-policy"] * 3
    assert [c.variant == "on-policy" for c in first].count(True) == 3


def _own(cell) -> set[str]:
    """The flags and values a cell's command has that its pair's other modes do not."""
    argv = cell.argv(WORK)
    out = argv[argv.index("--out") + 1]
    return {cell.variant, "--loss", out, "--set", *confirm.eval_flags(cell.group, cell.variant)}


def test_each_baseline_runs_on_its_modes_prompt_stream_sampler_and_warm_up():
    full = confirm.cells("full", (confirm.SEEDS[0],))
    for pair, modes in confirm.PAIR_MODES.items():
        sel = [c for c in full if c.group == pair]
        assert {c.variant for c in sel} == set(modes)
        cfgs = {c.variant: _config(c) for c in sel}
        common = [a for a in sel[0].argv(WORK) if a not in _own(sel[0])]
        for c in sel:
            # The commands differ only in --loss (and the on-policy cells' start evaluation).
            assert [a for a in c.argv(WORK) if a not in _own(c)] == common
            assert cfgs[c.variant].loss == c.variant
            assert cfgs[c.variant].eval_start == (c.variant == "on-policy")
            big = c.variant in ("on-policy", "f-tis") and pair in confirm.HETERO
            assert cfgs[c.variant].eval_size == (confirm.EVAL_SIZE if big else confirm.SMALL_EVAL)
        ref = next(iter(cfgs.values()))
        for cfg in cfgs.values():
            # The prompt stream of rank r is train_ids((round * N + r) * P ...): N, P and the task
            # are the same; the sampler seed of rank r is sampler_seed(seed, r); the nodes (init
            # seed, warm-up recipe) are the same.
            assert len(cfg.nodes) == len(ref.nodes) == 2
            assert cfg.prompts_per_node == ref.prompts_per_node
            assert cfg.group_size == ref.group_size and cfg.rounds == ref.rounds
            assert cfg.difficulty() == ref.difficulty() and cfg.seed == ref.seed
            assert cfg.nodes == ref.nodes and cfg.temperature == ref.temperature
            assert cfg.collab == ref.collab == "vertical"
    # The receiver is rank 0 with one spec in every pair: its prompts, sampler seed, initial
    # weights and warm-up are the same in every pair and mode of a seed.
    receivers = {c.group: _config(c).nodes[0] for c in full}
    assert {r.name for r in receivers.values()} == {confirm.RECEIVER}
    assert len({repr(r) for r in receivers.values()}) == 1
    seed = confirm.SEEDS[0]
    assert sampler_seed(seed, 0) != sampler_seed(seed, 1)
    problems = {
        pair: Problems(seed, "arith", None, _config(c).difficulty())
        for pair, c in {c.group: c for c in full}.items()
    }
    P = _config(full[0]).prompts_per_node
    streams = {
        pair: [p.problem(i).question for i in p.train_ids(range(3 * 2 * P, 3 * 2 * P + P))]
        for pair, p in problems.items()
    }
    assert len({tuple(s) for s in streams.values()}) == 1


def test_the_family_is_a_gate_and_at_most_four_claims_on_cells_the_study_runs():
    ran = {(c.group, c.variant) for c in confirm.cells("full")}
    configs = ROOT / "experiments" / "configs" / "confirm"
    names = {
        pair: set(re.findall(r"name: ([\w-]+)", (configs / f"{pair}.yaml").read_text()))
        for pair in confirm.PAIR_MODES
    }
    assert confirm.GATE.id == "P" and confirm.GATE.test.sign == -1
    assert len(confirm.FAMILY) <= 4
    assert [s.id for s in confirm.FAMILY] == ["C3", "C1", "C5"]
    specs = [*confirm.CLAIMS, *(s for s, _ in confirm.ESTIMATES)]
    assert len({s.id for s in specs}) == len(specs)
    for spec in specs:
        assert spec.test.metric in study.METRICS
        for pair, name, mode, base_pair, base_mode in spec.units:
            assert (pair, mode) in ran and (base_pair, base_mode) in ran, spec.id
            assert name in names[pair] and name in names[base_pair], (spec.id, name)
    # The family's claims are in the unit of sample accuracy; C1 is a non-inferiority.
    assert {s.test.metric for s in confirm.CLAIMS} <= {"acc_late", "acc_last"}
    c1 = next(s for s in confirm.FAMILY if s.id == "C1")
    assert c1.test.kind == "noninferiority" and c1.test.margin == confirm.MARGIN
    # Every family claim's baseline is its own pair's run (same node, seed and prompt stream).
    for spec in confirm.FAMILY:
        assert all(pair == base for pair, _, _, base, _ in spec.units)
    # The planned seeds give C3 and C5 80% power at the smallest Holm level, C1 at the largest.
    power = {p["id"]: p for p in confirm.power_table()}
    assert all(power[c]["holm_first"] <= len(confirm.SEEDS) for c in ("C3", "C5"))
    assert power["C1"]["holm_last"] <= len(confirm.SEEDS) < power["C1"]["holm_first"]


def test_the_seed_plan_uses_the_first_rounds_measured_spreads_and_effects():
    lines = (ROOT / "experiments" / "results" / "claims.jsonl").read_text().splitlines()
    first = {c["id"]: c for c in map(json.loads, lines)}
    # Each planned claim's per-seed data in the first round: C1 pooled over its three pairs (6
    # nodes, as the confirmatory C1 is), as the first round pooled C3.
    sources = {"C3": ["C3"], "C1": ["C1-size", "C1-expertise", "C1-lora"], "C5": ["C5"]}
    sources["C4"] = ["C4"]
    assert set(sources) == set(confirm.PLAN)
    for cid, ids in sources.items():
        seeds = first[ids[0]]["per_seed"]
        d = [sum(first[i]["per_seed"][s] for i in ids) / len(ids) for s in seeds]
        assert confirm.PLAN[cid]["sd"] == round(statistics.stdev(d), 3), cid
        effect = 0.0 if cid == "C1" else abs(round(statistics.fmean(d), 3))
        assert confirm.PLAN[cid]["effect"] == effect, cid


def test_a_failed_gate_makes_the_family_untestable_and_a_passed_one_leaves_it():
    rows = []
    for seed in range(12):
        for pair, modes in confirm.PAIR_MODES.items():
            for mode in modes:
                for name in (confirm.RECEIVER, confirm.PEER[pair]):
                    acc = 0.3 + 0.01 * (seed % 3) + (0.05 if mode == "f-tis" else 0.0)
                    if pair == "stale" and mode == "nois":
                        acc -= 0.1 + 0.01 * (seed % 2)
                    rows.append(
                        dict(
                            study="pairs",
                            group=pair,
                            variant=mode,
                            name=name,
                            seed=seed,
                            acc_late=acc,
                            acc_last=acc - (0.03 if mode == "f-vis" else 0.0),
                            acc_ood=acc,
                        )
                    )
    out = {c["id"]: c for c in confirm.analyse(rows)}
    assert out["P"]["verdict"] == "reproduced"
    assert out["C3"]["verdict"] == "reproduced" and out["C3"]["mean"] == pytest.approx(0.05)
    assert out["C1"]["verdict"] == "reproduced"
    assert out["C5"]["verdict"] == "reproduced"
    assert out["C4"]["verdict"] == "estimate" and "p" not in out["C4"]
    assert "floor" not in out["C6"]["left_out"]
    low = [dict(r, acc_ood=0.05) for r in rows]
    assert "under the floor 0.15" in {c["id"]: c for c in confirm.analyse(low)}["C6"]["left_out"]
    assert confirm.baseline_agreement(rows) == 0.0
    for r in rows:
        if r["group"] == "stale" and r["variant"] == "nois":
            # no harm: the stale run within +-0.01 of its baseline, half above and half below
            r["acc_late"] = 0.3 + 0.01 * (r["seed"] % 3) + (0.01 if r["seed"] % 2 else -0.01)
    out = {c["id"]: c for c in confirm.analyse(rows)}
    assert out["P"]["verdict"] != "reproduced"
    assert {out[i]["verdict"] for i in ("C3", "C1", "C5")} == {"untestable at this scale"}


def test_no_verdict_from_fewer_seeds_than_the_rules_minimum():
    assert f"From n >= {stats.MIN_SEEDS} seeds:" in confirm.rules_section()
    results = ROOT / "experiments" / "results" / "confirm"
    rows = [json.loads(x) for x in (results / "cells.jsonl").read_text().splitlines()]
    # Seeds 18-21 alone: P and C1 pass their tests on 4 seeds, which the rules give no verdict.
    few = {c["id"]: c for c in confirm.analyse([r for r in rows if 18 <= r["seed"] <= 21])}
    for cid in ("P", "C3", "C1", "C5"):
        assert few[cid]["verdict"] == "pending" and few[cid]["n"] == 4, few[cid]
        assert "p" not in few[cid] and len(few[cid]["ci"]) == 2  # a provisional interval
    assert "| P |" in confirm.tables(rows[:1], confirm.analyse(rows[:1]))  # 1 seed: no interval
    for n, pending in ((stats.MIN_SEEDS - 1, True), (stats.MIN_SEEDS, False)):
        some = confirm.analyse([r for r in rows if r["seed"] < confirm.SEEDS[n]])
        assert (some[0]["verdict"] == "pending") is pending and some[0]["n"] == n
    # The verdicts of record, from all 16 seeds, are what the committed claims say.
    committed = [json.loads(x) for x in (results / "claims.jsonl").read_text().splitlines()]
    assert confirm.analyse(rows) == committed


def test_holm_runs_over_the_whole_family_while_a_claim_of_it_is_pending():
    lines = (ROOT / "experiments" / "results" / "confirm" / "cells.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    full = {c["id"]: c for c in confirm.analyse(rows)}
    # No F-VIS cell yet: C5 is pending, and C3 and C1 are still adjusted over 3 claims.
    part = {c["id"]: c for c in confirm.analyse([r for r in rows if r["variant"] != "f-vis"])}
    assert part["C5"]["verdict"] == "pending"
    assert part["C3"]["p_holm"] == pytest.approx(full["C3"]["p_holm"]) == 2 * full["C3"]["p"]
    assert part["C1"]["p_holm"] == pytest.approx(3 * full["C1"]["p"])
    assert confirm.holm_levels(list(part.values())) == pytest.approx(
        {"C1": 1 - 0.05 / 3, "C3": 1 - 0.05 / 2}
    )
    with pytest.raises(ValueError, match="size"):
        stats.evaluate([(confirm.GATE.test, [0.1, 0.2], None)] * 2, size=1)


def test_readme_states_the_confirmatory_rules_the_code_applies():
    readme = (ROOT / "experiments" / "README.md").read_text()
    section = readme.split(confirm.RULES_BEGIN, 1)[1].split(confirm.RULES_END, 1)[0]
    assert section.strip() == confirm.rules_section().strip()


# -- the task ------------------------------------------------------------------------------------
def _frozen():
    cfg = _config(confirm.cells("full")[0])
    return ArithmeticTask(confirm.SEEDS[0], cfg.difficulty()), cfg


def _value(solution: str) -> int:
    """Recompute a worked solution step by step, checking each step's arithmetic."""
    total = None
    for step in solution.split(". "):
        a, op, b, result = re.fullmatch(r"(\d+)([+-])(\d+)=(\d+)\.?", step).groups()
        assert total is None or int(a) == total  # each step starts from the last result
        assert int(result) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        total = int(result)
    return total


def test_the_frozen_task_has_its_steps_operands_carries_and_right_answers():
    task, cfg = _frozen()
    assert (
        tuple(cfg.task_steps) == confirm.TASK_STEPS and cfg.task_operand_max == confirm.OPERAND_MAX
    )
    assert cfg.eval_size == confirm.EVAL_SIZE >= 512 and cfg.rounds == confirm.ROUNDS
    carries = 0
    for i in range(300):
        p = task.problem(make_prompt_id("train", i))
        steps = p.solution.count("=")
        assert confirm.TASK_STEPS[0] <= steps <= confirm.TASK_STEPS[1]
        assert str(_value(p.solution)) == p.answer
        numbers = [int(x) for x in re.findall(r"\d+", p.question)]
        assert max(numbers) <= confirm.OPERAND_MAX and len(numbers) == steps + 1
        carries += any(
            op == "+" and int(a) % 10 + int(b) % 10 >= 10
            for a, op, b in re.findall(r"(\d+)([+-])(\d+)=", p.solution)
        )
    assert carries > 40  # one addition in two, and 36 of its 81 operand pairs carry


def test_ood_is_the_same_arithmetic_in_words_no_train_or_test_problem_uses():
    task, cfg = _frozen()
    assert cfg.ood_surface and cfg.difficulty().of("ood") == cfg.difficulty().of("train")
    seen = set()
    for split in ("train", "test"):
        for i in range(400):
            seen |= set(task.problem(make_prompt_id(split, i)).question.split())
    assert not seen & (set(OOD_NAMES) | set(OOD_ITEMS))
    for i in range(confirm.EVAL_SIZE):
        p = task.problem(make_prompt_id("ood", i))
        words = set(p.question.replace("?", " ").replace(".", " ").split())
        assert words & set(OOD_NAMES) and words & set(OOD_ITEMS)
        assert not words & (set(NAMES) | set(ITEMS))
        assert str(_value(p.solution)) == p.answer
    # The vocabulary has the ood words only under ood_surface: the first round's token ids stay.
    assert set(OOD_NAMES) <= set(task.vocabulary_text())
    assert not set(OOD_NAMES) & set(ArithmeticTask(0).vocabulary_text())
    assert ArithmeticTask(0, Difficulty(ood_surface=False)).problem(
        make_prompt_id("ood", 0)
    ) == ArithmeticTask(0).problem(make_prompt_id("ood", 0))


def test_no_test_or_ood_problem_computes_a_chain_a_train_problem_computes():
    task, cfg = _frozen()
    assert cfg.disjoint_splits
    train = {task.problem(make_prompt_id("train", i)).solution for i in range(3000)}
    for split in ("test", "ood"):
        held = {task.problem(make_prompt_id(split, i)).solution for i in range(cfg.eval_size)}
        assert not held & train, split
        # One step with operands to 9 has about 117 computations; one in HELD_OUT is held out
        # (10 of them), each asked in many wordings.
        assert len(held) >= len(train) // (2 * HELD_OUT), (len(held), len(train))
    # Without the split the same generator repeats training chains in the test split.
    plain = ArithmeticTask(confirm.SEEDS[0], replace(cfg.difficulty(), disjoint_splits=False))
    train = {plain.problem(make_prompt_id("train", i)).solution for i in range(3000)}
    test = {plain.problem(make_prompt_id("test", i)).solution for i in range(cfg.eval_size)}
    assert test & train
    # The warm-up draws train problems: its steps keep to the train side too.
    warm = [task.problem(make_prompt_id("train", (1 << 40) + i)) for i in range(200)]
    assert not {p.solution for p in warm} & held


def test_disjoint_splits_is_another_warm_up_cache_entry(tmp_path, monkeypatch):
    from ftis_kernels.grpo import node as node_module
    from ftis_kernels.grpo.node import Node
    from ftis_kernels.grpo.tokenizer import build_tokenizer

    def cache_file(**overrides) -> str:
        seen = []
        cfg = build_config(
            "smoke",
            overrides=dict(out=str(tmp_path / "run"), warmup_cache=str(tmp_path), **overrides),
        )
        node = Node(cfg, 0, 2, torch.device("cpu"))
        node.tokenizer = build_tokenizer(node.problems.arith.vocabulary_text())
        node.model = None
        monkeypatch.setattr(
            node_module, "warm_up_cached", lambda *a, **kw: seen.append(a[3]) or 0.0
        )
        node.warm_up()
        return seen[0].name

    assert cache_file(disjoint_splits=True) != cache_file()


# -- the statistics it adds ------------------------------------------------------------------------
def test_noninferiority_is_the_interval_lower_bound_against_the_margin():
    z = [-1.5, -1.0, -0.7, -0.4, -0.1, 0.1, 0.4, 0.7, 1.0, 1.5]
    for shift, sd in ((0.0, 0.05), (-0.03, 0.05), (-0.06, 0.02), (0.02, 0.2)):
        d = [shift + sd * x for x in z]
        ci = stats.t_interval(d)
        assert (stats.noninferiority(d, 0.05) < 0.05) == (ci.lo > -0.05), (shift, sd)
    good = [0.0 + 0.02 * x for x in z]
    claim = stats.Claim("NI", "noninferiority", "m", margin=0.05)
    assert stats.evaluate([(claim, good, None)])[0].verdict == "reproduced"
    bad = [-0.2 + 0.02 * x for x in z]
    assert stats.evaluate([(claim, bad, None)])[0].verdict == "contradicted"
    with pytest.raises(ValueError, match="margin"):
        stats.Claim("NI", "noninferiority", "m")


def test_seeds_needed_matches_the_normal_approximation_and_grows_with_the_spread():
    # n ~ ((z_{1-a/2} + z_{power}) sd / effect)^2 + a little for t: 7.85 -> 10 at sd = effect.
    assert stats.seeds_needed(1.0, 1.0) == 10
    assert stats.seeds_needed(0.027, 0.029, 0.05 / 3) == 13
    assert stats.seeds_needed(0.109, 0.043, 0.05 / 3) > 60
    assert stats.seeds_needed(1.0, 1.0, power=0.5) < stats.seeds_needed(1.0, 1.0)
    assert stats.seeds_needed(1.0, 0.0, margin=1.0) == stats.seeds_needed(1.0, 1.0)
    assert stats.seeds_needed(1.0, 0.001, most=50) is None


def test_eval_start_false_skips_only_the_evaluation_before_the_first_round(tmp_path):
    from ftis_kernels.grpo.node import Node

    def rounds(**overrides) -> list[int]:
        cfg = build_config("smoke", overrides=dict(out=str(tmp_path / "run"), **overrides))
        node = Node(cfg, 0, 2, torch.device("cpu"))
        return [r for r in range(cfg.rounds) if node.evaluates(r)]

    assert rounds(rounds=30, eval_every=30) == [0, 29]
    assert rounds(rounds=30, eval_every=30, eval_start=False) == [29]
    assert rounds(rounds=7, eval_every=3, eval_start=False) == [3, 6]
    assert rounds(rounds=7, eval_every=3) == [0, 3, 6]


def test_the_warm_up_probe_measures_a_task_at_the_smallest_scale():
    out = confirm.probe((2, 3), 9, warmup_steps=2, gsm8k_format=0.8, n=8)
    assert out["steps"] == [2, 3] and out["operand_max"] == 9 and out["warmup_steps"] == 2
    assert math.isfinite(out["loss"]) and out["cpu_seconds"] > 0
    for key in ("sampled", "greedy_id", "greedy_ood"):
        assert out[key] in {k / 8 for k in range(9)}, key


def test_no_confirmatory_cell_runs_before_the_task_is_frozen(tmp_path, monkeypatch):
    monkeypatch.setattr(confirm, "FROZEN", False)
    with pytest.raises(SystemExit, match="not frozen"):
        confirm.main(["run", "--chunk", "1", "--work", str(tmp_path), "--readme", "none"])
    assert not any(tmp_path.iterdir())  # nothing started


TINY_SETS = (  # the smallest cell: 2 warm-up steps, 2 prompts of 2 samples, 8 tokens
    "nodes.0.warmup_steps=2",
    "nodes.1.warmup_steps=2",
    "warmup_cache=null",
    "prompts_per_node=2",
    "group_size=2",
    "max_new_tokens=8",
    "eval_max_new_tokens=8",
)


def test_a_node_alone_draws_the_prompts_and_samples_it_draws_in_its_pair(tmp_path):
    from ftis_kernels.grpo.node import Node

    cfg = build_config(
        config_file=str(ROOT / "experiments/configs/confirm/size.yaml"),
        overrides=dict(seed=11, loss="on-policy", out=str(tmp_path)),
        sets=TINY_SETS,
    )
    alone = confirm.alone_node(cfg, "tiny")  # rank 1: its slot and sampler are not rank 0's
    # As torchrun runs it: world 2, rank 1, peer id "1" (the transport only answers its agree()).
    paired = Node(cfg, 1, 2, torch.device("cpu"), confirm._Alone(1))
    paired.build()
    paired.warm_up()
    assert alone.sampler.initial_seed() == paired.sampler.initial_seed() == sampler_seed(11, 1)
    for round_ in (0, 3):
        a, b = alone.rollout(round_), paired.rollout(round_)
        assert [s.prompt_id for s in a] == [s.prompt_id for s in b]
        assert all(torch.equal(x.tokens, y.tokens) for x, y in zip(a, b))
    with pytest.raises(SystemExit, match="--node"):
        confirm.alone_node(cfg, "nobody")


def test_the_curve_runs_a_node_and_its_control_and_tables_their_gain():
    control = confirm.curve("size", "tiny", 0.0, rounds=3, every=2, n=4, sets=TINY_SETS)
    trained = confirm.curve("size", "tiny", 1e-2, rounds=3, every=2, n=4, sets=TINY_SETS)
    assert control["eval_rounds"] == trained["eval_rounds"] == [0, 2, 3]
    assert len(set(control["acc_id"])) == 1  # no update: the greedy answers never change
    assert len(trained["sample_acc"]) == 3 and (trained["n"], trained["every"]) == (4, 2)
    assert control["first_step"] == {} and set(trained["first_step"]) == {"rewarded", "penalised"}
    # The table pairs each run with its control round by round, seeds in order.
    row = dict(control, sample_acc=[0.5] * 6, acc_id=[0.5, 0.5], rounds=6, n=256, every=10)
    runs = [
        dict(row, lr=0.0),
        dict(row, lr=1e-4, seed=row["seed"] + 1, sample_acc=[0.5] * 6),
        dict(row, lr=0.0, seed=row["seed"] + 1),
        dict(row, lr=1e-4, sample_acc=[0.5, 0.5, 0.6, 0.6, 0.5, 0.9], acc_id=[0.5, 0.7]),
    ]
    (line,) = confirm.curve_table(runs).splitlines()[2:]
    assert "| size: tiny | 0.0001 | 6 | 2 | 0.500 -> 0.600 |" in line
    assert line.endswith(
        "| +0.000 (+0.00, +0.00) | +0.050 (+0.10, +0.00) | +0.100 (+0.20, +0.00) |"
    )
    # A run without its control (or with a control of another evaluation) is not tabled.
    assert len(confirm.curve_table([runs[3], dict(runs[0], n=64)]).splitlines()) == 2


def test_cells_recorded_on_another_machine_are_neither_rerun_nor_dropped(tmp_path, monkeypatch):
    # A chunk's run folders stay on the machine that ran it; its results files travel in git.
    results, work = tmp_path / "results", tmp_path / "work"
    results.mkdir()
    first, second, third = confirm.cells("full", confirm.SEEDS[:1])[:3]

    def record(cell, **extra):
        return dict(id=cell.id, node=0, name="small", command=shlex.join(cell.argv(work)), **extra)

    elsewhere = record(first, acc_late=0.1)
    here_too = record(second, acc_late=0.2)
    gone = dict(record(first), id="pairs/size/on-policy/s999")  # a cell no longer in the study
    rows = [elsewhere, here_too, gone]
    (results / "cells.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (results / "curves.jsonl").write_text(json.dumps(dict(elsewhere, sample_acc=[0.5])) + "\n")
    ran = []
    monkeypatch.setattr(study, "run_cells", lambda todo, *a: ran.extend(todo) or 0)
    confirm.run([first, second, third], work, 1, results)
    assert [c.id for c in ran] == [third.id]
    # A record of another command (the configs changed since) is refused, not trusted.
    (results / "cells.jsonl").write_text(json.dumps(dict(elsewhere, command="ftis-grpo x")) + "\n")
    with pytest.raises(SystemExit, match="another command"):
        confirm.run([first], work, 1, results)
    (results / "cells.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # report: the local copy of a cell wins, recorded cells of other machines stay, gone ones go.
    local = dict(here_too, acc_late=0.3)
    monkeypatch.setattr(study, "collect", lambda *a: ([local], []))
    monkeypatch.setattr(confirm, "analyse", lambda rows: [])
    monkeypatch.setattr(confirm, "tables", lambda rows, claims: f"{len(rows)} rows")
    monkeypatch.setattr(confirm, "plot_claims", lambda *a: False)
    monkeypatch.setattr(confirm, "plot_curves", lambda *a: False)
    assert confirm.report("full", work, results, None) == "2 rows"
    kept = [json.loads(x) for x in (results / "cells.jsonl").read_text().splitlines()]
    assert [(r["id"], r["acc_late"]) for r in kept] == [(first.id, 0.1), (second.id, 0.3)]
    assert json.loads((results / "curves.jsonl").read_text())["sample_acc"] == [0.5]


def test_round_two_plots_draw_per_seed_differences_and_bands_over_seeds(tmp_path):
    claims = [
        dict(
            id="C3",
            metric="acc_late",
            kind="direction",
            verdict="reproduced",
            n=3,
            p=0.01,
            mean=0.02,
            ci=[0.0, 0.04],
            per_seed={"10": 0.01, "11": 0.02, "12": 0.03},
        ),
        dict(
            id="C1",
            metric="acc_late",
            kind="noninferiority",
            margin=0.05,
            n=3,
            p=0.04,
            verdict="inconclusive",
            mean=0.0,
            ci=[-0.06, 0.06],
            per_seed={"10": -0.03, "11": 0.0, "12": 0.03},
        ),
        dict(id="C5", metric="acc_last", kind="direction", verdict="pending", n=0),
    ]
    # Holm over the family of 3 (C5 pending, last): the smallest p at 0.05 / 3, the next 0.05 / 2.
    assert confirm.holm_levels(claims) == {"C3": 1 - 0.05 / 3, "C1": 1 - 0.05 / 2}
    assert confirm.plot_claims(claims, tmp_path / "claims.png")
    assert (tmp_path / "claims.png").stat().st_size > 0
    curves = [
        dict(id=f"pairs/size/{mode}/s{seed}", name=name, sample_acc=[0.1 * seed % 1] * 30)
        for mode in ("on-policy", "nois")
        for seed in (10, 11)
        for name in ("small", "tiny")
    ]
    assert confirm.plot_curves(curves, tmp_path / "curves.png")
    assert not confirm.plot_curves(curves[:1], tmp_path / "none.png")  # one seed: no band


def test_leave_one_out_redoes_the_analysis_without_each_seed(monkeypatch):
    seen = []

    def analyse(rows):
        seen.append(sorted({r["seed"] for r in rows}))
        return [dict(id="P", verdict="reproduced" if 12 in seen[-1] else "inconclusive")]

    monkeypatch.setattr(confirm, "analyse", analyse)
    rows = [dict(seed=s) for s in (10, 11, 12)]
    assert confirm.leave_one_out(rows)["P"] == {"reproduced": 2, "inconclusive": 1}
    assert seen == [[11, 12], [10, 12], [10, 11]]
    assert confirm.leave_one_out(rows[:2])["P"] == {}  # fewer than 3 seeds: no subsets


def test_the_summary_puts_the_papers_statement_beside_each_verdict():
    claims = [
        dict(id="C3", verdict="reproduced", mean=0.02, ci=[0.01, 0.03], n=8),
        dict(id="C5", verdict="pending", n=0),
        dict(id="TIS-NoIS", verdict="estimate", mean=0.0, ci=[-0.1, 0.1], n=8),
    ]
    lines = confirm.summary(claims).splitlines()
    assert lines[2] == f"| C3 | reproduced | +0.020 [+0.010, +0.030] | 8 | {confirm.PAPER['C3']} |"
    assert lines[3].startswith("| C5 | pending | - | 0 |")
    assert len(lines) == 4  # the paper says nothing of the cap alone
    assert set(confirm.PAPER) <= {c.id for c in confirm.CLAIMS} | {
        s.id for s, _ in confirm.ESTIMATES
    }


def test_recheck_reruns_into_work_and_estimate_refuses_the_selections_it_ignores(
    tmp_path, monkeypatch, capsys
):
    cell = "pairs/size/f-tis/s10"
    seen = []
    monkeypatch.setattr(confirm, "recheck", lambda todo, results, work: seen.append(work) or [])
    base = ["--results", str(tmp_path), "--readme", "none"]
    assert confirm.main(["recheck", "--only", cell, "--work", str(tmp_path / "w"), *base]) == 0
    assert confirm.main(["recheck", "--only", cell, *base]) == 0
    assert seen == [tmp_path / "w", confirm.HERE / "runs-recheck"]
    with pytest.raises(SystemExit) as stop:  # it would replace the study's own run folder
        confirm.main(["recheck", "--only", cell, "--work", str(WORK), *base])
    assert stop.value.code == 2 and "--work" in capsys.readouterr().err and len(seen) == 2
    monkeypatch.setattr(confirm, "estimate", lambda work, results: "left")
    for flags in (["--only", "pairs/size/*"], ["--scale", "pilot"], ["--chunk", "1"]):
        with pytest.raises(SystemExit) as stop:
            confirm.main(["estimate", *flags, *base])
        assert stop.value.code == 2 and flags[0] in capsys.readouterr().err, flags
    assert confirm.main(["estimate", *base]) == 0 and capsys.readouterr().out == "left\n"


def test_recheck_compares_a_rerun_cell_with_its_record(tmp_path, monkeypatch):
    cell = confirm.cells("full", confirm.SEEDS[:1])[0]
    env = dict(commit="aaa")
    row = dict(
        id=cell.id, node=0, name="small", acc_late=0.5, acc_id=0.6, acc_ood=0.7, environment=env
    )
    curve = dict(id=cell.id, node=0, name="small", sample_acc=[0.5, 0.25])
    (tmp_path / "cells.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "curves.jsonl").write_text(json.dumps(curve) + "\n")
    stale = study._out(cell, tmp_path / "work", ())  # an earlier recheck's finished rerun
    stale.mkdir(parents=True)
    (stale / "summary.json").write_text("{}")
    ran = []
    monkeypatch.setattr(study, "run_cells", lambda *a: ran.append(stale.exists()) or 0)
    now = dict(row, environment=dict(commit="bbb"))
    monkeypatch.setattr(study, "collect", lambda *a: ([now], [curve]))
    (same,) = confirm.recheck([cell], tmp_path, tmp_path / "work")
    assert same["identical"] and same["commit_then"] == "aaa" and same["commit_now"] == "bbb"
    assert ran == [False]  # the earlier rerun was removed, not reused
    moved = dict(curve, sample_acc=[0.5, 0.5])
    monkeypatch.setattr(study, "collect", lambda *a: ([now], [moved]))
    (diff,) = confirm.recheck([cell], tmp_path, tmp_path / "work")
    assert not diff["identical"] and diff["max_sample_acc_diff"] == 0.25
    assert len((tmp_path / "recheck.jsonl").read_text().splitlines()) == 2
    with pytest.raises(SystemExit, match="not recorded"):
        confirm.recheck(confirm.cells("full", confirm.SEEDS[1:2])[:1], tmp_path, tmp_path)
