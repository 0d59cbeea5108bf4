"""End to end through the real launcher: `python -m ftis_kernels.grpo` starts torchrun itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = (
    "round",
    "node",
    "mode",
    "reward_mean",
    "acc_id",
    "acc_ood",
    "kl_mean",
    "filtered_frac",
    "clip_frac",
    "is_weight_mean",
    "tokens_sent",
    "bytes_sent",
    "seconds",
)
SMOKE = dict(rounds=4, nodes=2, prompts=2, group=4)  # the smoke preset's shape


def ftis_grpo(*args: str, timeout: float = 240, path: str = "") -> tuple[int, str, float]:
    """Run the CLI as a user would; returns (exit code, combined output, wall seconds). `path`:
    a folder put on every process's PYTHONPATH after the repository's."""
    env = dict(os.environ, FTIS_LOG_LEVEL="INFO")
    # conftest turns the Triton interpreter on for this process; the driver on CPU should take
    # ftis_loss's PyTorch path, as a user's run does.
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), path, env.get("PYTHONPATH")) if p)
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "ftis_kernels.grpo", "--no-progress", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout + proc.stderr, time.time() - t0


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def comparable(rows: list[dict]) -> list[dict]:
    return sorted(
        ({k: v for k, v in r.items() if k != "seconds"} for r in rows),
        key=lambda r: (r["round"], r["node"]),
    )


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    rc, log, seconds = ftis_grpo("--preset", "smoke", "--out", str(out))
    assert rc == 0, log[-4000:]
    return out, log, seconds


def test_smoke_preset_runs_two_gloo_nodes_through_torchrun(smoke):
    out, log, _ = smoke  # its time is docs/driver.md's figure, measured idle, not a test
    rows = rows_of(out)
    assert len(rows) == SMOKE["rounds"] * SMOKE["nodes"]
    assert {(r["round"], r["node"]) for r in rows} == {(i, n) for i in range(4) for n in range(2)}
    per_node = SMOKE["prompts"] * SMOKE["group"]
    for r in rows:
        assert all(k in r for k in REQUIRED), sorted(r)
        assert r["mode"] == "f-tis" and 0.0 <= r["reward_mean"] <= 1.0
        # The exchange sent every sample of the round: 8 bytes per token + a 24-byte header each.
        assert r["bytes_sent"] == 8 * r["tokens_sent"] + 24 * per_node
        assert r["samples_received"] == per_node and r["dropped"] == 0
        assert r["samples_trained"] == 2 * per_node
        assert r["is_weight_mean"] > 0 and r["kl_mean"] >= 0
    assert rows[0]["acc_id"] is not None and rows[-1]["acc_ood"] is not None
    assert (out / "curves.png").stat().st_size > 10_000
    assert json.loads((out / "ckpt" / "latest.json").read_text()) == {"round": 4}
    for node in range(2):
        ckpt = out / "ckpt" / f"node{node}" / "round_00004"
        assert {p.name for p in ckpt.iterdir()} == {
            "model.safetensors",
            "optimizer.pt",
            "rng.pt",
            "state.json",
            "manifest.json",
        }
    assert (out / "tokenizer" / "tokenizer.json").exists()
    assert "reward" in (out / "summary.txt").read_text() and "tiny-lora" in log
    assert "vocabulary of" in log and "LoRA" in log


def test_a_run_prints_no_torchrun_banner_and_no_library_warnings(smoke):
    _, log, _ = smoke
    assert "Setting OMP_NUM_THREADS" not in log and "****" not in log
    assert "Warning" not in log and "warnings.warn" not in log, log[-4000:]


def test_resume_gives_the_same_metrics_as_an_uninterrupted_run(smoke, tmp_path):
    full, _, _ = smoke
    rc, log, _ = ftis_grpo("--preset", "smoke", "--out", str(tmp_path), "--rounds", "2")
    assert rc == 0, log[-4000:]
    assert len(rows_of(tmp_path)) == 4
    rc, log, _ = ftis_grpo("--preset", "smoke", "--out", str(tmp_path), "--rounds", "4", "--resume")
    assert rc == 0, log[-4000:]
    assert "resumed after round 2" in log and "warm-up of" not in log
    assert comparable(rows_of(tmp_path)) == comparable(rows_of(full))


def test_dead_node_stops_the_swarm_with_a_clear_error_and_resume_continues(smoke, tmp_path):
    rc, log, seconds = ftis_grpo(
        "--preset",
        "smoke",
        "--out",
        str(tmp_path),
        "--timeout",
        "20",
        "--set",
        "nodes.1.fail_at_round=3",
        timeout=180,
    )
    assert rc == 17, log[-3000:]  # the failing node's own exit code, the cause of the stop
    (line,) = [x for x in log.splitlines() if "the swarm stopped" in x]
    assert "exit code 17: node 1: fault injection (fail_at_round=3)" in line and "--resume" in line
    assert "Traceback" not in log
    assert json.loads((tmp_path / "ckpt" / "latest.json").read_text()) == {"round": 2}
    rc, log, _ = ftis_grpo("--preset", "smoke", "--out", str(tmp_path), "--resume")
    assert rc == 0, log[-4000:]
    assert comparable(rows_of(tmp_path)) == comparable(rows_of(smoke[0]))


def test_a_resumed_run_counts_the_skipped_steps_before_its_checkpoint(tmp_path):
    # Node 1 sends a sample whose untruncated IS weight overflows: node 0 skips every step. With
    # max_skipped_steps=2 a 2-round run stops after round 1; stopped and resumed there, too.
    run = ["--preset", "smoke", "--out", str(tmp_path), "--loss", "vis"]
    for key in (
        "nodes.1.hostile=improbable_logprobs",
        "blame_peers=false",
        "max_skipped_steps=2",
        "nodes.0.warmup_steps=0",
        "nodes.1.warmup_steps=0",
        "eval_size=2",
    ):
        run += ["--set", key]
    rc, log, _ = ftis_grpo(*run, "--rounds", "1")
    assert rc == 0, log[-4000:]
    assert [r["skipped"] for r in rows_of(tmp_path) if r["node"] == 0] == [1]
    rc, log, _ = ftis_grpo(*run, "--rounds", "2", "--resume")
    assert rc == 4, log[-4000:]
    assert "node 0 (tiny-full) skipped its optimizer step 2 rounds in a row" in log


CRASH_AT_ROUND_1 = """
import os, signal
if os.environ.get("RANK") == "1":
    from ftis_kernels.grpo.node import Node
    run_round = Node.run_round
    def crash(self, round_):
        if round_ == 1:
            {crash}
        return run_round(self, round_)
    Node.run_round = crash
