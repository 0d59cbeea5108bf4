"""The driver features the claims study needs: a task with signal, a filter that says
what it did, reproducible runs, and stronger bad peers."""

from __future__ import annotations

import json
import math
import pickle

import pytest
import torch

from ftis_kernels import ftis_loss
from ftis_kernels.grpo.audit import (
    DEFENCE_KEYS,
    defence_metrics,
    sample_rows,
    sample_stats,
    start_sample_log,
)
from ftis_kernels.grpo.config import ConfigError, build_config
from ftis_kernels.grpo.exchange import Drop, Sample, make_hostile, pack, record_bytes, unpack
from ftis_kernels.grpo.node import signal_metrics
from ftis_kernels.grpo.task import (
    ArithmeticTask,
    Difficulty,
    Problems,
    make_prompt_id,
    reward,
)
from ftis_kernels.options import FTISOptions
from ftis_kernels.per_sample import per_sample_loss


def _bare_node(tmp_path, **overrides):
    from ftis_kernels.grpo.node import Node
    from ftis_kernels.grpo.tokenizer import build_tokenizer

    cfg = build_config("smoke", overrides=dict(out=str(tmp_path / "run"), **overrides))
    node = Node(cfg, 0, 2, torch.device("cpu"))
    node.tokenizer = build_tokenizer(node.problems.arith.vocabulary_text())
    return node


# -- a task with signal (item 3) ---------------------------------------------------------------
def test_format_credit_pays_a_well_formed_wrong_answer_and_zero_is_the_binary_reward():
    p = ArithmeticTask(0).problem(make_prompt_id("train", 0))
    right, wrong = f"{p.solution} #### {p.answer}", f"{p.solution} #### {int(p.answer) + 1}"
    unformatted = f"{p.solution} The answer is {p.answer}."
    assert [reward(t, p) for t in (right, wrong, unformatted)] == [1.0, 0.0, 0.0]
    assert [reward(t, p, 0.25) for t in (right, wrong, unformatted)] == [1.0, 0.25, 0.0]


def test_default_difficulty_keeps_the_original_problems():
    task = ArithmeticTask(0)
    train, ood = (task.problem(make_prompt_id(s, 0)) for s in ("train", "ood"))
    assert (train.question, train.solution) == (
        "Fay has 8 pens. She gets 2 more. How many pens does Fay have now?",
        "8+2=10.",
    )
    assert ood.solution == "13+16=29. 29+5=34. 34+16=50."


def test_difficulty_moves_the_steps_and_operands_of_each_split():
    easy = ArithmeticTask(0, Difficulty(1, 1, 4, 3, 3, 9))
    for i in range(60):
        train, ood = (easy.problem(make_prompt_id(s, i)) for s in ("train", "ood"))
        assert train.solution.count("=") == 1 and ood.solution.count("=") == 3
        operands = [int(x) for x in train.question.split() if x.isdigit()]
        assert max(operands) <= 4
        assert max(int(x) for x in ood.question.split() if x.isdigit()) <= 9
    with pytest.raises(ValueError, match="ood_steps"):
        Difficulty(ood_steps_min=3, ood_steps_max=2)


def test_config_difficulty_reaches_the_problems_and_a_reversed_range_is_a_config_error():
    cfg = build_config(sets=("task_steps=[2, 3]", "task_operand_max=5", "ood_steps=[3, 3]"))
    assert cfg.difficulty() == Difficulty(2, 3, 5, 3, 3, 19)
    problems = Problems(cfg.seed, cfg.task, cfg.data, cfg.difficulty())
    steps = {problems.problem(make_prompt_id("test", i)).solution.count("=") for i in range(40)}
    assert steps == {2, 3}
    assert build_config().difficulty() == Difficulty()
    with pytest.raises(ConfigError, match=r"task_steps: expected \[fewest, most\]"):
        build_config(sets=("task_steps=[3, 1]",)).validate(1)
    with pytest.raises(ConfigError, match="format_credit: expected a value < 1"):
        build_config(sets=("format_credit=1",))


