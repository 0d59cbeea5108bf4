"""Where the filter acts, from recorded cells, and the pre-registered plan of the next step:
known answers on small synthetic records, and the committed table against the recorded data."""

from __future__ import annotations

import math

import pytest
import yaml

from experiments import filter_effect as fe


def _row(pair, mode, seed, node, name, acc, changed=0.0, filtered=None, zero=0.25, kl=20.0):
    return dict(
        study="pairs",
        group=pair,
        variant=mode,
        seed=seed,
        node=node,
        name=name,
        acc_late=acc,
        cpu_seconds=40.0 + node,
        metrics=dict(
            samples_trained=64,
            samples_received=32,
            zero_adv_groups=zero,
            filter_changed_frac=changed,
            filtered_frac=changed if filtered is None else filtered,
            filter_changed_neg=changed * 4,
            recv_kl_mean=kl,
            recv_truncated_frac=0.01,
        ),
    )


def test_sample_figures_count_the_update_share_of_non_zero_advantage_samples():
    # 64 trained, 32 received; 8 changed; own groups 1/4 all-equal (24 non-zero own samples),
    # the peer's half all-equal (16 non-zero received): 8 of 40 non-zero samples changed.
    row = _row("expertise", "f-tis", 1, 0, "small", 0.7, changed=0.125, filtered=0.15)
    peer = _row("expertise", "f-tis", 1, 1, "add-expert", 0.4, zero=0.5)
    f = fe.sample_figures(row, peer)
    assert f["update_share"] == pytest.approx(8 / 40)
    assert f["changed_of_received"] == pytest.approx(0.25)
    assert f["zero_filtered"] == pytest.approx(0.025)


def _pair_rows(seeds, changed, effect):
    rows = []
    for s in seeds:
        base = 0.5 + 0.01 * s
        rows += [
            _row("expertise", "tis", s, 0, "small", base),
            _row("expertise", "tis", s, 1, "add-expert", base),
            _row(
                "expertise",
                "f-tis",
                s,
                0,
                "small",
                base + effect + 0.001 * (s % 2),
                changed=changed,
            ),
            _row("expertise", "f-tis", s, 1, "add-expert", base, changed=0.01),
            _row("stale", "nois", s, 0, "small", base),
            _row("stale", "nois", s, 1, "stale", 0.1),
            _row("stale", "f-tis", s, 0, "small", base + 0.02, changed=0.2),
            _row("stale", "f-tis", s, 1, "stale", 0.1, changed=0.5),
        ]
    return rows


def test_where_filter_acts_names_the_nodes_over_the_threshold_and_their_baseline():
    acts = fe.where_filter_acts(_pair_rows(range(4), changed=0.125, effect=0.0), 0.10)
    by = {(a["pair"], a["node"]): a for a in acts}
    # The stale peer does not train: it has no update to change, and no row.
    assert set(by) == {("expertise", "small"), ("expertise", "add-expert"), ("stale", "small")}
    assert by["expertise", "small"]["acts"] and by["expertise", "small"]["seeds_acting"] == 4
    assert not by["expertise", "add-expert"]["acts"]
    assert by["expertise", "small"]["baseline"] == "tis"
    assert by["stale", "small"]["baseline"] == "nois"  # no TIS arm: cap and filter together
    assert by["stale", "small"]["diff"].mean == pytest.approx(0.02)


def test_gradient_bound_is_the_larger_of_the_norm_gap_and_the_error_interval_gap():
    def mrow(mode, norm, rel, ci, var=0.0):
        return dict(
            peer="far",
            mode=mode,
            grad_norm=norm,
            rel_err=rel,
            rel_err_ci=ci,
            var=var,
            batches=100,
            kl_sample=20.0,
            filter_changed_frac=0.4,
            filter_changed_of_negative=0.8,
        )

    target = dict(peer="on-policy", mode="on-policy", target=dict(grad_norm=1.0))
    rows = [target, mrow("tis", 1.0, 0.2, [0.1, 0.3]), mrow("f-tis", 0.9, 0.6, [0.5, 0.7])]
    (b,) = fe.gradient_bounds(rows)
    assert b["lower"] == pytest.approx(0.2)  # interval gap 0.5 - 0.3 beats the norm gap 0.1
    rows[2] = mrow("f-tis", 0.5, 0.25, [0.1, 0.4], var=0.0)
    (b,) = fe.gradient_bounds(rows)
    assert b["lower"] == pytest.approx(0.5)  # overlapping intervals: the norm gap alone


