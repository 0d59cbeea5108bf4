"""Generation with the model's own sampling, group advantages, and accuracy evaluation."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Optional

import torch

ADVANTAGE_EPS = 1e-4


def _cache_name(model) -> str:
    """The KV-cache keyword of `model.forward`: 'cache' (transformers >= 5.x) or 'past_key_values'."""  # noqa: E501
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _cache_of(out):
    return out["cache"] if "cache" in out else out["past_key_values"]


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, P) int64, prompts right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if len(p):
            ids[i, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
    return ids, mask


@torch.no_grad()
def sample(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    eos_id: int,
    pad_id: int,
    generator: Optional[torch.Generator] = None,
    greedy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one completion per prompt from softmax(logits / temperature), no top-k/top-p.

    Returns CPU tensors: tokens (B, L) int64 (pad after the end), logprobs (B, L) float32 (the
    log-probability of each sampled token under the sampling distribution, 0 after the end) and
    lengths (B,) int64.
    A completion ends with its EOS token (included) or after `max_new_tokens` tokens.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids, mask = (t.to(device) for t in left_pad(prompts, pad_id))
    B = ids.shape[0]
    position = (mask.cumsum(dim=1) - 1).clamp(min=0)
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=position, use_cache=True, logits_to_keep=1
    )
    cache_name = _cache_name(model)
    past, logits = _cache_of(out), out.logits[:, -1]
    next_pos = position[:, -1:] + 1
    tokens = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=device)
    lengths = torch.zeros(B, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    for t in range(max_new_tokens):
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        if greedy:
            tok = logp.argmax(dim=-1)
        else:
            # Drawn on the CPU so that one CPU generator (checkpointed) drives every device.
            tok = torch.multinomial(logp.exp().cpu(), 1, generator=generator)[:, 0].to(device)
        live = ~done
        tokens[live, t] = tok[live]
        logprobs[live, t] = logp.gather(1, tok[:, None])[:, 0][live]
        lengths += live.long()
        done |= tok == eos_id
        if bool(done.all()) or t == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=device)], dim=1)
        out = model(
            input_ids=tok[:, None],
            attention_mask=mask,
            position_ids=next_pos,
            use_cache=True,
            **{cache_name: past},
        )
        past, logits = _cache_of(out), out.logits[:, -1]
        next_pos = next_pos + 1
    model.train(was_training)
    width = max(int(lengths.max()), 1)
    return tokens[:, :width].cpu(), logprobs[:, :width].cpu(), lengths.cpu()


def group_advantages(rewards: torch.Tensor, eps: float = ADVANTAGE_EPS) -> torch.Tensor:
    """A = (r - mean(r)) / (std(r) + eps) along the last dim (the group; std unbiased, as TRL).

    rewards (..., G) float with G >= 2; returns the same shape in float32. A group of equal
    rewards gets exactly 0: float32's mean of G rewards of 0.1 (a `format_credit`) is not 0.1,
    and the rounding divided by std + eps would be an advantage of about 1e-4.
    """
    if rewards.shape[-1] < 2:
        raise ValueError(
            f"rewards: expected groups of at least 2, got shape {tuple(rewards.shape)}"
        )
    r = rewards.float()
    advantages = (r - r.mean(dim=-1, keepdim=True)) / (r.std(dim=-1, keepdim=True) + eps)
    return advantages.masked_fill((r == r[..., :1]).all(dim=-1, keepdim=True), 0.0)


def vertical_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Vertical collaboration: rewards (P, G) of this node's own groups -> advantages (P, G)."""
    return group_advantages(rewards)


def horizontal_advantages(swarm_rewards: torch.Tensor) -> torch.Tensor:
    """Horizontal collaboration: rewards (N, P, G/N), node n's share of each shared prompt's group.

    The group of prompt p is the concatenation over nodes of swarm_rewards[:, p]; advantages are
    normalised over that whole swarm group and returned in the input's (N, P, G/N) layout.
    """
    N, P, g = swarm_rewards.shape
    groups = swarm_rewards.permute(1, 0, 2).reshape(P, N * g)
    return group_advantages(groups).reshape(P, N, g).permute(1, 0, 2).contiguous()
