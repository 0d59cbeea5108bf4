"""`ftis_kernels.integrations.genrl` with GenRL's own classes (gensyn-genrl 0.3.0), on CPU.

Two tiny Qwen2 models of different sizes, built from a config, share the project's word-level
tokenizer (with a chat template). GenRL's `BaseGameManager`, `GameState`,
`SimpleTextDataManager` (with the transplanting of peers' rollouts that RL Swarm's data manager
does), `DefaultRewardManager` and its communication classes drive them; the stock
`GRPOLanguageTrainerModule` runs beside the F-TIS trainer on the same rollouts. Communication:
threads exchanging through GenRL's `Communication` interface, two processes over its `torch_comm`
backend (gloo), and its hivemind backend with two local peers: with hivemind 1.1.12 that module
does not import (`from hivemind import DHT, get_dht_time`; 1.1.12 has get_dht_time in
`hivemind.utils` only), so its test gives `hivemind` that name first (`_hivemind_backend`).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("genrl.trainer.grpo_trainer", reason="needs the 'genrl' extra (gensyn-genrl)")

from datasets import Dataset  # noqa: E402
from genrl.communication.communication import Communication  # noqa: E402
from genrl.communication.local.null_comm import NullCommunicationBackend  # noqa: E402
from genrl.data.text_data_managers import SimpleTextDataManager  # noqa: E402
from genrl.game.game_manager import BaseGameManager  # noqa: E402
from genrl.rewards.reward_manager import DefaultRewardManager  # noqa: E402
from genrl.rewards.reward_store import RewardFnStore, RoundRewardFnStore  # noqa: E402
from genrl.state import GameState  # noqa: E402
from genrl.trainer.grpo_trainer import GRPOLanguageTrainerModule, GRPOTrainerConfig  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from ftis_kernels import FTISOptions, ftis_linear_loss, ftis_loss  # noqa: E402
from ftis_kernels.grpo.tokenizer import build_tokenizer  # noqa: E402
from ftis_kernels.integrations.genrl import (  # noqa: E402
    Completion,
    FTISGRPOLanguageTrainerModule,
    make_record,
    read_record,
)

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [("what is 1 plus 2", "3"), ("what is 4 plus 4", "8")]
G = 3  # generations per prompt
REL_TOL = 1e-5


def _tokenizer():
    tok = build_tokenizer(["what", "is", "plus", "answer"])
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    return tok


TOKENIZER = _tokenizer()


def _model(hidden: int, layers: int, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(TOKENIZER),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        initializer_range=0.2,  # peaked enough that two random models disagree
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    )
    return Qwen2ForCausalLM(config)


def _config(**overrides) -> GRPOTrainerConfig:
    values = dict(
        max_new_tokens=6,
        num_generations=G,
        minibatch_size=2 * len(QUESTIONS) * G,
        enable_gradient_checkpointing=False,
        learning_rate=1e-3,
    )
    return GRPOTrainerConfig(**{**values, **overrides})


def _data(**_) -> Dataset:
    return Dataset.from_dict(
        {"question": [q for q, _ in QUESTIONS], "answer": [a for _, a in QUESTIONS]}
    )


def _reward(state: GameState) -> dict:
    """A reward that varies within every group: distinct characters of the completion / 10."""
    return {
        agent: {
            batch_id: [[len(set(c)) / 10 for c in node.actions] for node in tree[0]]
            for batch_id, tree in trees.items()
        }
        for agent, trees in state.trees.items()
    }


class TransplantDataManager(SimpleTextDataManager):
    """SimpleTextDataManager that puts the peers' rollouts into the game state, as RL Swarm's
    reasoning-gym data manager does (`genrl.examples.rgym.data`, less its reward ranking)."""

    def __init__(self):
        # Batch items keyed by the question's hash, as RL Swarm's (msgpack refuses int map keys).
        super().__init__(
            train_dataset=None,
            data_generator=_data,
            num_train_samples=None,
            batch_item_id_column="question",
        )

    def prepare_states(self, current_state, swarm_states):
        trees = current_state.trees
        for agent, batches in swarm_states.items():
            if agent in trees:
                continue
            trees[agent] = {}
            for batch_id, payloads in batches.items():
                tree = current_state.game_tree_factory(payloads[0].world_state)
                tree.append_node_actions(
                    stage=current_state.stage, node_idx=0, actions=payloads[0].actions
                )
                trees[agent][batch_id] = tree
        return current_state.get_latest_state()


def _rewards(rounds: int = 1) -> DefaultRewardManager:
    return DefaultRewardManager(
        RewardFnStore(max_rounds=rounds, reward_fn_stores=[RoundRewardFnStore(1, [_reward])])
    )


def _manager(trainer, name: str, communication=None, rounds: int = 1) -> BaseGameManager:
    gm = BaseGameManager(
        max_stage=1,
        max_round=rounds,
        game_state=GameState(0, 0),
        reward_manager=_rewards(rounds),
        trainer=trainer,
        data_manager=TransplantDataManager(),
        communication=communication or NullCommunicationBackend(),
    )
    gm.rank, gm.agent_ids = name, [name]
    pruners, brancher = gm.aggregate_game_state_methods()
    gm.state._init_game(
        gm.data_manager.get_round_data(),
        agent_keys=gm.agent_ids,
        world_state_pruners=pruners,
        game_tree_brancher=brancher,
    )
    return gm


def _play_stage(receiver: BaseGameManager, *peers: BaseGameManager) -> None:
    """GenRL's round up to training (`GameManager.run_game_round`), in lockstep in one process:
    every manager generates; the receiver gets all payloads; rewards are computed."""
    for gm in (receiver, *peers):
        gm.run_game_stage()
    payloads = {gm.rank: gm.state.get_latest_communication()[gm.rank] for gm in (receiver, *peers)}
    receiver.state.advance_stage(receiver.data_manager.prepare_states(receiver.state, payloads))
    receiver.rewards.update_rewards(receiver.state)


def _trainer(cls=FTISGRPOLanguageTrainerModule, hidden=32, layers=2, seed=0, config=None, **kw):
    return cls(
        [_model(hidden, layers, seed)], config or _config(), processing_class=TOKENIZER, **kw
    )


def _step_grads(trainer, gm) -> dict[str, torch.Tensor]:
    """Train the receiver's stage 0 with GenRL's `train`; the gradients of its (one) step."""
    grads: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def capture(*args, **kwargs):
        grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    trainer.train(gm.state, gm.data_manager, gm.rewards)
    trainer.optimizer.step = step
    return grads


def _rel(got: dict, want: dict) -> float:
    return max(((got[n] - want[n]).abs().max() / want[n].abs().max()).item() for n in want)


def _stage_samples(gm):
    """The stage's rollouts in GenRL's order with their advantages: (prompt text, completion,
    advantage), from GenRL's own state and reward manager."""
    inputs, mapping = gm.data_manager.prepare_input(gm.state.get_stage_state(0), 0)
    actions, rewards = gm.state.get_stage_actions(0), gm.rewards[0]
    out = []
    for i in range(len(mapping)):
        a, b, n = mapping[i]
        r = torch.tensor(rewards[a][b][n])
        adv = (r - r.mean()) / (r.std() + 1e-8)
        prompt = TOKENIZER.apply_chat_template(
            inputs[i]["prompt"], tokenize=False, add_generation_prompt=True
        )
        out += [(prompt, c, float(adv[g])) for g, c in enumerate(actions[a][b][n])]
    return out


