"""The study's statistics, fixed before the numbers: paired intervals over seeds, equivalence
within a margin, Holm's correction over a family of claims, pooling across nodes, and the rule
that turns them into a verdict word.

The unit of replication is the seed: a seed fixes the task draw, every node's initial weights,
warm-up data and sampling, and every mode of a cell runs on the same seed, so a comparison is the
per-seed difference d_s = (metric under the mode) - (metric under the baseline), s = 1..n.

- `t_interval(d)`: mean(d) +- t_{n-1} * sd(d) / sqrt(n), the paired 95% interval;
  `bootstrap_interval(d)`: the percentile bootstrap of mean(d), reported next to it (the verdicts
  use the t interval).
- `t_test(d)`: the two-sided p-value of mean(d) = 0.
- `tost(d, margin)`: two one-sided t-tests of mean(d) <= -margin and mean(d) >= +margin; its
  p-value is the larger of the two. p < alpha exactly when the (1 - 2 alpha) t interval lies
  inside (-margin, +margin).
- `noninferiority(d, margin)`: the one-sided t-test of mean(d) <= -margin, its p-value doubled,
  so that p < alpha exactly when the two-sided (1 - alpha) t interval's lower bound lies above
  -margin ("not worse than the baseline by more than the margin").
- `holm(ps)`: Holm's step-down adjusted p-values over a family (controls the chance of any false
  "reproduced" or "contradicted" in the family at alpha).
- `gatekeep(gate, family)`: serial gatekeeping: a family is tested only if its gate claim (a
  positive control) is reproduced; otherwise every claim of it is "untestable at this scale".
- `seeds_needed(sd, effect, ...)`: the seeds a paired t-test needs for a power, from the noncentral
  t distribution (the power calculation of a pre-registered design).
- `pool(per_unit)`: a claim about every node is tested on the per-seed mean of the nodes'
  differences (nodes of one seed share runs, so they are not independent replicates).
- `verdict(...)`: the mechanical rule, `RULES` in words (the README quotes it).
- `MIN_SEEDS`: the fewest seeds the rule gives a verdict from; the reports call a claim with
  fewer "pending".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal, Optional

import numpy as np
from scipy import stats as sps

ALPHA = 0.05
BOOTSTRAP_RESAMPLES = 10_000
Verdict = Literal["reproduced", "contradicted", "inconclusive", "untestable at this scale"]
KINDS = ("direction", "equivalence", "noninferiority")
# The fewest seeds a verdict is given from (`RULES`); a claim with fewer is "pending".
MIN_SEEDS = 10

RULES = f"""\
Every claim has one primary metric and one test, fixed before the run. Its data are the per-seed
differences d_s (the mode minus the baseline, same node, same seed); a claim about all nodes or
pairs uses the per-seed mean of their differences. From n >= {MIN_SEEDS} seeds:

- **Direction claims** ("A is below B"): a two-sided paired t-test of mean(d) = 0, its p-value
  Holm-adjusted over the claims of the family. *Reproduced* if p_Holm < 0.05 and the mean has the
  predicted sign; *contradicted* if p_Holm < 0.05 with the opposite sign; otherwise
  *inconclusive*.
- **Equivalence claims** ("A behaves like B"): TOST against the claim's margin m, i.e. the
  90% t interval inside (-m, +m), its p-value Holm-adjusted. *Reproduced* if p_Holm < 0.05;
  *contradicted* if the 95% t interval lies wholly outside (-m, +m); otherwise *inconclusive*.
  Absence of a significant difference is never read as equivalence.
- **Untestable at this scale**: the test was inconclusive and the claim's precondition failed
  on the data: its positive control showed no harm (the setup could not have shown the effect),
  or the baseline metric sits at its floor (stated per claim), so no outcome could bear on it.
