"""`PeerRollout`: a TRL `rollout_func` whose prompt groups are sampled in turn by the trained
model and by peer models, each completion with its sampler's log-probabilities (pi_gen).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn
from trl import GRPOTrainer


class PeerRollout:
    """A TRL `rollout_func` for collaborative GRPO in one process: the prompt groups of each batch
    are sampled in turn by the model being trained and by `peers`, other models that share its
    tokenizer, and each completion comes with its sampler's log-probabilities, which
    `FTISGRPOTrainer` takes as pi_gen. The peers' samples are off-policy: F-TIS weights and filters
    them (ftis/kl_mean, ftis/is_weight_mean, ftis/filtered_frac show it).

        rollout = PeerRollout([peer_model])  # groups: policy, peer, policy, peer, ...
        trainer = FTISGRPOTrainer(model=model, ..., rollout_func=rollout)

    Args:
        peers: causal LMs with `generate` (transformers), on the trained model's device, with its
            vocabulary (the completion ids are the trainer's tokens). They are not trained.
        own_groups: groups the trained model samples per cycle before the peers sample one each;
            0 = every group from the peers.

    Sampling follows the trainer's config (temperature, top_p, top_k, min_p, repetition_penalty,
    max_completion_length), each model with `generate(do_sample=True)`, and the log-probability
    of a sampled token is taken from the processed scores `generate` sampled from: pi_gen is the
    distribution the token was drawn from. Completions are cut after the first eos. Prompts are
    text, or chat messages rendered with the tokenizer's chat template. A group is
    num_generations equal prompts in a row (num_generations_eval while TRL evaluates); prompts
    in another layout raise a ValueError.

    TRL marks `rollout_func` experimental (its UserWarning; TRL_EXPERIMENTAL_SILENCE=1 silences it).
    """

    def __init__(self, peers: Sequence[nn.Module], *, own_groups: int = 1):
        if isinstance(peers, nn.Module) or not isinstance(peers, Sequence) or not peers:
            raise ValueError(f"peers: expected a non-empty list of models, got {peers!r:.80}")
        for i, peer in enumerate(peers):
            if not callable(getattr(peer, "generate", None)):
                raise ValueError(
                    f"peers[{i}]: expected a causal LM with `generate`, got {type(peer).__name__}"
                )
        if isinstance(own_groups, bool) or not isinstance(own_groups, int) or own_groups < 0:
            raise ValueError(f"own_groups: expected an int >= 0, got {own_groups!r}")
        self.peers = list(peers)
        self.own_groups = own_groups

    def sampler(self, group: int, policy: nn.Module) -> nn.Module:
        """The model that samples the group-th prompt group of a batch."""
        cycle = [policy] * self.own_groups + self.peers
        return cycle[group % len(cycle)]

    def __call__(self, prompts: list, trainer: GRPOTrainer) -> dict[str, list]:
        args, tokenizer = trainer.args, trainer.processing_class
        policy = trainer.accelerator.unwrap_model(trainer.model)
        vocab = policy.get_output_embeddings().weight.shape[0]
        n = args.num_generations
        if not trainer.model.training:  # TRL's evaluation: num_generations_eval per prompt
            n = getattr(args, "num_generations_eval", None) or n
        out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for g in range(0, len(prompts), n):  # TRL lists each prompt's group consecutively
            group = prompts[g : g + n]
            if len(group) != n or any(prompt != group[0] for prompt in group):
                raise ValueError(
                    f"prompts: expected groups of {n} equal prompts in a row (TRL's layout in one "
                    f"process), got {len(prompts)} prompts that are not"
                )
            model = self.sampler(g // n, policy)
            peer_vocab = model.get_output_embeddings().weight.shape[0]
            if peer_vocab != vocab:
                raise ValueError(
                    f"peers: a peer has a vocabulary of {peer_vocab} tokens, the trained model "
                    f"{vocab}; PeerRollout needs models that share the trainer's tokenizer"
                )
            prompt_ids = _prompt_ids(tokenizer, prompts[g])
            completions, logprobs = _sample(model, prompt_ids, n, args, tokenizer)
            out["prompt_ids"] += [prompt_ids] * n
            out["completion_ids"] += completions
            out["logprobs"] += logprobs
        return out


def _prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


@torch.no_grad()
def _sample(model: nn.Module, prompt_ids: list[int], n: int, args, tokenizer) -> tuple:
    """n completions of one prompt from `model` and the log-probabilities their tokens were
    sampled with, each cut after the first eos."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device).expand(n, -1)
    training = model.training
    model.eval()
    try:
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            max_new_tokens=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k or 0,  # TRL: 0 or None is no top-k
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
    finally:
        model.train(training)
    tokens = out.sequences[:, ids.shape[1] :]
    scores = torch.stack(out.scores, dim=1).float().log_softmax(dim=-1)
    logprobs = scores.gather(-1, tokens[..., None]).squeeze(-1)
    eos = tokenizer.eos_token_id
    completions, logps = [], []
    for row, lp in zip(tokens.tolist(), logprobs.tolist()):
        end = row.index(eos) + 1 if eos in row else len(row)
        completions.append(row[:end])
        logps.append(lp[:end])
    return completions, logps
