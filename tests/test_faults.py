"""The driver's promises under faults (issue 13), one test per promise, grouped by what fails."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ftis_kernels.grpo.exchange import IMPROBABLE_LOGPROB, Sample, make_hostile, pack, unpack
from ftis_kernels.grpo.models import build_model
from ftis_kernels.grpo.task import ArithmeticTask, format_prompt, make_prompt_id
from ftis_kernels.grpo.tokenizer import build_tokenizer
from ftis_kernels.grpo.train import grpo_update, skip_cause
from ftis_kernels.options import FTISOptions
from tests.test_grpo_run import comparable, ftis_grpo, rows_of

TASK = ArithmeticTask(seed=0)
TOKENIZER = build_tokenizer(TASK.vocabulary_text())


def _prompt(pid: int) -> list[int]:
    return TOKENIZER(format_prompt(TASK.problem(pid).question))["input_ids"]


# -- poisoned updates: a non-finite loss or gradient never reaches the weights (issue 13.5) -------
def _batch(poisoned: bool) -> list[Sample]:
    """Three peer samples with positive advantages; `poisoned`: the first claims log pi_gen =
    -100 at one token (the issue's sample: the parser accepts it, VIS's weight overflows)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(3):
        tokens = torch.randint(3, len(TOKENIZER), (5,), generator=g, dtype=torch.int32)
        out.append(Sample(make_prompt_id("train", i), 1, tokens, -torch.rand(5, generator=g) * 3,
                          1.0, 1.0 + i))
    if poisoned:
        out[0].logprobs[2] = -100.0
    return out


def _update(model, optimizer, samples, loss: str) -> dict[str, float]:
    return grpo_update(model, optimizer, samples, _prompt, FTISOptions.for_variant(loss),
                       micro_batch=2, pad_id=TOKENIZER.pad_token_id, grad_clip=1.0,
                       device=torch.device("cpu"))


@pytest.mark.parametrize("loss", ["vis", "f-vis"])
def test_poisoned_peer_sample_skips_the_step_and_changes_no_parameter_or_optimizer_state(loss):
    model = build_model("tiny", TOKENIZER, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert _update(model, optimizer, _batch(poisoned=False), loss)["skipped"] == 0.0
    params = {k: v.clone() for k, v in model.state_dict().items()}
    state = {i: {k: v.clone() for k, v in s.items()} for i, s in
             enumerate(optimizer.state_dict()["state"].values())}
    stats = _update(model, optimizer, _batch(poisoned=True), loss)
    assert stats["skipped"] == 1.0
    assert skip_cause(stats) == "non-finite loss (-inf)"
    assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())
    after = list(optimizer.state_dict()["state"].values())
    assert all(torch.equal(state[i][k], v) for i, s in enumerate(after) for k, v in s.items())
    assert all(p.grad is None for p in model.parameters())
    assert _update(model, optimizer, _batch(poisoned=False), loss)["skipped"] == 0.0
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_non_finite_gradient_with_a_finite_loss_skips_the_step():
    model = build_model("tiny", TOKENIZER, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    next(model.parameters()).register_hook(lambda grad: grad * math.nan)
    stats = _update(model, optimizer, _batch(poisoned=False), "f-tis")
    assert math.isfinite(stats["loss"]) and stats["skipped"] == 1.0
    assert skip_cause(stats) == "non-finite gradient norm (nan)"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())



def test_max_skipped_steps_defaults_to_three_and_must_be_positive():
    from ftis_kernels.grpo.config import RESUMABLE, build_config

    assert build_config("smoke").max_skipped_steps == 3 and "max_skipped_steps" in RESUMABLE
    with pytest.raises(ValueError, match="max_skipped_steps: expected >= 1, got 0"):
        build_config("smoke", sets=("max_skipped_steps=0",)).validate(2)

def test_improbable_logprobs_peer_sends_the_issues_sample_and_the_parser_accepts_it():
    honest = _batch(poisoned=False)
    sent = make_hostile(honest, "improbable_logprobs", len(TOKENIZER), torch.Generator())
    assert sent[0].logprobs[0] == IMPROBABLE_LOGPROB == -100.0 and sent[0].advantage > 0
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(sent[1:], honest[1:]))
    got, drops = unpack(pack(sent), sender=1, vocab_size=len(TOKENIZER), max_tokens=64)
    assert len(got) == 3 and drops == []


def test_swarm_counts_skipped_steps_and_stops_after_max_skipped_steps_in_a_row(tmp_path):
    """Under --loss vis every round brings node 0 the -100 sample: each step is skipped, logged
    and counted, the swarm stops after the third, and node 0's weights never changed."""
    from safetensors.torch import load_file

    rc, log, _ = ftis_grpo("--preset", "smoke", "--out", str(tmp_path), "--loss", "vis",
                           "--set", "nodes.1.hostile=improbable_logprobs")
    assert rc != 0
    for round_ in range(3):
        assert (f"node 0 (tiny-full) round {round_}: optimizer step skipped, non-finite loss"
                in log)
    assert "node 0 (tiny-full) skipped its optimizer step 3 rounds in a row" in log
    assert "max_skipped_steps=3" in log
    rows = rows_of(tmp_path)
    assert [(r["round"], r["node"], r["skipped"]) for r in rows] == [
        (r, n, int(n == 0)) for r in range(3) for n in range(2)]
    assert "skipped" in (tmp_path / "summary.txt").read_text()
    ckpt = tmp_path / "ckpt" / "node0"
    start, after = (load_file(ckpt / f"round_0000{r}" / "model.safetensors") for r in (0, 2))
    assert all(torch.equal(start[k], after[k]) and bool(torch.isfinite(after[k]).all())
               for k in start)

