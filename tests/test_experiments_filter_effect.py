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


def test_the_pilot_rule_freezes_the_acting_g_with_the_largest_gain():
    plan = fe.load_plan()
    arms = {
        "tis": (0.0, 0.0),
        "f-tis-sum5": (0.03, 0.3),
        "f-tis-sum20": (0.01, 0.15),
        "f-tis-sum50": (0.05, 0.05),
        "f-tis-sum200": (0.0, 0.0),
        "f-tis-mean0.3": (0.0, 0.3),
        "f-tis-mean1": (0.0, 0.1),
    }
    out = fe.choose_g(_arm_rows(plan, range(200, 208), arms), plan)
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
