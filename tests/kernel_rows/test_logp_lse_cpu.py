"""The CPU row passes (`ftis_kernels/kernels/logp_lse_cpu.py`) against float64 and against each
other: eager, fused (compiled or C++), in place or not, and their fall-backs."""

from __future__ import annotations

import math

import pytest
import torch

from ftis_kernels.kernels import logp_lse_cpu
from tests import numerics


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 256 logits so that the tests' small shapes still span several chunks."""
    monkeypatch.setattr(logp_lse_cpu, "CPU_CHUNK_ELEMENTS", 256)


@pytest.mark.parametrize("dtype,offset", [(torch.float32, 1e4), (torch.bfloat16, 100.0)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("inplace", [False, True])
def test_cpu_row_passes_match_float64_softmax_at_large_logits(dtype, offset, temperature, inplace):
    """The chunked PyTorch passes against float64, on logits far from 0 (where one rounded
    log-sum-exp would cost ~1e-3 of every probability), across several chunks, with a masked row
    of nan, a row without gradient holding inf, -inf at untaken tokens, written in place or not."""
    g = torch.Generator().manual_seed(3)
    B, T, V = 2, 5, 100  # 2 rows per chunk (CPU_CHUNK_ELEMENTS = 256 here)
    x = (torch.randn(B, T, V, generator=g) * 3 + offset).to(dtype)
    tokens = torch.randint(0, V, (B, T), generator=g)
    x[1, 3, (tokens[1, 3] + 1) % V] = -math.inf
    x[0, 1] = math.nan
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 1] = False
    logp, row_max, log_sum, entropy = logp_lse_cpu.logp_lse_fwd_torch(x, tokens, mask, temperature)
    live_logits = torch.where(mask[..., None], x.double(), 0.0) / temperature
    want_logp = torch.log_softmax(live_logits, -1).gather(-1, tokens[..., None])[..., 0]
    numerics.assert_close("logp", logp, torch.where(mask, want_logp, 0.0), numerics.FP32)
    want_p = torch.softmax(live_logits, -1)
    want_h = -(want_p * torch.log_softmax(live_logits, -1).clamp(min=-1e300)).sum(-1)
    want_h = torch.where(mask, want_h, 0.0)
    numerics.assert_close("entropy", entropy, want_h, numerics.Tol(1e-4, 1e-5))
    assert logp[0, 1] == 0 and row_max[0, 1] == 0 and log_sum[0, 1] == 0 and entropy[0, 1] == 0
    # Without the entropy: the same statistics, entropy None.
    plain = logp_lse_cpu.logp_lse_fwd_torch(x, tokens, mask, temperature, with_entropy=False)
    assert plain[3] is None
    assert all(torch.equal(a, b) for a, b in zip(plain[:3], (logp, row_max, log_sum)))
    assert torch.equal(row_max[mask], (x.float().amax(-1) / temperature)[mask])
    # A mask of only live rows is skipped, not applied: the same as none.
    all_live = logp_lse_cpu.logp_lse_fwd_torch(x[1:], tokens[1:], mask[1:], temperature)
    no_mask = logp_lse_cpu.logp_lse_fwd_torch(x[1:], tokens[1:], None, temperature)
    assert all(torch.equal(a, b) for a, b in zip(all_live, no_mask))

    coef = torch.randn(B, T, generator=g)
    coef[0, 1] = 0.0
    coef[1, 0] = 0.0
    x[1, 0] = math.inf  # no gradient: never read
    out = x if inplace else torch.empty_like(x)
    # A token of another vocabulary shard (id outside [0, V), sharded.py) adds no 1 - p entry.
    shard_tokens = tokens.clone()
    shard_tokens[1, 2] = V + 5
    shard_tokens[0, 4] = -3
    x_in = x.clone()
    grad = logp_lse_cpu.logits_bwd_torch(x, shard_tokens, row_max, log_sum, coef, temperature, out)
    onehot = torch.nn.functional.one_hot(shard_tokens.clamp(0, V - 1), V).double()
    owned = (shard_tokens >= 0) & (shard_tokens < V)
    onehot = onehot * owned[..., None]
    want = coef.double()[..., None] * (onehot - torch.softmax(live_logits, -1))
    want = torch.where((coef != 0)[..., None], want, 0.0)
    assert grad is out and grad.dtype == dtype
    tol = numerics.FP32 if dtype == torch.float32 else numerics.Tol(2.0**-8, 1e-6)
    numerics.assert_close("grad", grad, want, tol)
    # With an entropy term: d loss / d x = c (onehot - p) - e p (log p + H).
    ecoef = torch.randn(B, T, generator=g)
    ecoef[0, 1] = 0.0
    ecoef[1, 0] = 0.0
    out = torch.empty_like(x_in)
    stats = (row_max, log_sum, coef, temperature, out, entropy, ecoef)
    grad = logp_lse_cpu.logits_bwd_torch(x_in, shard_tokens, *stats)
    log_p = torch.log_softmax(live_logits, -1)
    dh = want_p * (log_p.clamp(min=-1e4) + want_h[..., None])
    want = want - ecoef.double()[..., None] * dh
    want = torch.where(((coef != 0) | (ecoef != 0))[..., None], want, 0.0)
    # That chunk takes the plain fp32 formula (x / tau rounded at |x| = 1e4: spacing ~1e-3).
    numerics.assert_close("grad with entropy", grad, want, numerics.Tol(4e-3, 1e-4))


def _awkward_rows(dtype):
    """Logits for the CPU row passes: rows of mixed magnitude, runs of masked rows (one with nan,
    never read), -inf at untaken tokens, a live nan row; coef 0 on some live rows (one holding
    inf) and tokens of another vocabulary shard."""
    g = torch.Generator().manual_seed(5)
    B, T, V = 3, 7, 50
    scale = torch.tensor([1.0, 1e2, 1e4])[torch.randint(0, 3, (B, T, 1), generator=g)]
    x = ((torch.randn(B, T, V, generator=g) + 2.0) * scale).to(dtype)
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, [2, 5]] = False
    mask[2] = False
    x[0, 2] = math.nan
    x[0, 3, (tokens[0, 3] + 1) % V] = -math.inf
    x[1, 6] = math.nan
    coef = torch.randn(B, T, generator=g) * mask
    coef[0, 0] = 0.0
    coef[1, 6] = 0.0
    x[1, 1] = math.inf
    coef[1, 1] = 0.0
    shard_tokens = tokens.clone()
    shard_tokens[1, 2] = V + 5
    shard_tokens[0, 4] = -3
    return x, tokens, mask, coef, shard_tokens