# -- checkpoints that prove themselves, metrics that survive a torn write (issue 13.9) -----------
def _spoil(path) -> None:
    """Write finite garbage (float32 123.0s) over the first tensor bytes of a safetensors file."""
    header = int.from_bytes(path.read_bytes()[:8], "little")
    with open(path, "r+b") as f:
        f.seek(8 + header)
        f.write(torch.full((16,), 123.0).numpy().tobytes())


def test_checkpoint_manifest_catches_finite_garbage_in_a_weights_file(tmp_path):
    from ftis_kernels.grpo import checkpoint

    model = build_model("tiny", TOKENIZER, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = torch.Generator().manual_seed(0)
    for round_ in (2, 4):
        checkpoint.save_node(tmp_path, 0, round_, model, optimizer, sampler, {"config": "x"})
    assert checkpoint.node_rounds(tmp_path, 0) == [4, 2]
    assert [checkpoint.verify_node(tmp_path, 0, r) for r in (4, 2)] == [None, None]
    _spoil(checkpoint.node_dir(tmp_path, 0, 4) / "model.safetensors")
    problem = checkpoint.verify_node(tmp_path, 0, 4)
    assert "model.safetensors does not match its sha256" in problem
    assert checkpoint.verify_node(tmp_path, 0, 2) is None
    (checkpoint.node_dir(tmp_path, 0, 2) / "rng.pt").unlink()
    assert "rng.pt is missing" in checkpoint.verify_node(tmp_path, 0, 2)
    (checkpoint.node_dir(tmp_path, 0, 2) / checkpoint.MANIFEST).write_text("{")
    assert "unreadable" in checkpoint.verify_node(tmp_path, 0, 2)


def test_resume_round_is_the_newest_that_every_node_has_good():
    from ftis_kernels.grpo.checkpoint import newest_common

    assert newest_common([[4, 2], [4, 2]]) == 4
    assert newest_common([[4, 2], [2]]) == 2
    assert newest_common([[4], [2]]) is None
    assert newest_common([[4, 2], []]) is None


def _metrics_file(tmp_path, tail: str = "", middle: str = ""):
    rows = [json.dumps({"round": r, "node": n, "reward_mean": 0.5}) for r in range(3)
            for n in range(2)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(rows[:3] + ([middle] if middle else []) + rows[3:]) + "\n" + tail)
    return path


@pytest.mark.parametrize("tail", ['{"round": 3, "node": 0, "rew', "\x00\x00\x00\x00",
                                  '["not", "a", "row"]\n'])
def test_torn_or_garbage_last_metrics_line_is_dropped_with_a_warning(tmp_path, caplog, tail):
    from ftis_kernels.grpo.report import read_metrics

    rows = read_metrics(_metrics_file(tmp_path, tail=tail))
    assert [(r["round"], r["node"]) for r in rows] == [(r, n) for r in range(3) for n in range(2)]
    assert "line 7 (the last): dropped a torn or garbage row" in caplog.text


@pytest.mark.parametrize("middle", ['{"round": 1, "node": 1, "rew', "garbage", '{"node": 1}'])
def test_bad_metrics_line_before_the_last_is_an_error_naming_the_line(tmp_path, middle):
    from ftis_kernels.grpo.report import read_metrics

    with pytest.raises(ValueError, match=r"metrics.jsonl, line 4: .*fix or delete that line"):
        read_metrics(_metrics_file(tmp_path, middle=middle))



@pytest.fixture(scope="module")
def four_rounds(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "run"
    rc, log, _ = ftis_grpo("--preset", "smoke", "--out", str(out))
    assert rc == 0, log[-4000:]
    return out, rows_of(out)


def test_resume_falls_back_past_a_damaged_checkpoint_and_a_torn_metrics_line(four_rounds):
    """Finite garbage in node 1's newest weights (and later in node 0's older ones): --resume
    refuses when no round is good on every node, and otherwise reruns from the newest that is,
    giving the metrics of the uninterrupted run."""
    out, full = four_rounds
    ckpt = out / "ckpt"
    _spoil(ckpt / "node1" / "round_00004" / "model.safetensors")
    older = ckpt / "node0" / "round_00002" / "model.safetensors"
    intact = older.read_bytes()
    _spoil(older)
    rc, log, _ = ftis_grpo("--preset", "smoke", "--out", str(out), "--resume")
    assert rc != 0
    assert "--resume: no checkpoint under" in log and "is good on every node" in log
    assert "node 0: [4]; node 1: [2]" in log
    older.write_bytes(intact)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"round": 4, "node": 0, "rew')  # a write cut short by a kill
    rc, log, _ = ftis_grpo("--preset", "smoke", "--out", str(out), "--resume")
    assert rc == 0, log[-4000:]
    assert "checkpoint of round 4 is damaged, not used" in log
    assert "model.safetensors does not match its sha256" in log
    assert "falling back to the checkpoint of round 2" in log
    assert "dropped a torn or garbage row" in log
    assert comparable(rows_of(out)) == comparable(full)


def test_resume_with_a_bad_metrics_line_before_the_last_names_the_line(four_rounds, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(four_rounds[0], out)
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[2] = "garbage\n"
    (out / "metrics.jsonl").write_text("".join(lines))
    rc, log, _ = ftis_grpo("--preset", "smoke", "--out", str(out), "--resume")
    assert rc != 0
    assert "--resume: " in log and "metrics.jsonl, line 3: " in log
