"""Packed (padding-free) batches with cu_seqlens: both ops give what the padded call gives on the
same data, loss, metrics and gradients, to the last bit (within 1 ulp allowed), for every option."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ftis_kernels import ftis_linear_loss, ftis_loss
from ftis_kernels.kernels import logp_lse, logp_lse_cpu
from ftis_kernels.validate import raise_on_bad_values
from tests.cases import backend, implementations, options


@pytest.fixture(autouse=True)
def small_vocab_blocks(monkeypatch):
    monkeypatch.setattr(logp_lse, "MAX_BLOCK_V", 16)
    monkeypatch.setattr(logp_lse_cpu, "CPU_CHUNK_ELEMENTS", 64)


def assert_within_one_ulp(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal, or the next float32 towards the other value (NaN-aware)."""
    assert got.shape == want.shape and got.dtype == want.dtype, name
    if got.dtype == torch.bool:
        assert torch.equal(got, want), name
        return
    same = (got == want) | (got.isnan() & want.isnan())
    one_ulp = torch.nextafter(want, got) == got
    bad = ~(same | one_ulp)
    assert not bad.any(), f"{name}: {got[bad][:5].tolist()} vs {want[bad][:5].tolist()}"


def padded_batch(B, T, lengths, seed, with_inner_mask):
    g = torch.Generator().manual_seed(seed)
    inside = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    mask = inside & (torch.rand(B, T, generator=g) < 0.8) if with_inner_mask else inside
    return g, mask


def pack(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    return torch.cat([x[b, :n] for b, n in enumerate(lengths)])


@settings(max_examples=25)
@given(
    lengths=st.lists(st.integers(0, 5), min_size=1, max_size=3),
    V=st.integers(1, 40),
    with_inner_mask=st.booleans(),
    with_old=st.booleans(),
    linear=st.booleans(),
    seed=st.integers(0, 2**16),
    opts=options,
)
def test_packed_batch_gives_the_padded_loss_metrics_and_gradients(
    lengths, V, with_inner_mask, with_old, linear, seed, opts
):
    T = 5
    lengths[seed % len(lengths)] = T  # the longest segment spans T: dr_grpo's L agrees
    B, H = len(lengths), 4
    g, mask = padded_batch(B, T, lengths, seed, with_inner_mask)
    tokens = torch.randint(0, V, (B, T), generator=g)
    gen = -torch.rand(B, T, generator=g) * 2
    old = -torch.rand(B, T, generator=g) * 2 if with_old else None
    ref = -torch.rand(B, T, generator=g) * 2 if opts["beta"] > 0 else None
    adv = torch.randn(B, generator=g)
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0)
    p = lambda x: None if x is None else pack(x, lengths)  # noqa: E731
    if linear:
        hidden = torch.randn(B, T, H, generator=g)
        weight = torch.randn(V, H, generator=g).requires_grad_()
        bias = torch.randn(V, generator=g).requires_grad_()
        padded_in = hidden.clone().requires_grad_()
        packed_in = pack(hidden, lengths).clone().requires_grad_()

        def run(x, *rows, **kw):
            return ftis_linear_loss(x, weight, *rows, bias=bias, chunk_size=3, **opts, **kw)

        params = (weight, bias)
    else:
        logits = torch.randn(B, T, V, generator=g) * 3
        padded_in = logits.clone().requires_grad_()
        packed_in = pack(logits, lengths).clone().requires_grad_()

        def run(x, *rows, **kw):
            return ftis_loss(x, *rows, **opts, **kw)

        params = ()
    loss, metrics = run(padded_in, tokens, gen, adv, mask, old, ref)
    grads = torch.autograd.grad(loss, (padded_in, *params), allow_unused=True)
    rows = (p(tokens), p(gen), adv, p(mask), p(old), p(ref))
    packed_loss, packed_metrics = run(packed_in, *rows, cu_seqlens=cu_seqlens)
    packed_grads = torch.autograd.grad(packed_loss, (packed_in, *params), allow_unused=True)

    close = assert_within_one_ulp
    if linear:
        # The lm-head's chunks of 3 rows differ between the layouts (the padded call computes its
        # padding rows too), and a GEMM's accumulation order follows its shape: the logits differ
        # by a few ulp, and what comes from them by as many.
        def close(name, got, want):
            if got.dtype == torch.bool:
                assert torch.equal(got, want), name
                return
            torch.testing.assert_close(got, want, rtol=16 * 2**-23, atol=1e-7, msg=name)

    close("loss", packed_loss, loss)
    for name, value in metrics.items():
        want = pack(value, lengths) if name in ("logp", "entropy") else value
        close(name, packed_metrics[name], want)
    close("grad input", packed_grads[0], pack(grads[0], lengths))
    for name, got, want in zip(("grad weight", "grad bias"), packed_grads[1:], grads[1:]):
        # Sums over the rows, grouped into other chunks in the two layouts: fp32 adds the same
        # products in another order, a rounding per addition, bounded by n * eps * max |sum|
        # (n <= B * T = 21 rows here), on top of the logits' few ulp.
        bound = 21 * torch.finfo(torch.float32).eps * want.abs().max().clamp(min=1e-30)
        assert (got - want).abs().max() <= bound, (name, (got - want).abs().max(), bound)