- Every verdict is printed with its 95% t interval (and the bootstrap interval beside it)."""


@dataclass(frozen=True)
class Interval:
    """A 95% (or `level`) interval of the mean of `n` paired differences."""

    mean: float
    lo: float
    hi: float
    n: int
    level: float
    method: str

    def __str__(self) -> str:
        return f"{self.mean:+.3f} [{self.lo:+.3f}, {self.hi:+.3f}]"

    def inside(self, margin: float) -> bool:
        return -margin < self.lo and self.hi < margin

    def outside(self, margin: float) -> bool:
        return self.lo >= margin or self.hi <= -margin


def _clean(d: Sequence[float]) -> np.ndarray:
    x = np.asarray([v for v in d if v is not None and not math.isnan(v)], dtype=np.float64)
    if x.size < 2:
        raise ValueError(f"d: expected at least 2 finite paired differences, got {x.size}")
    return x


def paired(a: Mapping[int, float], b: Mapping[int, float]) -> list[float]:
    """The per-seed differences a[s] - b[s] over the seeds both hold (dicts seed -> value)."""
    return [a[s] - b[s] for s in sorted(set(a) & set(b)) if a[s] is not None and b[s] is not None]


def t_interval(d: Sequence[float], level: float = 0.95) -> Interval:
    """mean(d) +- t_{n-1, (1+level)/2} * sd(d) / sqrt(n)."""
    x = _clean(d)
    n, m = x.size, float(x.mean())
    half = float(sps.t.ppf((1 + level) / 2, n - 1)) * float(x.std(ddof=1)) / math.sqrt(n)
    return Interval(m, m - half, m + half, n, level, "t")


def bootstrap_interval(
    d: Sequence[float], level: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> Interval:
    """The percentile bootstrap interval of mean(d): `resamples` draws of n seeds with
    replacement, a fixed generator so that the report is reproducible."""
    x = _clean(d)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return Interval(float(x.mean()), float(lo), float(hi), x.size, level, "bootstrap")


def percentile_interval(draws: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The percentile interval of bootstrap draws of a statistic."""
    lo, hi = np.percentile(draws, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def basic_bootstrap(
    values: np.ndarray, upper: Optional[float] = None, level: float = 0.95
) -> tuple[float, float, float]:
    """(estimate, low, high) from values = [plug-in, *bootstrap draws]: 2 * plug-in - the draws'
    mean (the plug-in's bias removed) and the basic bootstrap interval [2 * plug-in - q_hi,
    2 * plug-in - q_lo], each clipped to `upper` (e.g. 1 for a cosine)."""
    plug, draws = values[0], values[1:]
    lo, hi = percentile_interval(draws, level)
    est, low, high = 2 * plug - draws.mean(), 2 * plug - hi, 2 * plug - lo
    if upper is not None:
        est, low, high = min(est, upper), min(low, upper), min(high, upper)
    return float(est), float(low), float(high)


def _t_stat(x: np.ndarray, shift: float = 0.0) -> float:
    se = float(x.std(ddof=1)) / math.sqrt(x.size)
    diff = float(x.mean()) - shift
    if se == 0.0:
        return math.copysign(math.inf, diff) if diff else 0.0
    return diff / se


def t_test(d: Sequence[float]) -> float:
    """Two-sided p-value of the paired t-test of mean(d) = 0."""
    x = _clean(d)
    return float(2 * sps.t.sf(abs(_t_stat(x)), x.size - 1))


def tost(d: Sequence[float], margin: float) -> float:
    """p-value of the two one-sided tests that |mean(d)| >= margin: the larger one-sided p."""
    if not margin > 0:
        raise ValueError(f"margin: expected a value > 0, got {margin}")
    x = _clean(d)
    p_low = sps.t.sf(_t_stat(x, -margin), x.size - 1)  # H0: mean <= -margin
    p_high = sps.t.cdf(_t_stat(x, margin), x.size - 1)  # H0: mean >= +margin
    return float(max(p_low, p_high))


def noninferiority(d: Sequence[float], margin: float) -> float:
    """p-value that mean(d) > -margin: the one-sided t-test of mean(d) <= -margin, doubled (and
    capped at 1), so that p < alpha exactly when the (1 - alpha) t interval's lower bound is
    above -margin."""
    if not margin > 0:
        raise ValueError(f"margin: expected a value > 0, got {margin}")
    x = _clean(d)
    return float(min(1.0, 2 * sps.t.sf(_t_stat(x, -margin), x.size - 1)))


def seeds_needed(
    sd: float,
    effect: float,
    alpha: float = ALPHA,
    power: float = 0.8,
    margin: float = 0.0,
    most: int = 1000,
) -> Optional[int]:
    """The fewest seeds n (>= 3) at which a paired t-test at two-sided level `alpha` detects a
    true mean difference `effect` (in the claimed direction, sign ignored) with probability
    `power`, for per-seed differences of standard deviation `sd`; with `margin`, the
    non-inferiority test against -margin (`noninferiority`) of a true difference `effect`
    (signed: a true loss is negative). None if `most` seeds are not enough."""
    if not sd > 0:
        raise ValueError(f"sd: expected a value > 0, got {sd}")
    if not 0 < alpha < 1 or not 0 < power < 1:
        raise ValueError(f"alpha, power: expected values in (0, 1), got {alpha}, {power}")
    shift = effect + margin if margin else abs(effect)
    for n in range(3, most + 1):
        crit = sps.t.ppf(1 - alpha / 2, n - 1)
        if sps.nct.sf(crit, n - 1, shift / (sd / math.sqrt(n))) >= power:
            return n
    return None


def holm(ps: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: the k-th smallest p times
    (m - k + 1), made non-decreasing along that order, capped at 1."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    out, running = [0.0] * len(ps), 0.0
    for k, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - k) * ps[i]))
        out[i] = running
    return out


def pool(per_unit: Sequence[Mapping[int, float]]) -> dict[int, float]:
    """Per seed, the mean over units (nodes, pairs) of their differences: one pooled difference
    per seed that every unit has."""
    seeds = set.intersection(*(set(u) for u in per_unit)) if per_unit else set()
    return {s: float(np.mean([u[s] for u in per_unit])) for s in sorted(seeds)}


