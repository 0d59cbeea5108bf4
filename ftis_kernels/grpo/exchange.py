"""The sample exchange: a fixed binary record per sample, moved by a `transport.Transport`.

Wire format of one sample (little-endian), `HEADER_BYTES` + 8 bytes per completion token:

    int64 prompt_id | int32 source node | int32 n_tokens | float32 reward | float32 advantage
    int32 tokens[n_tokens] | float32 logprobs[n_tokens]

A node's payload is its records back to back, published for one round through the transport
(under torch two `all_gather`s: the payload lengths (int64), then the payloads padded to the
longest (uint8)). `bytes_sent` counts the payload only (the transport's framing is its own).
No pickle crosses the wire: a receiver parses bytes with bounds checks and drops, with a logged
reason, any record that is malformed, so nothing a peer sends can crash it.
"""

from __future__ import annotations

import logging
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ftis_kernels.grpo.rollout import group_advantages
from ftis_kernels.grpo.transport import (
    REJECT_KINDS,
    SwarmError,  # noqa: F401 (callers import it from here too)
    TorchTransport,
    Transport,
    collective,  # noqa: F401 (callers import it from here too)
    peer_label,
    source_of,
)

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<qiiff")
HEADER_BYTES = _HEADER.size  # 24
BYTES_PER_TOKEN = 8  # int32 token id + float32 logprob
# The wire format's version: peers of another version are refused before their bytes are parsed.
WIRE_VERSION = 1
HOSTILE_KINDS = (
    "forged_logprobs",
    "flipped_rewards",
    "random_tokens",
    "malformed",
    "improbable_logprobs",
    "random_tokens_max_weight",
    "replay",
)
# What an "improbable_logprobs" peer claims for log pi_gen of one token: exp(-log pi_gen) > 1e43
# overflows float32, and so does an untruncated IS weight pi_theta / pi_gen of any likely token.
IMPROBABLE_LOGPROB = -100.0
# What a "random_tokens_max_weight" peer claims for log pi_gen of every token: any token the
# receiver gives a probability above C * e^-30 gets the full truncated IS weight C, and the
# summed k3 KL (about e^30 per token) stays finite in float32.
MAX_WEIGHT_LOGPROB = -30.0
# Why a record was dropped: the parser's checks (`unpack`), then the receiver's own: an advantage
# that the group's rewards do not give ("advantage"), a reward its rescoring refutes ("verify"),
# samples without which a non-finite update is finite ("diverged", `blame_peers`); then the
# transport's refusals before the parser (`transport.REJECT_KINDS`).
DROP_KINDS = (
    "length",
    "source",
    "token",
    "logprob",
    "reward",
    "prompt",
    "advantage",
    "verify",
    "diverged",
    *REJECT_KINDS,
)


class Drop(str):
    """A dropped record's reason as logged, with the `kind` of check (one of DROP_KINDS) that
    dropped it, the `sender` node (None: a record the transport refused that no known peer
    signed) and its transport `peer` id ("" where unknown)."""

    kind: str
    sender: Optional[int]
    peer: str

    def __new__(cls, reason: str, kind: str, sender: Optional[int], peer: str = "") -> Drop:
        drop = super().__new__(cls, reason)
        drop.kind, drop.sender, drop.peer = kind, sender, peer
        return drop

    def __reduce__(self):
        return Drop, (str(self), self.kind, self.sender, self.peer)


@dataclass
class Sample:
    """One completion as exchanged: tokens (L,) int32 and logprobs (L,) float32 of the generator."""

    prompt_id: int
    source: int
    tokens: torch.Tensor
    logprobs: torch.Tensor
    reward: float
    advantage: float
    staleness: int = 0  # rounds between its generation and its use (received samples)
    peer: str = ""  # the transport's id of the peer it came from (received samples)

    @property
    def sender(self) -> str:
        """How messages name the peer it came from (`transport.peer_label`)."""
        return peer_label(self.peer or str(self.source))

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.numel())


def record_bytes(n_tokens: int) -> int:
    """Size on the wire of one sample with `n_tokens` completion tokens."""
    return HEADER_BYTES + BYTES_PER_TOKEN * n_tokens


def pack(samples: list[Sample]) -> bytes:
    """The payload of `samples`: their records back to back."""
    parts = []
    for s in samples:
        tokens = s.tokens.to(torch.int32).numpy().astype("<i4", copy=False)
        logprobs = s.logprobs.to(torch.float32).numpy().astype("<f4", copy=False)
        parts.append(_HEADER.pack(s.prompt_id, s.source, tokens.size, s.reward, s.advantage))
        parts.append(tokens.tobytes())
        parts.append(logprobs.tobytes())
    return b"".join(parts)