def _op_grads(model, samples, options) -> tuple[dict, dict]:
    """Our op on the batch, built here from the rollouts: the generators' tokens and log pi_gen
    from the records, prompts left-padded, completions right-padded, generate's position ids."""
    model = copy.deepcopy(model)
    prompts = TOKENIZER([p for p, _, _ in samples], padding=True, return_tensors="pt")
    records = [c.record for _, c, _ in samples]
    comps = [torch.frombuffer(bytearray(r["token_ids"]), dtype=torch.int32) for r in records]
    gens = [torch.frombuffer(bytearray(r["logprobs"]), dtype=torch.float32) for r in records]
    B, C, P = len(samples), max(len(c) for c in comps), prompts.input_ids.shape[1]
    tokens = torch.zeros(B, C, dtype=torch.long)
    mask = torch.zeros(B, C, dtype=torch.bool)
    gen = torch.zeros(B, C)
    for b, ids in enumerate(comps):
        tokens[b, : len(ids)], mask[b, : len(ids)], gen[b, : len(ids)] = ids, True, gens[b]
    input_ids = torch.cat([prompts.input_ids, tokens], 1)
    attention = torch.cat([prompts.attention_mask, mask.long()], 1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    hidden = model.model(input_ids, attention_mask=attention, position_ids=positions)
    hidden = hidden.last_hidden_state[:, P - 1 : -1]
    adv = torch.tensor([a for _, _, a in samples])
    loss, metrics = ftis_linear_loss(
        hidden, model.lm_head.weight, tokens, gen, adv, mask, options=options
    )
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, metrics


def _nois_grads_in_genrls_layout(model, samples) -> tuple[dict, dict]:
    """Our op with no IS weight and no filter (pi_gen = pi_old = pi_theta) on the batch as
    GenRL's stock trainer builds it: the text re-tokenized, prompts and completions each
    left-padded, no position ids, GenRL's token mean and clip (epsilon 0.2, epsilon_high 0.28)."""
    model = copy.deepcopy(model)
    prompts = TOKENIZER([p for p, _, _ in samples], padding=True, return_tensors="pt")
    comps = TOKENIZER([str(c) for _, c, _ in samples], padding=True, return_tensors="pt")
    C = comps.input_ids.shape[1]
    input_ids = torch.cat([prompts.input_ids, comps.input_ids], 1)
    attention = torch.cat([prompts.attention_mask, comps.attention_mask], 1).float()
    logits = model(input_ids, attention_mask=attention, logits_to_keep=C + 1).logits[:, :-1]
    tokens, mask = comps.input_ids, comps.attention_mask.bool()
    with torch.no_grad():
        gen = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    adv = torch.tensor([a for _, _, a in samples])
    loss, metrics = ftis_loss(logits, tokens, gen, adv, mask, options=NOIS)
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, metrics


F_TIS = FTISOptions.preset("f-tis", loss_type="bnpo", epsilon_high=0.28)
NOIS = FTISOptions.preset("grpo", loss_type="bnpo", epsilon_high=0.28)


@pytest.fixture(scope="module")
def two_peers():
    """Receiver A (F-TIS, 32 wide, 2 layers) and peer B (48 wide, 3 layers): one stage played."""
    a = _manager(_trainer(seed=0), "A")
    b = _manager(_trainer(hidden=48, layers=3, seed=1), "B")
    _play_stage(a, b)
    return a, b


# --- generation --------------------------------------------------------------------------------


def test_generation_records_the_generators_tokens_and_logprobs_at_the_temperature():
    trainer = _trainer(config=_config(temperature=0.7))
    gm = _manager(trainer, "A")
    _play_stage(gm)
    completions = [c for node in gm.state.get_stage_actions(0)["A"].values() for c in node[0]]
    assert len(completions) == len(QUESTIONS) * G
    for c in completions:
        assert isinstance(c, Completion) and c.record is not None
        n = len(c.record["token_ids"]) // 4
        assert n >= 1 and len(c.record["logprobs"]) == 4 * n  # 8 bytes per token
        kind, (ids, gen) = read_record(
            c.record,
            str(c),
            len(TOKENIZER),
            trainer.fingerprint,
            lambda i: TOKENIZER.decode(i, skip_special_tokens=True),
        )
        assert kind == "recorded"
    # log pi_gen is the model's log-softmax at the temperature, on the generator's tokens.
    samples = _stage_samples(gm)
    neutral = FTISOptions(is_mode="none", filter=None, temperature=0.7)
    _, metrics = _op_grads(trainer.model, samples, neutral)
    for b, (_, c, _) in enumerate(samples):
        gen = torch.frombuffer(bytearray(c.record["logprobs"]), dtype=torch.float32)
        torch.testing.assert_close(metrics["logp"][b, : len(gen)], gen, rtol=1e-5, atol=1e-5)


def test_the_sampler_draws_from_the_whole_vocabulary_as_recorded():
    """pi_gen is recorded as the model's softmax over the whole vocabulary: the sampler must not
    keep only its top k (transformers replaces a top_k of None by 50 at generate time; these
    tests' other vocabularies are smaller than that). config.top_k = 0 is off too."""
    tok = build_tokenizer([f"w{i}" for i in range(300)])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=1,
        )
    )  # fmt: skip
    for top_k in (None, 0):
        trainer = FTISGRPOLanguageTrainerModule([model], _config(top_k=top_k), processing_class=tok)
        ids = torch.randint(60, len(tok), (32, 4))
        with torch.no_grad():
            config = trainer.generation_config
            out = trainer.model.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=config
            )
        logits = torch.stack(out.scores, 1)
        taken = out.sequences[:, ids.shape[1] :]
        rank = (logits > logits.gather(-1, taken[..., None])).sum(-1)
        # Near-uniform over ~300 tokens: most draws rank past 50 unless only the top 50 are kept.
        assert (rank >= 50).float().mean() > 0.5, rank.max()