def test_the_committed_plan_is_frozen_and_its_seeds_are_fresh(tmp_path):
    plan = fe.load_plan()
    assert plan["metric"] == "acc_late" and plan["mode"] == "f-tis" and plan["baseline"] == "tis"
    assert {u["pair"] for u in plan["family"]} == {"stale", "expertise"}
    for change in ({"frozen": False}, {"pilot": dict(plan["pilot"], seeds=[10, 200])}):
        bad = tmp_path / "bad.yaml"
        bad.write_text(yaml.safe_dump(dict(plan, **change)))
        with pytest.raises(ValueError):
            fe.load_plan(bad)
    # The stale pair gets its TIS arm; every grid entry is one F-TIS arm per pair and seed.
    cells = fe.plan_cells(plan, "pilot")
    assert ("stale", "tis", None, 200) in cells
    assert len(cells) == len(plan["pilot"]["seeds"]) * 2 * (1 + len(plan["pilot"]["grid"]))
    assert fe.grid_flags(plan["pilot"]["grid"][0])[-1] == "loss_options.kl_reduction=sum"


def test_sample_size_grows_with_the_pilot_spread_and_gives_up_above_the_cap():
    plan = fe.load_plan()
    small, large = fe.sample_size(plan, 0.01, 8), fe.sample_size(plan, 0.02, 8)
    assert plan["confirm"]["min_seeds"] <= small < large
    assert fe.sample_size(plan, 0.2, 8) is None
    assert fe.sd_upper(0.02, 8, 0.8) == pytest.approx(0.02 * math.sqrt(7 / 3.8223), rel=1e-3)


def _arm_rows(plan, seeds, arms):
    """Cell rows of the plan's family and estimate nodes: `arms` {variant: (effect, changed)}."""
    rows = []
    for s in seeds:
        for variant, (effect, changed) in arms.items():
            for pair, nodes in (
                ("stale", ("small", "stale")),
                ("expertise", ("small", "add-expert")),
            ):
                for node, name in enumerate(nodes):
                    noise = 0.002 * (s % 3 - 1) if variant != "tis" else 0.0
                    acc = 0.5 + 0.01 * s + (effect + noise if node == 0 else 0.0)
                    rows.append(
                        _row(
                            pair, variant, s, node, name, acc, changed=changed if node == 0 else 0.0
                        )
                    )
    return rows


# Per arm: (its acc_late gain over TIS, the share of the update its filter changes).
PILOT_ARMS = {
    "tis": (0.0, 0.0),
    "f-tis-sum5": (0.03, 0.3),
    "f-tis-sum20": (0.01, 0.15),
    "f-tis-sum50": (0.05, 0.05),
    "f-tis-sum200": (0.0, 0.0),
    "f-tis-mean0.3": (0.0, 0.3),
    "f-tis-mean1": (0.0, 0.1),
}


def test_the_pilot_rule_freezes_the_acting_g_with_the_largest_gain():
    plan = fe.load_plan()
    out = fe.choose_g(_arm_rows(plan, range(200, 208), PILOT_ARMS), plan)
    # sum50 gains most but filters too little to count as acting.
    assert out["frozen"] == "sum5"
    assert out["seeds"] is not None and out["seeds"] >= plan["confirm"]["min_seeds"]


def test_confirmatory_analysis_holm_and_leave_one_out():
    plan = fe.load_plan()
    seeds = range(300, 316)
    out = fe.confirmatory(
        _arm_rows(plan, seeds, {"tis": (0, 0), "f-tis-frozen": (0.02, 0.2)}), plan
    )
    assert [r.verdict for r in out["results"]] == ["reproduced", "reproduced"]
    assert all(r.p_holm >= r.p for r in out["results"])
    assert out["leave_one_out"]["F-stale"] == {"reproduced": 16}
    assert out["estimates"]["E-add-expert"].mean == pytest.approx(0.0)
    null = fe.confirmatory(_arm_rows(plan, seeds, {"tis": (0, 0), "f-tis-frozen": (0, 0)}), plan)
    assert [r.verdict for r in null["results"]] == ["inconclusive", "inconclusive"]


def test_the_committed_table_is_the_recorded_datas():
    assert fe.main(["--check"]) == 0


def test_every_grid_entry_is_a_config_the_driver_accepts():
    from ftis_kernels.grpo.config import build_config

    plan = fe.load_plan()
    for entry in plan["pilot"]["grid"]:
        sets = tuple(fe.grid_flags(entry)[1::2])
        cfg = build_config(
            config_file=str(fe.HERE / "configs" / "confirm" / "stale.yaml"),
            overrides={"loss": "f-tis"},
            sets=sets,
        )
        assert cfg.kl_threshold == entry["kl_threshold"]
        assert cfg.loss_options["kl_reduction"] == entry["kl_reduction"]