def _fused_uncompiled(monkeypatch) -> None:
    """Every CPU call takes the fused path, with its row functions uncompiled (the test suite
    never compiles; bench/test_bench.py checks inductor's build of the same functions)."""
    monkeypatch.setattr(logp_lse_cpu, "CPU_FUSED_MIN_ELEMENTS", 0)
    plain = {
        "fwd": logp_lse_cpu._fwd_rows,
        "bwd": logp_lse_cpu._bwd_rows,
        "bwd_inplace": logp_lse_cpu._bwd_rows_inplace,
    }
    monkeypatch.setattr(logp_lse_cpu, "_fused", plain.__getitem__)


def _samples_apart(x: torch.Tensor) -> torch.Tensor:
    """x (B, T, V) as a view whose samples lie T + 2 rows apart (no (B * T, V) view of it)."""
    B, T, V = x.shape
    big = torch.full((B, T + 2, V), math.nan, dtype=x.dtype)
    big[:, 1 : T + 1] = x
    return big[:, 1 : T + 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "samples_apart"])
def test_fused_cpu_row_passes_give_the_eager_results(
    monkeypatch, dtype, temperature, inplace, layout
):
    """The fused CPU path (runs of live rows, the element-wise part in one function per direction,
    here not compiled: bench/test_bench.py checks inductor's build of the same functions) gives
    the eager passes' statistics and gradient, NaN where they have NaN, zeros at masked rows and
    rows without gradient, in place or not, whether its runs may cross samples (a (B * T, V) view
    exists) or not."""
    x, tokens, mask, coef, shard_tokens = _awkward_rows(dtype)
    if layout == "samples_apart":
        x = _samples_apart(x)
    eager_fwd = logp_lse_cpu.logp_lse_fwd_torch(x, tokens, mask, temperature)
    out = torch.empty_like(x)
    eager_grad = logp_lse_cpu.logits_bwd_torch(
        x, shard_tokens, *eager_fwd[1:3], coef, temperature, out
    ).clone()
    _fused_uncompiled(monkeypatch)
    fused_fwd = logp_lse_cpu.logp_lse_fwd_torch(x, tokens, mask, temperature)
    for name, got, want in zip(("logp", "row_max", "log_sum", "entropy"), fused_fwd, eager_fwd):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, equal_nan=True, msg=name)
    torch.testing.assert_close(fused_fwd[1], eager_fwd[1], rtol=0, atol=0, equal_nan=True)
    assert not fused_fwd[0][~mask].any() and not fused_fwd[3][~mask].any()
    x_in = _samples_apart(x) if layout == "samples_apart" else x.clone()
    out = x_in if inplace else torch.full_like(x, math.nan)
    grad = logp_lse_cpu.logits_bwd_torch(
        x_in, shard_tokens, *fused_fwd[1:3], coef, temperature, out
    )
    assert grad is out
    assert not grad[coef == 0].any()
    tol = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 2.0**-8, "atol": 0}
    torch.testing.assert_close(grad, eager_grad, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("fused", [False, True])
def test_cpu_backward_of_a_vocabulary_shard_takes_the_whole_vocabularys_statistics(
    monkeypatch, dtype, temperature, fused
):
    """A vocabulary shard's CPU backward gets the row statistics of the whole vocabulary (what
    `sharded.combine_row_stats` gives it) and writes its columns of the whole gradient, whether
    it holds the row's maximum or not. (Before, it recomputed its own maximum and read log_sum
    as relative to it: a shard without the maximum got p times exp(gap / tau).)"""
    g = torch.Generator().manual_seed(0)
    B, T, V, split = 2, 3, 40, 17
    x = torch.randn(B, T, V, generator=g) * 3
    x[0, :, split:] += 8  # the second shard holds these rows' maxima, the first the others'
    x[1, :, :split] += 8
    x = x.to(dtype)
    tokens = torch.randint(0, V, (B, T), generator=g)
    coef = torch.randn(B, T, generator=g)
    coef[1, 2] = 0.0
    if fused:
        _fused_uncompiled(monkeypatch)
    whole = logp_lse_cpu.logp_lse_fwd_torch(x, tokens, None, temperature)
    want = logp_lse_cpu.logits_bwd_torch(x, tokens, *whole[1:3], coef, temperature, x.clone())
    f32 = dtype == torch.float32
    tol = {"rtol": 1e-5, "atol": 1e-6} if f32 else {"rtol": 2.0**-7, "atol": 1e-5}
    for cols in (slice(0, split), slice(split, V)):
        shard = x[..., cols].contiguous()
        local = tokens - cols.start  # outside [0, shard width) where another shard owns it
        got = logp_lse_cpu.logits_bwd_torch(
            shard, local, *whole[1:3], coef, temperature, torch.empty_like(shard)
        )
        torch.testing.assert_close(got, want[..., cols], **tol)


def test_fused_cpu_row_passes_fall_back_to_the_eager_ones_where_inductor_cannot_build(
    monkeypatch,
):
    """Without a working C++ compiler the compiled row functions raise BackendCompilerFailed at
    their first call: one warning, the eager results, and no second attempt."""
    import torch._dynamo

    x, tokens, mask, coef, _ = _awkward_rows(torch.float32)
    want_fwd = logp_lse_cpu.logp_lse_fwd_torch(x, tokens, mask, 1.0)
    want_grad = logp_lse_cpu.logits_bwd_torch(x, tokens, *want_fwd[1:3], coef, 1.0, x.clone())
    attempts = []

    def cannot_build(name):
        def fn(*args):
            attempts.append(name)
            raise torch._dynamo.exc.BackendCompilerFailed(fn, RuntimeError("no C++ compiler"), None)

        return fn

    monkeypatch.setattr(logp_lse_cpu, "CPU_FUSED_MIN_ELEMENTS", 0)
    monkeypatch.setattr(logp_lse_cpu, "_FUSED", {})
    monkeypatch.setattr(logp_lse_cpu, "_fused", cannot_build)
    with pytest.warns(RuntimeWarning, match="could not be compiled, the eager ones run"):
        got_fwd = logp_lse_cpu.logp_lse_fwd_torch(x, tokens, mask, 1.0)
    got_grad = logp_lse_cpu.logits_bwd_torch(x, tokens, *got_fwd[1:3], coef, 1.0, x.clone())
    assert attempts == ["fwd"]
    for got, want in zip(got_fwd, want_fwd):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=0, equal_nan=True)