"""
CRASHES = {  # how node 1 fails at round 1: (the code injected, exit code, the launcher's reason)
    "error": ('raise RuntimeError("out of memory (injected)")', 6, "RuntimeError: out of memory"),
    "sigkill": ("os.kill(os.getpid(), signal.SIGKILL)", 137, "killed by SIGKILL"),
}


@pytest.mark.parametrize("crash", CRASHES)
def test_a_node_that_fails_is_named_as_the_cause_not_its_peers_lost_contact(tmp_path, crash):
    # A node's own error (out of memory, say) or a kill by the out-of-memory killer, injected
    # into node 1's process; node 0 then loses contact or gets torchrun's SIGTERM.
    code, rc_want, reason = CRASHES[crash]
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(CRASH_AT_ROUND_1.format(crash=code))
    run = ["--preset", "smoke", "--out", str(tmp_path / "run"), "--timeout", "20"]
    for key in ("nodes.0.warmup_steps=0", "nodes.1.warmup_steps=0", "eval_size=2"):
        run += ["--set", key]
    rc, log, _ = ftis_grpo(*run, path=str(tmp_path / "inject"), timeout=180)
    assert rc == rc_want, log[-3000:]
    (line,) = [x for x in log.splitlines() if "the swarm stopped" in x]
    assert f"exit code {rc_want}: node 1: {reason}" in line, line
    assert "Continue from the checkpoint of round 0" in line and "--resume" in line
    if crash == "error":  # its traceback, logged by the node
        assert "node1 ERROR" in log and 'raise RuntimeError("out of memory' in log


def _smoke_with_node1_model(tmp_path, model, tok) -> tuple[int, str]:
    """The smoke preset with node 1's model folder holding `model` and `tok`: (exit code, log)."""
    model.save_pretrained(tmp_path / "node1_model")
    tok.save_pretrained(tmp_path / "node1_model")
    rc, log, _ = ftis_grpo(
        *("--preset", "smoke", "--out", str(tmp_path / "run")),
        *("--set", f"nodes.1.model={tmp_path / 'node1_model'}"),
        timeout=120,
    )
    return rc, log


def test_nodes_with_different_vocabularies_refuse_to_start(tmp_path):
    from ftis_kernels.grpo.models import build_model
    from ftis_kernels.grpo.tokenizer import build_tokenizer

    tok = build_tokenizer(["alien", "words"])
    rc, log = _smoke_with_node1_model(tmp_path, build_model("tiny", tok, seed=0), tok)
    assert rc == 1, log[-3000:]
    said = [x for x in log.splitlines() if "vocabulary mismatch" in x]
    assert len(said) == 2 and all(x.count("vocabulary mismatch") == 1 for x in said), said
    assert "node0 ERROR" in said[0] and "the swarm stopped with exit code 1: vocabulary" in said[1]
    assert "Continue from" not in log and "Traceback" not in log


def test_a_model_with_fewer_embeddings_than_tokenizer_tokens_is_a_refusal(tmp_path):
    from ftis_kernels.grpo.models import build_model
    from ftis_kernels.grpo.tokenizer import build_tokenizer

    tok = build_tokenizer(["alien", "words"])
    model = build_model("tiny", tok, seed=0)
    tok.add_tokens(["<added>"])  # the embedding not resized
    rc, log = _smoke_with_node1_model(tmp_path, model, tok)
    assert rc == 1, log[-3000:]
    (line,) = [x for x in log.splitlines() if "the swarm stopped" in x]
    n = len(tok)
    assert (
        f"exit code 1: node 1: tokenizer has {n} tokens but the model's embedding only {n - 1}"
        in (line)
    )
    assert "Continue from" not in log and "Traceback" not in log
    # Node 1 says it too (under torchrun by hand, no launcher line would).
    assert sum("tokenizer has" in x for x in log.splitlines()) == 2, log[-3000:]
