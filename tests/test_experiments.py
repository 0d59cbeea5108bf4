"""The experiment script's smallest configuration, end to end: one cell through the real driver."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from experiments import study

ROOT = Path(__file__).resolve().parents[1]


def test_every_cell_has_a_unique_id_and_a_runnable_command():
    full = study.cells("full")
    per_seed = 1 + sum(len(m) for m in study.PAIR_MODES.values())
    bad = sum(len(m) for m in study.ATTACKS.values()) * len(study.BADPEER_SEEDS)
    assert len({c.id for c in full}) == len(full) == per_seed * len(study.SEEDS) + bad
    assert len(study.SEEDS) >= 10
    assert {c.study for c in full} == {"isolated", "pairs", "badpeer"}
    for c in full:
        argv = c.argv(ROOT / "experiments" / "runs")
        assert argv[:3] == ["ftis-grpo", "--config", f"experiments/configs/{c.config}.yaml"]
        assert (ROOT / argv[2]).exists() and argv[argv.index("--seed") + 1] == str(c.seed)
    # Seed by seed: a study stopped early holds whole seeds.
    seeds = [c.seed for c in full if c.study != "badpeer"]
    assert seeds == sorted(seeds)


def test_every_claim_compares_cells_and_nodes_the_study_runs():
    names = {}
    for pair in [*study.PAIR_MODES, "isolated"]:
        cfg = (ROOT / "experiments" / "configs" / f"{pair}.yaml").read_text()
        names[pair] = set(re.findall(r"name: ([\w-]+)", cfg))
    ran = {(c.group if c.study == "pairs" else "isolated", c.variant) for c in study.cells("full")}
    ids = [spec.id for spec in study.CLAIMS]
    assert len(set(ids)) == len(ids)
    for spec in study.CLAIMS:
        assert spec.test.metric in study.METRICS
        assert spec.control is None or spec.control in ids
        for pair, name, mode, base_pair, base_mode in spec.units:
            assert (pair, mode) in ran and (base_pair, base_mode) in ran, spec.id
            assert name in names[pair] and name in names[base_pair], (spec.id, name)


def test_smallest_configuration_runs_end_to_end_and_writes_a_table_row(tmp_path):
    # About 25 s on 2 cores; its time is reported, not asserted (the timeout only catches a hang).
    env = dict(os.environ)
    env.pop(
        "TRITON_INTERPRET", None
    )  # the driver takes ftis_loss's PyTorch path, as users' runs do
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.study",
            "run",
            "--scale",
            "smoke",
            "--work",
            str(tmp_path / "runs"),
            "--results",
            str(tmp_path / "results"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]

    rows = [json.loads(x) for x in (tmp_path / "results" / "cells.jsonl").read_text().splitlines()]
    assert [(r["id"], r["node"], r["name"]) for r in rows] == [
        ("pairs/size/f-tis/s0", 0, "tiny"),
        ("pairs/size/f-tis/s0", 1, "small"),
    ]
    for r in rows:
        assert r["rounds"] == 3 and r["metrics"]["samples_received"] > 0
        assert r["metrics"]["dropped"] == 0
        for key in ("acc_id", "acc_ood", "acc_late", "acc_last", "reward_late"):
            assert 0.0 <= r[key] <= 1.0, (key, r[key])
        assert r["command"].startswith("ftis-grpo --config experiments/configs/size.yaml")
        assert r["cpu_seconds"] > 0
        env = r["environment"]
        assert env["torch"] and env["numpy"] and env["cpu"] and env["commit"]
    # The command in the row reruns the cell: it names the same output folder.
    assert str(tmp_path / "runs" / "pairs" / "size" / "f-tis" / "s0") in rows[0]["command"]

    claims = (tmp_path / "results" / "claims.jsonl").read_text().splitlines()
    claims = [json.loads(x) for x in claims]
    assert {c["verdict"] for c in claims} == {"pending"}  # one seed tests nothing
    table = (tmp_path / "results" / "tables.md").read_text()
    line = next(x for x in table.splitlines() if x.startswith("| size | small | f-tis |"))
    cols = [c.strip() for c in line.strip("|").split("|")]
    assert len(cols) == 10 and cols[3] == "1"
    for c in cols[4:9]:
        assert 0.0 <= float(c) <= 1.0
    assert cols[9] == "`python -m experiments.study run --scale smoke --only 'pairs/size/f-tis/*'`"
    assert (tmp_path / "results" / "pairs_sample_acc.png").stat().st_size > 10_000
    assert table.strip() in proc.stdout  # the tables are printed too


def test_the_first_round_gives_no_verdict_from_fewer_seeds_than_the_rules_minimum():
    results = ROOT / "experiments" / "results"
    rows = [json.loads(x) for x in (results / "cells.jsonl").read_text().splitlines()]
    # Seeds 0-3 alone: N passes its test on 4 seeds, which the rules give no verdict.
    few = study.analyse([r for r in rows if r["seed"] < 4])
    assert {(c["n"], c["verdict"]) for c in few} == {(4, "pending")}
    committed = [json.loads(x) for x in (results / "claims.jsonl").read_text().splitlines()]
    assert study.analyse(rows) == committed  # the first round's 10 seeds: its verdicts


def test_readme_states_the_rules_and_claims_the_code_applies():
    readme = (ROOT / "experiments" / "README.md").read_text()
    section = readme.split(study.RULES_BEGIN, 1)[1].split(study.RULES_END, 1)[0]
    assert section.strip() == study.rules_section().strip()


def test_report_writes_the_readmes_mechanism_section_with_its_figure_path(tmp_path):
    readme = (ROOT / "experiments" / "README.md").read_text()
    committed = readme.split(study.MECH_BEGIN, 1)[1].split(study.MECH_END, 1)[0]
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(ROOT / "experiments" / "results" / "mechanism.md", results)
    out = tmp_path / "README.md"
    out.write_text(f"{study.MECH_BEGIN}\nold\n{study.MECH_END}\n")
    study.report([], tmp_path / "runs", results, out, (), "full")
    written = out.read_text().split(study.MECH_BEGIN, 1)[1].split(study.MECH_END, 1)[0]
    assert written == committed and "](results/mechanism.png)" in written
