"""The study's statistics give known answers on synthetic data."""

from __future__ import annotations

import math

import numpy as np
import pytest

from experiments import stats

# Ten fixed deviations with mean 0 and standard deviation 1: a seed-to-seed spread.
Z = np.array([-1.5, -1.0, -0.7, -0.4, -0.1, 0.1, 0.4, 0.7, 1.0, 1.5])
Z = (Z - Z.mean()) / Z.std(ddof=1)


def test_t_interval_matches_a_hand_computation():
    ci = stats.t_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    # mean 3, sd sqrt(2.5), t_{4, 0.975} = 2.7764451
    half = 2.7764451 * math.sqrt(2.5) / math.sqrt(5)
    assert ci.mean == 3.0 and ci.n == 5
    assert ci.lo == pytest.approx(3.0 - half, rel=1e-7)
    assert ci.hi == pytest.approx(3.0 + half, rel=1e-7)


def test_a_known_mean_difference_is_detected_in_its_direction():
    d = 0.10 + 0.05 * Z  # 10 seeds, true difference +0.10, spread 0.05
    ci = stats.t_interval(d)
    assert ci.lo < 0.10 < ci.hi and ci.lo > 0
    assert stats.t_test(d) < 1e-3  # t = 0.10 / (0.05 / sqrt(10)) = 6.3 on 9 df
    up = stats.Claim("above", "direction", "m", sign=+1)
    down = stats.Claim("below", "direction", "m", sign=-1)
    assert [r.verdict for r in stats.evaluate([(up, d, None), (down, d, None)])] == [
        "reproduced",
        "contradicted",
    ]


def test_a_difference_inside_its_spread_is_inconclusive_not_equivalent():
    d = 0.01 + 0.2 * Z  # no real difference, large spread
    same = stats.Claim("like", "equivalence", "m", margin=0.05)
    down = stats.Claim("below", "direction", "m", sign=-1)
    results = stats.evaluate([(same, d, None), (down, d, None)])
    assert [r.verdict for r in results] == ["inconclusive", "inconclusive"]


def test_an_equivalence_within_the_margin_is_accepted():
    d = 0.01 + 0.02 * Z
    assert stats.tost(d, 0.05) < 0.05
    assert stats.t_interval(d, level=0.90).inside(0.05)
    (r,) = stats.evaluate([(stats.Claim("like", "equivalence", "m", margin=0.05), d, None)])
    assert r.verdict == "reproduced" and r.ci.inside(0.05)


def test_an_equivalence_outside_the_margin_is_not_accepted():
    d = 0.12 + 0.03 * Z
    assert stats.tost(d, 0.05) > 0.5
    (r,) = stats.evaluate([(stats.Claim("like", "equivalence", "m", margin=0.05), d, None)])
    assert r.verdict == "contradicted" and r.ci.outside(0.05)
    # Straddling the margin: neither accepted nor contradicted.
    (r,) = stats.evaluate(
        [(stats.Claim("like", "equivalence", "m", margin=0.05), 0.05 + 0.03 * Z, None)]
    )
    assert r.verdict == "inconclusive"


def test_tost_is_the_ninety_percent_interval_inside_the_margin():
    for shift in np.linspace(-0.08, 0.08, 33):
        d = shift + 0.03 * Z
        assert (stats.tost(d, 0.05) < 0.05) == stats.t_interval(d, level=0.90).inside(0.05)


def test_holm_matches_a_hand_computation():
    # sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> 0.06
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    assert stats.holm([]) == []


def test_holm_can_turn_a_single_test_significance_into_inconclusive():
    d = 0.045 + 0.05 * Z  # t = 2.85 on 9 df: p = 0.019 alone, 0.076 as one of 4
    p = stats.t_test(d)
    assert 0.01 < p < 0.05
    claim = stats.Claim("above", "direction", "m", sign=+1)
    alone = stats.evaluate([(claim, d, None)])
    family = stats.evaluate([(claim, d, None)] * 4)
    assert alone[0].verdict == "reproduced"
    assert {r.verdict for r in family} == {"inconclusive"}
    assert family[0].p_holm == pytest.approx(min(1.0, 4 * p))


def test_pooling_averages_nodes_within_a_seed():
    a = {0: 0.1, 1: 0.2, 2: 0.3}
    b = {0: -0.1, 1: 0.0, 3: 9.0}
    assert stats.pool([a, b]) == pytest.approx({0: 0.0, 1: 0.1})
    assert stats.paired({0: 1.0, 1: 2.0, 2: 5.0}, {1: 1.5, 2: 4.0, 7: 0.0}) == [0.5, 1.0]


def test_bootstrap_interval_is_reproducible_and_near_the_t_interval():
    d = 0.10 + 0.05 * Z
    b1, b2 = stats.bootstrap_interval(d), stats.bootstrap_interval(d)
    assert b1 == b2 and b1.method == "bootstrap"
    t = stats.t_interval(d)
    assert b1.lo < 0.10 < b1.hi
    # With n = 10 the percentile bootstrap is a little narrower than the t interval.
    assert t.lo - 0.02 < b1.lo and b1.hi < t.hi + 0.02


def test_a_failed_precondition_turns_only_an_inconclusive_verdict_untestable():
    claim = stats.Claim("c", "direction", "m", sign=+1)
    why = "the positive control saw no harm"
    clear, unclear = 0.10 + 0.05 * Z, 0.01 + 0.2 * Z
    results = stats.evaluate([(claim, clear, why), (claim, unclear, why)])
    assert [r.verdict for r in results] == ["reproduced", "untestable at this scale"]
    assert why in results[1].why


def test_too_few_seeds_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match="^d: expected at least 2"):
        stats.t_interval([0.1])


def test_basic_bootstrap_removes_the_plug_in_bias_and_reflects_the_interval():
    """values = [plug-in, *draws]: estimate 2 * plug-in - mean(draws), interval [2 * plug-in -
    q97.5, 2 * plug-in - q2.5], clipped to `upper`; percentile_interval the draws' quantiles."""
    draws = np.arange(1, 1001, dtype=float) / 1000  # uniform on (0, 1]: mean 0.5005
    values = np.concatenate([[0.6], draws])
    est, lo, hi = stats.basic_bootstrap(values)
    q_lo, q_hi = stats.percentile_interval(draws)
    assert q_lo == pytest.approx(np.percentile(draws, 2.5))
    assert q_hi == pytest.approx(np.percentile(draws, 97.5))
    assert est == pytest.approx(1.2 - 0.5005)
    assert (lo, hi) == pytest.approx((1.2 - q_hi, 1.2 - q_lo))
    est_c, lo_c, hi_c = stats.basic_bootstrap(values, upper=0.6)
    assert max(est_c, lo_c, hi_c) <= 0.6 and est_c == pytest.approx(0.6)