def test_node_scores_with_format_credit_and_its_accuracy_counts_right_answers_only(
    tmp_path, monkeypatch
):
    node = _bare_node(tmp_path, format_credit=0.25)
    pid = make_prompt_id("train", 0)
    p = node.problems.problem(pid)
    wrong = node.tokenizer(f"{p.solution} #### {int(p.answer) + 1}")["input_ids"]
    assert node.score(pid, torch.tensor(wrong)) == 0.25
    done = [(None, None, r) for r in (1.0, 0.25, 0.25, 0.0)]
    monkeypatch.setattr(node, "generate", lambda ids, **kw: done)
    assert node.accuracy("test") == 0.25


def test_verify_rewards_keeps_an_honest_partial_credit_reward_as_the_wire_carries_it(tmp_path):
    """A reward of 0.1 crosses the wire as float32 (0.10000000149...): the rescored 0.1 is the
    same claim, not a lie."""
    from ftis_kernels.grpo.rollout import vertical_advantages

    node = _bare_node(tmp_path, verify_rewards=True, format_credit=0.1)
    pid = make_prompt_id("train", 0)
    p = node.problems.problem(pid)
    right = node.tokenizer(f"{p.solution} #### {p.answer}")["input_ids"]
    wrong = node.tokenizer(f"{p.solution} #### {int(p.answer) + 1}")["input_ids"]
    texts = [right, wrong, wrong, wrong]
    rewards = [node.score(pid, torch.tensor(t)) for t in texts]
    assert rewards == [1.0, 0.1, 0.1, 0.1]
    advantages = vertical_advantages(torch.tensor([rewards]))[0].tolist()
    sent = [
        Sample(pid, 1, torch.tensor(t, dtype=torch.int32), torch.full((len(t),), -0.5), r, a)
        for t, r, a in zip(texts, rewards, advantages)
    ]
    received, _ = unpack(pack(sent), sender=1, vocab_size=len(node.tokenizer), max_tokens=99)
    kept, drops = node.check_advantages(received)
    assert drops == [] and [s.advantage for s in kept] == advantages


def test_signal_metrics_count_right_answers_and_groups_without_advantage():
    def s(pid: int, r: float, a: float) -> Sample:
        return Sample(pid, 0, torch.tensor([5]), torch.tensor([-1.0]), r, a)

    own = [s(1, 1.0, 0.7), s(1, 0.25, -0.7), s(2, 0.0, 0.0), s(2, 0.0, 0.0)]
    own += [s(3, 1.0, 0.0), s(3, 1.0, 0.0)]
    assert signal_metrics(own) == dict(sample_acc=0.5, zero_adv_groups=2 / 3)


def test_a_harder_task_is_another_warm_up_cache_entry_and_the_default_keeps_its_key(
    tmp_path, monkeypatch
):
    from ftis_kernels.grpo import node as node_module

    def cache_file(**overrides) -> str:
        seen = []
        node = _bare_node(tmp_path, warmup_cache=str(tmp_path / "cache"), **overrides)
        node.model = None
        monkeypatch.setattr(
            node_module, "warm_up_cached", lambda *a, **kw: seen.append(a[3]) or 0.0
        )
        node.warm_up()
        return seen[0].name

    default = cache_file()
    assert cache_file(ood_operand_max=9) == default  # the warm-up never sees ood problems
    assert cache_file(task_operand_max=5) != default
    assert default == "tiny-10a5d3333d01e117.pt"  # the key main wrote: old caches stay valid


# -- a filter that says what it did (item 4) ---------------------------------------------------
def test_sample_stats_of_a_packed_batch_are_the_padded_batchs():
    # The driver packs by default: its per-sample log must read the packed layout as the padded.
    g = torch.Generator().manual_seed(1)
    lengths = [3, 1, 5, 2]
    B, T, V = len(lengths), max(lengths), 9
    logits = torch.randn(B, T, V, generator=g) * 2
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    gen = (logp + torch.randn(B, T, generator=g) - 0.5).clamp(max=0)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0])
    opt = FTISOptions.preset("f-tis", kl_threshold=0.5)
    _, padded = ftis_loss(logits, tokens, gen, adv, mask, **opt.as_kwargs())
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    _, packed = ftis_loss(
        logits[mask], tokens[mask], gen[mask], adv, cu_seqlens=cu, **opt.as_kwargs()
    )
    want = sample_stats(padded)
    got = sample_stats(packed)
    assert got == want
    assert 0 < sum(want["filtered"]) < B and 0 < sum(want["truncated"])  # both defences act