def test_fused_cpu_row_passes_are_off_with_ftis_cpu_fused_0(monkeypatch):
    """FTIS_CPU_FUSED=0: no compilation is attempted however large the call."""
    x, tokens, mask, coef, _ = _awkward_rows(torch.float32)
    attempts = []

    def must_not_build(name):
        attempts.append(name)
        raise AssertionError("compiled row function requested")

    monkeypatch.setattr(logp_lse_cpu, "CPU_FUSED_MIN_ELEMENTS", 0)
    monkeypatch.setattr(logp_lse_cpu, "_FUSED", {})
    monkeypatch.setattr(logp_lse_cpu, "_fused", must_not_build)
    monkeypatch.setenv("FTIS_CPU_FUSED", "0")
    stats = logp_lse_cpu.logp_lse_fwd_torch(x, tokens, mask, 1.0)
    logp_lse_cpu.logits_bwd_torch(x, tokens, *stats[1:3], coef, 1.0, x.clone())
    assert attempts == []
    monkeypatch.setenv("FTIS_CPU_FUSED", "1")
    with pytest.raises(AssertionError, match="compiled row function requested"):
        logp_lse_cpu.logp_lse_fwd_torch(x, tokens, mask, 1.0)


def test_cpu_row_functions_fall_back_to_the_compiled_ones_where_the_cpp_cannot_build(monkeypatch):
    """Where `cpu_rows`' C++ cannot be built (here: the build raises), one warning, then every
    fused call takes the torch.compile'd functions (here run uncompiled), with their results."""
    import torch.utils.cpp_extension

    from ftis_kernels.kernels import cpu_rows

    builds = []

    def cannot_build(*args, **kwargs):
        builds.append(args)
        raise RuntimeError("no ninja")

    plain = {"fwd": logp_lse_cpu._fwd_rows, "bwd": logp_lse_cpu._bwd_rows}
    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", cannot_build)
    monkeypatch.setattr(cpu_rows, "_MODULE", {})
    monkeypatch.setattr(logp_lse_cpu, "_compiled", plain.__getitem__)
    x = torch.randn(5, 300)
    scale = torch.tensor(logp_lse_cpu._exp2_scale(1.0), dtype=torch.float32)
    with pytest.warns(RuntimeWarning, match="C\\+\\+ CPU row functions could not be built"):
        got = logp_lse_cpu._fwd_rows_fused(x, scale, True)
    for a, b in zip(got, logp_lse_cpu._fwd_rows(x, scale, True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    out = torch.empty_like(x)
    logp_lse_cpu._bwd_rows_fused(x, got[0], scale, torch.ones(5, 1), out)
    assert len(builds) == 1 and not cpu_rows.usable("bwd", x)


def test_fused_cpu_row_passes_run_uncompiled_past_torch_compiles_recompile_limit(monkeypatch):
    """torch.compile gives up on a row function after `recompile_limit` shapes (fullgraph: it
    raises): that run and the rest of the call take the function uncompiled, after one warning,
    and later calls the eager passes. Here the limit is hit by the second run of live rows of a
    call, so the in-place backward has written its first run already: the fall-back must not
    start the call again on overwritten logits. fp16 rows take the compiled functions."""
    import torch._dynamo

    def limited_compile(fn, **kwargs):
        calls = []

        def compiled(*args):
            calls.append(fn.__name__)
            if len(calls) > 1:
                raise torch._dynamo.exc.FailOnRecompileLimitHit("Hard failure, fullgraph=True")
            return fn(*args)

        return compiled

    g = torch.Generator().manual_seed(3)
    B, T, V = 2, 6, 40
    x = (torch.randn(B, T, V, generator=g) * 3).half()
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, [1, 4]] = False  # runs of live rows: (0, 1), (2, 4), (5, 6) in each sample
    coef = torch.randn(B, T, generator=g) * mask
    eager_fwd = logp_lse_cpu.logp_lse_fwd_torch(x, tokens, mask, 0.7)
    eager_grad = logp_lse_cpu.logits_bwd_torch(x, tokens, *eager_fwd[1:3], coef, 0.7, x.clone())
    monkeypatch.setattr(logp_lse_cpu, "CPU_FUSED_MIN_ELEMENTS", 0)
    monkeypatch.setattr(logp_lse_cpu, "_FUSED", {})
    monkeypatch.setattr(torch, "compile", limited_compile)
    with pytest.warns(RuntimeWarning, match="recompile limit"):
        fwd = logp_lse_cpu.logp_lse_fwd_torch(x, tokens, mask, 0.7)
    for got, want in zip(fwd, eager_fwd):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)
    monkeypatch.setattr(logp_lse_cpu, "_FUSED", {})  # the backward's turn to hit the limit
    x_in = x.clone()  # the gradient is written over it
    with pytest.warns(RuntimeWarning, match="recompile limit"):
        grad = logp_lse_cpu.logits_bwd_torch(x_in, tokens, *fwd[1:3], coef, 0.7, x_in)
    torch.testing.assert_close(grad, eager_grad, rtol=2.0**-10, atol=0)
