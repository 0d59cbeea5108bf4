"""The driver features the claims study needs (issue 15): a task with signal, a filter that says
what it did, reproducible runs, and stronger bad peers."""

from __future__ import annotations

import pytest
import torch

from ftis_kernels.grpo.config import ConfigError, build_config
from ftis_kernels.grpo.exchange import Sample
from ftis_kernels.grpo.node import signal_metrics
from ftis_kernels.grpo.task import (
    ArithmeticTask,
    Difficulty,
    Problems,
    make_prompt_id,
    reward,
)


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
