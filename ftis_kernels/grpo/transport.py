"""How a node's bytes reach its peers: the seam between the round loop and what moves them.

The round loop (`node.Node`) packs its samples into the exchange's wire format (`exchange.pack`),
hands the bytes to a `Transport`, and parses what comes back (`exchange.unpack`): it never calls
a collective itself and never asks which transport runs. Two implement this protocol:

- `torch` (`TorchTransport`): today's lockstep swarm, one torchrun world on one host; every
  method is a collective over the process group, so every node runs every round together and
  the run is bit-reproducible.
- `hivemind` (`swarm.HivemindTransport`): one peer per process on any host, over hivemind: its
  DHT says who is in the swarm, each peer serves its rounds' payloads, signed, over libp2p
  streams, and collects its peers' payloads of recent rounds from them, waiting at most
  `timeout_s`, with no barrier anywhere.

Peers are named by `peer_id` (a string: the rank under torch, the libp2p peer id under hivemind).
The exchange's int32 source field carries `source`, a number every receiver can derive from the
sender's id alone (`source_of`), so the parser's "source" check holds under both.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist

from ftis_kernels.grpo import checkpoint

# Why a transport refused a peer's record before the parser saw it (the exchange's DROP_KINDS
# are the parser's and the receiver's checks after it).
REJECT_KINDS = (
    "forged",  # signed by another key than the one its subkey names: charged to that key's peer
    "untrusted",  # its peer is not in --trusted-peers
    "size",  # larger than the payload cap
    "incompatible",  # its peer runs another configuration, vocabulary or wire version
)


@dataclass(frozen=True)
class Incoming:
    """One peer's payload of one round: `payload` is `exchange.pack`'s bytes."""

    peer: str
    round: int
    payload: bytes


@dataclass(frozen=True)
class Rejection:
    """A record the transport refused, with the `kind` (one of REJECT_KINDS) and why, charged to
    `peer`: the peer whose key signed it, never the one a forgery names; "" when no known key
    did (an unsigned record, or one signed by a stranger)."""

    peer: str
    kind: str
    reason: str


def source_of(peer_id: str) -> int:
    """The exchange's int32 source field for a peer: the rank under torch (peer ids "0", "1",
    ...), else the first 31 bits of the SHA-256 of the id."""
    if peer_id.isdigit():
        return int(peer_id)
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "little") & 0x7FFFFFFF


def peer_label(peer_id: str) -> str:
    """How messages name a peer: "node 3" under torch (peer ids are ranks); under hivemind its
    peer id with the exchange's source beside it, "peer QmX... (node 123)", as the swarm's own
    log lines and `received.jsonl`'s `peer` name it."""
    if not peer_id or peer_id.isdigit():
        return f"node {peer_id or '?'}"
    return f"peer {peer_id} (node {source_of(peer_id)})"


class Transport(Protocol):
    """What the round loop needs from the network. Lockstep-only steps (barriers, the
    checkpoint agreement, the gathers of metrics and sample-log rows) are methods too: under
    torch they are collectives over every node, under hivemind they concern this peer alone."""

    kind: str  # "torch" | "hivemind"
    peer_id: str

    def agree(self, what: str, fingerprint: str) -> None:
        """Refuse to start (SystemExit naming `what`) unless every peer reports `fingerprint`;
        a transport without a fixed world instead drops a peer whose fingerprint differs
        (Rejection kind "incompatible")."""
        ...

    def barrier(self, phase: str, *, setup: bool = False) -> None:
        """Wait for every node (`setup`: under the set-up timeout); a no-op without lockstep."""
        ...

    def common_round(self, good: list[int]) -> Optional[int]:
        """The newest checkpointed round good on every node, from this node's `good` rounds."""
        ...

    def gather(self, obj: Any) -> list[Any]:
        """Every node's `obj`, in node order (only this peer's without lockstep)."""
        ...

    def publish(self, round_: int, payload: bytes) -> None:
        """Offer this peer's payload of `round_` to the others."""
        ...

    def collect(
        self, round_: int, *, max_staleness: int, timeout_s: float
    ) -> tuple[list[Incoming], list[Rejection]]:
        """The peers' payloads of rounds in [round_ - max_staleness, round_] that this peer has
        not collected before, waiting at most `timeout_s` for the live peers' payloads of
        `round_`; with the records refused on the way."""
        ...

    def close(self) -> None: ...


class SwarmError(RuntimeError):
    """A collective failed or timed out: some peer node died or stopped answering."""


