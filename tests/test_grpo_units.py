"""Unit tests of the GRPO driver's pieces: task, tokenizer, advantages, wire format, batch layout."""  # noqa: E501

from __future__ import annotations

import dataclasses
import json
import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ftis_kernels.grpo.config import ConfigError, build_config
from ftis_kernels.grpo.exchange import (
    BYTES_PER_TOKEN,
    HEADER_BYTES,
    Sample,
    claim_first_correct,
    make_hostile,
    pack,
    record_bytes,
    unpack,
)
from ftis_kernels.grpo.models import build_model
from ftis_kernels.grpo.rollout import (
    ADVANTAGE_EPS,
    horizontal_advantages,
    left_pad,
    sample,
    vertical_advantages,
)
from ftis_kernels.grpo.task import (
    ArithmeticTask,
    extract_answer,
    format_prompt,
    load_jsonl,
    make_prompt_id,
    reward,
    split_prompt_id,
)
from ftis_kernels.grpo.tokenizer import build_tokenizer, vocab_fingerprint
from ftis_kernels.grpo.train import build_batch, completion_logits, grpo_update
from ftis_kernels.options import FTISOptions

TASK = ArithmeticTask(seed=0)
TOKENIZER = build_tokenizer(TASK.vocabulary_text())
V = len(TOKENIZER)


