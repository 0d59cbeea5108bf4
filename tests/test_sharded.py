"""Vocabulary-sharded ftis_loss / ftis_linear_loss on 2 and 4 gloo processes (CPU) against the
unsharded op on the same data: loss, metrics, grad_hidden and each shard's grad_weight / grad_bias
/ logits columns; V not divisible by P, tokens owned by every rank; bad shards refused. On CUDA,
the same on 2 processes sharing the GPU (gloo moves CUDA tensors through the host), called from
torch.compile(fullgraph=True): no graph break."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ftis_kernels import ftis_linear_loss, ftis_loss
from tests import numerics

B, T, V, H = 2, 4, 13, 4
OPTIONS = {"entropy_coef": 0.1, "beta": 0.04, "kl_threshold": 0.3, "temperature": 0.8}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _data(P: int):
    g = torch.Generator().manual_seed(P)
    hidden = torch.randn(B, T, H, generator=g)
    weight, bias = torch.randn(V, H, generator=g), torch.randn(V, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    tokens[0] = torch.arange(T) * (V // T)  # tokens in every rank's shard
    gen = -torch.rand(B, T, generator=g) * 3
    ref = -torch.rand(B, T, generator=g) * 3
    mask = torch.rand(B, T, generator=g) < 0.8
    return hidden, weight, bias, tokens, (gen, torch.randn(B, generator=g), mask, None, ref)


def _shard(rank: int, P: int) -> slice:
    sizes = [V // P + (1 if r < V % P else 0) for r in range(P)]
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _compare(got, want, cols: slice) -> None:
    (loss, metrics, grads), (loss_full, metrics_full, grads_full) = got, want
    numerics.assert_close("loss", loss, loss_full)
    for name, value in metrics_full.items():
        numerics.assert_close(name, metrics[name].float(), value.float())
    for name, g in grads.items():
        full = grads_full[name]
        full = full[cols] if name in ("weight", "bias") else full
        full = full[..., cols] if name == "logits" else full
        numerics.assert_close(f"grad {name}", g, full)


def _run_logits(logits, tokens, rows, **kw):
    logits = logits.clone().requires_grad_()
    loss, metrics = ftis_loss(logits, tokens, *rows, **OPTIONS, **kw)
    (grad,) = torch.autograd.grad(loss, logits)
    return loss, metrics, {"logits": grad}


def _run_linear(hidden, weight, bias, tokens, rows, **kw):
    leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    loss, metrics = ftis_linear_loss(
        leaves[0], leaves[1], tokens, *rows, bias=leaves[2], chunk_size=3, **OPTIONS, **kw
    )
    grads = torch.autograd.grad(loss, leaves)
    return loss, metrics, dict(zip(("hidden", "weight", "bias"), grads))


def _worker(rank: int, P: int, port: int, extra: bool) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P)
    try:
        hidden, weight, bias, tokens, rows = _data(P)
        cols, group = _shard(rank, P), dist.group.WORLD
        shard = {"vocab_start": cols.start, "process_group": group}
        logits = hidden @ weight.T + bias
        want = _run_logits(logits, tokens, rows)
        _compare(_run_logits(logits[..., cols], tokens, rows, **shard), want, cols)
        want = _run_linear(hidden, weight, bias, tokens, rows)
        got = _run_linear(hidden, weight[cols], bias[cols], tokens, rows, **shard)
        _compare(got, want, cols)
        if extra:
            _compiled_and_refused(rank, logits, hidden, weight, bias, tokens, rows, cols, group)
        # Every rank done before any tears gloo down: once (CI, 4 ranks on 2 cores under load)
        # one rank aborted in teardown ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _compiled_and_refused(rank, logits, hidden, weight, bias, tokens, rows, cols, group):
    shard = {"vocab_start": cols.start, "process_group": group}

    @torch.compile(backend="aot_eager", fullgraph=True)
    def compiled(x):
        return ftis_loss(x, tokens, *rows, **OPTIONS, **shard)[0]

    x = logits[..., cols].clone().requires_grad_()
    loss = compiled(x)
    loss.backward()
    eager = _run_logits(logits[..., cols], tokens, rows, **shard)
    numerics.assert_close("compiled loss", loss, eager[0])
    numerics.assert_close("compiled grad", x.grad, eager[2]["logits"])

    wrong_start = {"vocab_start": cols.start + rank, "process_group": group}
    with pytest.raises(ValueError, match="^vocab_start: expected shards that tile"):
        ftis_loss(logits[..., cols], tokens, *rows, **OPTIONS, **wrong_start)
    first_off = {"vocab_start": cols.start + (rank == 0), "process_group": group}
    with pytest.raises(ValueError, match="got rank 0 starting at 1 instead of at 0 "):
        ftis_loss(logits[..., cols], tokens, *rows, **OPTIONS, **first_off)
    # Rows of another shape on each rank: refused on every rank (the all-reduces waited forever).
    short = slice(0, T - rank)
    cut = [x[:, short] if x is not None and x.dim() == 2 else x for x in rows]
    with pytest.raises(ValueError, match=r"^tokens: expected the same \(B, T\) on every rank"):
        ftis_loss(logits[:, short, cols], tokens[:, short], *cut, **OPTIONS, **shard)
    h = torch.randn(B, T, H + rank)
    with pytest.raises(ValueError, match="^process_group: expected shards that agree on H"):
        ftis_linear_loss(
            h, torch.randn(cols.stop - cols.start, H + rank), tokens, *rows, **OPTIONS, **shard
        )
    bad = tokens.clone()
    bad[1, 0] = V
    with pytest.raises(ValueError, match=rf"^tokens: expected ids in \[0, {V}\)"):
        ftis_loss(logits[..., cols], bad, *rows, **OPTIONS, **shard)


def _cuda_worker(rank: int, P: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P)
    try:
        hidden, weight, bias, tokens, rows = _data(P)
        hidden, weight, bias, tokens = (x.cuda() for x in (hidden, weight, bias, tokens))
        rows = tuple(None if x is None else x.cuda() for x in rows)
        cols = _shard(rank, P)
        shard = {"vocab_start": cols.start, "process_group": dist.group.WORLD}
        logits = hidden @ weight.T + bias

        @torch.compile(backend="aot_eager", fullgraph=True)
        def logits_step(x):
            return ftis_loss(x, tokens, *rows, **OPTIONS, **shard)

        @torch.compile(backend="aot_eager", fullgraph=True)
        def linear_step(h, w, b):
            return ftis_linear_loss(h, w, tokens, *rows, bias=b, chunk_size=3, **OPTIONS, **shard)

        x = logits[..., cols].clone().requires_grad_()
        loss, metrics = logits_step(x)
        loss.backward()
        _compare((loss, metrics, {"logits": x.grad}), _run_logits(logits, tokens, rows), cols)
        leaves = [t.clone().requires_grad_() for t in (hidden, weight[cols], bias[cols])]
        loss, metrics = linear_step(*leaves)
        loss.backward()
        grads = dict(zip(("hidden", "weight", "bias"), (t.grad for t in leaves)))
        want = _run_linear(hidden, weight, bias, tokens, rows)
        _compare((loss, metrics, grads), want, cols)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
def test_compiled_sharded_ops_on_cuda_have_no_graph_break_and_equal_the_unsharded_op():
    mp.spawn(_cuda_worker, args=(2, _free_port()), nprocs=2)


@pytest.mark.parametrize("P", [2, 4])
def test_sharded_vocabulary_equals_the_unsharded_op(P):
    mp.spawn(_worker, args=(P, _free_port(), P == 2), nprocs=P)


def test_vocab_start_without_a_group_is_refused():
    logits = torch.randn(1, 2, 5)
    rows = (torch.zeros(1, 2, dtype=torch.long), -torch.rand(1, 2), torch.randn(1))
    with pytest.raises(ValueError, match="^vocab_start: expected 0 without a process_group"):
        ftis_loss(logits, *rows, vocab_start=5)
    with pytest.raises(ValueError, match="^process_group: expected a torch.distributed"):
        ftis_loss(logits, *rows, process_group="tp")
