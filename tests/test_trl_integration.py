"""FTISGRPOTrainer inside TRL's real GRPOTrainer loop, on CPU, with no download.

A tiny Qwen2 built from a config and a character-level tokenizer are saved to a temporary folder
and loaded by path (TRL builds its reference model from that path when beta > 0). Plain
`GRPOTrainer` and `FTISGRPOTrainer` then train from the same folder with the same seed, so they
generate the same batches; with F-TIS reduced to TRL's loss, every step's loss and the weights
after the run must agree. SGD keeps a weight difference proportional to a gradient difference.
"""

import os
import subprocess
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("WANDB_MODE", "disabled")

trl = pytest.importorskip("trl")

import dataclasses  # noqa: E402
import math  # noqa: E402

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Regex, Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from ftis_kernels import FTISOptions  # noqa: E402
from ftis_kernels.integrations.trl import FTISGRPOConfig, FTISGRPOTrainer  # noqa: E402

PROMPTS = ["1+2=", "3+4=", "5+1=", "2+2=", "7+1=", "4+4=", "9+0=", "6+3="]
LOSS_TOL = 1e-5  # fp32, per step
WEIGHT_TOL = 1e-6  # after 2 SGD steps at lr 0.5: gradients agree to ~1e-6
# transformers 5 renamed gradient_checkpointing (TRL turns it on by default; off is faster here).
CHECKPOINTING = next(
    name
    for name in ("activation_checkpointing", "gradient_checkpointing")
    if name in {f.name for f in dataclasses.fields(trl.GRPOConfig)}
)


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1}
    for ch in "abcdefghijklmnopqrstuvwxyz0123456789 +=?.":
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _tiny_qwen2(vocab_size: int, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    )
    return Qwen2ForCausalLM(config)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-qwen2")
    tok = _tokenizer()
    _tiny_qwen2(len(tok), seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _vowel_reward(completions, **kwargs) -> list[float]:
    return [sum(ch in "aeiou" for ch in c) / (1 + len(c)) for c in completions]


def _train(trainer_cls, config_cls, model_dir, out_dir, rollout_func=None, **overrides):
    """Runs 2 optimisation steps; returns the trainer and, per compute_loss call, the batch's
    completion ids, its advantages and the loss."""
    options = dict(
        output_dir=str(out_dir),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        logging_steps=1,
        learning_rate=0.5,
        optim="sgd",
        seed=0,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    options[CHECKPOINTING] = False
    options.update(overrides)
    trainer = trainer_cls(
        model=model_dir,
        reward_funcs=_vowel_reward,
        args=config_cls(**options),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=_tokenizer(),
        rollout_func=rollout_func,
    )
    records = []
    compute_loss = trainer.compute_loss

    def recording_compute_loss(model, inputs, *args, **kwargs):
        loss = compute_loss(model, inputs, *args, **kwargs)
        records.append(
            (inputs["completion_ids"].clone(), inputs["advantages"].clone(), loss.item())
        )
        return loss

    trainer.compute_loss = recording_compute_loss
    trainer.train()
    return trainer, records


REDUCTION_CASES = {
    # Generation every 2 micro-batches: TRL's dapo divides by the generation batch's token count.
    "dapo-on-policy-gradient-accumulation": dict(
        loss_type="dapo", per_device_train_batch_size=4, gradient_accumulation_steps=2
    ),
    "grpo-beta-ref-epsilon_high-temperature-2-iterations": dict(
        loss_type="grpo",
        beta=0.1,
        use_bias_correction_kl=False,
        epsilon_high=0.28,
        temperature=0.7,
        num_iterations=2,
    ),
    # Completions of at most 5 tokens: TRL's dr_grpo divides by max_completion_length (8), not T.
    "dr_grpo-2-iterations-short-rollouts": dict(
        loss_type="dr_grpo", num_iterations=2, peer_tokens=5
    ),
    "bnpo-gradient-accumulation": dict(
        loss_type="bnpo", per_device_train_batch_size=4, gradient_accumulation_steps=2
    ),
    # The loss menu through TRL's real trainer: TRL's defaults for the KL (bias-corrected), the
    # entropy bonus under dapo-style scaling, a sequence-level ratio with two-sided clipping, OPSM
    # on another node's completions.
    "cispo-beta-bias-corrected-kl-entropy-accumulation": dict(
        loss_type="cispo",
        epsilon_high=1.1,
        beta=0.1,
        entropy_coef=0.05,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
    ),
    "gspo-delta-2-iterations": dict(
        loss_type="grpo",
        importance_sampling_level="sequence",
        delta=1.02,
        num_iterations=2,
    ),
    "luspo-opsm-peer": dict(loss_type="luspo", off_policy_mask_threshold=0.05, peer_tokens=8),
    # TRL's adaptive entropy controller: no bonus in the first window (no entropy measured yet),
    # then the coefficient raised by delta below the target and applied.
    "dapo-adaptive-entropy-accumulation": dict(
        loss_type="dapo",
        use_adaptive_entropy=True,
        entropy_coef=0.05,
        entropy_target=5.0,
        entropy_coef_delta=0.02,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
    ),
}


@pytest.fixture(scope="module")
def trl_runs(model_dir, tmp_path_factory):
    """Plain TRL's run of each case, done once for both F-TIS ops: case -> (weights, steps)."""
    runs = {}

    def run(case):
        if case not in runs:
            options, rollout = _case(case)
            out_dir = tmp_path_factory.mktemp("trl")
            trainer, steps = _train(
                trl.GRPOTrainer, trl.GRPOConfig, model_dir, out_dir, rollout_func=rollout, **options
            )
            runs[case] = (
                {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
                steps,
            )
        return runs[case]

    return run


def _case(case):
    options = dict(REDUCTION_CASES[case])
    peer_tokens = options.pop("peer_tokens", None)
    rollout = (
        None
        if peer_tokens is None
        else PeerRollout(_tokenizer(), seed=1, max_new_tokens=peer_tokens)
    )
    return options, rollout


@pytest.mark.parametrize("ftis_op", ["ftis_loss", "ftis_linear_loss"])
@pytest.mark.parametrize("case", list(REDUCTION_CASES))
def test_without_is_and_filter_each_step_loss_and_the_weights_equal_trl_grpo(
    case, ftis_op, model_dir, tmp_path, trl_runs
):
    trl_weights, trl_steps = trl_runs(case)
    options, rollout = _case(case)
    ftis_trainer, ftis_steps = _train(
        FTISGRPOTrainer,
        FTISGRPOConfig,
        model_dir,
        tmp_path,
        rollout_func=rollout,
        is_mode="none",
        filter=None,
        ftis_op=ftis_op,
        **options,
    )

    assert len(ftis_steps) == len(trl_steps) >= 2
    for step, ((trl_ids, _, trl_loss), (ftis_ids, _, ftis_loss)) in enumerate(
        zip(trl_steps, ftis_steps)
    ):
        assert torch.equal(trl_ids, ftis_ids), (
            f"micro-step {step}: the two trainers saw different batches"
        )
        assert abs(ftis_loss - trl_loss) <= LOSS_TOL, (
            f"micro-step {step}: {ftis_loss!r} vs TRL {trl_loss!r}"
        )
    for name, weight in ftis_trainer.model.named_parameters():
        err = (weight - trl_weights[name]).abs().max().item()
        assert err <= WEIGHT_TOL, f"{name}: weights after 2 steps differ by {err:.3e}"
    assert any(step["loss"] != 0 for step in ftis_trainer.state.log_history if "loss" in step)
    if options.get("use_adaptive_entropy"):
        assert ftis_trainer.entropy_coef > options["entropy_coef"], "the controller never moved"


class PeerRollout:
    """Another node's generator: a differently initialised tiny Qwen2 samples each completion and
    reports its per-token logprobs, the way the swarm does (TRL's `rollout_func` hook)."""

    def __init__(self, tokenizer, seed: int, max_new_tokens: int = 8, temperature: float = 1.0):
        self.tokenizer, self.max_new_tokens, self.temperature = (
            tokenizer,
            max_new_tokens,
            temperature,
        )
        self.model = _tiny_qwen2(len(tokenizer), seed=seed).eval()
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def __call__(self, prompts, trainer):
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for prompt in prompts:
            ids = self.tokenizer(prompt)["input_ids"]
            completion, logprobs = [], []
            for _ in range(self.max_new_tokens):
                logits = (
                    self.model(torch.tensor([ids + completion])).logits[0, -1] / self.temperature
                )
                logp = torch.log_softmax(logits.float(), dim=-1)
                token = torch.multinomial(logp.exp(), 1, generator=self.generator).item()
                completion.append(token)
                logprobs.append(logp[token].item())
                if token == self.tokenizer.eos_token_id:
                    break
            out["prompt_ids"].append(ids)
            out["completion_ids"].append(completion)
            out["logprobs"].append(logprobs)
        return out


@pytest.mark.parametrize("ftis_op", ["ftis_loss", "ftis_linear_loss"])
def test_ftis_metrics_are_logged_and_pi_gen_is_the_rollout_logprobs(ftis_op, model_dir, tmp_path):
    # With g = 0 every off-policy sample (KL > 0) counts as far off-policy, so the paper's filter
    # zeroes exactly the samples with A <= 0: the logged fraction must be theirs. Had pi_gen been
    # the trainer's own logprobs (KL = 0), nothing would be filtered.
    trainer, steps = _train(
        FTISGRPOTrainer,
        FTISGRPOConfig,
        model_dir,
        tmp_path,
        rollout_func=PeerRollout(_tokenizer(), seed=1),
        is_mode="tis",
        is_cap=2.0,
        filter="negative_offpolicy",
        kl_threshold=0.0,
        loss_type="grpo",
        ftis_op=ftis_op,
    )
    logged = [
        entry
        for entry in trainer.state.log_history
        if "loss" in entry and "train_loss" not in entry
    ]
    assert len(logged) == len(steps) == 2
    for entry, (_, advantages, _) in zip(logged, steps):
        for name in (
            "ftis/kl_mean",
            "ftis/filtered_frac",
            "ftis/is_weight_mean",
            "ftis/is_truncated_frac",
            "ftis/clip_frac",
        ):
            assert name in entry and math.isfinite(entry[name]), (
                f"{name} missing or not finite in {entry}"
            )
        assert entry["ftis/kl_mean"] > 0
        assert entry["ftis/filtered_frac"] == pytest.approx(
            (advantages <= 0).float().mean().item(), abs=1e-6
        )
        assert 0 < entry["ftis/is_weight_mean"] <= 2.0
        assert entry["ftis/is_weight_mean"] != pytest.approx(1.0, abs=1e-3)
        assert 0 <= entry["ftis/is_truncated_frac"] <= 1


# TRL's metrics FTISGRPOTrainer does not compute (its docstring says so), and run times.
NOT_LOGGED = ("clip_ratio/", "cispo_clip_ratio", "vespo/", "step_time", "train_", "total_flos")
METRIC_CASES = {
    # TRL's kl is the k3 times the PPO ratio (use_bias_correction_kl, its default), != 1 here.
    "grpo-bias-corrected-kl-2-iterations": dict(loss_type="grpo", beta=0.1, num_iterations=2),
    # With an entropy bonus TRL logs policy_loss (before the accumulation scaling, but for dapo)
    # and entropy_coef, static or adaptive.
    "grpo-static-entropy-accumulation": dict(
        loss_type="grpo",
        entropy_coef=0.05,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
    ),
    "dapo-adaptive-entropy-accumulation": REDUCTION_CASES["dapo-adaptive-entropy-accumulation"],
}


@pytest.mark.parametrize("case", list(METRIC_CASES))
def test_trls_metrics_are_logged_with_trls_values(case, model_dir, tmp_path):
    trl_run, _ = _train(
        trl.GRPOTrainer, trl.GRPOConfig, model_dir, tmp_path / "trl", **METRIC_CASES[case]
    )
    ftis_run, _ = _train(
        FTISGRPOTrainer,
        FTISGRPOConfig,
        model_dir,
        tmp_path / "ftis",
        is_mode="none",
        filter=None,
        **METRIC_CASES[case],
    )
    trl_logs, ftis_logs = trl_run.state.log_history, ftis_run.state.log_history
    assert len(trl_logs) == len(ftis_logs) >= 2
    for step, (want, got) in enumerate(zip(trl_logs, ftis_logs)):
        for name, value in want.items():
            if not name.startswith(NOT_LOGGED):
                assert got.get(name) == pytest.approx(value, rel=1e-5, abs=1e-6), (
                    f"log {step}: {name} = {got.get(name)!r}, TRL's {value!r}"
                )


@pytest.mark.parametrize("ftis_op", ["ftis_loss", "ftis_linear_loss"])
def test_on_policy_batches_take_pi_gen_as_pi_theta_at_the_sampling_temperature(
    ftis_op, model_dir, tmp_path
):
    # TRL generated with this very model and kept no logprobs: pi_gen = pi_theta, so w = 1 and
    # KL = 0 exactly, and even at g = 0 the off-policy filter removes nothing.
    trainer, steps = _train(
        FTISGRPOTrainer,
        FTISGRPOConfig,
        model_dir,
        tmp_path,
        max_steps=1,
        temperature=0.7,
        is_mode="vis",
        filter="offpolicy",
        kl_threshold=0.0,
        ftis_op=ftis_op,
    )
    entry = next(e for e in trainer.state.log_history if "ftis/kl_mean" in e)
    assert entry["ftis/kl_mean"] == 0 and entry["ftis/is_weight_mean"] == 1
    assert entry["ftis/filtered_frac"] == 0


class UnscoredRollout(PeerRollout):
    """A generator that could not score its tokens: TRL turns a None logprob into NaN."""

    def __call__(self, prompts, trainer):
        out = super().__call__(prompts, trainer)
        out["logprobs"] = [[None] * len(lp) for lp in out["logprobs"]]
        return out


def test_rollout_tokens_without_a_logprob_get_no_correction(model_dir, tmp_path):
    # As in TRL's vLLM path, a token the generator could not score is not corrected: pi_gen falls
    # back to the policy the weight reads, so w = 1 and KL = 0 instead of a NaN loss, also on the
    # second iteration, where TRL's pi_old is no longer the current policy.
    trainer, steps = _train(
        FTISGRPOTrainer,
        FTISGRPOConfig,
        model_dir,
        tmp_path,
        num_iterations=2,
        rollout_func=UnscoredRollout(_tokenizer(), seed=1),
        filter="offpolicy",
        kl_threshold=0.0,
    )
    entries = [e for e in trainer.state.log_history if "ftis/kl_mean" in e]
    assert len(entries) == len(steps) == 2
    for (_, _, loss), entry in zip(steps, entries):
        assert math.isfinite(loss)
        assert entry["ftis/kl_mean"] == 0 and entry["ftis/is_weight_mean"] == 1


REFUSED = [
    ("top_entropy_quantile", 0.2),
    ("ftis_op", "ftis_lossy"),
    ("is_mode", "sis"),
    ("is_cap", 0.0),
    ("kl_estimator", "k4"),
    ("epsilon_high", 0.0),
    ("loss_type", "ppo"),
]


@pytest.mark.parametrize("option,value", REFUSED, ids=[f"{o}={v}" for o, v in REFUSED])
def test_config_refuses_what_ftis_cannot_honour_naming_the_option(option, value, tmp_path):
    with pytest.raises(ValueError, match=option):
        FTISGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **{option: value})


def _config(tmp_path, **overrides):
    return FTISGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **overrides)


def test_config_maps_trl_loss_options_and_corrections_onto_the_op(tmp_path):
    args = _config(tmp_path)
    assert not args.vllm_importance_sampling_correction and args.use_bias_correction_kl
    assert _config(tmp_path, filter="none").filter is None  # the command line's None
    options = _config(
        tmp_path,
        loss_type="cispo",
        epsilon_high=5.0,
        beta=0.1,
        entropy_coef=0.01,
        importance_sampling_level="token",
        delta=None,
    ).ftis_options()
    assert (options.loss_type, options.epsilon_high, options.use_bias_correction_kl) == (
        "cispo",
        5.0,
        True,
    )
    assert (
        options.entropy_coef == 0.01 and options.max_completion_length == args.max_completion_length
    )
    gspo = _config(tmp_path, importance_sampling_level="sequence", delta=1.5).ftis_options()
    assert (gspo.ratio_level, gspo.delta) == ("sequence", 1.5)
    opsm = _config(tmp_path, off_policy_mask_threshold=0.3, filter=None).ftis_options()
    assert opsm == FTISOptions.preset(
        "opsm",
        kl_threshold=0.3,
        is_mode="tis",
        loss_type="dapo",
        use_bias_correction_kl=True,
        max_completion_length=512,
    )
    with pytest.raises(ValueError, match="^filter='negative'.*off_policy_mask_threshold"):
        _config(tmp_path, off_policy_mask_threshold=0.3, filter="negative")


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "vespo"])
def test_config_accepts_a_sequence_level_ratio_with_every_loss_type_trl_runs(loss_type, tmp_path):
    # TRL 1.16 runs these (tests/test_parity.py checks the loss against its own); the trainer
    # must not refuse a configuration TRL accepts.
    options = _config(
        tmp_path,
        loss_type=loss_type,
        importance_sampling_level="sequence",
        beta=0.04,
        use_bias_correction_kl=True,
    ).ftis_options()
    assert (options.loss_type, options.ratio_level) == (loss_type, "sequence")