def _s(adv: float, n: int = 4, source: int = 1) -> Sample:
    return Sample(7, source, torch.arange(n, dtype=torch.int32), -torch.ones(n), 0.0, adv)


def test_filter_changed_counts_only_filtered_samples_whose_advantage_was_not_zero():
    own = [_s(0.0, source=0), _s(1.0, source=0)]
    received = [_s(-1.0), _s(-0.5, 2), _s(0.0), _s(2.0, 6)]
    per_sample = dict(
        filtered=[1.0, 0.0, 1.0, 0.0, 1.0, 0.0],
        kl=[0.0, 0.0, 80.0, 2.0, 70.0, 4.0],
        truncated=[0.0, 0.0, 0.5, 1.0, 0.0, 0.25],
    )
    drops = [Drop("a", "token", 2), Drop("b", "verify", 1), Drop("c", "verify", 2)]
    got = defence_metrics(own, received, per_sample, drops)
    assert list(got) == list(DEFENCE_KEYS)
    assert got["filter_changed_frac"] == 1 / 6  # the own and received 0-advantage ones: no change
    assert got["filter_changed_neg"] == 1 / 2
    assert got["recv_kl_mean"] == 39.0
    assert got["recv_truncated_frac"] == (0.5 * 4 + 1.0 * 2 + 0.25 * 6) / 16
    assert (got["dropped_token"], got["dropped_verify"], got["dropped_length"]) == (1, 2, 0)
    alone = defence_metrics(own, [], dict(filtered=[1.0, 0.0], kl=[0, 0], truncated=[0, 0]), [])
    assert math.isnan(alone["recv_kl_mean"]) and math.isnan(alone["filter_changed_neg"])
    rows = sample_rows(3, 0, own, received, per_sample, drops)
    assert [(r["sender"], r["changed"], r["dropped"]) for r in rows] == [
        (1, True, None),
        (1, False, None),
        (1, False, None),
        (1, False, None),
        (2, None, "token"),
        (1, None, "verify"),
        (2, None, "verify"),
    ]
    assert rows[0]["kl"] == 80.0 and rows[1]["truncated"] == 1.0 and rows[2]["filtered"] is True


def test_a_node_may_set_its_own_kl_threshold():
    cfg = build_config(
        "smoke", overrides={"kl_threshold": 20.0}, sets=("nodes.1.kl_threshold=0.5",)
    )
    assert (cfg.ftis_options(0).kl_threshold, cfg.ftis_options(1).kl_threshold) == (20.0, 0.5)
    assert cfg.ftis_options().kl_threshold == 20.0
    with pytest.raises(ConfigError, match="nodes.0.kl_threshold: expected a value >= 0"):
        build_config("smoke", sets=("nodes.0.kl_threshold=-1",))


def test_every_parser_drop_names_its_kind_and_sender():
    honest = [_s(0.5) for _ in range(6)]
    broken = make_hostile(honest, "malformed", 50, torch.Generator())
    _, drops = unpack(
        pack(broken), sender=1, vocab_size=50, max_tokens=8, prompt_ok=lambda p: p < 8
    )
    assert [d.kind for d in drops] == ["source", "token", "logprob", "logprob", "reward", "prompt"]
    assert all(d.sender == 1 for d in drops)
    _, drops = unpack(pack(honest)[:-3], sender=1, vocab_size=50, max_tokens=8)
    assert [d.kind for d in drops] == ["length"] and "runs past" in drops[0]
    (again,) = pickle.loads(pickle.dumps(drops))
    assert (again, again.kind, again.sender) == (drops[0], "length", 1)