# -- the runner: its cells, the refusal without a frozen g, the pilot's report ---------------------
def test_the_pilot_cells_are_one_tis_and_one_f_tis_arm_per_grid_entry_in_both_pairs():
    plan = fe.load_plan()
    cells = fe.study_cells(plan, "pilot")
    grid = plan["pilot"]["grid"]
    assert len(cells) == len(fe.plan_cells(plan, "pilot")) == 8 * 2 * (1 + len(grid))
    assert sorted({c.seed for c in cells}) == list(range(200, 208))
    by = {(c.group, c.variant, c.seed): c for c in cells}
    for seed in plan["pilot"]["seeds"]:
        for pair in ("stale", "expertise"):
            tis = by[pair, "tis", seed]  # the stale pair has its TIS arm too
            assert tis.config == f"confirm/{pair}" and tis.flags[:2] == ["--loss", "tis"]
            assert "kl_threshold" not in " ".join(tis.flags)
            for g in grid:
                c = by[pair, f"f-tis-{g['name']}", seed]
                assert c.flags[:2] == ["--loss", "f-tis"]
                assert c.flags[-4:] == fe.grid_flags(g)
                assert c.config == f"confirm/{pair}"
    # every cell's final evaluation is the small one, the same in every arm
    assert all("eval_size=128" in c.flags for c in cells)
    assert len({c.id for c in cells}) == len(cells)
    assert all(c.id.startswith("filter-pilot/") for c in cells)
    # chunks of two seeds, in order
    assert fe.stage_chunks(plan, "pilot") == [[200, 201], [202, 203], [204, 205], [206, 207]]
    # the variant names are the ones unit_diffs reads
    arms = {c.variant for c in cells}
    assert arms == {"tis", *(fe._variant("f-tis", g["name"]) for g in grid)}


def test_the_confirmatory_run_refuses_without_the_pilots_frozen_g(tmp_path, capsys):
    plan = fe.load_plan()
    with pytest.raises(SystemExit, match="frozen g"):
        fe.study_cells(plan, "confirm", None)
    with pytest.raises(SystemExit, match="frozen g"):
        fe.main(["run", "--scale", "confirm", "--results", str(tmp_path), "--work", str(tmp_path)])
    # an underpowered pilot: the cap's seeds, for estimates only
    capped = fe.study_cells(plan, "confirm", dict(frozen="sum20", seeds=None))
    cap = plan["confirm"]["max_seeds"]
    assert sorted({c.seed for c in capped}) == list(range(300, 300 + cap))
    assert fe.confirm_seeds(plan, dict(seeds=None)) == (cap, False)
    assert fe.confirm_seeds(plan, dict(seeds=17)) == (17, True)
    # frozen: fresh seeds from seeds_from, TIS and F-TIS at the frozen entry's flags
    cells = fe.study_cells(plan, "confirm", dict(frozen="sum20", seeds=17))
    assert sorted({c.seed for c in cells}) == list(range(300, 317))
    assert {c.variant for c in cells} == {"tis", "f-tis-frozen"}
    frozen = next(c for c in cells if c.variant == "f-tis-frozen")
    assert frozen.flags[-4:] == fe.grid_flags(fe._entry(plan, "sum20"))
    assert all(c.id.startswith("filter-confirm/") for c in cells)
    (tmp_path / "frozen.json").write_text('{"frozen": "sum20", "seeds": 17}')
    assert fe.main(["list", "--scale", "confirm", "--results", str(tmp_path)]) == 0
    assert "filter-confirm/stale/f-tis-frozen/s316" in capsys.readouterr().out


def _pilot_rows(plan, seeds):
    rows = _arm_rows(plan, seeds, PILOT_ARMS)
    for r in rows:
        r["id"] = f"filter-pilot/{r['group']}/{r['variant']}/s{r['seed']}"
    return rows