def unpack(
    payload: bytes,
    *,
    sender: int,
    vocab_size: int,
    max_tokens: int,
    prompt_ok: Callable[[int], bool] = lambda pid: True,
    peer: str = "",
) -> tuple[list[Sample], list[Drop]]:
    """Parse and validate `sender`'s payload (from the transport's `peer`, "" for the rank
    `sender`); returns (valid samples, one `Drop` per dropped record).

    A record is dropped when its source is not `sender`, its length is outside [1, max_tokens], a
    token id is outside [0, vocab_size), a logprob is non-finite or > 0, the reward or advantage is
    non-finite, or `prompt_ok(prompt_id)` (the receiver's: is it a training problem) is false. A
    record whose length field cannot be trusted (out of range, or past the payload's end) ends the
    parse: the rest of the payload is dropped.
    """  # noqa: E501
    samples, drops = [], []
    offset, index = 0, 0
    name = peer_label(peer or str(sender))
    while offset < len(payload):
        where = f"sample {index} from {name}"
        if len(payload) - offset < HEADER_BYTES:
            drops.append(
                Drop(
                    f"{where}: truncated header ({len(payload) - offset} bytes left)",
                    "length",
                    sender,
                    peer,
                )
            )
            break
        prompt_id, source, n, rew, adv = _HEADER.unpack_from(payload, offset)
        if not 1 <= n <= max_tokens:
            drops.append(
                Drop(
                    f"{where}: length {n} outside [1, {max_tokens}]; rest of payload dropped",
                    "length",
                    sender,
                    peer,
                )
            )
            break
        end = offset + record_bytes(n)
        if end > len(payload):
            drops.append(
                Drop(
                    f"{where}: record of {n} tokens runs past the payload; rest dropped",
                    "length",
                    sender,
                    peer,
                )
            )
            break
        body = offset + HEADER_BYTES
        tokens = np.frombuffer(payload, dtype="<i4", count=n, offset=body)
        logprobs = np.frombuffer(payload, dtype="<f4", count=n, offset=body + 4 * n)
        offset, index = end, index + 1
        reason = None
        if source != sender:
            reason, kind = f"source field {source} is not the sending node {sender}", "source"
        elif tokens.min() < 0 or tokens.max() >= vocab_size:
            reason, kind = f"token id outside [0, {vocab_size})", "token"
        elif not np.isfinite(logprobs).all():
            reason, kind = "non-finite logprob", "logprob"
        elif (logprobs > 0).any():
            reason, kind = "logprob > 0", "logprob"
        elif not (math.isfinite(rew) and math.isfinite(adv)):
            reason, kind = "non-finite reward or advantage", "reward"
        elif not prompt_ok(prompt_id):
            reason, kind = f"prompt id {prompt_id} is not a training problem", "prompt"
        if reason is not None:
            drops.append(Drop(f"{where}: {reason}", kind, sender, peer))
            continue
        samples.append(
            Sample(
                prompt_id,
                source,
                torch.from_numpy(tokens.astype(np.int32)),
                torch.from_numpy(logprobs.astype(np.float32)),
                rew,
                adv,
                peer=peer,
            )
        )
    return samples, drops


def exchange(
    samples: list[Sample],
    *,
    vocab_size: int,
    max_tokens: int,
    max_samples: int,
    prompt_ok: Callable[[int], bool] = lambda pid: True,
    transport: Optional[Transport] = None,
    round_: int = 0,
    max_staleness: int = 0,
    timeout_s: float = 0.0,
    group: Optional[dist.ProcessGroup] = None,
) -> tuple[list[Sample], list[Drop], int]:
    """Send `samples` (of round `round_`) to the peers and receive theirs: `pack`, then the
    transport's `publish` and `collect` (payloads of rounds within `max_staleness` of `round_`,
    waiting at most `timeout_s`), then `unpack` of each peer's payload. Without a `transport`,
    the lockstep one over `group` (`TorchTransport`: one all_gather of lengths, one of bytes).

    Returns (valid samples from the peers, in the order the transport gave their payloads, each
    with its `staleness`: `round_` minus the round it was generated in; drop reasons, a record
    the transport refused among them with its `REJECT_KINDS` kind; bytes this node sent).
    `max_samples` and `max_tokens` must be the same on every node (they come from the shared run
    configuration, checked at start-up): a peer payload longer than `max_samples` records of
    `max_tokens` tokens is cut at that cap (kind "size"; the cut record is then dropped too), so
    a peer cannot make the others allocate without bound.
    """
    cap = max_samples * record_bytes(max_tokens)
    if transport is None:
        transport = TorchTransport(max_payload_bytes=cap, group=group)
    payload = pack(samples)
    transport.publish(round_, payload)
    incoming, rejected = transport.collect(round_, max_staleness=max_staleness, timeout_s=timeout_s)
    # A refusal is charged to the peer that signed the record; to nobody (sender None) when no
    # known key did, so that nobody is blamed for a record forged in its name.
    drops = [
        Drop(r.reason, r.kind, source_of(r.peer) if r.peer else None, r.peer) for r in rejected
    ]
    received = []
    for got in incoming:
        sender = source_of(got.peer)
        body = got.payload
        if len(body) > cap:
            body = body[:cap]
            size = len(got.payload)
            why = f"{peer_label(got.peer)}: payload of {size} bytes cut at the cap {cap}"
            drops.append(Drop(why, "size", sender, got.peer))
        samples_in, dropped = unpack(
            body,
            sender=sender,
            vocab_size=vocab_size,
            max_tokens=max_tokens,
            prompt_ok=prompt_ok,
            peer=got.peer,
        )
        for s in samples_in:
            s.staleness = round_ - got.round
        received.extend(samples_in)
        drops.extend(dropped)
    for reason in drops:
        log.warning("dropped peer sample: %s", reason)
    return received, drops, len(payload)