@pytest.mark.parametrize(
    "mode,is_mode,is_level",
    [
        ("token_truncate", "tis", "token"),
        ("token_mask", "mask", "token"),
        ("sequence_truncate", "tis", "sequence_product"),
        ("sequence_mask", "mask", "sequence_product"),
    ],
)
def test_vllm_importance_sampling_modes_map_onto_the_ops_is_weight(
    mode, is_mode, is_level, tmp_path
):
    args = _config(
        tmp_path,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=0.5,
        vllm_importance_sampling_clip_max=4.0,
    )
    args.use_vllm, args.vllm_importance_sampling_correction = True, True  # no vLLM needed to map
    options = args.ftis_options()
    assert (options.is_mode, options.is_level, options.is_source) == (is_mode, is_level, "old")
    assert (options.is_cap_min, options.is_cap) == (0.5, 4.0)


def test_trainer_refuses_at_construction_a_config_changed_after_validation(model_dir, tmp_path):
    args = FTISGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        num_generations=4,
        per_device_train_batch_size=4,
    )
    args.top_entropy_quantile = 0.5
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        FTISGRPOTrainer(
            model=model_dir, reward_funcs=_vowel_reward, args=args, train_dataset=dataset
        )
    with pytest.raises(TypeError, match="FTISGRPOConfig"):
        FTISGRPOTrainer(
            model=model_dir,
            reward_funcs=_vowel_reward,
            train_dataset=dataset,
            args=trl.GRPOConfig(
                output_dir=str(tmp_path),
                use_cpu=True,
                report_to="none",
                num_generations=4,
                per_device_train_batch_size=4,
            ),
        )


