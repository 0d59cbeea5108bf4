"""GenRL integration (Gensyn's RL Swarm framework): `FTISGRPOLanguageTrainerModule`, GenRL's GRPO
trainer with the generator's log-probabilities carried with each rollout and the loss replaced by
F-TIS.

The one line a GenRL user changes, in the Hydra config of the game manager's trainer:

    _target_: genrl.trainer.grpo_trainer.GRPOLanguageTrainerModule           # before
    _target_: ftis_kernels.integrations.genrl.FTISGRPOLanguageTrainerModule  # after

Stock GenRL re-tokenizes every rollout's text and takes pi_old from the receiving model itself, so a
peer's rollout is trained on as if it were on-policy (the paper's NoIS). This trainer:

- at generation, records the generated token ids and their log pi_gen (log softmax of the scores
  `generate` sampled from: the model's logits at the sampling temperature, with the other
  samplers off) with each completion: the completions GenRL stores and
  shares are `Completion` strings (the text, unchanged for rewards and data managers) whose
  `record` holds the ids as int32 and the log-probabilities as float32 (8 bytes per token), the
  vocabulary size and a fingerprint of the tokenizer;
- trains on the generator's tokens with `ftis_linear_loss` (or `ftis_loss`), F-TIS by default or
  any preset of the menu, GenRL's config mapped onto the op (`epsilon`, `epsilon_high`, `beta`,
  `temperature`; `ppo_epochs` and `minibatch_size` drive the same loop as GenRL's; GenRL's loss is
  a token mean over the minibatch, the op's `loss_type="bnpo"`);
- handles a rollout without a record (a peer on the stock trainer) by `unrecorded`: "nois" trains
  on its re-tokenized text as the stock trainer does (w = 1, KL = 0: no IS weight, no filter) and
  "drop" leaves it out; a record from another tokenizer (vocabulary size or fingerprint differs)
  never gets a token-level ratio and is handled as a rollout without a record; a malformed record
  is dropped, never trained on, with its reason logged. Each kind is counted in the metrics.

The record travels wherever GenRL's payload travels as a Python object: in process (the local null
backend) and pickled (the `torch_comm` backend, `all_gather_object`). GenRL's hivemind backend
packs payloads with msgpack, which writes a `str` subclass as a plain string: there the record is
lost and a receiver trains the rollout by its `unrecorded` policy, counted (carrying it would take
the payload's `metadata`, which GenRL's game manager fills from the game tree, not the trainer).
With hivemind 1.1.12 that backend does not import at all (`from hivemind import get_dht_time`).

Differences from GenRL's loss with `preset="grpo"` (no IS weight, no filter): GenRL clamps each
token's loss to [-10, 10] (it zeroes the gradient of a token past it), the op does not; GenRL runs
the model on left-padded prompts without position ids, this trainer passes the position ids that
`generate` used, so that log pi_theta of the generator's own tokens matches log pi_gen.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ftis_kernels._extras import require
from ftis_kernels.ftis_linear_loss import ftis_linear_loss
from ftis_kernels.ftis_loss import ftis_loss
from ftis_kernels.integrations.hf import lm_head_inputs
from ftis_kernels.options import FTISOptions
from ftis_kernels.validate import dispatch

require("genrl", "ftis_kernels.integrations.genrl")

from genrl.trainer.grpo_trainer import GRPOLanguageTrainerModule  # noqa: E402

logger = logging.getLogger(__name__)

FTIS_OPS = ("ftis_linear_loss", "ftis_loss")
UNRECORDED_POLICIES = ("nois", "drop")
# GenRL config keys that are options of the op, under the same name.
GENRL_OPTIONS = ("epsilon", "epsilon_high", "beta", "temperature")
# Sampler settings that make the sampling distribution differ from the model at the temperature,
# the pi_gen recorded and the pi_theta trained: only their neutral values are honoured.
NEUTRAL_SAMPLER = {
    "top_p": (1.0,),
    "top_k": (None, 0),
    "min_p": (None, 0.0),
    "repetition_penalty": (1.0,),
}
RECORD_KEYS = ("token_ids", "logprobs", "vocab_size", "tokenizer")
LOGGED_METRICS = ("filtered_frac", "kl_mean", "is_weight_mean", "is_truncated_frac", "clip_frac")
ROLLOUT_KINDS = ("recorded", "unrecorded", "other_tokenizer", "malformed")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's token -> id map: two peers can exchange token ids iff equal."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()


class Completion(str):
    """A completion's text as GenRL's actions hold it, with the generator's `record` (a dict):
    token_ids (bytes, int32 little-endian), logprobs (bytes, float32 little-endian, log pi_gen of
    each token), vocab_size (int) and tokenizer (`tokenizer_fingerprint`)."""

    record: Optional[dict]

    def __new__(cls, text: str, record: Optional[dict]) -> Completion:
        obj = super().__new__(cls, text)
        obj.record = record
        return obj

    def __reduce__(self):
        return (Completion, (str(self), self.record))


def make_record(token_ids: torch.Tensor, logprobs: torch.Tensor, vocab_size: int, fingerprint: str):
    """The record of one completion: token_ids (n,) int, logprobs (n,) float."""
    return {
        "token_ids": token_ids.to(torch.int32).cpu().numpy().astype("<i4").tobytes(),
        "logprobs": logprobs.to(torch.float32).cpu().numpy().astype("<f4").tobytes(),
        "vocab_size": int(vocab_size),
        "tokenizer": fingerprint,
    }


def read_record(
    record: Any, text: str, vocab_size: int, fingerprint: str, decode
) -> tuple[str, Any]:
    """("recorded", (ids (n,) int64, logprobs (n,) fp32)), ("other_tokenizer", None) or
    ("malformed", reason). `decode(ids)` is the text the ids must give back."""
    if not isinstance(record, dict) or set(record) != set(RECORD_KEYS):
        return "malformed", f"expected a dict with keys {RECORD_KEYS}"
    if record["vocab_size"] != vocab_size or record["tokenizer"] != fingerprint:
        return "other_tokenizer", None
    raw_ids, raw_logp = record["token_ids"], record["logprobs"]
    if not isinstance(raw_ids, bytes) or not isinstance(raw_logp, bytes):
        return "malformed", "token_ids and logprobs must be bytes"
    if not raw_ids:
        return "malformed", "no tokens"
    if len(raw_ids) % 4 or len(raw_ids) != len(raw_logp):
        return "malformed", f"{len(raw_ids)} bytes of token ids for {len(raw_logp)} of logprobs"
    ids = torch.frombuffer(bytearray(raw_ids), dtype=torch.int32).long()
    logp = torch.frombuffer(bytearray(raw_logp), dtype=torch.float32).clone()
    if ids.min() < 0 or ids.max() >= vocab_size:
        return "malformed", f"a token id outside [0, {vocab_size})"
    if not bool(torch.isfinite(logp).all()) or bool((logp > 0).any()):
        return "malformed", "a log-probability that is not finite and <= 0"
    if decode(ids.tolist()) != text:
        return "malformed", "the token ids do not decode to the completion's text"
    return "recorded", (ids, logp)


def genrl_options(config: Any, preset: str, ftis: Optional[dict]) -> FTISOptions:
    """The op's options: `preset` (F-TIS by default), GenRL's reduction (token mean over the
    minibatch, loss_type "bnpo") and KL penalty (k3, no bias correction), GenRL's `epsilon`,
    `epsilon_high`, `beta`, `temperature`, then `ftis` (option overrides). A ValueError names the
    GenRL key or the option it cannot honour."""
    for key, neutral in NEUTRAL_SAMPLER.items():
        value = getattr(config, key, neutral[0])
        if value not in neutral:
            raise ValueError(
                f"config.{key}: expected {' or '.join(map(repr, neutral))} (the F-TIS trainer "
                f"records pi_gen as the model at the sampling temperature, which {key} would "
                f"change), got {value!r}"
            )
    for key in ("ppo_epochs", "minibatch_size"):
        value = getattr(config, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config.{key}: expected an int >= 1, got {value!r}")
    ftis = dict(ftis or {})
    for key in GENRL_OPTIONS:
        if key in ftis:
            raise ValueError(f"ftis.{key}: expected it in GenRL's config (config.{key}), not here")
    base = dict(loss_type="bnpo", use_bias_correction_kl=False)
    genrl = {key: getattr(config, key) for key in GENRL_OPTIONS}
    try:
        FTISOptions.preset(preset, **base, **genrl)
    except ValueError as err:
        name = str(err).split(":", 1)[0]
        raise ValueError(f"config.{err}" if name in GENRL_OPTIONS else str(err)) from None
    return FTISOptions.preset(preset, **{**base, **genrl, **ftis})


@dataclass
class _Sample:
    prompt_row: int
    tokens: torch.Tensor  # (n,) int64
    gen_logprobs: Optional[torch.Tensor]  # (n,) fp32, None: no record (NoIS)
    advantage: float


class FTISGRPOLanguageTrainerModule(GRPOLanguageTrainerModule):
    """GenRL's `GRPOLanguageTrainerModule` with generator log-probabilities and the F-TIS loss.

    Args (besides GenRL's `models`, `config` (GRPOTrainerConfig) and keyword arguments):
        preset: a name of `FTISOptions.preset` ("f-tis", the default; "grpo" is GenRL's loss).
        ftis: option overrides on top of the preset (a dict, as Hydra passes it); GenRL's own keys
            (epsilon, epsilon_high, beta, temperature) stay in `config`.
        ftis_op: "ftis_linear_loss" (fused with the lm-head) or "ftis_loss" (from the logits).
        unrecorded: what a rollout without a usable record gets: "nois" (trained on its
            re-tokenized text with w = 1 and KL = 0, as the stock trainer) or "drop".

    Everything is checked before the parent's constructor, so before any rollout; the ValueError
    names the key. Metrics (`_metrics["train"]` and GenRL's logger) per step: the rollouts of each
    kind (ftis/recorded, ftis/unrecorded, ftis/other_tokenizer, ftis/malformed), those dropped
    (ftis/dropped), and the op's filtered_frac, kl_mean, is_weight_mean, is_truncated_frac,
    clip_frac averaged over the minibatches.
    """

    def __init__(
        self,
        models: list[Any],
        config: Any,
        *,
        preset: str = "f-tis",
        ftis: Optional[dict] = None,
        ftis_op: str = "ftis_linear_loss",
        unrecorded: str = "nois",
        **kwargs: Any,
    ):
        self.ftis = genrl_options(config, preset, ftis)
        self.ftis_op = dispatch({op: op for op in FTIS_OPS}, ftis_op, "ftis_op")
        self.unrecorded = dispatch({p: p for p in UNRECORDED_POLICIES}, unrecorded, "unrecorded")
        super().__init__(models, config, **kwargs)
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.fingerprint = tokenizer_fingerprint(self.processing_class)

    # --- generation -------------------------------------------------------------------------

    def _initialize_generation_config(self) -> None:
        super()._initialize_generation_config()
        # top_k off as transformers reads it: 0 (None is replaced by its default of 50 at
        # generate time, and pi_gen would be the model's top 50 renormalised, not the model).
        self.generation_config.top_k = 0
        # The other warpers off, not unset: generate fills a setting left None from the model's
        # own generation_config (a checkpoint's sampling defaults, e.g. its min_p).
        self.generation_config.update(
            min_p=0.0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, no_repeat_ngram_size=0
        )
        # The scores each step sampled from: log pi_gen is their log-softmax (the model's logits at
        # the temperature, and whatever a processor the settings above leave on did to them).
        self.generation_config.output_scores = True
        self.generation_config.return_dict_in_generate = True

    def _generate_options(self) -> dict:
        """generate's keywords besides the config: transformers 4.50-4.x replaces each setting
        equal to its global default (temperature 1, top_p 1, repetition_penalty 1...) by the
        checkpoint's own (e.g. an instruct model's 0.7 and 0.8) unless use_model_defaults=False;
        5.x fills only what is unset and has no such keyword."""
        params = inspect.signature(self.model.generate).parameters
        return {"use_model_defaults": False} if "use_model_defaults" in params else {}

    def generate(self, inputs: Any, return_completion_ids: bool = False, stage: int = 0) -> Any:
        """GenRL's generation, each completion a `Completion` carrying its record."""
        prompts = self._process_inputs(inputs)
        prompt_ids = prompts.input_ids.to(self.model.device)
        attention_mask = prompts.attention_mask.to(self.model.device, dtype=self.dtype)
        eos = self.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
        rollout = [[] for _ in range(prompt_ids.shape[0])]
        rollout_ids = [[] for _ in range(prompt_ids.shape[0])]
        for _ in range(self.args.num_generations):
            with torch.no_grad():
                out = self.model.generate(
                    prompt_ids,
                    attention_mask=attention_mask,
                    generation_config=self.generation_config,
                    **self._generate_options(),
                )
                completion_ids = out.sequences[:, prompt_ids.shape[1] :]
                logp = torch.log_softmax(torch.stack(out.scores, dim=1).float(), dim=-1)
                logp = logp.gather(-1, completion_ids[..., None])[..., 0]
            texts = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
            for i, text in enumerate(texts):
                ids = completion_ids[i].tolist()
                n = next((j + 1 for j, t in enumerate(ids) if t in eos), len(ids))
                record = make_record(
                    completion_ids[i, :n], logp[i, :n], self.vocab_size, self.fingerprint
                )
                rollout[i].append(Completion(text, record))
                rollout_ids[i].append(completion_ids[i])
        return (rollout, rollout_ids) if return_completion_ids else rollout

    # --- training ---------------------------------------------------------------------------

    def step(self, stage, state, data_manager, reward_manager, global_step: int) -> int:
        """One GRPO update on a stage's rollouts (GenRL's loop: advantages per prompt group,
        `ppo_epochs` passes over shuffled minibatches of `minibatch_size`), with the F-TIS loss."""
        global_step += 1
        stage_inputs, index_mapping = data_manager.prepare_input(
            state.get_stage_state(stage), stage
        )
        actions = state.get_stage_actions(stage)
        order = [index_mapping[i] for i in range(len(index_mapping))]
        outputs = [actions[a][b][n] for a, b, n in order]
        stage_rewards = reward_manager[stage]
        rewards = torch.tensor([stage_rewards[a][b][n] for a, b, n in order], dtype=torch.float32)
        prompts = self._process_inputs(stage_inputs, for_training=True)
        metrics: dict[str, float] = {}
        if bool((rewards != 0).any()):
            advantages = rewards - rewards.mean(dim=1, keepdim=True)
            if rewards.shape[1] > 1:
                advantages /= rewards.std(dim=1, keepdim=True) + 1e-8
            samples, counts = self._samples(outputs, advantages)
            metrics.update({f"ftis/{k}": float(counts[k]) for k in (*ROLLOUT_KINDS, "dropped")})
            losses, op_metrics = self._update(samples, prompts)
            metrics["train/loss"] = float(torch.stack(losses).mean()) if losses else 0.0
            for name in LOGGED_METRICS:
                if op_metrics[name]:
                    metrics[f"ftis/{name}"] = sum(op_metrics[name]) / len(op_metrics[name])
        else:  # every reward 0: no advantage, no update (GenRL's rule)
            metrics["train/loss"] = 0.0
        metrics["train/rewards"] = rewards.mean().item()
        for name, value in metrics.items():
            self._metrics["train"][name].append(value)
        self.log(metrics, global_step)
        self.cleanup_step()
        return global_step

    def _samples(self, outputs: list, advantages: torch.Tensor) -> tuple[list[_Sample], Counter]:
        """The training samples of a stage, one per completion, row-major as GenRL's prompts are
        repeated (prompt i, generation g -> row i * G + g), and the count of each rollout kind."""
        counts: Counter = Counter()
        samples = []
        G = self.args.num_generations
        for i, generations in enumerate(outputs):
            for g, completion in enumerate(generations):
                kind, value = "unrecorded", None
                record = getattr(completion, "record", None)
                if record is not None:
                    kind, value = read_record(
                        record,
                        str(completion),
                        self.vocab_size,
                        self.fingerprint,
                        functools.partial(self.processing_class.decode, skip_special_tokens=True),
                    )
                counts[kind] += 1
                if kind == "malformed":
                    logger.warning("dropped a rollout with a malformed record: %s", value)
                    counts["dropped"] += 1
                    continue
                if kind == "recorded":
                    tokens, gen = value
                elif self.unrecorded == "drop":
                    counts["dropped"] += 1
                    continue
                else:  # NoIS: the text re-tokenized, as the stock trainer trains on it
                    tokens = torch.tensor(self.processing_class(text=str(completion))["input_ids"])
                    gen = None
                samples.append(_Sample(i * G + g, tokens.long(), gen, float(advantages[i, g])))
        return samples, counts

    def _update(self, samples: list[_Sample], prompts: Any) -> tuple[list, dict[str, list]]:
        """GenRL's epochs x minibatches of optimiser steps on `samples`, less those without a
        token (an empty text re-tokenized: nothing to train on)."""
        losses: list[torch.Tensor] = []
        op_metrics: dict[str, list] = {name: [] for name in LOGGED_METRICS}
        samples = [s for s in samples if s.tokens.numel() > 0]
        if not samples:
            return losses, op_metrics
        batch = self._batch(samples, prompts)
        with torch.no_grad():
            batch["old"] = self._logprobs(self.model, batch)
            batch["ref"] = self._logprobs(self.ref_model, batch) if self.ftis.beta > 0 else None
        n = len(samples)
        size = min(self.args.minibatch_size, n)
        for _ in range(self.args.ppo_epochs):
            perm = torch.randperm(n, device=self.model.device)
            for start in range(0, n, size):
                rows = perm[start : start + size]
                self.model.zero_grad()
                loss, metrics = self.minibatch_loss(batch, rows)
                loss.backward()
                self.optimizer.step()
                losses.append(loss.detach().float())
                for name in LOGGED_METRICS:
                    op_metrics[name].append(float(metrics[name]))
        return losses, op_metrics

    def _batch(self, samples: list[_Sample], prompts: Any) -> dict[str, torch.Tensor]:
        """Prompt (left-padded, GenRL's) and completion (right-padded) rows of the samples:
        input_ids, attention_mask, position_ids (B, P + C); completion mask, gen (B, C), with
        has_gen (B,) False where the sample has no record; advantages (B,)."""
        dev = self.model.device
        rows = torch.tensor([s.prompt_row for s in samples])
        prompt_ids = prompts.input_ids[rows].to(dev)
        prompt_mask = prompts.attention_mask[rows].to(dev)
        B, C = len(samples), max(1, max(s.tokens.numel() for s in samples))
        completion = torch.full((B, C), self.processing_class.pad_token_id, dtype=torch.long)
        completion_mask = torch.zeros(B, C, dtype=torch.long)
        gen = torch.zeros(B, C, dtype=torch.float32)
        for b, s in enumerate(samples):
            k = s.tokens.numel()
            completion[b, :k], completion_mask[b, :k] = s.tokens, 1
            if s.gen_logprobs is not None:
                gen[b, :k] = s.gen_logprobs
        attention_mask = torch.cat([prompt_mask, completion_mask.to(dev)], dim=1)
        return {
            "input_ids": torch.cat([prompt_ids, completion.to(dev)], dim=1),
            "attention_mask": attention_mask,
            # The positions `generate` gives left-padded prompts, so pi_theta matches pi_gen.
            "position_ids": (attention_mask.long().cumsum(-1) - 1).clamp(min=0),
            "completion_mask": completion_mask.to(dev),
            "gen": gen.to(dev),
            "has_gen": torch.tensor([s.gen_logprobs is not None for s in samples], device=dev),
            "advantages": torch.tensor([s.advantage for s in samples], device=dev),
        }

    def _head(self, model, batch, rows):
        """(op, tokens, mask, start): `op(tokens, gen, adv, mask, old, ref, options=)` is the loss
        of `model` on the rows; per-token (B, C) inputs are sliced [:, start:]."""
        input_ids, attention_mask = batch["input_ids"][rows], batch["attention_mask"][rows]
        states = model.get_decoder()(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=batch["position_ids"][rows],
        ).last_hidden_state
        x = lm_head_inputs(
            model, input_ids, attention_mask, batch["completion_mask"][rows], states=states
        )
        start = x.start - (input_ids.shape[1] - batch["completion_mask"].shape[1])
        if self.ftis_op == "ftis_linear_loss":
            op = functools.partial(ftis_linear_loss, x.hidden, x.weight, bias=x.bias)
        else:
            logits = torch.nn.functional.linear(x.hidden, x.weight, x.bias)
            op = functools.partial(ftis_loss, logits)
        return op, x.tokens, x.mask, start

    def _logprobs(self, model, batch) -> torch.Tensor:
        """log `model`(token) at the temperature, (B, C), detached, from the loss's own op."""
        rows = torch.arange(batch["input_ids"].shape[0], device=batch["input_ids"].device)
        op, tokens, mask, start = self._head(model, batch, rows)
        neutral = FTISOptions(is_mode="none", filter=None, temperature=self.ftis.temperature)
        zeros = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        _, metrics = op(tokens, zeros, batch["advantages"], mask, options=neutral)
        out = torch.zeros_like(batch["gen"])
        out[:, start:] = metrics["logp"]
        return out

    def minibatch_loss(self, batch: dict, rows: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The op's loss and metrics on `rows` of `batch` (see `_batch`; old and ref added)."""
        op, tokens, mask, start = self._head(self.model, batch, rows)
        gen, old = batch["gen"][rows][:, start:], batch["old"][rows][:, start:]
        ref = None if batch["ref"] is None else batch["ref"][rows][:, start:]
        advantages, has_gen = batch["advantages"][rows], batch["has_gen"][rows]
        if not bool(has_gen.all()):
            # No record: pi_gen is pi_theta itself, from the same op, so w = 1 and KL = 0.
            with torch.no_grad():
                neutral = FTISOptions(
                    is_mode="none", filter=None, temperature=self.ftis.temperature
                )
                _, current = op(tokens, torch.zeros_like(gen), advantages, mask, options=neutral)
            gen = torch.where(has_gen[:, None], gen, current["logp"])
        return op(tokens, gen, advantages, mask, old, ref, options=self.ftis)


__all__ = [
    "Completion",
    "FTISGRPOLanguageTrainerModule",
    "genrl_options",
    "make_record",
    "read_record",
    "tokenizer_fingerprint",
]
