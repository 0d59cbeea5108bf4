"""The run's report: the summary table and the plan of curves.png, from metrics rows."""

from __future__ import annotations

import json
import math
import struct

import pytest

from ftis_kernels.grpo.provenance import describe
from ftis_kernels.grpo.report import (
    curves_plan,
    mean_window,
    plot_curves,
    summary_table,
    write_outputs,
    y_limits,
)


def _rows(n_rounds: int, ood=lambda r, n: 0.0, skipped=()) -> list[dict]:
    """Two nodes; node n's reward in round r is r / 100 + n / 10; evaluations every 2 rounds."""
    rows = []
    for r in range(n_rounds):
        for n in range(2):
            evaluated = r % 2 == 0
            rows.append(
                dict(
                    round=r,
                    node=n,
                    name=f"node-{n}",
                    mode="f-tis",
                    collab="vertical",
                    reward_mean=r / 100 + n / 10,
                    acc_id=0.5 if evaluated else None,
                    acc_ood=ood(r, n) if evaluated else None,
                    kl_mean=1.0,
                    filtered_frac=0.0,
                    tokens_sent=10,
                    bytes_sent=100,
                    seconds=1.0,
                    skipped=int((r, n) in skipped),
                )
            )
    return rows


@pytest.mark.parametrize("n, k", [(1, 1), (3, 1), (4, 2), (9, 4), (10, 5), (80, 5)])
def test_mean_window_is_five_rounds_or_half_a_short_run(n, k):
    assert mean_window(n) == k


def test_summary_names_the_reward_window_it_used_and_counts_skipped_steps():
    table = summary_table(_rows(4, skipped={(2, 1), (3, 1)})).splitlines()
    assert "reward (2-round means)" in table[0] and "skipped" in table[0]
    node1 = table[3].split()
    assert node1[3:6] == ["0.105", "->", "0.125"]  # rounds 0-1 and 2-3 of 0.1 + r / 100
    assert node1[14] == "2"  # after acc_id, acc_ood (3 cells each), kl_mean, filtered
    long = summary_table(_rows(40)).splitlines()
    assert "reward (5-round means)" in long[0]
    assert long[2].split()[3:6] == ["0.020", "->", "0.370"]
    assert "reward (first -> last round)" in summary_table(_rows(1)).splitlines()[0]


def test_curves_draw_ood_only_where_it_carries_signal_and_caption_the_smoothing(tmp_path):
    k, panels, caption = curves_plan(_rows(4))
    assert k == 2 and [p[0] for p in panels] == ["reward_mean", "acc_id"]
    assert all(label for _, _, label in panels)
    assert "trailing mean of the last 2 rounds" in caption[0]
    assert any("0.000 at every evaluation" in line and "not drawn" in line for line in caption)
    _, panels, caption = curves_plan(_rows(12, ood=lambda r, n: r / 20, skipped={(5, 0)}))
    assert [p[0] for p in panels] == ["reward_mean", "acc_id", "acc_ood"]
    assert any("skipped" in line for line in caption)
    assert "too few rounds" in curves_plan(_rows(1))[2][0]
    for rows, panels_drawn in ((_rows(4), 2), (_rows(12, ood=lambda r, n: r / 20), 3)):
        path = tmp_path / "curves.png"
        plot_curves(rows, path)
        width = struct.unpack(">I", path.read_bytes()[16:20])[0]  # the PNG's IHDR width
        assert width == 5 * panels_drawn * 110


def test_metrics_lines_are_strict_json_in_a_skipped_round(tmp_path):
    """A skipped step's loss and KL are infinite: written null, not `Infinity`, which is no JSON."""
    from ftis_kernels.grpo.report import METRIC_KEYS, append_metrics, metric_rows, start_metrics

    vec = [1.0] * len(METRIC_KEYS)
    vec[METRIC_KEYS.index("loss")], vec[METRIC_KEYS.index("kl_mean")] = math.inf, -math.inf
    rows = metric_rows(0, [vec], ["a"], "f-tis", "vertical")
    path = tmp_path / "metrics.jsonl"
    start_metrics(path, [{"round": -1, "node": 0, "loss": math.nan}])
    append_metrics(path, rows)

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    got = [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]
    assert got[0]["loss"] is None and got[1]["loss"] is None and got[1]["kl_mean"] is None
    assert got[1]["reward_mean"] == 1.0