def test_a_resumed_sample_log_keeps_the_rounds_before_the_resume(tmp_path):
    path = tmp_path / "received.jsonl"
    rows = [json.dumps(dict(round=r, receiver=0)) for r in range(4)]
    path.write_text("\n".join(rows) + '\n{"round": 4, "rec')
    start_sample_log(path, 2)
    assert path.read_text().splitlines() == rows[:2]
    start_sample_log(path, None)
    assert path.read_text() == ""


# -- reproducibility (item 6) ------------------------------------------------------------------
def test_rerunning_a_command_on_the_same_machine_is_bit_identical(tmp_path):
    """Two runs of one command, at once (so their timings differ): metrics.jsonl is the same
    line by line apart from its wall-time fields, received.jsonl byte for byte, and each run
    records its environment."""
    import os
    import subprocess
    import sys

    from ftis_kernels.grpo.report import WALL_TIME_KEYS, without_wall_time
    from tests.test_grpo_run import ROOT

    env = dict(os.environ, FTIS_LOG_LEVEL="WARNING")
    env.pop("TRITON_INTERPRET", None)  # the driver on CPU takes ftis_loss's PyTorch path
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    args = ["--preset", "smoke", "--no-progress", "--rounds", "2", "--set", "sample_log=true"]
    outs = [tmp_path / f"run{i}" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ftis_kernels.grpo", *args, "--out", str(out)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for out in outs
    ]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    lines = [(out / "metrics.jsonl").read_text().splitlines() for out in outs]
    assert len(lines[0]) == 4
    assert [without_wall_time(x) for x in lines[0]] == [without_wall_time(x) for x in lines[1]]
    assert WALL_TIME_KEYS == ("seconds",)
    received = [(out / "received.jsonl").read_bytes() for out in outs]
    assert received[0] == received[1]
    rows = [json.loads(x) for x in lines[0]]
    logged = [json.loads(x) for x in received[0].decode().splitlines()]
    for r in rows:  # one received.jsonl line per record a node received or dropped
        mine = [x for x in logged if (x["round"], x["receiver"]) == (r["round"], r["node"])]
        assert len(mine) == r["samples_received"] + r["dropped"] > 0
        assert all(x["sender"] == 1 - r["node"] for x in mine)
    (start,) = json.loads((outs[0] / "environment.json").read_text())
    for key in ("torch", "triton", "numpy", "cpu", "cpu_capability", "threads_per_node"):
        assert start[key], key
    assert start["first_round"] == 0 and start["commit"] != ""
    assert f"commit {start['commit']}" in (outs[0] / "summary.txt").read_text()


# -- stronger bad peers (item 8) ---------------------------------------------------------------
def test_random_tokens_max_weight_claims_the_logprob_that_gives_every_token_the_cap():
    from ftis_kernels.grpo.exchange import MAX_WEIGHT_LOGPROB, claim_first_correct

    honest = [_s(-0.5, 6) for _ in range(3)]
    sent = make_hostile(honest, "random_tokens_max_weight", 50, torch.Generator().manual_seed(0))
    assert all(bool((s.logprobs == MAX_WEIGHT_LOGPROB).all()) for s in sent)
    assert [(s.reward, s.advantage) for s in sent] == claim_first_correct(honest)
    assert sent[0].advantage > 1 and sent[1].advantage < 0  # one sold as correct per group
    assert any(not torch.equal(a.tokens, b.tokens) for a, b in zip(sent, honest))
    got, drops = unpack(pack(sent), sender=1, vocab_size=50, max_tokens=8)
    assert len(got) == 3 and drops == []
    # A receiver that finds a token 1e6 times less likely than uniform still gives it the cap.
    logp = torch.full((3, 6), math.log(1 / 50) - math.log(1e6))
    gen = torch.stack([s.logprobs for s in got])
    opt = FTISOptions.preset("f-tis")
    result = per_sample_loss(logp, gen, torch.ones(3), None, None, None, opt)
    assert bool((result.metrics["is_truncated"] == 1).all())