def test_importing_ftis_kernels_does_not_import_trl():
    code = "import sys, ftis_kernels, ftis_kernels.integrations; assert 'trl' not in sys.modules, 'trl'"  # noqa: E501
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_trl_example_script_runs():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {
        k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"
    }  # the user's default CPU path
    result = subprocess.run(
        [sys.executable, "examples/trl_grpo.py", "--steps", "5"],
        cwd=root,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    assert "step   5  reward" in result.stdout, result.stdout


def test_a_bad_sampler_logprob_raises_in_compute_loss_before_the_backward(model_dir, tmp_path):
    """The trainer calls the op with value_check="deferred" and reads the verdict with the
    step's metrics: a positive log-probability from the rollout raises the op's error naming
    gen_logprobs from compute_loss, before any backward runs."""
    peer = PeerRollout(_tokenizer(), seed=1)

    def bad_rollout(prompts, trainer):
        out = peer(prompts, trainer)
        out["logprobs"][0] = [0.5, *out["logprobs"][0][1:]]  # log pi_gen > 0: not a probability
        return out

    with pytest.raises(ValueError, match="^gen_logprobs: expected finite values <= 0") as caught:
        _train(FTISGRPOTrainer, FTISGRPOConfig, model_dir, tmp_path, rollout_func=bad_rollout)
    frames = [entry.name for entry in caught.traceback]
    assert "raise_on_bad_values" in frames, frames
    assert "backward" not in frames and "_backward" not in frames, frames
