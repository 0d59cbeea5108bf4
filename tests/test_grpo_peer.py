"""The round loop above the transport seam without lockstep: peers in one process over the
in-memory swarm of tests/memory_swarm.py (the semantics of the hivemind transport), their
staleness, a late joiner and a resumed peer; the peer's and the local swarm's usage errors; and
`ftis-grpo report` merging several peers' folders."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ftis_kernels.grpo.config import ConfigError, build_config
from ftis_kernels.grpo.exchange import Sample, exchange
from ftis_kernels.grpo.transport import source_of
from tests.memory_swarm import MemorySwarm, MemoryTransport

TIMEOUT_S = 240  # a whole in-process swarm test; each is a few seconds on 2 cores


@pytest.fixture
def torch_kernels(monkeypatch):
    """The loss on the torch backend, as a CPU run outside the tests has it: the Triton
    interpreter the tests otherwise run is not thread-safe, and these peers are threads."""
    from ftis_kernels.kernels import logp_lse

    monkeypatch.setattr(logp_lse, "triton_is_interpreted", lambda: False)


def _peer_cfg(tmp_path, name: str, hostile: str = "", **over):
    small = dict(
        out=str(tmp_path / name),
        transport="hivemind",
        rounds=3,
        prompts_per_node=1,
        group_size=2,
        max_new_tokens=8,
        eval_size=4,
        eval_every=100,
        eval_max_new_tokens=8,
        ckpt_every=1,
        progress=False,
        sample_log=True,
        collect_timeout_s=20.0,
    )
    small.update(over)
    bad = f", hostile: {hostile}" if hostile else ""
    spec = f"nodes=[{{name: {name}, warmup_steps: 2, init_seed: {len(name)}{bad}}}]"
    return build_config("smoke", overrides=small, sets=(spec,))


def _connect(swarm: MemorySwarm, peer_id: str, seen: dict):
    def connect(out, fingerprints, max_payload_bytes):
        seen[peer_id] = MemoryTransport(swarm, peer_id, fingerprints)
        return seen[peer_id]

    return connect


def _run_peers(cfgs, swarm, seen, *, start_after=None, gate=None) -> dict[str, int]:
    """Run `run_peer` for each (peer id, cfg) in a thread; `start_after`: (peer id, a predicate
    the others must meet first); `gate`: a file the peers wait for after their warm-up (the
    local swarm's start, `START_ENV` set by the caller), made once every peer is ready, so that
    their first rounds start together however long each warm-up took. Returns {peer id: exit
    code}."""
    from ftis_kernels.grpo.peer import run_peer
    from ftis_kernels.grpo.process import READY_FILE

    codes: dict[str, int] = {}
    if gate is not None:
        ready_files = [Path(cfg.out) / READY_FILE for _, cfg in cfgs]

        def open_gate():
            deadline = time.monotonic() + TIMEOUT_S
            while not all(f.exists() for f in ready_files) and time.monotonic() < deadline:
                time.sleep(0.05)
            gate.touch()

        threading.Thread(target=open_gate, daemon=True).start()

    def one(peer_id, cfg):
        codes[peer_id] = run_peer(cfg, _connect(swarm, peer_id, seen))

    threads = {pid: threading.Thread(target=one, args=(pid, cfg)) for pid, cfg in cfgs}
    late, ready = start_after or (None, None)
    for pid, t in threads.items():
        if pid != late:
            t.start()
    if late is not None:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.1)
        threads[late].start()
    for t in threads.values():
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads.values()), "a peer hung"
    return codes


def _rows(folder, name="metrics.jsonl"):
    path = folder / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


SKIP_LOG = re.compile(
    r"peer (\S+): .* its round (\d+) is out of their reach, skipping to round (\d+)"
)


def _skips(caplog) -> dict[str, set[tuple[int, int]]]:
    """{peer id: {(round skipped, round it went to)}}, from the peers' log (`catch_up_round`)."""
    skips: dict[str, set[tuple[int, int]]] = {}
    for record in caplog.records:
        found = SKIP_LOG.search(record.getMessage())
        if found:
            skips.setdefault(found[1], set()).add((int(found[2]), int(found[3])))
    return skips


def test_three_peers_train_on_each_others_samples_with_their_staleness(
    tmp_path, torch_kernels, caplog
):
    caplog.set_level(logging.INFO, logger="ftis_kernels.grpo")
    swarm, seen = MemorySwarm(), {}
    ids = ["QmAlpha", "QmBeta", "QmGamma"]
    cfgs = [(pid, _peer_cfg(tmp_path, pid, rounds=4, collect_timeout_s=60.0)) for pid in ids]
    assert _run_peers(cfgs, swarm, seen) == {pid: 0 for pid in ids}
    heard, skips = set(), _skips(caplog)
    for pid in ids:
        rows = _rows(tmp_path / pid)
        # A peer whose warm-up ends after the others' first round joins at the swarm's round; one
        # that falls a round behind theirs (a slow round on a loaded machine) skips to it, and says
        # so. No other round is missing.
        rounds = [r["round"] for r in rows]
        assert rounds[-1] == 3, rounds
        for before, after in zip(rounds, rounds[1:]):
            assert after == before + 1 or (before + 1, after) in skips.get(pid, ()), (rounds, skips)
        assert sum(r["samples_received"] for r in rows) > 0
        log = _rows(tmp_path / pid, "received.jsonl")
        senders = {r["sender"] for r in log if r["dropped"] is None}
        assert senders and senders <= {source_of(p) for p in ids if p != pid}
        # Each received sample also names its peer by id, beside the exchange's source number.
        assert all(r["sender"] == source_of(r["peer"]) for r in log if r["dropped"] is None)
        heard |= senders
        # Each sample is used once, at most max_staleness (1) rounds after it was generated.
        assert {r["staleness"] for r in log} <= {0, 1}
        # Each row names its peer by its stable id, not by the node index every peer has.
        assert {(r["node"], r["peer"]) for r in rows} == {(0, pid)}
        for row in rows:
            mine = [r for r in log if r["round"] == row["round"] and r["dropped"] is None]
            assert row["samples_received"] == len(mine)
            assert row["samples_stale"] == sum(r["staleness"] > 0 for r in mine)
        for name in ("curves.png", "summary.txt", "peer.json"):
            assert (tmp_path / pid / name).is_file()
        assert json.loads((tmp_path / pid / "peer.json").read_text())["peer_id"] == pid
    assert heard == {source_of(p) for p in ids}
    # The merged summary numbers the peers 0, 1, 2 and names each by the id its own rows carry.
    from ftis_kernels.grpo.report import merge

    _, table = merge([tmp_path / pid for pid in ids], tmp_path / "merged")
    cells = [line.split() for line in table.splitlines()[2:]]
    assert table.splitlines()[0].split()[-1] == "peer"
    assert [(c[0], c[-1]) for c in cells] == [(str(k), pid) for k, pid in enumerate(ids)]


def test_a_malformed_peers_records_are_dropped_over_a_swarm_transport(
    tmp_path, torch_kernels, monkeypatch
):
    from ftis_kernels.grpo.process import START_ENV

    swarm, seen, gate = MemorySwarm(), {}, tmp_path / "start"
    monkeypatch.setenv(START_ENV, str(gate))  # both start their rounds together
    cfgs = [
        ("QmGood", _peer_cfg(tmp_path, "QmGood", rounds=2)),
        ("QmBad", _peer_cfg(tmp_path, "QmBad", hostile="malformed", rounds=2)),
    ]
    assert _run_peers(cfgs, swarm, seen, gate=gate) == {"QmGood": 0, "QmBad": 0}
    log = _rows(tmp_path / "QmGood", "received.jsonl")
    from_bad = [r for r in log if r["sender"] == source_of("QmBad")]
    assert from_bad and all(r["dropped"] is not None for r in from_bad)
    # The drops name the peer by its id, as the swarm's log lines do, not by a 31-bit number alone.
    assert all(r["peer"] == "QmBad" for r in from_bad)
    assert all(f"peer QmBad (node {source_of('QmBad')})" in r["reason"] for r in from_bad)
    rows = _rows(tmp_path / "QmGood")
    assert sum(r["dropped"] for r in rows) == len(from_bad)
    assert sum(r["samples_received"] for r in rows) == 0


def test_a_late_peer_joins_at_the_swarms_round_and_a_resumed_one_continues(tmp_path, torch_kernels):
    swarm, seen = MemorySwarm(), {}
    cfgs = [(pid, _peer_cfg(tmp_path, pid, rounds=4)) for pid in ("QmEarly", "QmLate")]
    cfgs[1] = ("QmLate", _peer_cfg(tmp_path, "QmLate", rounds=4, max_staleness=2))
    early = tmp_path / "QmEarly"
    codes = _run_peers(cfgs, swarm, seen, start_after=("QmLate", lambda: len(_rows(early)) >= 2))
    assert codes == {"QmEarly": 0, "QmLate": 0}
    late = _rows(tmp_path / "QmLate")
    first = late[0]["round"]
    # The early peer had published rounds 0 and 1 when the late one started.
    assert first >= 1, "the late peer started at round 0, not at the swarm's"
    assert [r["round"] for r in late] == list(range(first, 4))
    assert sum(r["samples_received"] for r in late) > 0  # the early peer's recent rounds
    assert late[0]["staleness_mean"] is not None

    # The early peer again, with --resume and more rounds: it continues after its round 4 as
    # the same peer, and the records it published before are not taken again.
    resumed = _peer_cfg(tmp_path, "QmEarly", rounds=5, resume=True)
    assert _run_peers([("QmEarly", resumed)], swarm, seen) == {"QmEarly": 0}
    rows = _rows(early)
    assert [r["round"] for r in rows] == [0, 1, 2, 3, 4]
    # The late peer's round 3, which the early one may have trained on before it stopped, is
    # not taken after the resume, though within max_staleness of round 4.
    assert rows[4]["samples_received"] == 0


def test_a_peer_left_behind_skips_to_the_swarms_round(tmp_path, torch_kernels):
    """A peer whose first round is far behind its peers' (its join read the swarm's round
    before a slow start) skips to their round after it, or they would never take its samples;
    the evaluation and checkpoint due in the rounds it skipped come at the next round it runs."""
    from ftis_kernels.grpo import checkpoint

    swarm = MemorySwarm()

    class Behind(MemoryTransport):
        def latest_round(self):
            # Meanwhile a compatible peer published rounds 0-5 (without samples) and is live.
            ahead = MemoryTransport(self.swarm, "QmAhead", self.fingerprints)
            for r in range(6):
                ahead.publish(r, b"")
            return 0

    def connect(out, fingerprints, max_payload_bytes):
        return Behind(swarm, "QmBehind", fingerprints)

    from ftis_kernels.grpo.peer import run_peer

    cfg = _peer_cfg(
        tmp_path,
        "QmBehind",
        rounds=8,
        eval_every=4,
        eval_start=False,
        ckpt_every=4,
        collect_timeout_s=0.5,
    )
    assert run_peer(cfg, connect) == 0
    rows = _rows(tmp_path / "QmBehind")
    # Round 0 heard the swarm at round 5: on at 6, where the swarm is when its samples come out.
    assert [r["round"] for r in rows] == [0, 6, 7]
    # Round 6 evaluates in place of round 4, skipped; round 7, the last, as always.
    assert [r["acc_id"] is not None for r in rows] == [False, True, True]
    # The last two checkpoints kept: after round 6 (for round 4's, skipped) and at the end.
    assert checkpoint.node_rounds(tmp_path / "QmBehind" / "ckpt", 0) == [8, 7]


def test_a_peer_resumed_far_behind_its_swarm_skips_before_its_first_round(tmp_path, torch_kernels):
    swarm, seen = MemorySwarm(), {}
    opts = dict(collect_timeout_s=0.5, eval_every=4, eval_start=False)
    first = _peer_cfg(tmp_path, "QmBack", rounds=2, **opts)
    assert _run_peers([("QmBack", first)], swarm, seen) == {"QmBack": 0}
    # Meanwhile the swarm went on: a compatible peer published rounds 0-9 (without samples).
    ahead = MemoryTransport(swarm, "QmAhead", seen["QmBack"].fingerprints)
    for r in range(10):
        ahead.publish(r, b"")
    resumed = _peer_cfg(tmp_path, "QmBack", rounds=13, resume=True, **opts)
    assert _run_peers([("QmBack", resumed)], swarm, seen) == {"QmBack": 0}
    # Its checkpoint is of round 2; the swarm is at 9: it goes on at 10, not at 2, evaluating
    # there in place of rounds 4 and 8, skipped; its start is recorded at round 10.
    rows = _rows(tmp_path / "QmBack")
    assert [r["round"] for r in rows] == [0, 1, 10, 11, 12]
    assert [r["acc_id"] is not None for r in rows[2:]] == [True, False, True]
    starts = json.loads((tmp_path / "QmBack" / "environment.json").read_text())
    assert [e["first_round"] for e in starts] == [0, 10]


def _taken_share(lag: float, max_staleness: int, skip: bool, jitter: float = 0.0):
    """A model of two peers at one pace under the hivemind transport's rules, after the peer ahead
    stopped waiting for the other (`waited` False): the one ahead publishes round k at time
    k (+ up to `jitter`) and at once takes the other's rounds in [k - max_staleness, k]
    published by then (each once); the other starts `lag` rounds behind, publishes and hears
    the newest round of the one ahead, then (with `skip`) moves on by `catch_up_round`.
    Returns (the share of its rounds taken, how many rounds it skipped)."""
    import random

    from ftis_kernels.grpo.peer import catch_up_round

    rng = random.Random(0)
    ahead = [k + rng.uniform(0, jitter) for k in range(80)]  # one pace, each round's own delay
    j, n, published, skipped = 0, 0, {}, 0
    while n < 50:
        published[n] = t = lag + j + rng.uniform(0, jitter)
        swarm = max(k for k, at in enumerate(ahead) if at <= t)
        nxt = catch_up_round(swarm, n + 1, max_staleness) if skip else n + 1
        skipped += nxt - (n + 1)
        n, j = nxt, j + 1
    taken = set()
    for k, at in enumerate(ahead):
        taken |= {r for r, p in published.items() if k - max_staleness <= r <= k and p <= at}
    return len(taken) / len(published), skipped


@pytest.mark.parametrize("max_staleness", [1, 2, 3])
def test_a_peer_behind_skips_into_its_peers_reach_and_only_then(max_staleness):
    for lag in (max_staleness + 0.25, max_staleness + 1.5, max_staleness + 4.75):
        for jitter in (0.0, 0.2):
            # Without skipping, a peer further behind than max_staleness is never taken...
            assert _taken_share(lag, max_staleness, skip=False, jitter=jitter)[0] == 0
            # ...with it, its rounds are (all but those before its skip).
            share, skipped = _taken_share(lag, max_staleness, skip=True, jitter=jitter)
            assert share >= 0.9 and skipped >= 1, (lag, jitter, share)
    # Within reach it skips nothing: every round is taken as it is.
    for lag in (0.25, max_staleness - 0.25):
        assert _taken_share(lag, max_staleness, skip=True) == (1.0, 0)
    # The rule at its edges: nobody heard from, a peer at or ahead of the swarm, the threshold.
    from ftis_kernels.grpo.peer import catch_up_round

    assert catch_up_round(None, 7, max_staleness) == 7
    assert catch_up_round(9, 12, max_staleness) == 12
    assert catch_up_round(5 + max_staleness, 7, max_staleness) == 7
    assert catch_up_round(6 + max_staleness, 7, max_staleness) == 7 + max_staleness
    # A peer that some peer waits for is within its reach, however far the rounds say it is.
    assert catch_up_round(60, 7, max_staleness, waited=True) == 7


def test_exchange_over_a_swarm_transport_records_staleness_and_refuses_incompatible_peers():
    swarm = MemorySwarm()
    prints = {"configuration": "c", "vocabulary": "v"}
    a, b = (MemoryTransport(swarm, pid, prints) for pid in ("QmA", "QmB"))
    other = MemoryTransport(swarm, "QmOther", {**prints, "vocabulary": "w"})

    def samples(peer, n):
        return [
            Sample(
                k, source_of(peer), torch.tensor([1, 2], dtype=torch.int32), -torch.ones(2), 1, 0
            )
            for k in range(n)
        ]

    bounds = dict(vocab_size=5, max_tokens=4, max_samples=4, max_staleness=1, timeout_s=5.0)
    a.publish(0, b"")  # a's round 0: nothing; then a and the other peer publish round 1
    exchange(samples("QmA", 2), transport=a, round_=1, **{**bounds, "timeout_s": 0.0})
    other.publish(1, b"x" * 10)
    b.publish(0, b"")
    received, drops, _ = exchange(samples("QmB", 1), transport=b, round_=1, **bounds)
    assert [(s.source, s.staleness) for s in received] == [(source_of("QmA"), 0)] * 2
    assert [(d.kind, d.sender) for d in drops] == [("incompatible", source_of("QmOther"))]
    # Round 2, two rounds of staleness allowed: only what b has not used yet (a's round 0 is
    # empty, its round 1 was taken).
    a.publish(2, b"")
    quick = {**bounds, "timeout_s": 0.0}
    received, drops, _ = exchange([], transport=b, round_=2, **{**quick, "max_staleness": 2})
    assert received == [] and drops == []
    # A peer ahead: its samples wait until b's round is within max_staleness of theirs, and
    # arrive as stale as the rounds between.
    exchange(samples("QmA", 3), transport=a, round_=4, **quick)
    assert exchange([], transport=b, round_=3, **quick)[0] == []
    received, _, _ = exchange([], transport=b, round_=5, **quick)
    assert [s.staleness for s in received] == [1, 1, 1]


def test_horizontal_collaboration_is_refused_under_hivemind_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^collab: expected vertical under transport hivemind"):
        _peer_cfg(tmp_path, "QmH", collab="horizontal").validate(1)
    _peer_cfg(tmp_path, "QmH", collab="horizontal", loss="on-policy").validate(1)  # no exchange


def test_a_payload_hiveminds_messages_cannot_carry_is_refused_naming_the_key(tmp_path):
    from ftis_kernels.grpo.peer import check_peer_config

    big = dict(prompts_per_node=64, group_size=64, max_new_tokens=64)  # 4096 x 536 B
    check_peer_config(_peer_cfg(tmp_path, "QmP", **{**big, "group_size": 8}))
    with pytest.raises(ConfigError, match=r"^max_new_tokens: .* 2 MiB\), got 2195456$"):
        check_peer_config(_peer_cfg(tmp_path, "QmP", **big))


def _cli(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "ftis_kernels.grpo", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_peer_and_local_swarm_usage_errors_are_one_line_naming_the_key(tmp_path):
    two = tmp_path / "two.yaml"
    two.write_text("nodes: [{name: a}, {name: b}]\n")
    got = _cli("peer", "--config", str(two), "--out", str(tmp_path / "p"))
    assert got.returncode == 2
    assert got.stderr.strip().splitlines() == [
        "ftis-grpo peer: nodes: expected one node spec: this peer's, got '2 specs'"
    ]
    one = tmp_path / "one.yaml"
    one.write_text("nodes: [{name: a}]\n")
    got = _cli("peer", "--config", str(one), "--out", str(tmp_path / "p"), "--swarm-key", "")
    assert got.returncode == 2
    assert got.stderr.strip().splitlines() == ["ftis-grpo peer: --swarm-key: must not be empty"]
    got = _cli("peer", "--config", str(two), "--rounds", "0")
    assert got.returncode == 2 and got.stderr.startswith("ftis-grpo peer: --rounds: expected")
    got = _cli("--preset", "smoke", "--transport", "hivemind", "--collab", "horizontal")
    assert got.returncode == 2
    assert got.stderr.startswith("ftis-grpo: --collab: expected vertical under transport hivemind")
    assert not (tmp_path / "p").exists()


def test_report_merges_several_peers_folders_into_one_summary_and_plot(tmp_path):
    from ftis_kernels.grpo.report import METRIC_KEYS, metric_rows

    for k, name in enumerate(("alpha", "beta")):
        folder = tmp_path / "swarm" / f"node_{k}"
        folder.mkdir(parents=True)
        rows = [
            metric_rows(
                r, [[0.1 * (r + k)] * len(METRIC_KEYS)], [name], "f-tis", "vertical", [f"Qm{name}"]
            )[0]
            for r in range(k, 3)  # beta joined at round 1
        ]
        assert {(r["node"], r["peer"]) for r in rows} == {(0, f"Qm{name}")}
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    peers = [str(tmp_path / "swarm" / f"node_{k}") for k in range(2)]
    got = _cli("report", *peers)
    assert got.returncode == 0, got.stderr
    summary = (tmp_path / "swarm" / "summary.txt").read_text()
    lines = summary.splitlines()
    assert lines[2].split()[:3] == ["0", "alpha", "3"] and lines[3].split()[:3] == [
        "1",
        "beta",
        "2",
    ]
    # Renumbered in the merged view, each node keeps the peer id of its own rows.
    assert lines[0].split()[-1] == "peer"
    assert [lines[2].split()[-1], lines[3].split()[-1]] == ["Qmalpha", "Qmbeta"]
    assert (tmp_path / "swarm" / "curves.png").stat().st_size > 0
    got = _cli("report", peers[0], str(tmp_path / "nowhere"))
    assert got.returncode == 2 and got.stderr.startswith("ftis-grpo report: RUN: expected")


def test_the_address_others_are_told_to_join_by_is_not_loopback_when_there_is_another():
    from ftis_kernels.grpo.peer import join_address

    lo, lan = "/ip4/127.0.0.1/tcp/31337/p2p/QmA", "/ip4/10.0.0.1/tcp/31337/p2p/QmA"
    assert join_address([lo, lan]) == lan
    assert join_address([lo]) == lo


def test_a_peers_own_error_exits_with_code_6_and_its_traceback(tmp_path, torch_kernels, caplog):
    """An error of the peer's own (not the swarm's, not a refusal): logged with its traceback,
    exit code 6, as a torch node's, and the peer's folder unlocked."""
    from ftis_kernels.grpo.peer import run_peer
    from ftis_kernels.grpo.process import EXIT_ERROR

    class Broken(MemoryTransport):
        def publish(self, round_, payload):
            raise RuntimeError("the device fell over")

    def connect(out, fingerprints, max_payload_bytes):
        return Broken(MemorySwarm(), "QmBroken", fingerprints)

    caplog.set_level(logging.INFO, logger="ftis_kernels.grpo")
    cfg = _peer_cfg(tmp_path, "QmBroken", rounds=1)
    assert run_peer(cfg, connect) == EXIT_ERROR
    (record,) = [r for r in caplog.records if "the device fell over" in r.getMessage()]
    assert "peer QmBroken: RuntimeError: the device fell over; stopping" == record.getMessage()
    assert record.exc_info is not None
    from ftis_kernels.grpo.run_folder import OutLock

    with OutLock(Path(cfg.out)):  # free again
        pass
