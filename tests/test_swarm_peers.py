"""`ftis-grpo peer` processes over hivemind on loopback: a local swarm of three completes its
rounds, each peer training on the others' samples, and continues them with --resume; a peer
killed with SIGKILL mid-run costs the others at most `collect_timeout_s`; a peer started late
joins at the swarm's round; a killed peer restarted with --resume continues as the same peer;
bad multiaddrs are one line, exit code 2.
Small (tiny models, a few rounds) and bounded by timeouts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("hivemind")
pytest.importorskip("ftis_kernels.grpo.swarm")

ROOT = Path(__file__).resolve().parents[1]
COLLECT_S = 8.0  # collect_timeout_s of these runs
RUN_S = 420  # the most a whole scenario may take on 2 busy cores
SMALL = [
    "--set",
    "prompts_per_node=1",
    "--set",
    "group_size=2",
    "--set",
    "max_new_tokens=8",
    "--set",
    "eval_size=4",
    "--set",
    "eval_every=100",
    "--set",
    "eval_max_new_tokens=8",
    "--set",
    "ckpt_every=1",
    "--set",
    "sample_log=true",
    "--set",
    f"collect_timeout_s={COLLECT_S}",
    "--set",
    "threads=1",
]


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # a user's CPU run: the torch backend of the loss
    return env


def _grpo(*args, timeout=RUN_S):
    return subprocess.run(
        [sys.executable, "-m", "ftis_kernels.grpo", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
        cwd=ROOT,
    )


def _rows(folder: Path):
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    from ftis_kernels.grpo.report import read_metrics

    return read_metrics(path, warn=False)  # a killed peer may leave a torn last line


def test_a_local_swarm_of_three_peers_trains_on_each_others_samples(tmp_path):
    out = tmp_path / "swarm"
    got = _grpo(
        "--preset", "smoke", "--transport", "hivemind", "--nodes", "3", "--rounds", "3",
        "--out", str(out), "--no-progress", "--set", "nodes.0.warmup_steps=2",
        "--set", "nodes.1.warmup_steps=2", "--set", "nodes.2.warmup_steps=2", *SMALL,
    )  # fmt: skip
    assert got.returncode == 0, got.stderr[-3000:]
    ids = [json.loads((out / f"node_{k}" / "peer.json").read_text())["peer_id"] for k in range(3)]
    assert len(set(ids)) == 3
    for k in range(3):
        rows = _rows(out / f"node_{k}")
        assert rows and rows[-1]["round"] == 2
        assert sum(r["samples_received"] for r in rows) > 0, f"peer {k} received nothing"
        assert all(r["dropped"] == 0 for r in rows)
    assert (out / "summary.txt").is_file() and (out / "curves.png").is_file()
    assert "merged:" in got.stdout
    # The folder holds a run now: a fresh start is refused before any peer starts, and --resume
    # continues every peer, together (none finishes alone before the others can join it).
    args = ["--preset", "smoke", "--transport", "hivemind", "--nodes", "3", "--out", str(out)]
    args += ["--no-progress", *SMALL]
    args += [x for k in range(3) for x in ("--set", f"nodes.{k}.warmup_steps=2")]
    refused = _grpo(*args, "--rounds", "4")
    assert refused.returncode == 2 and "which holds a run: curves.png, summary.txt" in (
        refused.stderr
    ), refused.stderr[-3000:]
    resumed = _grpo(*args, "--rounds", "4", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for k in range(3):
        assert _rows(out / f"node_{k}")[-1]["round"] == 3


def _peer_config(tmp_path: Path, k: int, rounds: int, warmup_steps: int = 2) -> Path:
    """node.yaml of peer k: the smoke preset's node k % 2, small."""
    from ftis_kernels.grpo.config import build_config, to_dict

    cfg = build_config("smoke", overrides=dict(rounds=rounds, progress=False))
    d = to_dict(cfg)
    spec = dict(d["nodes"][k % 2], name=f"peer{k}", warmup_steps=warmup_steps, init_seed=k)
    d.update(nodes=[spec], transport="hivemind")
    for item in SMALL[1::2]:
        key, value = item.split("=", 1)
        d[key] = yaml.safe_load(value)
    path = tmp_path / f"peer{k}.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def _start(tmp_path, k, rounds, join=(), resume=False, warmup_steps=2, gate=None):
    """Peer k as its own process; `gate`: the start file its first round waits for."""
    from ftis_kernels.grpo.process import START_ENV

    cmd = [sys.executable, "-m", "ftis_kernels.grpo", "peer", "--out", str(tmp_path / f"p{k}")]
    cmd += ["--config", str(_peer_config(tmp_path, k, rounds, warmup_steps))]
    cmd += ["--host-maddr", "/ip4/127.0.0.1/tcp/0"] + (["--resume"] if resume else [])
    cmd += ["--initial-peers", *join] if join else []
    env = _env() if gate is None else dict(_env(), **{START_ENV: str(gate)})
    log = open(tmp_path / f"p{k}.log", "a")
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=log)