def test_a_checkpoints_sampling_defaults_change_neither_the_sampler_nor_pi_gen():
    """A checkpoint's generation_config (here a near-argmax sampler: temperature 0.01, top_p,
    min_p, typical_p, a repetition penalty, no repeated token) must not reach the trainer's
    sampling: transformers 4.50-4.x replaces each setting equal to a global default
    (temperature 1, top_p 1...) by the checkpoint's, 5.x fills what is left unset. The trainer
    samples from the model at its configured temperature and records that distribution as
    pi_gen."""
    trainer = _trainer(config=_config(temperature=1.0))
    trainer.model.generation_config.update(
        temperature=0.01, top_p=0.01, min_p=1.0, typical_p=0.01, repetition_penalty=1.5,
        no_repeat_ngram_size=1,
    )  # fmt: skip
    gm = _manager(trainer, "A")
    _play_stage(gm)
    # Near-argmax sampling would give each prompt G equal completions.
    for node in gm.state.get_stage_actions(0)["A"].values():
        assert len({bytes(c.record["token_ids"]) for c in node[0]}) > 1, "argmax draws"
    samples = _stage_samples(gm)
    _, metrics = _op_grads(
        trainer.model, samples, FTISOptions(is_mode="none", filter=None, temperature=1.0)
    )
    for b, (_, c, _) in enumerate(samples):
        gen = torch.frombuffer(bytearray(c.record["logprobs"]), dtype=torch.float32)
        torch.testing.assert_close(metrics["logp"][b, : len(gen)], gen, rtol=1e-5, atol=1e-5)