def _samples(n: int, source: int = 1, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = int(torch.randint(1, 9, (1,), generator=g))
        out.append(
            Sample(
                prompt_id=make_prompt_id("train", 1000 * seed + i),
                source=source,
                tokens=torch.randint(0, V, (L,), generator=g, dtype=torch.int32),
                logprobs=-torch.rand(L, generator=g) * 5,
                reward=float(i % 2),
                advantage=float(torch.randn(1, generator=g).float()),
            )
        )
    return out


def _same(a: Sample, b: Sample) -> bool:
    return (
        a.prompt_id == b.prompt_id
        and a.source == b.source
        and torch.equal(a.tokens.to(torch.int32), b.tokens)
        and torch.equal(a.logprobs.float(), b.logprobs)
        and struct.pack("<f", a.reward) == struct.pack("<f", b.reward)
        and struct.pack("<f", a.advantage) == struct.pack("<f", b.advantage)
    )


# -- task and tokenizer ---------------------------------------------------------------------------
def test_generator_is_deterministic_and_splits_differ():
    a, b = ArithmeticTask(0), ArithmeticTask(0)
    ids = [make_prompt_id(s, i) for s in ("train", "test", "ood") for i in range(20)]
    assert [a.problem(i) for i in ids] == [b.problem(i) for i in ids]
    assert ArithmeticTask(1).problem(ids[0]) != a.problem(ids[0])
    ood_steps = [a.problem(make_prompt_id("ood", i)).solution.count("=") for i in range(50)]
    id_steps = [a.problem(make_prompt_id("test", i)).solution.count("=") for i in range(50)]
    assert min(ood_steps) >= 3 and max(id_steps) <= 2
    assert split_prompt_id(make_prompt_id("ood", 123)) == ("ood", 123)


def test_worked_answers_are_correct_and_reward_is_strict():
    for i in range(50):
        p = TASK.problem(make_prompt_id("ood", i))
        *_, last = p.solution.split()
        assert last.split("=")[1].rstrip(".") == p.answer
        assert reward(TASK.target(p), p) == 1.0
    p = TASK.problem(make_prompt_id("test", 0))
    wrong = str(int(p.answer) + 1)
    assert reward(f"#### {wrong}", p) == 0.0
    assert reward(p.answer, p) == 0.0  # no '####': no answer
    assert reward(f"#### {p.answer} and more", p) == 0.0
    assert extract_answer("x #### 1,200") == "1200"
    # Exact at any size: no float rounding (2^53 + 1 is not 2^53), no overflow past 1e308.
    big = dataclasses.replace(p, answer="9007199254740993")
    assert reward("#### 9007199254740992", big) == 0.0 and reward("#### 9007199254740993", big) == 1
    assert reward("#### " + "9" * 400, p) == 0.0


def test_tokenizer_round_trips_task_text_and_fingerprints_vocabulary():
    for i in range(20):
        p = TASK.problem(make_prompt_id("ood", i))
        text = format_prompt(p.question) + TASK.target(p)
        ids = TOKENIZER(text)["input_ids"]
        assert TOKENIZER.unk_token_id not in ids
        assert TOKENIZER.decode(ids) == text
    assert vocab_fingerprint(TOKENIZER) == vocab_fingerprint(
        build_tokenizer(TASK.vocabulary_text())
    )
    assert vocab_fingerprint(TOKENIZER) != vocab_fingerprint(build_tokenizer(["other"]))


def test_jsonl_loader_reads_gsm8k_and_math500(tmp_path):
    gsm = tmp_path / "gsm8k.jsonl"
    gsm.write_text(json.dumps({"question": "2+2?", "answer": "2+2=4\n#### 4"}) + "\n")
    math500 = tmp_path / "math500.jsonl"
    math500.write_text(json.dumps({"problem": "1+1?", "answer": "2", "level": 1}) + "\n")
    (g,) = load_jsonl(str(gsm), "train")
    (m,) = load_jsonl(str(math500), "ood")
    assert (g.question, g.answer, g.solution) == ("2+2?", "4", "2+2=4")
    assert (m.question, m.answer) == ("1+1?", "2")
    assert reward("so #### 4", g) == 1.0 and reward("#### 2", m) == 1.0
    assert g.prompt_id != m.prompt_id


# -- advantages -----------------------------------------------------------------------------------
def test_vertical_advantages_match_hand_computed_values():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    # group 0: mean 0.5, unbiased std sqrt(1/3); group 1: mean 0.75, std 0.5; group 2: all equal.
    s0 = math.sqrt(1 / 3) + ADVANTAGE_EPS
    s1 = 0.5 + ADVANTAGE_EPS
    expected = torch.tensor(
        [
            [0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0],
            [0.25 / s1, 0.25 / s1, 0.25 / s1, -0.75 / s1],
            [0.0, 0.0, 0.0, 0.0],
        ]
    )
    torch.testing.assert_close(vertical_advantages(rewards), expected)


def test_horizontal_advantages_normalise_over_the_swarm_group():
    # 2 nodes, 2 shared prompts, 2 completions each per node.
    swarm = torch.tensor(
        [
            [[1.0, 0.0], [1.0, 1.0]],  # node 0
            [[0.0, 0.0], [0.0, 1.0]],
        ]
    )  # node 1
    # prompt 0's group [1, 0, 0, 0]: mean 0.25, unbiased std 0.5;
    # prompt 1's group [1, 1, 0, 1]: mean 0.75, unbiased std 0.5.
    s = 0.5 + ADVANTAGE_EPS
    expected = torch.tensor(
        [
            [[0.75 / s, -0.25 / s], [0.25 / s, 0.25 / s]],
            [[-0.25 / s, -0.25 / s], [-0.75 / s, 0.25 / s]],
        ]
    )
    got = horizontal_advantages(swarm)
    torch.testing.assert_close(got, expected)
    # Not the same as normalising each node's share on its own (the horizontal bias).
    assert not torch.allclose(got[0], vertical_advantages(swarm[0]))


def test_a_group_of_equal_partial_credit_rewards_has_no_advantage():
    """A group whose completions all earn a `format_credit` of 0.1 teaches nothing: advantages
    exactly 0 (not float32's rounding over std + eps), so zero_adv_groups counts the group."""
    from ftis_kernels.grpo.node import signal_metrics

    rewards = torch.tensor([[0.1] * 8, [0.3] * 8, [1.0, 0.1, 0.0, 0.1, 0.1, 0.0, 0.1, 0.1]])
    got = vertical_advantages(rewards)
    assert got[:2].eq(0).all() and got[2].ne(0).all()
    assert horizontal_advantages(torch.full((2, 1, 3), 0.7)).eq(0).all()
    own = [
        Sample(
            make_prompt_id("train", p), 0, torch.ones(1, dtype=torch.int32), -torch.ones(1), r, a
        )
        for p in range(3)
        for r, a in zip(rewards[p].tolist(), got[p].tolist())
    ]
    assert signal_metrics(own)["zero_adv_groups"] == pytest.approx(2 / 3)


def test_advantages_refuse_groups_of_one():
    with pytest.raises(ValueError, match="rewards"):
        vertical_advantages(torch.ones(3, 1))


# -- the wire format ------------------------------------------------------------------------------
def test_pack_unpack_round_trips_exactly_and_counts_8_bytes_per_token_plus_header():
    samples = _samples(12)
    payload = pack(samples)
    n_tokens = sum(s.n_tokens for s in samples)
    assert len(payload) == BYTES_PER_TOKEN * n_tokens + HEADER_BYTES * len(samples)
    assert (BYTES_PER_TOKEN, HEADER_BYTES) == (8, 24)
    assert record_bytes(5) == 24 + 40
    back, drops = unpack(payload, sender=1, vocab_size=V, max_tokens=8)
    assert drops == []
    assert len(back) == len(samples) and all(_same(a, b) for a, b in zip(samples, back))


@pytest.mark.parametrize(
    "corrupt, reason",
    [
        (lambda s: s.tokens.__setitem__(-1, V), "token id"),
        (lambda s: s.tokens.__setitem__(0, -1), "token id"),
        (lambda s: s.logprobs.__setitem__(-1, 0.5), "logprob > 0"),
        (lambda s: s.logprobs.__setitem__(0, float("nan")), "non-finite logprob"),
        (lambda s: s.logprobs.__setitem__(-1, -float("inf")), "non-finite logprob"),
        (lambda s: setattr(s, "reward", float("inf")), "non-finite reward"),
        (lambda s: setattr(s, "advantage", float("nan")), "non-finite reward"),
        (lambda s: setattr(s, "source", 0), "source field"),
        (lambda s: setattr(s, "prompt_id", 7 << 48), "is not a training problem"),
    ],
)
def test_malformed_peer_sample_is_dropped_with_a_reason(corrupt, reason):
    samples = _samples(3)
    corrupt(samples[1])
    task = ArithmeticTask(0)

    def known(pid):
        try:
            task.problem(pid)
        except ValueError:
            return False
        return True

    got, drops = unpack(pack(samples), sender=1, vocab_size=V, max_tokens=8, prompt_ok=known)
    assert [s.prompt_id for s in got] == [samples[0].prompt_id, samples[2].prompt_id]
    assert len(drops) == 1 and reason in drops[0] and "sample 1 from node 1" in drops[0]


def test_untrustworthy_lengths_end_the_parse_without_raising():
    samples = _samples(3)
    payload = bytearray(pack(samples))
    first = record_bytes(samples[0].n_tokens)
    struct.pack_into("<i", payload, first + 12, 10_000)  # sample 1 claims 10k tokens
    got, drops = unpack(bytes(payload), sender=1, vocab_size=V, max_tokens=8)
    assert len(got) == 1 and "outside [1, 8]" in drops[0]
    got, drops = unpack(pack(samples)[:-3], sender=1, vocab_size=V, max_tokens=8)
    assert len(got) == 2 and "runs past the payload" in drops[0]
    got, drops = unpack(pack(samples) + b"\x01\x02", sender=1, vocab_size=V, max_tokens=8)
    assert len(got) == 3 and "truncated header" in drops[0]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.binary(max_size=400))