def _report(tmp_path, rows):
    import json

    res = tmp_path / "results"
    res.mkdir(exist_ok=True)
    (res / "pilot.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "t.md")
    argv = ["--results", str(res), "--work", str(tmp_path / "runs"), "--out", out]
    assert fe.main(["report", "--scale", "pilot", *argv]) == 0
    return res, argv


def test_the_pilot_report_freezes_g_only_on_the_complete_pilot(tmp_path):
    plan = fe.load_plan()
    # seven of eight seeds: the table, no frozen g
    res, argv = _report(tmp_path, _pilot_rows(plan, range(200, 207)))
    text = (tmp_path / "t.md").read_text()
    assert "Partial" in text and "98 of 112 cells" in text
    assert not (res / "frozen.json").exists()
    with pytest.raises(SystemExit, match="frozen g"):
        fe.main(["run", "--scale", "confirm", *argv])
    # all eight: the rule freezes sum5 and the sample size, and the markdown says so
    res, argv = _report(tmp_path, _pilot_rows(plan, range(200, 208)))
    frozen = fe.load_frozen(res / "frozen.json")
    assert frozen["frozen"] == "sum5" and frozen["entry"]["kl_threshold"] == 5
    assert frozen["seeds"] == fe.choose_g(_pilot_rows(plan, range(200, 208)), plan)["seeds"]
    text = (tmp_path / "t.md").read_text()
    assert "g = sum5" in text and f"confirmatory seeds: {frozen['seeds']}" in text
    assert fe.main(["--check", *argv[:2], "--out", str(tmp_path / "t.md")]) == 0
    # the confirmatory run now lists its cells at the frozen g
    cells = fe.study_cells(plan, "confirm", frozen)
    assert len(cells) == frozen["seeds"] * 2 * 2
    # a second report with rows that would choose otherwise refuses to move the frozen g
    rows = _pilot_rows(plan, range(200, 208))
    for r in rows:
        if r["variant"] == "f-tis-sum20" and r["node"] == 0:
            r["acc_late"] += 0.1
    with pytest.raises(SystemExit, match="froze sum5"):
        _report(tmp_path, rows)


def _confirm_report(tmp_path, g: str, seeds):
    """(plan, rows, the report's text) of 16 synthetic confirmatory seeds, F-TIS 2 points above
    TIS at the family nodes, frozen at g with `seeds` (None: underpowered)."""
    import json

    plan = fe.load_plan()
    rows = _arm_rows(plan, range(300, 316), {"tis": (0, 0), "f-tis-frozen": (0.02, 0.2)})
    res = tmp_path / "results"
    res.mkdir()
    (res / "cells.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (res / "frozen.json").write_text(json.dumps(dict(frozen=g, seeds=seeds)))
    out = tmp_path / "t.md"
    assert fe.main(["--results", str(res), "--out", str(out)]) == 0
    return plan, rows, out.read_text()


def test_the_confirmatory_section_reports_each_family_member_and_the_estimate(tmp_path):
    plan, rows, text = _confirm_report(tmp_path, "sum20", 16)
    assert "### The confirmatory test (g = sum20; seeds 300-315)" in text
    assert "| F-stale | +0.0199 |" in text and "reproduced 16" in text
    assert "E-add-expert (estimate)" in text


def test_an_underpowered_plan_reports_intervals_what_they_rule_out_and_no_verdict(tmp_path):
    plan, rows, text = _confirm_report(tmp_path, "mean1", None)
    assert "### The confirmatory estimates (g = mean1; seeds 300-315, 16 of 96;" in text
    assert "reproduced" not in text and "inconclusive" not in text
    line = next(x for x in text.splitlines() if x.startswith("| F-stale |"))
    d = list(fe.unit_diffs(rows, plan, plan["family"], "frozen")["F-stale"].values())
    ci = fe.stats.t_interval(d)
    assert f"[{ci.lo:+.4f}, {ci.hi:+.4f}]" in line and f"above {ci.hi:+.4f}" in line
    assert "| E-add-expert | 16 | +0.0000 |" in text


def test_the_detectable_effect_is_the_one_the_sample_size_rule_inverts():
    for sd in (0.01, 0.04):
        e = fe.detectable(sd, 40, 0.025, 0.8)
        assert fe.stats.seeds_needed(sd, e * 1.001, alpha=0.025, power=0.8) <= 40
        assert fe.stats.seeds_needed(sd, e * 0.99, alpha=0.025, power=0.8) > 40
    assert fe.detectable(0.04, 96, 0.025, 0.8) < fe.detectable(0.04, 24, 0.025, 0.8)


def test_until_is_the_next_occurrence_of_that_time_of_day():
    import datetime as dt

    def at(h, m):
        return dt.datetime(2026, 12, 4, h, m, tzinfo=dt.timezone.utc).timestamp()

    assert fe._deadline("22:00", at(20, 14)) == at(22, 0)
    assert fe._deadline("01:40", at(23, 33)) == at(1, 40) + 86400
    assert fe._deadline(None) is None
