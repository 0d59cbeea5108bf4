"""FTISGRPOTrainer's pi_old / reference passes run ftis_logprobs (the loss's row kernels, from the
hidden states): the same log-probabilities as TRL's own pass, at the temperature, 0 at padding."""

import pytest

trl = pytest.importorskip("trl")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from ftis_kernels.integrations.trl import FTISGRPOConfig, FTISGRPOTrainer  # noqa: E402
from ftis_kernels.integrations.trl import trainer as ftis_trl  # noqa: E402
from tests.test_trl_integration import (  # noqa: E402
    CHECKPOINTING,
    PROMPTS,
    _tiny_qwen2,
    _tokenizer,
    _vowel_reward,
)


def test_old_and_ref_logprobs_come_from_ftis_logprobs_and_equal_trls(tmp_path, monkeypatch):
    tok = _tokenizer()
    _tiny_qwen2(len(tok), seed=0).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    args = FTISGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        bf16=False,
        per_device_train_batch_size=4,
        num_generations=2,
        temperature=0.7,
        **{CHECKPOINTING: False},
    )
    trainer = FTISGRPOTrainer(
        model=str(tmp_path / "m"),
        reward_funcs=_vowel_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tok,
    )
    calls = []
    real = ftis_trl.ftis_logprobs
    monkeypatch.setattr(ftis_trl, "ftis_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, len(tok), (4, 9), generator=g)
    mask = torch.ones(4, 9, dtype=torch.long)
    mask[1, 7:] = 0  # a short completion
    got, entropy, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, ids, mask, 4, batch_size=3, compute_entropy=True
    )
    want, want_entropy, _ = GRPOTrainer._get_per_token_logps_and_entropies(
        trainer, trainer.model, ids, mask, 4, batch_size=3, compute_entropy=True
    )
    assert calls == [1, 1]  # two chunks of rows, both through ftis_logprobs
    live = mask[:, -4:].bool()
    assert (got[~live] == 0).all()
    torch.testing.assert_close(got[live], want[live], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropy[live], want_entropy[live], rtol=1e-5, atol=1e-6)