# --- the update --------------------------------------------------------------------------------


def test_ftis_update_equals_the_op_on_the_generators_tokens(two_peers):
    a, _ = two_peers
    trainer = a.trainer
    before = copy.deepcopy(trainer.model)
    samples = _stage_samples(a)
    assert len(samples) == 2 * len(QUESTIONS) * G  # A's own rollouts and B's, transplanted
    grads = _step_grads(trainer, a)
    want, metrics = _op_grads(before, samples, F_TIS)
    assert _rel(grads, want) <= REL_TOL
    m = trainer._metrics["train"]
    assert m["ftis/recorded"][-1] == len(samples) and m["ftis/dropped"][-1] == 0
    # The peer's rollouts are off-policy for A: the IS weight acts on them (and only them).
    assert metrics["is_truncated_frac"] > 0 and m["ftis/is_truncated_frac"][-1] > 0
    own = len(QUESTIONS) * G
    assert metrics["kl"][:own].abs().max() < 1e-4 < metrics["kl"][own:].min()


def test_stock_genrl_trainer_on_the_same_rollouts_trains_them_as_nois(two_peers):
    a, _ = two_peers
    stock = _trainer(GRPOLanguageTrainerModule, seed=0)
    ftis = _trainer(seed=0)
    samples = _stage_samples(a)
    # The stock trainer's update is the op with no IS weight and no filter (NoIS) on the
    # re-tokenized text; the F-TIS trainer's differs from it on the same rollouts.
    stock_grads = _step_grads(stock, a)
    nois, nois_metrics = _nois_grads_in_genrls_layout(_model(32, 2, 0), samples)
    stock_vs_nois = _rel(stock_grads, nois)
    ftis_grads = _step_grads(ftis, a)
    ftis_vs_nois = _rel(ftis_grads, nois)
    assert nois_metrics["is_weight_mean"] == 1 and nois_metrics["filtered_frac"] == 0
    assert stock_vs_nois <= REL_TOL, stock_vs_nois
    assert ftis_vs_nois > 1e-2, ftis_vs_nois