def _wait(predicate, what: str, procs, timeout=RUN_S):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


def _finish(procs):
    for p in procs:
        try:
            p.wait(RUN_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a peer hung")


def test_sigkill_a_late_joiner_and_a_resumed_peer(tmp_path):
    """Peers 0 and 1 start their 8 rounds together; peer 2, started with them, starts its rounds
    once peer 0 has done 2: it joins at the swarm's round. Peer 1 is killed with SIGKILL after
    its third round: the others lose at most collect_timeout_s once and go on. Restarted with
    --resume (alone, the others done), it continues from its checkpoint as the same peer."""
    from ftis_kernels.grpo.process import READY_FILE

    rounds, gate, late_gate = 8, tmp_path / "start", tmp_path / "start-late"
    p0 = _start(tmp_path, 0, rounds, gate=gate)
    procs = [p0]
    _wait(lambda: (tmp_path / "p0" / "peer.json").exists(), "peer 0's multiaddr", procs)
    join = json.loads((tmp_path / "p0" / "peer.json").read_text())["maddrs"]
    procs.append(_start(tmp_path, 1, rounds, join, gate=gate))
    procs.append(_start(tmp_path, 2, rounds, join, gate=late_gate))
    ready = [tmp_path / f"p{k}" / READY_FILE for k in (0, 1)]
    _wait(lambda: all(f.exists() for f in ready), "peers 0 and 1 warmed up", procs)
    gate.touch()
    _wait(lambda: len(_rows(tmp_path / "p0")) >= 2, "peer 0's second round", procs)
    late_gate.touch()
    _wait(lambda: len(_rows(tmp_path / "p1")) >= 3, "peer 1's third round", procs)
    first_id = json.loads((tmp_path / "p1" / "peer.json").read_text())["peer_id"]
    os.kill(procs[1].pid, signal.SIGKILL)
    _finish(procs)
    killed_after = _rows(tmp_path / "p1")[-1]["round"]
    logs = {k: (tmp_path / f"p{k}.log").read_text()[-3000:] for k in range(3)}
    assert [p.returncode for p in procs] == [0, -signal.SIGKILL, 0], logs

    r0, r2 = _rows(tmp_path / "p0"), _rows(tmp_path / "p2")
    assert [r["round"] for r in r0] == list(range(rounds))
    # The late joiner started at the swarm's round, not at 0, and trained on its peers' samples
    # (skipping rounds wherever it fell more than max_staleness behind them).
    got = [r["round"] for r in r2]
    assert got[0] >= 1 and got == sorted(set(got)) and got[-1] == rounds - 1, got
    assert sum(r["samples_received"] for r in r2) > 0
    # No round of peer 0 waited for the dead peer more than collect_timeout_s (plus the work).
    work = sorted(r["seconds"] for r in r0)[len(r0) // 2]
    assert max(r["seconds"] for r in r0) < work + COLLECT_S + 15, [r["seconds"] for r in r0]
    print("peer 0's round seconds:", [round(r["seconds"], 2) for r in r0])
    print("peer 2's round seconds:", [round(r["seconds"], 2) for r in r2])

    # The killed peer, restarted with --resume, is the same peer and continues after its last
    # checkpoint (every round is one).
    resumed = _start(tmp_path, 1, rounds, resume=True)
    _finish([resumed])
    log = (tmp_path / "p1.log").read_text()
    assert resumed.returncode == 0, log[-3000:]
    assert json.loads((tmp_path / "p1" / "peer.json").read_text())["peer_id"] == first_id
    r1 = _rows(tmp_path / "p1")
    assert [r["round"] for r in r1] == list(range(rounds))  # its rows before the kill kept
    assert "resumed after round" in log and killed_after < rounds - 1


def test_a_malformed_or_unreachable_initial_peer_is_one_line_and_exit_code_2(tmp_path):
    cfg = _peer_config(tmp_path, 0, 2)
    got = _grpo("peer", "--config", str(cfg), "--out", str(tmp_path / "a"),
                "--initial-peers", "not-a-multiaddr", timeout=120)  # fmt: skip
    assert got.returncode == 2, got.stderr[-2000:]
    assert got.stderr.strip().splitlines()[-1].startswith("ftis-grpo peer: --initial-peers: ")
    nobody = "/ip4/127.0.0.1/tcp/9/p2p/QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"
    got = _grpo("peer", "--config", str(cfg), "--out", str(tmp_path / "b"), "--set",
                "timeout_s=10", "--initial-peers", nobody, timeout=120)  # fmt: skip
    assert got.returncode == 2, got.stderr[-2000:]
    assert got.stderr.strip().splitlines()[-1].startswith("ftis-grpo peer: --initial-peers: ")