def test_arbitrary_peer_bytes_never_raise(payload):
    got, drops = unpack(payload, sender=1, vocab_size=V, max_tokens=8)
    for s in got:
        assert 1 <= s.n_tokens <= 8 and int(s.tokens.min()) >= 0 and int(s.tokens.max()) < V
        assert bool(torch.isfinite(s.logprobs).all()) and float(s.logprobs.max()) <= 0


def test_hostile_hook_forges_what_it_says():
    honest = _samples(4)
    g = torch.Generator().manual_seed(0)
    forged = make_hostile(honest, "forged_logprobs", V, g)
    assert all(bool((s.logprobs == 0).all()) for s in forged)
    flipped = make_hostile(honest, "flipped_rewards", V, g)
    assert [s.reward for s in flipped] == [1 - s.reward for s in honest]
    assert [s.advantage for s in flipped] == [-s.advantage for s in honest]
    rand = make_hostile(honest, "random_tokens", V, g)
    assert any(not torch.equal(a.tokens, b.tokens) for a, b in zip(rand, honest))
    assert [(s.reward, s.advantage) for s in rand] == claim_first_correct(honest)
    broken = make_hostile(honest * 2, "malformed", V, g)  # 8 records: every check, some twice
    got, drops = unpack(
        pack(broken), sender=1, vocab_size=V, max_tokens=64, prompt_ok=lambda pid: (pid >> 48) < 4
    )
    assert got == [] and len(drops) == 8
    for reason in (
        "source field",
        "token id outside",
        "non-finite logprob",
        "logprob > 0",
        "non-finite reward",
        "is not a training problem",
    ):
        assert any(reason in d for d in drops), reason
    for kind in ("forged_logprobs", "flipped_rewards", "random_tokens"):  # all well formed
        hostile = make_hostile(honest, kind, V, g)
        got, drops = unpack(pack(hostile), sender=hostile[0].source, vocab_size=V, max_tokens=64)
        assert len(got) == len(hostile) and not drops
    assert make_hostile(honest, None, V, g) is honest
    with pytest.raises(ValueError, match="hostile"):
        make_hostile(honest, "nice", V, g)