@pytest.mark.parametrize("policy", ["nois", "drop"])
def test_rollouts_without_a_record_follow_the_policy_and_are_counted(policy):
    a = _manager(_trainer(seed=0, unrecorded=policy), "A")
    stock_peer = _manager(_trainer(GRPOLanguageTrainerModule, hidden=48, layers=3, seed=1), "B")
    _play_stage(a, stock_peer)
    samples = _stage_samples(a)
    own = len(QUESTIONS) * G
    assert all(type(c) is str for _, c, _ in samples[own:])  # the stock peer's plain text
    grads = _step_grads(a.trainer, a)
    m = a.trainer._metrics["train"]
    assert (m["ftis/recorded"][-1], m["ftis/unrecorded"][-1]) == (own, own)
    assert m["ftis/dropped"][-1] == (own if policy == "drop" else 0)
    assert all(g.abs().max() > 0 for g in grads.values() if g is not None)


def test_a_rollout_without_a_record_gets_weight_one_and_kl_zero():
    trainer = _trainer(seed=0)
    a = _manager(trainer, "A")
    a.run_game_stage()
    samples, counts = trainer._samples(
        [[str(c) for c in node[0]] for node in a.state.get_stage_actions(0)["A"].values()],
        torch.ones(len(QUESTIONS), G),
    )
    assert counts["unrecorded"] == len(samples) == len(QUESTIONS) * G
    inputs, _ = a.data_manager.prepare_input(a.state.get_stage_state(0), 0)
    batch = trainer._batch(samples, trainer._process_inputs(inputs, for_training=True))
    with torch.no_grad():
        batch["old"], batch["ref"] = trainer._logprobs(trainer.model, batch), None
    _, metrics = trainer.minibatch_loss(batch, torch.arange(len(samples)))
    assert metrics["is_weight_mean"] == 1 and metrics["kl"].abs().max() == 0


def test_empty_completions_without_a_record_are_not_trained_on():
    """A stock peer's empty completion re-tokenizes to no token: it has nothing to train on, and
    a minibatch of such rows (or a stage of them) is no update, not an error."""
    trainer = _trainer(seed=0, config=_config(minibatch_size=1))
    a = _manager(trainer, "A")
    a.run_game_stage()
    texts = [[str(c) for c in node[0]] for node in a.state.get_stage_actions(0)["A"].values()]
    texts[0] = [""] * G
    samples, _ = trainer._samples(texts, torch.randn(len(QUESTIONS), G))
    inputs, _ = a.data_manager.prepare_input(a.state.get_stage_state(0), 0)
    prompts = trainer._process_inputs(inputs, for_training=True)
    losses, metrics = trainer._update(samples, prompts)
    assert len(losses) == len(metrics["kl_mean"]) == (len(QUESTIONS) - 1) * G
    assert all(torch.isfinite(loss) for loss in losses)
    assert trainer._update(samples[:G], prompts) == ([], {name: [] for name in metrics})