def test_axes_fit_the_data_and_the_caption_says_whether_a_baseline_is_drawn(tmp_path):
    assert y_limits([0.0, 0.1, 0.3]) == pytest.approx((-0.03, 0.35))  # not squashed into 0-1
    assert y_limits([0.5, 0.9]) == pytest.approx((0.45, 0.95))
    assert y_limits([0.0, 1.0]) == pytest.approx((-0.03, 1.03))
    _, _, alone = curves_plan(_rows(4))
    assert any(line.startswith("No baseline drawn") for line in alone)
    baseline = [dict(r, mode="on-policy", reward_mean=r["reward_mean"] / 2) for r in _rows(4)]
    _, _, compared = curves_plan(_rows(4), baseline)
    assert not any("No baseline" in line for line in compared)
    assert any("Dashed: the same nodes in the baseline run (on-policy" in line for line in compared)


def test_report_redraws_the_curves_with_a_baseline_run(tmp_path, capsys):
    from ftis_kernels.grpo import cli

    run, other = tmp_path / "run", tmp_path / "other"
    for folder, mode in ((run, "f-tis"), (other, "on-policy")):
        folder.mkdir()
        rows = [dict(r, mode=mode) for r in _rows(6)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main(["report", str(run), "--baseline", str(other)]) == 0
    assert (run / "curves.png").stat().st_size > 10_000
    assert cli.main(["report", str(run), "--baseline", str(tmp_path / "none")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("ftis-grpo report: --baseline: expected the output folder of a run")
    # A RUN whose path starts with the baseline's (run2 beside run) is still named RUN.
    assert cli.main(["report", str(tmp_path / "run2"), "--baseline", str(run)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("ftis-grpo report: RUN: expected the output folder of a run"), line


def test_summary_txt_has_a_legend_of_its_columns(tmp_path):
    from ftis_kernels.grpo.tokenizer import build_tokenizer

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in _rows(4)))
    write_outputs(tmp_path, build_tokenizer(["x"]), metrics, ["environment: ..."])
    text = (tmp_path / "summary.txt").read_text()
    table, legend = text.split("\ncolumns:\n")
    columns = table.splitlines()[0].split()
    explained = [line.split()[0] for line in legend.splitlines() if line.startswith("  ")]
    assert (
        {"reward", "acc_id", "acc_ood", "kl_mean", "filtered", "skipped", "MB_sent"}
        <= set(explained)
        and "B/token" in legend
        and "s/round" in columns
        and text.endswith("environment: ...\n")
    )
    assert "means of the first and of the last 2 rounds" in legend
    # The peer column, and its line of the legend, only where some node's peer is not its number.
    assert "peer" not in columns and "peer" not in explained
    rows = [dict(r, peer=f"Qm{r['node']}") for r in _rows(4)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_outputs(tmp_path, build_tokenizer(["x"]), metrics)
    table, legend = (tmp_path / "summary.txt").read_text().split("\ncolumns:\n")
    assert table.splitlines()[0].split()[-1] == "peer" and "\n  peer " in legend


def test_the_environment_line_counts_one_thread_in_the_singular():
    env = dict(
        torch="2", triton="3", numpy="2", transformers="5", cpu="x", cpu_capability="AVX2",
        cpu_count=2, commit="abc",
    )  # fmt: skip
    assert "1 thread per node" in describe({**env, "threads_per_node": 1})
    assert "2 threads per node" in describe({**env, "threads_per_node": 2})


def test_report_merges_over_no_file_that_no_run_or_report_wrote(tmp_path, capsys):
    from ftis_kernels.grpo import cli

    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(4)))
    (tmp_path / "summary.txt").write_text("a user's notes")  # the runs' common parent folder
    assert cli.main(["report", *map(str, runs)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("ftis-grpo report: --to: expected a folder without"), line
    assert (tmp_path / "summary.txt").read_text() == "a user's notes"
    to = tmp_path / "ab"
    for _ in range(2):  # a report's own files are replaced by the next report
        assert cli.main(["report", *map(str, runs), "--to", str(to)]) == 0
    assert (to / "curves.png").stat().st_size > 10_000