# -- generation and training ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model():
    return build_model("tiny", TOKENIZER, seed=0)


def _prompt(pid: int) -> list[int]:
    return TOKENIZER(format_prompt(TASK.problem(pid).question))["input_ids"]


def test_sampled_logprobs_are_the_training_forward_logprobs(tiny_model):
    """Own samples: the loss's log pi_theta (shifted logits of the padded batch) equals the
    sampling logprobs, so w = 1 and KL = 0 on a node's own data."""
    pids = [make_prompt_id("train", i) for i in range(6)]  # prompts of different lengths
    g = torch.Generator().manual_seed(0)
    tokens, logprobs, lengths = sample(
        tiny_model,
        [_prompt(p) for p in pids],
        max_new_tokens=10,
        temperature=0.7,
        eos_id=TOKENIZER.eos_token_id,
        pad_id=TOKENIZER.pad_token_id,
        generator=g,
    )
    assert len({len(_prompt(p)) for p in pids}) > 1
    samples = [
        Sample(p, 0, tokens[i, : lengths[i]].to(torch.int32), logprobs[i, : lengths[i]], 0.0, 0.0)
        for i, p in enumerate(pids)
    ]
    batch = build_batch(samples, _prompt, TOKENIZER.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        logits = completion_logits(tiny_model, batch)
    logp = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, batch["tokens"][..., None])[..., 0]
    m = batch["mask"]
    torch.testing.assert_close(logp[m], batch["gen_logprobs"][m], atol=2e-5, rtol=0)
    assert bool((batch["gen_logprobs"][m] < 0).all())


@pytest.mark.parametrize("entropy_coef", [0.0, 0.05])
@pytest.mark.parametrize(
    ("loss_type", "reject_mode"),
    [("grpo", "advantage"), ("dr_grpo", "advantage"), ("dapo", "mask")],
)
def test_micro_batches_accumulate_to_the_full_batch_gradient(loss_type, reject_mode, entropy_coef):
    """dr_grpo too: its L (max_completion_length unset) is the batch's longest completion, not
    each micro-batch's; a token mean whose rejected samples leave the mask: it divides by the
    batch's kept tokens, not each micro-batch's; and the entropy bonus, a mean over the batch's
    tokens whatever the loss type (micro-batches weighted by samples rescale it)."""
    opts = FTISOptions.for_variant("f-tis").replace(
        loss_type=loss_type, reject_mode=reject_mode, kl_threshold=3.0, entropy_coef=entropy_coef
    )
    pids = [make_prompt_id("train", i) for i in range(5)]
    g = torch.Generator().manual_seed(1)
    samples = []
    for i, p in enumerate(pids):
        L = 3 + i
        samples.append(
            Sample(
                p,
                0,
                torch.randint(3, V, (L,), generator=g, dtype=torch.int32),
                -torch.rand(L, generator=g) * 3,
                float(i % 2),
                float(i) - 2.0,
            )
        )
    grads, stats = [], []
    for micro in (5, 2):
        model = build_model("tiny", TOKENIZER, seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        before = [p.detach().clone() for p in model.parameters()]
        stats.append(
            grpo_update(
                model,
                opt,
                samples,
                _prompt,
                opts,
                micro_batch=micro,
                pad_id=TOKENIZER.pad_token_id,
                grad_clip=1e9,
                device=torch.device("cpu"),
            )
        )
        grads.append(
            torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())])
        )
    assert grads[0].abs().max() > 0 and 0 < stats[0]["filtered_frac"] < 1
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)
    assert stats[1]["loss"] == pytest.approx(stats[0]["loss"], rel=1e-5)