def test_a_record_from_another_tokenizer_gets_no_token_level_ratio(two_peers):
    a, _ = two_peers
    trainer = a.trainer
    c = _stage_samples(a)[-1][1]
    other = Completion(str(c), {**c.record, "tokenizer": "0" * 64})
    bigger = Completion(str(c), {**c.record, "vocab_size": c.record["vocab_size"] + 1})
    samples, counts = trainer._samples([[other, bigger]], torch.ones(1, 2))
    assert counts["other_tokenizer"] == 2 and counts["recorded"] == 0
    assert all(s.gen_logprobs is None for s in samples)  # NoIS on the re-tokenized text


def _malformed(record: dict) -> list[tuple[str, dict]]:
    """(the reason's words, a malformed copy of `record`), one per check of `read_record`."""
    ids, logp = record["token_ids"], record["logprobs"]
    n = len(ids) // 4

    def packed(key: str, ids=None, logp=None) -> bytes:
        zeros = torch.zeros(n)
        return make_record(zeros if ids is None else ids, zeros if logp is None else logp, 1, "")[
            key
        ]

    shuffled = ids[4:] + ids[:4] if n > 1 else packed("token_ids", ids=torch.tensor([3]))
    return [
        ("expected a dict", {k: v for k, v in record.items() if k != "logprobs"}),
        ("must be bytes", {**record, "logprobs": list(logp)}),
        ("no tokens", {**record, "token_ids": b"", "logprobs": b""}),
        ("bytes of token ids", {**record, "logprobs": logp[:-4]}),
        ("outside", {**record, "token_ids": packed("token_ids", ids=torch.full((n,), 10**6))}),
        ("not finite", {**record, "logprobs": packed("logprobs", logp=torch.full((n,), math.nan))}),
        ("<= 0", {**record, "logprobs": packed("logprobs", logp=torch.full((n,), 0.5))}),
        ("do not decode", {**record, "token_ids": shuffled}),
    ]


def test_a_malformed_record_is_dropped_with_its_reason_never_trained_on(two_peers, caplog):
    a, _ = two_peers
    trainer = a.trainer
    c = next(c for _, c, _ in _stage_samples(a) if len(set(str(c))) > 1)
    bad = _malformed(c.record)
    decode = lambda i: TOKENIZER.decode(i, skip_special_tokens=True)  # noqa: E731
    for reason, record in bad:
        kind, why = read_record(record, str(c), len(TOKENIZER), trainer.fingerprint, decode)
        assert kind == "malformed" and reason in why, (reason, why)
    with caplog.at_level(logging.WARNING, logger="ftis_kernels.integrations.genrl"):
        samples, counts = trainer._samples(
            [[Completion(str(c), r) for _, r in bad] + [c]], torch.ones(1, len(bad) + 1)
        )
    assert counts["malformed"] == counts["dropped"] == len(bad) and len(samples) == 1
    assert sum("malformed record" in r.message for r in caplog.records) == len(bad)


# --- configuration -----------------------------------------------------------------------------

REFUSED = [
    ("config.top_p", dict(config=_config(top_p=0.9))),
    ("config.top_k", dict(config=_config(top_k=5))),
    ("config.min_p", dict(config=_config(min_p=0.1))),
    ("config.repetition_penalty", dict(config=_config(repetition_penalty=1.2))),
    ("config.epsilon", dict(config=_config(epsilon=1.5))),
    ("config.epsilon_high", dict(config=_config(epsilon_high=0.0))),
    ("config.beta", dict(config=_config(beta=-1.0))),
    ("config.temperature", dict(config=_config(temperature=0.0))),
    ("config.ppo_epochs", dict(config=_config(ppo_epochs=0))),
    ("config.minibatch_size", dict(config=_config(minibatch_size=0))),
    ("ftis.epsilon", dict(ftis={"epsilon": 0.1})),
    ("is_cap", dict(ftis={"is_cap": -1.0})),
    ("preset", dict(preset="ppo")),
    ("ftis_op", dict(ftis_op="ftis_lossy")),
    ("unrecorded", dict(unrecorded="keep")),
]