def test_packed_shapes_and_empty_segments():
    V = 7
    logits = torch.randn(1, 6, V, requires_grad=True)
    tokens, gen = torch.randint(0, V, (1, 6)), -torch.rand(1, 6)
    cu_seqlens = torch.tensor([0, 2, 2, 6])  # the second sample has no token
    loss, metrics = ftis_loss(logits, tokens, gen, torch.randn(3), cu_seqlens=cu_seqlens)
    loss.backward()
    assert metrics["logp"].shape == (1, 6) and metrics["kl"].shape == (3,)
    _, flat = ftis_loss(logits[0], tokens[0], gen[0], torch.randn(3), cu_seqlens=cu_seqlens)
    assert flat["logp"].shape == (6,)


@pytest.mark.parametrize(
    ("cu_seqlens", "message"),
    [
        (torch.tensor([1, 3, 6]), "starting at 0"),
        (torch.tensor([0, 4, 3, 6]), "non-decreasing"),
        (torch.tensor([0, 2, 5]), "ending at N = 6"),
        (torch.tensor([0.0, 6.0]), "int32 or int64"),
        (torch.tensor([[0, 6]]), "1-D"),
    ],
)
def test_bad_cu_seqlens_is_refused_naming_it(cu_seqlens, message):
    V, N = 5, 6
    tokens, gen = torch.randint(0, V, (N,)), -torch.rand(N)
    S = max(1, cu_seqlens.numel() - 1)
    with pytest.raises(ValueError, match=f"^cu_seqlens: .*{message}"):
        ftis_loss(torch.randn(N, V), tokens, gen, torch.randn(S), cu_seqlens=cu_seqlens)
    with pytest.raises(ValueError, match=f"^cu_seqlens: .*{message}"):
        ftis_linear_loss(
            torch.randn(N, 3), torch.randn(V, 3), tokens, gen, torch.randn(S), cu_seqlens=cu_seqlens
        )


def test_packed_advantages_are_one_per_segment():
    N, V = 6, 5
    with pytest.raises(ValueError, match=r"^advantages: expected shape \(2,\)"):
        ftis_loss(
            torch.randn(N, V),
            torch.randint(0, V, (N,)),
            -torch.rand(N),
            torch.randn(3),
            cu_seqlens=torch.tensor([0, 2, 6]),
        )
    with pytest.raises(ValueError, match=r"^logits: expected \(N, V\) or \(1, N, V\)"):
        ftis_loss(
            torch.randn(2, 3, V),
            torch.randint(0, V, (2, 3)),
            -torch.rand(2, 3),
            torch.randn(2),
            cu_seqlens=torch.tensor([0, 2, 6]),
        )


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's NumPy, on inf and NaN
@pytest.mark.parametrize("impl", implementations(torch.device("cpu")))
@pytest.mark.parametrize("value_check", ["call", "backward", "deferred"])
@pytest.mark.parametrize("linear", [False, True])
def test_a_packed_calls_bad_value_is_located_in_the_packed_stream(impl, value_check, linear):
    """The first failing position of a packed call is its index among the N tokens, (i,), as the
    caller's (N,) tensors have it, not (0, i) of the op's inner (1, N) view; likewise the row of
    a non-finite logit."""
    N, V, H = 6, 5, 3
    g = torch.Generator().manual_seed(0)
    tokens, gen = torch.randint(0, V, (N,), generator=g), -torch.rand(N, generator=g)
    gen[4] = float("nan")
    cu_seqlens, advantages = torch.tensor([0, 2, 6]), torch.randn(2, generator=g)
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g)
    want = r"^gen_logprobs: .* got 1 of 6 positions outside that, the first at \(4,\): nan"
    with backend(impl), pytest.raises(ValueError, match=want):
        kw = dict(cu_seqlens=cu_seqlens, value_check=value_check)
        if linear:
            loss, metrics = ftis_linear_loss(hidden, weight, tokens, gen, advantages, **kw)
        else:
            loss, metrics = ftis_loss(hidden @ weight.T, tokens, gen, advantages, **kw)
        if value_check == "deferred":
            raise_on_bad_values(metrics)
        loss.backward()
    logits = torch.randn(1, N, V, generator=g)
    logits[0, 3, 1] = float("inf")
    gen = -torch.rand(1, N, generator=g)
    with backend(impl), pytest.raises(ValueError, match=r"^logits: .* the first at \(3,\)"):
        ftis_loss(logits, tokens[None], gen, advantages, cu_seqlens=cu_seqlens, value_check="call")


def test_strided_cu_seqlens_gives_what_contiguous_ones_give():
    # A column of a (S + 1, 2) tensor: stride 2. The per-sample kernel read it as if contiguous
    # (another segment's offsets, or memory past the tensor).
    N, V, H = 8, 7, 3
    g = torch.Generator().manual_seed(0)
    logits, hidden, weight = (torch.randn(*s, generator=g) for s in ((N, V), (N, H), (V, H)))
    rows = (torch.randint(0, V, (N,), generator=g), -torch.rand(N, generator=g), torch.randn(3))
    cu_seqlens = torch.tensor([0, 3, 3, 8])
    strided = torch.stack([cu_seqlens, torch.full_like(cu_seqlens, 99)], dim=1)[:, 0]
    assert strided.stride() == (2,)
    for run in (
        lambda cu: ftis_loss(logits, *rows, cu_seqlens=cu, loss_type="dr_grpo"),
        lambda cu: ftis_linear_loss(hidden, weight, *rows, cu_seqlens=cu, chunk_size=3),
    ):
        (loss, metrics), (want, want_metrics) = run(strided), run(cu_seqlens)
        assert torch.equal(loss, want)
        for name, value in want_metrics.items():
            assert torch.equal(metrics[name], value), name
