"""The experiment script's smallest configuration, end to end: one cell through the real driver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from experiments import study

ROOT = Path(__file__).resolve().parents[1]


def test_every_cell_has_a_unique_id_and_a_runnable_command():
    full = study.cells("full")
    assert len({c.id for c in full}) == len(full) == 87
    assert {c.study for c in full} == {"pairs", "collab", "g", "badpeer"}
    for c in full:
        argv = c.argv(ROOT / "experiments" / "runs")
        assert argv[:3] == ["ftis-grpo", "--config", f"experiments/configs/{c.config}.yaml"]
        assert (ROOT / argv[2]).exists() and argv[argv.index("--seed") + 1] == str(c.seed)


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
        assert r["rounds"] == 3 and r["samples_received"] > 0 and r["dropped"] == 0
        for key in ("acc_id", "acc_ood", "acc_id_early", "reward_late", "kl_mean"):
            assert 0.0 <= r[key] <= (1.0 if key != "kl_mean" else 1e6), (key, r[key])
        assert r["command"].startswith("ftis-grpo --config experiments/configs/size.yaml")
    # The command in the row reruns the cell: it names the same output folder.
    assert str(tmp_path / "runs" / "pairs" / "size" / "f-tis" / "s0") in rows[0]["command"]

    table = (tmp_path / "results" / "tables.md").read_text()
    line = next(x for x in table.splitlines() if x.startswith("| size | f-tis |"))
    cols = [c.strip() for c in line.strip("|").split("|")]
    assert len(cols) == 11 and cols[2] == "tiny" and cols[5] == "small"
    for c in cols[3:5] + cols[6:10]:
        assert 0.0 <= float(c) <= 1.0
    assert cols[10] == "`python -m experiments.study run --scale smoke --only 'pairs/size/f-tis/*'`"
    assert (tmp_path / "results" / "pairs_reward.png").stat().st_size > 10_000
    assert proc.stdout.count("| size | f-tis |") == 1  # the table is printed too
