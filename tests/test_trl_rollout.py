"""`PeerRollout`, the supported TRL rollout_func for collaborative GRPO in one process, and the
notice `FTISGRPOTrainer` logs when pi_gen is pi_old on every token (F-TIS then corrects nothing)."""

import logging
import math
from types import SimpleNamespace

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402

from ftis_kernels.integrations.trl import FTISGRPOConfig, FTISGRPOTrainer, PeerRollout  # noqa: E402
from tests.test_trl_integration import _tiny_qwen2, _tokenizer, _train  # noqa: E402

NOTICE = "pi_gen equals pi_old on every completion token"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-qwen2")
    tok = _tokenizer()
    _tiny_qwen2(len(tok), seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _trainer_view(policy, tokenizer, **args):
    """What PeerRollout reads of a GRPOTrainer: its config, tokenizer, accelerator and model."""
    config = dict(
        num_generations=4,
        max_completion_length=6,
        temperature=0.7,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
    )
    config.update(args)
    return SimpleNamespace(
        args=SimpleNamespace(**config),
        processing_class=tokenizer,
        accelerator=SimpleNamespace(unwrap_model=lambda model: model),
        model=policy,
    )


def test_peer_rollout_samples_groups_in_turn_with_each_samplers_logprobs():
    tok = _tokenizer()
    policy, peer = _tiny_qwen2(len(tok), seed=0), _tiny_qwen2(len(tok), seed=1)
    policy.train()
    torch.manual_seed(0)
    out = PeerRollout([peer])(["1+2="] * 4 + ["3+4="] * 4, _trainer_view(policy, tok))
    assert policy.training, "the trained model's mode is restored"
    assert len(out["completion_ids"]) == len(out["logprobs"]) == len(out["prompt_ids"]) == 8
    for i, (prompt, completion, logprobs) in enumerate(
        zip(out["prompt_ids"], out["completion_ids"], out["logprobs"])
    ):
        assert len(completion) == len(logprobs) >= 1
        assert tok.eos_token_id not in completion[:-1], "cut after the first eos"
        sampler = policy if i < 4 else peer  # group 0: the policy, group 1: the peer
        with torch.no_grad():
            logits = sampler.eval()(torch.tensor([prompt + completion])).logits[0].float()
        policy.train()
        expected = (logits[len(prompt) - 1 : -1] / 0.7).log_softmax(-1)
        expected = expected.gather(-1, torch.tensor(completion)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logprobs), expected, rtol=1e-5, atol=1e-5)


def test_peer_rollout_refuses_bad_arguments_naming_them():
    tok = _tokenizer()
    with pytest.raises(ValueError, match="^peers: expected a non-empty list"):
        PeerRollout([])
    with pytest.raises(ValueError, match=r"^peers\[0\]: expected a causal LM with `generate`"):
        PeerRollout([torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="^own_groups: expected an int >= 0"):
        PeerRollout([_tiny_qwen2(len(tok), seed=1)], own_groups=-1)
    other_vocab = PeerRollout([_tiny_qwen2(len(tok) + 3, seed=1)], own_groups=0)
    with pytest.raises(ValueError, match="^peers: a peer has a vocabulary of"):
        other_vocab(["1+2="] * 4, _trainer_view(_tiny_qwen2(len(tok), seed=0), tok))


def test_peer_rollout_samples_num_generations_eval_per_prompt_while_trl_evaluates():
    """TRL evaluates with num_generations_eval completions per prompt (here 2, training 4):
    every completion is sampled from its own row's prompt."""
    tok = _tokenizer()
    policy, peer = _tiny_qwen2(len(tok), seed=0), _tiny_qwen2(len(tok), seed=1)
    policy.eval()  # TRL's evaluation mode
    prompts = ["1+2="] * 2 + ["3+4="] * 2
    view = _trainer_view(policy, tok, num_generations=4, num_generations_eval=2)
    out = PeerRollout([peer])(prompts, view)
    assert out["prompt_ids"] == [tok(p)["input_ids"] for p in prompts]
    assert len(out["completion_ids"]) == len(out["logprobs"]) == 4
    with pytest.raises(ValueError, match="^prompts: expected groups of 2 equal prompts"):
        PeerRollout([peer])(["1+2=", "3+4="] * 2, view)


def _notices(caplog) -> int:
    return sum(NOTICE in r.getMessage() for r in caplog.records)


def test_an_on_policy_run_is_noticed_once_and_a_peer_run_acts(model_dir, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="ftis_kernels.integrations.trl")
    # No rollout_func: TRL samples with the policy, pi_gen = pi_old, F-TIS is GRPO (2 steps).
    trainer, steps = _train(FTISGRPOTrainer, FTISGRPOConfig, model_dir, tmp_path / "own")
    assert len(steps) == 2 and _notices(caplog) == 1
    logged = [e for e in trainer.state.log_history if "ftis/kl_mean" in e]
    assert all(e["ftis/kl_mean"] == 0 and e["ftis/is_weight_mean"] == 1 for e in logged)

    caplog.clear()
    peer = _tiny_qwen2(len(_tokenizer()), seed=1)
    trainer, _ = _train(
        FTISGRPOTrainer,
        FTISGRPOConfig,
        model_dir,
        tmp_path / "peer",
        rollout_func=PeerRollout([peer]),
    )
    assert _notices(caplog) == 0
    logged = [e for e in trainer.state.log_history if "ftis/kl_mean" in e]
    assert len(logged) == 2
    for entry in logged:
        assert entry["ftis/kl_mean"] > 1e-3 and math.isfinite(entry["ftis/kl_mean"])
        assert abs(entry["ftis/is_weight_mean"] - 1) > 1e-3