@pytest.mark.parametrize("key,kwargs", REFUSED, ids=[k for k, _ in REFUSED])
def test_a_config_value_the_trainer_cannot_honour_is_refused_naming_the_key(key, kwargs):
    model = _model(32, 2, 0)

    def no_rollout(*args, **kw):
        raise AssertionError("generated before refusing")

    model.generate = no_rollout
    config = kwargs.pop("config", _config())
    with pytest.raises(ValueError, match=rf"^{key}: expected"):
        FTISGRPOLanguageTrainerModule([model], config, processing_class=TOKENIZER, **kwargs)


def test_genrl_config_and_presets_map_onto_the_op():
    trainer = _trainer(
        config=_config(epsilon=0.1, epsilon_high=0.3, beta=0.02, temperature=0.8),
        preset="tis",
        ftis={"is_cap": 3.0},
    )
    want = FTISOptions.preset(
        "tis",
        loss_type="bnpo",
        use_bias_correction_kl=False,
        epsilon=0.1,
        epsilon_high=0.3,
        beta=0.02,
        temperature=0.8,
        is_cap=3.0,
    )
    assert trainer.ftis == want and trainer.ref_model is not None


# --- the game, driven by GenRL ----------------------------------------------------------------


class PairBoard(Communication):
    """All-gather between game managers in threads of one process (GenRL's `Communication`
    interface; its null backend gathers one peer only)."""

    def __init__(self, name: str, board: dict, barrier: threading.Barrier):
        self.name, self.board, self.barrier = name, board, barrier

    def all_gather_object(self, obj, *args, **kwargs):
        self.board[self.name] = obj
        self.barrier.wait()
        out = dict(self.board)
        self.barrier.wait()
        return out

    def get_id(self):
        return self.name


def _serialised(train, lock: threading.Lock):
    def locked(*args, **kwargs):
        with lock:
            return train(*args, **kwargs)

    return locked