def test_an_entropy_bonus_with_rejection_by_mask_needs_a_token_mean_loss_type():
    """The bonus's mean over the batch's kept tokens cannot be split over micro-batches weighted by
    samples: the driver refuses it there, and takes it with a token mean."""
    sets = ("loss_options.reject_mode=mask", "loss_options.entropy_coef=0.01")
    with pytest.raises(ConfigError, match=r"loss_options\.reject_mode: expected \"advantage\""):
        build_config("smoke", None, {}, (*sets, "loss_options.loss_type=grpo"), 2).validate(2)
    build_config("smoke", None, {}, (*sets, "loss_options.loss_type=dapo"), 2).validate(2)


def test_left_pad_right_aligns_prompts():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


# -- configuration --------------------------------------------------------------------------------
def test_config_layers_preset_file_and_flags(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('rounds = 9\nloss = "nois"\n')
    cfg = build_config("smoke", str(f), {"loss": "tis"}, ("nodes.1.hostile=random_tokens",), 3)
    assert (cfg.rounds, cfg.loss, len(cfg.nodes)) == (9, "tis", 3)
    assert cfg.nodes[1].hostile == "random_tokens" and cfg.nodes[2].lora is False
    assert cfg.ftis_options() == FTISOptions.for_variant("tis", temperature=cfg.temperature)
    onp = build_config("smoke", overrides={"loss": "on-policy"}).ftis_options()
    assert (onp.is_mode, onp.filter) == ("none", None)
    y = tmp_path / "run.yaml"
    y.write_text("collab: horizontal\ngroup_size: 6\nis_cap: 2E0\nnodes:\n  - {lr: 3e-4}\n")
    from_yaml = build_config("smoke", str(y), sets=("nodes.0.warmup_lr=1e-3", "epsilon=.25"))
    assert (from_yaml.nodes[0].lr, from_yaml.nodes[0].warmup_lr) == (3e-4, 1e-3)
    assert (from_yaml.is_cap, from_yaml.epsilon, from_yaml.group_size) == (2.0, 0.25, 6)
    with pytest.raises(ValueError, match="group_size"):
        build_config("smoke", str(y), n_nodes=4).validate(4)
    with pytest.raises(ValueError, match="lossy: expected a known key"):
        build_config(sets=("lossy=1",))
    a = build_config("smoke")
    b = build_config(
        "smoke", overrides={"rounds": 99, "timeout_s": 5}, sets=("nodes.1.fail_at_round=2",)
    )
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint() != build_config("smoke", overrides={"loss": "nois"}).fingerprint()


# -- node-side defences and the warm-up cache (no process group needed) --------------------------
def _bare_node(tmp_path, **overrides):
    from ftis_kernels.grpo.node import Node

    cfg = build_config("smoke", overrides=dict(out=str(tmp_path / "run"), **overrides))
    node = Node(cfg, 0, 2, torch.device("cpu"))
    node.tokenizer = build_tokenizer(node.problems.arith.vocabulary_text())
    return node


def _group(node, pid: int, rights: tuple[bool, ...], source: int = 1) -> list[Sample]:
    """An honest peer's group for `pid`: right or wrong completions, true rewards, the group
    advantages those rewards give."""
    task, tok = node.problems.arith, node.tokenizer
    problem = task.problem(pid)
    ids = {
        True: tok(task.target(problem))["input_ids"],
        False: tok(task.target(problem, gsm8k_format=False))["input_ids"],
    }
    rewards = torch.tensor([float(r) for r in rights])
    return [
        Sample(
            pid,
            source,
            torch.tensor(ids[r], dtype=torch.int32),
            torch.full((len(ids[r]),), -0.5),
            float(r),
            a,
        )
        for r, a in zip(rights, vertical_advantages(rewards[None]).flatten().tolist())
    ]


def test_verify_rewards_drops_false_claims_and_keeps_true_ones(tmp_path):
    node = _bare_node(tmp_path, verify_rewards=True)
    honest = _group(node, make_prompt_id("train", 3), (True, False, False, False))
    kept, drops = node.check_advantages(honest)
    assert kept == honest and drops == []
    g = torch.Generator().manual_seed(0)
    for kind in ("flipped_rewards", "random_tokens"):
        kept, drops = node.check_advantages(make_hostile(honest, kind, len(node.tokenizer), g))
        lies = [d for d in drops if d.kind == "verify"]
        assert lies and all("claimed reward" in d for d in lies)
        assert all(s.advantage == 0 for s in kept)  # a group of wrong answers teaches nothing
    forged = make_hostile(honest, "forged_logprobs", len(node.tokenizer), g)
    assert node.check_advantages(forged) == (forged, [])  # logprobs cannot be checked so


def test_warmup_cache_gives_the_fresh_warmup_weights_and_keys_on_the_recipe(tmp_path, monkeypatch):
    from ftis_kernels.grpo import models as models_module

    cache = tmp_path / "cache"
    fresh = _bare_node(tmp_path, warmup_cache=str(cache))
    fresh.spec.warmup_steps = 3
    fresh.model = build_model("tiny", fresh.tokenizer, fresh.cfg.init_seed(0))
    fresh.warm_up()
    files = list(cache.glob("*.pt"))
    assert len(files) == 1 and files[0].suffix == ".pt"
    again = _bare_node(tmp_path, warmup_cache=str(cache))
    again.spec.warmup_steps = 3
    again.model = build_model("tiny", again.tokenizer, again.cfg.init_seed(0))
    with monkeypatch.context() as m:
        m.setattr(models_module, "warm_up", lambda *a, **k: pytest.fail("cache not used"))
        again.warm_up()  # loads the file, trains nothing
    a, b = fresh.model.state_dict(), again.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = _bare_node(tmp_path, warmup_cache=str(cache), seed=1)  # another seed, another key
    other.spec.warmup_steps = 3
    other.model = build_model("tiny", other.tokenizer, other.cfg.init_seed(0))
    other.warm_up()
    assert len(list(cache.glob("*.pt"))) == 2
    assert other.cfg.init_seed(0) == fresh.cfg.init_seed(0) + 1000


def test_warm_up_advances_the_progress_bar_step_by_step_and_on_a_cache_hit(tmp_path):
    import io

    from tqdm import tqdm

    for attempt in ("fresh", "cached"):
        node = _bare_node(tmp_path, warmup_cache=str(tmp_path / "cache"))
        node.spec.warmup_steps = 3
        node.model = build_model("tiny", node.tokenizer, node.cfg.init_seed(0))
        seen = io.StringIO()
        bar = tqdm(total=3, desc="warm-up of node 0 (tiny-full)", file=seen)
        node.warm_up(bar)
        assert bar.n == 3, attempt
        assert ("loss" if attempt == "fresh" else "warm-up cache") in bar.postfix
        bar.close()
        assert "warm-up of node 0 (tiny-full)" in seen.getvalue()


_FIRST_REGION = """
import sys, torch
from ftis_kernels.grpo.process import set_threads
if sys.argv[1] == "set_threads":
    set_threads(2)
else:
    torch.set_num_threads(2)
x = torch.randn(21, 1000, generator=torch.Generator().manual_seed(0)) * 2
a = x.exp()  # the second half on the second thread
torch.set_num_threads(1)
print(int(torch.equal(a, x.exp())))
"""


def test_a_nodes_threads_compute_exp_as_one_thread_does_from_its_first_region():
    """The driver sets its threads with `set_threads`, so that its first parallel region is not
    one its results depend on: on a torch build with MKL, the second thread's `exp` there was
    sometimes up to 1.5e-4 off (`set_threads`' docstring). Ten fresh processes, each an exact
    match to one thread's result. Run with `plain` instead of `set_threads`, the script differed
    in 3 of 20 processes on this 2-core machine (2 to 6 of 30 in other runs), so a regression
    fails here one time in two or more; on a build without the race it cannot fail."""
    import os
    import subprocess
    import sys

    from tests.test_grpo_run import ROOT

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    runs = [
        subprocess.run(
            [sys.executable, "-c", _FIRST_REGION, "set_threads"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        for _ in range(10)
    ]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:]
    assert [r.stdout.split()[-1] for r in runs] == ["1"] * 10
