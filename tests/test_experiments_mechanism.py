"""The mechanism test: its estimators on synthetic gradients, and its quick scale end to end."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from experiments import mechanism

ROOT = Path(__file__).resolve().parents[1]


def _stats(batches: torch.Tensor, blocks: int, source: str) -> mechanism.BlockStats:
    stats = mechanism.BlockStats(batches.shape[1], batches.shape[0], blocks, source)
    for g in batches:
        stats.add(g)
    return stats


def _synthetic(n_batches=60, dim=64, sigma=0.1, seed=0):
    """A target gradient g* of norm 1 and batch gradients around shifted means."""
    gen = torch.Generator().manual_seed(seed)
    g_star = torch.randn(dim, generator=gen)
    g_star /= g_star.norm()
    other = torch.randn(dim, generator=gen)
    other -= other.dot(g_star) * g_star
    other /= other.norm()  # orthogonal to g*, norm 1

    def batches(mean: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return mean + scale * sigma * torch.randn(n_batches, dim, generator=gen)

    return g_star, other, batches


def test_block_statistics_give_the_mean_and_covariance_trace_of_the_batches():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(12, 30, generator=gen) + 2.0
    b = torch.randn(12, 30, generator=gen) * 3
    sa, sb = _stats(a, 4, "a"), _stats(b, 3, "b")
    torch.testing.assert_close(sa.mean(), a.double().mean(dim=0))
    out = mechanism.compare(sb, sa, {"a": sa}, n_boot=10)
    # Block sums are float32 (the gradients' dtype), the rest float64.
    tol = 1e-6
    trace_a = float(torch.cov(a.double().T).trace())
    trace_b = float(torch.cov(b.double().T).trace())
    assert math.isclose(out["a"]["var"], trace_a, rel_tol=tol)
    assert math.isclose(out["_target"]["var"], trace_b, rel_tol=tol)
    assert math.isclose(out["a"]["var_ratio"], 1.0, rel_tol=1e-12)  # a is its own reference
    ma, mb = a.double().mean(dim=0), b.double().mean(dim=0)
    cos = float(ma.dot(mb) / (ma.norm() * mb.norm()))
    assert math.isclose(out["a"]["cos_raw"], cos, rel_tol=tol)
    assert math.isclose(out["a"]["rel_err_raw"], float((ma - mb).norm() / mb.norm()), rel_tol=tol)


def test_bias_estimator_detects_a_known_bias_and_not_an_absent_one():
    # 20 independent synthetic studies: a 95% interval must cover the truth in about 19 of them,
    # and a bias of half the target's norm must be detected in every one.
    seeds = range(20)
    covered = dict.fromkeys(("biased", "shrunk", "cos", "noisy", "unbiased"), 0)
    for seed in seeds:
        g_star, other, batches = _synthetic(seed=seed)
        target = _stats(batches(g_star), 10, "target")
        reference = _stats(batches(g_star), 10, "reference")
        modes = {
            "unbiased": _stats(batches(g_star), 10, "unbiased"),
            "biased": _stats(batches(g_star + 0.5 * other), 10, "biased"),  # rel. error 0.5
            "shrunk": _stats(batches(0.5 * g_star), 10, "shrunk"),  # cosine 1, rel. error 0.5
            "noisy": _stats(batches(g_star, scale=3.0), 10, "noisy"),  # variance x 9
        }
        out = mechanism.compare(target, reference, modes, n_boot=1000, seed=seed)
        unbiased, biased, shrunk, noisy = (out[k] for k in modes)
        # Noise alone makes the plug-in relative error clearly non-zero; the estimate removes it.
        assert unbiased["rel_err_raw"] > 0.1 and unbiased["rel_err_noise"] > 0.1
        covered["unbiased"] += unbiased["rel_err_ci"][0] == 0.0 and unbiased["cos_ci"][1] == 1.0
        for name, row in (("biased", biased), ("shrunk", shrunk)):
            low, high = row["rel_err_ci"]
            assert low > 0.3 and high < 0.7, row  # detected, and not by far off
            covered[name] += low <= 0.5 <= high
        low, high = biased["cos_ci"]
        assert high < 0.95
        covered["cos"] += low <= 1 / math.sqrt(1.25) <= high
        assert shrunk["cos_ci"][1] == 1.0  # the cosine cannot see a shrunk gradient
        low, high = noisy["var_ratio_ci"]
        assert low > 4.0
        covered["noisy"] += low <= 9.0 <= high
    assert all(n >= 16 for n in covered.values()), covered


def test_findings_call_a_mode_biased_by_its_relative_errors_interval_as_the_text_says():
    def row(mode, rel_err_ci, cos_ci):
        return dict(
            peer="far", mode=mode, rel_err=0.2, rel_err_ci=rel_err_ci, cos=0.9, cos_ci=cos_ci,
            var_ratio=1.0, kl_sample=1.0, kl_token=0.1,
        )  # fmt: skip

    # NoIS: the relative error's interval excludes 0, the cosine's reaches 1; TIS: the reverse.
    rows = [row("nois", [0.1, 0.3], [0.95, 1.0]), row("tis", [0.0, 0.3], [0.5, 0.8])]
    header, _, line = mechanism.findings(rows)
    assert line.endswith("biased: NoIS; not detected: TIS.")
    rule = "relative error's 95% interval excludes 0"
    assert rule in header and rule in " ".join(mechanism.findings.__doc__.split())
    assert "cosine's excludes" not in mechanism.findings.__doc__  # the one rule, not another


def test_quick_scale_runs_end_to_end_and_the_identical_peer_gives_on_policys_gradient(tmp_path):
    # About a minute of one core; the timeout only catches a hang.
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the driver's path: ftis_loss on PyTorch, as users run it
    results = tmp_path / "results"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.mechanism",
            "--quick",
            "--results",
            str(results),
            "--cache",
            str(tmp_path / "cache"),
            "--work",
            str(tmp_path / "work"),
            "--jobs",
            "1",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = [json.loads(x) for x in (results / "mechanism.jsonl").read_text().splitlines()]
    peers = [p.name for p in mechanism.peers(mechanism.QUICK, 1.0)]
    assert [(r["peer"], r["mode"]) for r in rows] == [("on-policy", "on-policy")] + [
        (p, m) for p in peers for m in mechanism.MODES
    ]
    for r in rows:
        assert {"torch", "triton", "numpy", "cpu", "threads_per_node", "commit"} <= set(r["env"])
        assert r["clip_frac"] == 0.0  # one update per batch: the ratio is 1
    reference = rows[0]
    assert reference["grad_norm"] > 0  # some group had a reward: the check below is not 0 == 0
    for r in rows:
        if r["peer"] == "identical":
            # The same samples: every mode's batch gradient is on-policy's.
            assert r["same_samples_max_rel_diff"] < 1e-4, r  # w = 1 up to float32 rounding
            assert math.isclose(r["grad_norm"], reference["grad_norm"], rel_tol=1e-5)
            assert math.isclose(r["cos_raw"], reference["cos_raw"], rel_tol=1e-5)
            assert r["kl_sample"] < 1e-4 and r["filter_changed_frac"] == 0.0
    hot = [r for r in rows if r["peer"] == "hot"]
    assert all(r["kl_sample"] > rows[1]["kl_sample"] + 0.1 for r in hot)
    assert (results / "mechanism.png").stat().st_size > 10_000
    table = (results / "mechanism.md").read_text()
    assert "| **identical**:" in table
    # Every image the write-up links is found from where the write-up lies.
    links = re.findall(r"!\[[^]]*\]\(([^)]+)\)", table)
    assert links == ["mechanism.png"] and all((results / link).is_file() for link in links)