def test_genrl_game_manager_drives_two_peers_of_different_sizes_for_rounds():
    rounds = 2
    board, barrier = {}, threading.Barrier(2, timeout=120)
    peers = {
        "A": _trainer(seed=0),
        "B": _trainer(hidden=48, layers=3, seed=1, preset="tis"),
    }
    before = {k: copy.deepcopy(t.model) for k, t in peers.items()}
    # Triton's interpreter (the CPU path of the tests) keeps global state: one update at a time.
    # Peers run in processes of their own in a swarm; here the threads share one interpreter.
    interpreter = threading.Lock()
    for trainer in peers.values():
        trainer.train = _serialised(trainer.train, interpreter)
    managers = []
    for name, trainer in peers.items():
        gm = BaseGameManager(
            max_stage=1,
            max_round=rounds,
            game_state=GameState(0, 0),
            reward_manager=_rewards(rounds),
            trainer=trainer,
            data_manager=TransplantDataManager(),
            communication=PairBoard(name, board, barrier),
        )
        managers.append(gm)
    threads = [threading.Thread(target=gm.run_game) for gm in managers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for name, trainer in peers.items():
        m = trainer._metrics["train"]
        # GenRL logs and swallows a training error: the metrics prove each round trained.
        assert m["ftis/recorded"] == [2 * len(QUESTIONS) * G] * rounds, (name, dict(m))
        assert m["ftis/kl_mean"][-1] > 0  # the other peer's rollouts are off-policy
        moved = any(
            not torch.equal(p, q)
            for p, q in zip(trainer.model.parameters(), before[name].parameters())
        )
        assert moved, name


def _torch_comm_peer(rank: int, port: int, out: str) -> None:
    """One peer of a two-process swarm over GenRL's `torch_comm` backend (gloo): one round."""
    import json

    import torch.distributed as dist
    from genrl.communication.distributed.torch_comm import TorchBackend

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    trainer = _trainer(hidden=(32, 48)[rank], layers=(2, 3)[rank], seed=rank)
    gm = BaseGameManager(
        max_stage=1,
        max_round=1,
        game_state=GameState(0, 0),
        reward_manager=_rewards(),
        trainer=trainer,
        data_manager=TransplantDataManager(),
        communication=TorchBackend(),
    )
    gm.run_game()
    dist.barrier()
    dist.destroy_process_group()
    Path(out).write_text(json.dumps({k: v for k, v in trainer._metrics["train"].items()}))


def test_two_peer_processes_exchange_records_through_genrls_torch_comm_backend(tmp_path):
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = "import sys; sys.path.insert(0, 'tests'); import test_genrl_integration as t; "
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                code + f"t._torch_comm_peer({r}, {port}, {str(tmp_path / str(r))!r})",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, logs[r][-3000:]
        m = json.loads((tmp_path / str(r)).read_text())
        # Its own rollouts and the other process's, unpickled with their records.
        assert m["ftis/recorded"] == [2 * len(QUESTIONS) * G], (r, m, logs[r][-2000:])
        assert m["ftis/kl_mean"][0] > 0


def _hivemind_backend():
    """GenRL's HivemindBackend class. With hivemind 1.1.12 its module does not import
    (`from hivemind import DHT, get_dht_time`: 1.1.12 has get_dht_time in hivemind.utils only);
    the shim gives the name the module expects, the same function, and changes nothing else."""
    hivemind = pytest.importorskip("hivemind")
    if not hasattr(hivemind, "get_dht_time"):
        hivemind.get_dht_time = hivemind.utils.get_dht_time
    from genrl.communication.hivemind import hivemind_backend

    return hivemind_backend


def test_over_genrls_hivemind_backend_records_are_lost_and_the_policy_applies(monkeypatch):
    # msgpack writes a str subclass as a plain str: the peer's completions arrive as text only,
    # so the receiver trains them by its `unrecorded` policy (NoIS here) and counts them.
    backend = _hivemind_backend()
    monkeypatch.setenv("HIVEMIND_WORLD_SIZE", "2")
    monkeypatch.setattr(backend.HivemindRendezvouz, "_IS_MASTER", True)
    first = backend.HivemindBackend(timeout=60)
    second = backend.HivemindBackend(
        initial_peers=[str(a) for a in first.dht.get_visible_maddrs()], timeout=60
    )
    try:
        a = _manager(_trainer(seed=0), "A", communication=first)
        b = _manager(_trainer(hidden=48, layers=3, seed=1), "B", communication=second)
        for gm in (a, b):
            gm.run_game_stage()
        gathered = {}

        def gather(gm):
            gathered[gm.rank] = gm.communication.all_gather_object(
                gm.state.get_latest_communication()[gm.rank]
            )

        threads = [threading.Thread(target=gather, args=(gm,)) for gm in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        received = gathered["A"]
        assert len(received) == 2  # keyed by hivemind peer id
        peer = {k: v for k, v in received.items() if k != str(first.dht.peer_id)}
        (payloads,) = peer.values()
        swarm = {"A": a.state.get_latest_communication()["A"], "B": payloads}
        a.state.advance_stage(a.data_manager.prepare_states(a.state, swarm))
        a.rewards.update_rewards(a.state)
        own = len(QUESTIONS) * G
        assert all(type(c) is str for _, c, _ in _stage_samples(a)[own:])
        a.trainer.train(a.state, a.data_manager, a.rewards)
        m = a.trainer._metrics["train"]
        assert (m["ftis/recorded"], m["ftis/unrecorded"], m["ftis/dropped"]) == (
            [own],
            [own],
            [0],
        )
    finally:
        first.dht.shutdown()
        second.dht.shutdown()


def test_genrl_example_runs_as_written():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the user's CPU path
    out = subprocess.run(
        [sys.executable, "examples/genrl_ftis.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "F-TIS" in out.stdout