def test_replay_sends_last_rounds_samples_of_one_peer_as_its_own():
    own = [_s(0.5, source=2) for _ in range(3)]
    first, second = [_s(1.0, 3, source=0) for _ in range(4)], [_s(-1.0, 5, source=1)]
    assert make_hostile(own, "replay", 50, torch.Generator()) == []  # nothing to replay yet
    sent = make_hostile(own, "replay", 50, torch.Generator(), previous=second + first)
    assert len(sent) == 3 and all(s.source == 2 and s.n_tokens == 3 for s in sent)
    assert all(
        (a.prompt_id, a.reward, a.advantage) == (b.prompt_id, b.reward, b.advantage)
        and torch.equal(a.tokens, b.tokens)
        for a, b in zip(sent, first)
    )
    got, drops = unpack(pack(sent), sender=2, vocab_size=50, max_tokens=8)
    assert len(got) == 3 and drops == []


def test_a_swarm_with_a_replaying_and_a_max_weight_peer_logs_what_each_defence_did(tmp_path):
    """Node 1 replays node 0's samples, node 2 sends max-weight random tokens: node 0 gets its
    own samples of round 0 back in round 1, and every token of node 2's samples has its IS
    weight truncated at C."""
    from ftis_kernels.grpo.task import make_prompt_id
    from tests.test_grpo_run import ftis_grpo, rows_of

    rc, log, _ = ftis_grpo(
        *("--preset", "smoke", "--nodes", "3", "--rounds", "2", "--out", str(tmp_path)),
        *("--set", "nodes.1.hostile=replay", "--set", "nodes.2.hostile=random_tokens_max_weight"),
        *("--set", "sample_log=true", "--set", "nodes.2.lora=0"),
    )
    assert rc == 0, log[-3000:]
    logged = [json.loads(x) for x in (tmp_path / "received.jsonl").read_text().splitlines()]
    to0 = [r for r in logged if r["receiver"] == 0]
    own_prompts = {make_prompt_id("train", i) for i in range(2)}  # node 0's round-0 prompts
    replayed = [r for r in to0 if r["sender"] == 1]
    assert [r["round"] for r in replayed] == [1] * 8
    assert {r["prompt_id"] for r in replayed} == own_prompts
    assert all(r["dropped"] is None for r in replayed)  # the parser cannot tell
    forged = [r for r in logged if r["sender"] == 2]
    assert len(forged) == 2 * 2 * 8 and all(r["truncated"] == 1.0 for r in forged)
    assert all(r["dropped"] is None for r in forged)  # their advantages agree with their rewards
    assert {round(r["advantage"], 3) for r in forged} == {1.5, -0.5}
    rows = rows_of(tmp_path)
    assert all(r["recv_truncated_frac"] > 0.3 for r in rows if r["node"] != 2)
    # What node 1 put on the wire is counted, not the honest samples it kept: nothing in round 0.
    sent1 = {r["round"]: r for r in rows if r["node"] == 1}
    replayed_tokens = sum(r["n_tokens"] for r in replayed)
    assert (sent1[0]["tokens_sent"], sent1[0]["bytes_sent"]) == (0, 0)
    assert sent1[1]["tokens_sent"] == replayed_tokens
    assert sent1[1]["bytes_sent"] == sum(record_bytes(r["n_tokens"]) for r in replayed)


def test_verify_rewards_drops_carry_their_kind_and_sender(tmp_path):
    """A lie about one reward, with the advantages the lie gives: the liar is dropped as "verify",
    the rest of its group trained on with the advantages of the rescored rewards."""
    from ftis_kernels.grpo.rollout import vertical_advantages
    from tests.test_grpo_units import _group

    node = _bare_node(tmp_path, verify_rewards=True)
    group = _group(node, make_prompt_id("train", 0), (True, False, False, False))
    group[1].reward = 1.0
    claimed = vertical_advantages(torch.tensor([[1.0, 1.0, 0.0, 0.0]]))[0].tolist()
    for s, adv in zip(group, claimed):
        s.advantage = adv
    kept, drops = node.check_advantages(group)
    assert [(d.kind, d.sender) for d in drops] == [("verify", 1)]
    true = vertical_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))[0].tolist()
    assert [s.advantage for s in kept] == [true[0], true[2], true[3]]