def make_hostile(
    samples: list[Sample],
    kind: Optional[str],
    vocab_size: int,
    generator: torch.Generator,
    previous: Sequence[Sample] = (),
) -> list[Sample]:
    """What a hostile node sends instead of `samples` (hook for robustness experiments).

    kind: None (honest) | "forged_logprobs" (claims certainty: log pi_gen = 0 at every token) |
    "flipped_rewards" (reward 1 - r, advantage negated) | "random_tokens" (uniform token ids, the
    first of each prompt's group sold as correct: `claim_first_correct`) | "malformed" (each
    record broken in one of the ways `unpack` checks, in turn) | "improbable_logprobs" (the
    round's first sample claims log pi_gen = `IMPROBABLE_LOGPROB` at its first token, and its
    group the rewards of `claim_first_correct`: its untruncated IS weight overflows, and it weighs
    in the update) |
    "random_tokens_max_weight" (random tokens sold as "random_tokens" sells them, claiming
    log pi_gen = `MAX_WEIGHT_LOGPROB` at every token, so that the receiver's IS weight is the
    cap C, or huge without one) | "replay" (the honest samples the node received last round from
    its lowest-ranked peer, `previous`, sent as its own: at most as many as `samples`, none in a
    first round or the first after a --resume). All but "malformed" are well formed on the wire,
    so the receiver's parser accepts them, and each claims the advantages its claimed rewards give
    (a receiver recomputes them); only `verify_rewards` (the receiver rescoring the completion) or
    the loss can catch them. The node itself still trains on its honest samples.
    """
    if kind is None:
        return samples
    if kind not in HOSTILE_KINDS:
        raise ValueError(f"hostile: expected None or one of {HOSTILE_KINDS}, got {kind!r}")
    if kind == "replay":
        victims = {s.source for s in previous if s.source != samples[0].source}
        return [
            Sample(s.prompt_id, samples[0].source, s.tokens, s.logprobs, s.reward, s.advantage)
            for s in previous
            if victims and s.source == min(victims)
        ][: len(samples)]
    claims = claim_first_correct(samples)
    out = []
    for i, s in enumerate(samples):
        tokens, logprobs, rew, adv = s.tokens, s.logprobs, s.reward, s.advantage
        if kind == "forged_logprobs":
            logprobs = torch.zeros_like(logprobs)
        elif kind == "flipped_rewards":
            rew, adv = 1.0 - rew, -adv
        elif kind == "malformed":
            out.append(_malformed(s, len(out), vocab_size))
            continue
        elif kind == "improbable_logprobs":
            if s.prompt_id == samples[0].prompt_id:
                rew, adv = claims[i]
            if i == 0:
                logprobs = logprobs.clone()
                logprobs[0] = IMPROBABLE_LOGPROB
        else:
            tokens = torch.randint(
                0, vocab_size, tokens.shape, generator=generator, dtype=torch.int32
            )
            rew, adv = claims[i]
            if kind == "random_tokens_max_weight":
                logprobs = torch.full_like(logprobs, MAX_WEIGHT_LOGPROB)
        out.append(Sample(s.prompt_id, s.source, tokens, logprobs, rew, adv))
    return out


def claim_first_correct(samples: Sequence[Sample]) -> list[tuple[float, float]]:
    """(reward, advantage) per sample that a forger selling completions as correct claims and a
    receiver's recomputation confirms: in each prompt's group, the first sample correct (reward 1)
    and the others wrong (0), with the group advantages those rewards give (a group of one: 0)."""
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.prompt_id, []).append(i)
    claims = [(1.0, 0.0)] * len(samples)
    for members in groups.values():
        if len(members) < 2:
            continue
        rewards = torch.zeros(len(members))
        rewards[0] = 1.0
        for i, rew, adv in zip(members, rewards.tolist(), group_advantages(rewards).tolist()):
            claims[i] = (rew, adv)
    return claims


def _malformed(s: Sample, i: int, vocab_size: int) -> Sample:
    """`s` broken in the i-th (mod 6) of the ways a receiver must catch."""
    tokens, logprobs = s.tokens.clone(), s.logprobs.clone()
    prompt_id, source, rew, adv = s.prompt_id, s.source, s.reward, s.advantage
    kind = i % 6
    if kind == 0:
        source += 1  # claims another node's sample
    elif kind == 1:
        tokens[-1] = vocab_size  # an id past the vocabulary
    elif kind == 2:
        logprobs[0] = math.nan
    elif kind == 3:
        logprobs[-1] = 0.5  # a probability above 1
    elif kind == 4:
        rew, adv = math.inf, math.nan
    else:
        prompt_id = (0x7FFF << 48) | 1  # names no problem
    return Sample(prompt_id, source, tokens, logprobs, rew, adv)