def collective(phase: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run the collective `fn`; any failure becomes a SwarmError naming `phase`."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # gloo/nccl raise RuntimeError or DistBackendError subclasses
        raise SwarmError(f"during {phase}: {type(exc).__name__}: {exc}") from exc


class TorchTransport:
    """The lockstep swarm of one torchrun world: every method is a collective over the process
    group (`group`, None for the default one), run through `collective` so that a dead or silent
    peer surfaces as a SwarmError naming the phase. `setup_group` carries the set-up's checks and
    barrier (its timeout covers a warm-up or a model load); `names` are the nodes' names, for the
    agreement's message; `timeout_s` bounds a monitored barrier. A payload longer than
    `max_payload_bytes` is cut there (its prefix still reaches the parser) and reported as a
    Rejection of kind "size"."""

    kind = "torch"

    def __init__(
        self,
        *,
        names: Sequence[str] = (),
        max_payload_bytes: int = 1 << 30,
        timeout_s: float = 120.0,
        setup_group: Optional[dist.ProcessGroup] = None,
        group: Optional[dist.ProcessGroup] = None,
    ):
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.peer_id = str(self.rank)
        self.names = list(names) or [f"node {i}" for i in range(self.world)]
        self.max_payload_bytes, self.timeout_s = max_payload_bytes, timeout_s
        self.setup_group, self.group = setup_group, group
        self._outgoing: Optional[tuple[int, bytes]] = None

    def agree(self, what: str, fingerprint: str) -> None:
        mine = torch.frombuffer(bytearray(fingerprint[:64].ljust(64).encode()), dtype=torch.uint8)
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        collective(f"the {what} check", dist.all_gather, everyone, mine, group=self.setup_group)
        prints = [bytes(t.tolist()).decode(errors="replace").strip() for t in everyone]
        if len(set(prints)) > 1:
            detail = ", ".join(
                f"node {i} ({self.names[i % len(self.names)]}): {p[:12]}"
                for i, p in enumerate(prints)
            )
            raise SystemExit(
                f"{what} mismatch, refusing to start: every node must use the "
                f"same {what} (fingerprints {detail})"
            )

    def barrier(self, phase: str, *, setup: bool = False) -> None:
        if setup:
            collective(phase, dist.barrier, group=self.setup_group)
        elif self.world > 1 and dist.get_backend(self.group) == "gloo":
            # monitored_barrier names the silent ranks (gloo only).
            collective(
                phase,
                dist.monitored_barrier,
                group=self.group,
                timeout=timedelta(seconds=self.timeout_s),
                wait_all_ranks=True,
            )
        else:
            collective(phase, dist.barrier, group=self.group)

    def common_round(self, good: list[int]) -> Optional[int]:
        everyone: list = [None] * self.world
        collective(
            "the checkpoint check", dist.all_gather_object, everyone, good, group=self.setup_group
        )
        return checkpoint.newest_common(everyone)

    def gather(self, obj: Any) -> list[Any]:
        """Every node's `obj`; a non-empty list of floats (of one length on every node: a
        metrics vector, a round's rewards) travels as one float64 tensor, bit-exact and without
        pickle; anything else through all_gather_object."""
        if isinstance(obj, list) and obj and all(isinstance(x, float) for x in obj):
            vec = torch.tensor(obj, dtype=torch.float64)
            everyone = [torch.empty_like(vec) for _ in range(self.world)]
            phase = "the gather of every node's numbers (rewards or metrics)"
            collective(phase, dist.all_gather, everyone, vec, group=self.group)
            return [v.tolist() for v in everyone]
        got: list = [None] * self.world
        phase = "the gather of every node's sample-log rows"
        collective(phase, dist.all_gather_object, got, obj, group=self.group)
        return got

    def publish(self, round_: int, payload: bytes) -> None:
        """Kept for `collect`, which moves every node's payload in the same collective."""
        self._outgoing = (round_, payload)

    def collect(
        self, round_: int, *, max_staleness: int = 0, timeout_s: float = 0.0
    ) -> tuple[list[Incoming], list[Rejection]]:
        """Two all_gathers: the payload lengths (int64), then the payloads padded to the longest
        (uint8), at most `max_payload_bytes`. Every node publishes every round, so the others'
        payloads are of `round_` (staleness 0); `timeout_s` is the process group's."""
        if self._outgoing is None or self._outgoing[0] != round_:
            raise ValueError(f"round_: collect of round {round_} before its publish")
        payload = self._outgoing[1]
        self._outgoing = None
        return collective("the sample exchange", self._all_gather_payloads, round_, payload)

    def _all_gather_payloads(
        self, round_: int, payload: bytes
    ) -> tuple[list[Incoming], list[Rejection]]:
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(lengths, torch.tensor([len(payload)], dtype=torch.int64), group=self.group)
        claimed = [int(t.item()) for t in lengths]
        width = max(1, min(max(claimed), self.max_payload_bytes))
        mine = torch.zeros(width, dtype=torch.uint8)
        sent = payload[:width]
        if sent:
            mine[: len(sent)] = torch.frombuffer(bytearray(sent), dtype=torch.uint8)
        buffers = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world)]
        dist.all_gather(buffers, mine, group=self.group)
        incoming, rejected = [], []
        for peer in range(self.world):
            if peer == self.rank:
                continue
            size = min(max(claimed[peer], 0), width)
            incoming.append(Incoming(str(peer), round_, buffers[peer][:size].numpy().tobytes()))
            if claimed[peer] > width:
                rejected.append(
                    Rejection(
                        str(peer),
                        "size",
                        f"node {peer}: payload of {claimed[peer]} bytes cut at the cap "
                        f"{self.max_payload_bytes}",
                    )
                )
        return incoming, rejected

    def close(self) -> None:
        """Nothing to release: the process group belongs to the worker that made it."""
