"""The sample exchange over a real 2-process gloo group on 127.0.0.1, and a dead peer."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import struct
import time
from datetime import timedelta

import torch

V = 73  # any vocabulary size: the exchange only range-checks token ids


def _samples(n: int, source: int, seed: int) -> list:
    from ftis_kernels.grpo.exchange import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = int(torch.randint(1, 9, (1,), generator=g))
        out.append(
            Sample(
                i + 100 * seed,
                source,
                torch.randint(0, V, (L,), generator=g, dtype=torch.int32),
                -torch.rand(L, generator=g) * 5,
                float(i % 2),
                float(torch.randn(1, generator=g)),
            )
        )
    return out


def _same(a, b) -> bool:
    return (
        a.prompt_id == b.prompt_id
        and a.source == b.source
        and torch.equal(a.tokens, b.tokens)
        and torch.equal(a.logprobs, b.logprobs)
        and struct.pack("<ff", a.reward, a.advantage) == struct.pack("<ff", b.reward, b.advantage)
    )


TIMEOUT_S = 60


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, port: int, timeout_s: float) -> None:
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=timeout_s),
    )


def _exchange_worker(rank: int, port: int, out: str) -> None:
    from ftis_kernels.grpo.exchange import exchange

    _init(rank, port, TIMEOUT_S)
    mine = _samples(5 + rank, source=rank, seed=rank)
    if rank == 1:  # two malformed records among honest ones
        bad = _samples(2, source=1, seed=9)
        bad[0].tokens[0] = V + 3
        bad[1].logprobs[-1] = float("nan")
        mine = mine[:2] + [bad[0]] + mine[2:] + [bad[1]]
    # max_samples is a swarm-wide setting: every node derives the same buffer width from it.
    received, drops, sent = exchange(mine, vocab_size=V, max_tokens=8, max_samples=8)
    # And a second round, to show a peer's bad samples did not break the group.
    again, _, _ = exchange(mine[:1], vocab_size=V, max_tokens=8, max_samples=8)
    torch.save(
        {
            "received": [vars(s) for s in received],
            "drops": drops,
            "sent": sent,
            "again": [vars(s) for s in again],
        },
        os.path.join(out, f"rank{rank}.pt"),
    )
    torch.distributed.destroy_process_group()


def _dead_peer_worker(rank: int, port: int, out: str) -> None:
    from ftis_kernels.grpo.exchange import SwarmError, collective, exchange

    _init(rank, port, timeout_s=10)
    if rank == 1:
        os._exit(1)  # dies without a word
    t0 = time.time()
    try:
        collective(
            "the sample exchange",
            exchange,
            _samples(3, source=0, seed=0),
            vocab_size=V,
            max_tokens=8,
            max_samples=3,
        )
        result = "no error"
    except SwarmError as exc:
        result = f"SwarmError {exc}"
    with open(os.path.join(out, "rank0.txt"), "w") as f:
        f.write(f"{time.time() - t0:.1f}s {result}")
    os._exit(0)  # as the node does: no C++ teardown of a group whose peer is gone


def _run(target, tmp_path) -> list[int]:
    ctx = mp.get_context("spawn")
    port = _port()
    procs = [ctx.Process(target=target, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.time() + TIMEOUT_S + 30
    for p in procs:
        p.join(max(1.0, deadline - time.time()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a worker hung"
    return [p.exitcode for p in procs]


def test_exchange_round_trips_samples_exactly_and_drops_malformed_ones(tmp_path):
    from ftis_kernels.grpo.exchange import Sample

    assert _run(_exchange_worker, tmp_path) == [0, 0]
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=False)
    sent0, sent1 = _samples(5, source=0, seed=0), _samples(6, source=1, seed=1)
    got1 = [Sample(**d) for d in r0["received"]]  # what node 0 got from node 1
    got0 = [Sample(**d) for d in r1["received"]]
    assert len(got1) == 6 and all(_same(a, b) for a, b in zip(sent1, got1))
    assert len(got0) == 5 and all(_same(a, b) for a, b in zip(sent0, got0))
    assert len(r0["drops"]) == 2 and r1["drops"] == []
    assert "token id outside" in r0["drops"][0] and "non-finite logprob" in r0["drops"][1]
    assert r0["sent"] == 8 * sum(s.n_tokens for s in sent0) + 24 * 5
    bad = _samples(2, source=1, seed=9)
    assert r1["sent"] == 8 * sum(s.n_tokens for s in sent1 + bad) + 24 * 8
    assert len(r0["again"]) == 1 and len(r1["again"]) == 1


def test_dead_peer_raises_swarm_error_instead_of_hanging(tmp_path):
    codes = _run(_dead_peer_worker, tmp_path)
    assert codes == [0, 1]
    seconds, result = (tmp_path / "rank0.txt").read_text().split(" ", 1)
    assert result.startswith("SwarmError during the sample exchange"), result
    assert float(seconds[:-1]) < 30
