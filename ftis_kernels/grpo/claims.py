"""What a node holds its peers' samples to: their claims, checked before it trains on them
(`check_claims`), and, when the update with them comes out non-finite, whose samples made it so
(`blame_peers`).

A peer's advantage field never reaches the loss. Vertical collaboration: a peer sends whole
groups, so the group advantages of its claimed rewards must give its claimed advantages; a sample
whose group is not `group_size` samples, or whose advantage differs, is dropped ("advantage").
Horizontal: each (peer, prompt) share must be one of this round's shared prompts, with the rewards
the peer reported in the reward exchange, and each advantage the one the swarm group gives its
reward. With `verify_rewards`, each completion is rescored and a false reward dropped ("verify");
in vertical mode the kept samples' advantages are then recomputed from the rescored rewards of
their whole group.
"""

from __future__ import annotations

import logging
import math
import struct
from collections.abc import Callable
from typing import Optional

import torch

from ftis_kernels.grpo.exchange import Drop, Sample
from ftis_kernels.grpo.rollout import horizontal_advantages, vertical_advantages
from ftis_kernels.grpo.train import skip_cause

log = logging.getLogger("ftis_kernels.grpo")


def check_claims(
    received: list[Sample],
    group_size: int,
    *,
    score: Optional[Callable[[int, torch.Tensor], float]] = None,
    swarm_rewards: Optional[torch.Tensor] = None,
    shared_prompts: Optional[dict[int, int]] = None,
) -> tuple[list[Sample], list[Drop]]:
    """Check each received sample's claims (module docstring); returns (the samples to train on,
    with the advantages this node computed, and one `Drop` per refused sample).

    `score(prompt_id, completion)`: the task's reward, given with `verify_rewards`. Horizontal
    mode is given the round's reward exchange: `swarm_rewards` (nodes, prompts, samples per node)
    float32, as each node reported its rewards, and `shared_prompts`, prompt id -> its index among
    the round's shared prompts."""
    horizontal = swarm_rewards is not None
    groups: dict[tuple[int, int], list[Sample]] = {}
    for s in received:
        groups.setdefault((s.source, s.prompt_id), []).append(s)
    kept, drops = [], []
    for (source, prompt_id), group in groups.items():
        if horizontal:
            expected, problem = _swarm_advantages(
                source, prompt_id, group, swarm_rewards, shared_prompts
            )
        else:
            expected, problem = _group_advantages(group, [s.reward for s in group], group_size)
        if problem is not None:
            drops += [Drop(f"{s.sender}: {problem}", "advantage", source, s.peer) for s in group]
            continue
        true = [s.reward for s in group]
        if score is not None:
            # As the wire carries a reward (float32): a rescored 0.1 is the claim 0.1 it sent.
            true = [_float32(score(prompt_id, s.tokens)) for s in group]
            rescored, _ = _group_advantages(group, true, group_size)
        for i, s in enumerate(group):
            if not math.isclose(s.advantage, expected[i], rel_tol=1e-5, abs_tol=1e-5):
                why = (
                    f"claimed advantage {s.advantage:g} for prompt {prompt_id}, its group's "
                    f"rewards give {expected[i]:g}"
                )
                drops.append(Drop(f"{s.sender}: {why}", "advantage", source, s.peer))
            elif true[i] != s.reward:
                why = f"claimed reward {s.reward:g}, completion scores {true[i]:g}"
                drops.append(Drop(f"{s.sender}: {why}", "verify", source, s.peer))
            else:
                adv = rescored[i] if score is not None and not horizontal else expected[i]
                kept.append(
                    Sample(
                        s.prompt_id,
                        s.source,
                        s.tokens,
                        s.logprobs,
                        s.reward,
                        adv,
                        s.staleness,
                        s.peer,
                    )
                )
    for reason in drops[:3]:
        log.warning("dropped peer sample: %s", reason)
    if len(drops) > 3:
        log.warning("dropped %d more peer samples whose claims failed", len(drops) - 3)
    return kept, drops


def _float32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _group_advantages(
    group: list[Sample], rewards: list[float], group_size: int
) -> tuple[list[float], Optional[str]]:
    """Vertical mode: (the group advantages of `rewards`, None), or ([], why not) when the
    group is not `group_size` samples."""
    if len(group) != group_size:
        return [], (
            f"{len(group)} samples for prompt {group[0].prompt_id}, a group is {group_size}"
        )
    return vertical_advantages(torch.tensor([rewards])).flatten().tolist(), None


def _swarm_advantages(
    source: int,
    prompt_id: int,
    share: list[Sample],
    swarm_rewards: torch.Tensor,
    shared_prompts: dict[int, int],
) -> tuple[list[float], Optional[str]]:
    """Horizontal mode: (the advantage of each sample of node `source`'s `share` of prompt
    `prompt_id`'s swarm group, None), or ([], why not)."""
    p = shared_prompts.get(prompt_id)
    if p is None:
        return [], f"prompt {prompt_id} is not one of this round's shared prompts"
    reported = swarm_rewards[source, p]
    if sorted(s.reward for s in share) != sorted(reported.tolist()):
        return [], (
            f"rewards {sorted(s.reward for s in share)} for prompt {prompt_id}, it reported "
            f"{sorted(reported.tolist())} in the reward exchange"
        )
    advantages = horizontal_advantages(swarm_rewards)[source, p]
    by_reward = dict(zip(reported.tolist(), advantages.tolist()))
    return [by_reward[s.reward] for s in share], None


def blame_peers(
    update: Callable[[list[Sample], dict[str, list[float]]], dict[str, float]],
    own: list[Sample],
    received: list[Sample],
    skipped: dict[str, float],
    skipped_per_sample: dict[str, list[float]],
    who: str,
) -> tuple[dict[str, float], list[Sample], dict[str, list[float]], list[Drop]]:
    """After a skipped step on own + received (`skipped`, its stats): retry without each peer's
    samples in turn (peers in rank order), then with the node's own samples alone;
    `update(samples, per_sample)` is the node's optimizer step. The first retry that comes out
    finite is the step taken (a skipped retry changes nothing), and the peers it left out are
    named (in a warning that starts with `who`) and their samples dropped ("diverged"): a peer
    whose samples make the update non-finite costs the receiver that peer's samples, not a
    skipped step. When no retry is finite, the node's own samples diverge: returns the skipped
    step as it was.

    Returns (stats, the received samples trained on, their per-sample stats, the drops)."""
    sources = sorted({s.source for s in received})
    trials = [[p] for p in sources] + ([sources] if len(sources) > 1 else [])
    for left_out in trials:
        kept = [s for s in received if s.source not in left_out]
        per_sample: dict[str, list[float]] = {}
        stats = update(own + kept, per_sample)
        if stats["skipped"]:
            continue
        cause = skip_cause(skipped)
        sender = {s.source: s.sender for s in received}
        names = ", ".join(sender[p] for p in left_out)
        log.warning(
            "%s: the update with every peer's samples was skipped (%s); "
            "without those of %s it is finite and was taken: their samples are dropped",
            who,
            cause,
            names,
        )
        drops = [
            Drop(
                f"{s.sender}: its samples made the update non-finite ({cause})",
                "diverged",
                s.source,
                s.peer,
            )
            for s in received
            if s.source in left_out
        ]
        return stats, kept, per_sample, drops
    return skipped, received, skipped_per_sample, []