@dataclass(frozen=True)
class Claim:
    """One claim, stated before the numbers. kind "direction": the mode differs from the
    baseline with sign `sign` (+1 above, -1 below); kind "equivalence": |difference| < margin."""

    name: str
    kind: Literal["direction", "equivalence", "noninferiority"]
    metric: str
    sign: int = 0
    margin: Optional[float] = None

    def __post_init__(self):
        if self.kind == "direction" and self.sign not in (-1, 1):
            raise ValueError(f"{self.name}: a direction claim needs sign +1 or -1")
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind != "direction" and not (self.margin and self.margin > 0):
            raise ValueError(f"{self.name}: an {self.kind} claim needs a margin > 0")


@dataclass(frozen=True)
class Result:
    """A claim's test on its per-seed differences, before and after Holm."""

    claim: Claim
    ci: Interval
    boot: Interval
    p: float
    p_holm: float
    verdict: Verdict
    why: str


RULE_NONINFERIORITY = """\
- **Non-inferiority claims** ("A is not worse than B"): the 95% t interval's lower bound
  against -m, i.e. a one-sided t-test of mean(d) <= -m, its p-value doubled and Holm-adjusted.
  *Reproduced* if p_Holm < 0.05; *contradicted* if the 95% t interval lies wholly below -m;
  otherwise *inconclusive*."""
RULE_GATE = """\
- **A gate**: the claims of the family are tested only if their gate (the positive control,
  tested alone at 0.05) is reproduced; otherwise each is *untestable at this scale*, its
  interval still reported (serial gatekeeping: the chance of any false verdict over the gate
  and the family stays at most 0.05)."""


def p_value(claim: Claim, d: Sequence[float]) -> float:
    """The claim's unadjusted p-value: the t-test for a direction, TOST for an equivalence, the
    doubled one-sided test for a non-inferiority."""
    if claim.kind == "direction":
        return t_test(d)
    if claim.kind == "noninferiority":
        return noninferiority(d, claim.margin)
    return tost(d, claim.margin)


def verdict(
    claim: Claim, ci: Interval, p_holm: float, untestable: Optional[str] = None
) -> tuple[Verdict, str]:
    """The verdict word from the rule in `RULES`, and the reason in a few words. `untestable`
    (the failed precondition, or None) turns only an inconclusive verdict into "untestable"."""
    if claim.kind == "direction":
        if p_holm < ALPHA:
            agrees = math.copysign(1, ci.mean) == claim.sign
            return (
                ("reproduced" if agrees else "contradicted"),
                f"p_Holm = {p_holm:.3g}, mean {'in' if agrees else 'against'} the claimed "
                "direction",
            )
        word, why = "inconclusive", f"p_Holm = {p_holm:.3g} >= {ALPHA}"
    elif claim.kind == "noninferiority":
        if p_holm < ALPHA:
            return "reproduced", f"p_Holm = {p_holm:.3g}: above -{claim.margin:g}"
        if ci.hi <= -claim.margin:
            return "contradicted", f"the 95% interval lies below -{claim.margin:g}"
        word = "inconclusive"
        why = f"p_Holm = {p_holm:.3g}: the interval reaches below -{claim.margin:g}"
    elif p_holm < ALPHA:
        return "reproduced", f"TOST p_Holm = {p_holm:.3g}: within +-{claim.margin:g}"
    elif ci.outside(claim.margin):
        return "contradicted", f"the 95% interval lies outside +-{claim.margin:g}"
    else:
        word = "inconclusive"
        why = f"TOST p_Holm = {p_holm:.3g}: the interval reaches past +-{claim.margin:g}"
    if untestable:
        return "untestable at this scale", f"{why}, and {untestable}"
    return word, why


def evaluate(
    family: Sequence[tuple[Claim, Sequence[float], Optional[str]]],
    size: Optional[int] = None,
) -> list[Result]:
    """Test a family of claims together: (claim, per-seed differences, the failed precondition
    or None). Holm runs over every claim's p-value, and over `size` claims when given (the whole
    family's, some of it pending: each pending claim counted with p = 1)."""
    ps = [p_value(c, d) for c, d, _ in family]
    if size is not None and size < len(ps):
        raise ValueError(f"size: expected at least the {len(ps)} claims given, got {size}")
    adjusted = holm(ps + [1.0] * ((size or len(ps)) - len(ps)))[: len(ps)]
    out = []
    for (claim, d, why), p, p_h in zip(family, ps, adjusted):
        ci = t_interval(d)
        word, reason = verdict(claim, ci, p_h, why)
        out.append(Result(claim, ci, bootstrap_interval(d), p, p_h, word, reason))
    return out


def gatekeep(gate: Result, family: Sequence[Result]) -> list[Result]:
    """Serial gatekeeping: `family` (tested together, Holm within it) stands only if its `gate`
    (a positive control, tested alone at ALPHA) is reproduced; otherwise each of its claims is
    "untestable at this scale", its interval still reported. The chance of any false verdict
    over gate and family stays at most ALPHA."""
    if gate.verdict == "reproduced":
        return list(family)
    why = f"its gate {gate.claim.name} was not reproduced ({gate.verdict})"
    return [replace(r, verdict="untestable at this scale", why=why) for r in family]
