"""How a node's bytes reach its peers: the seam between the round loop and what moves them.

The round loop (`node.Node`) packs its samples into the exchange's wire format (`exchange.pack`),
hands the bytes to a `Transport`, and parses what comes back (`exchange.unpack`): it never calls
a collective itself and never asks which transport runs. Two implement this protocol:

- `torch` (`TorchTransport`): today's lockstep swarm, one torchrun world on one host; every
  method is a collective over the process group, so every node runs every round together and
  the run is bit-reproducible.
- `hivemind` (`swarm.HivemindTransport`): one peer per process on any host, over hivemind's DHT;
  a peer publishes each round's payload under a signed subkey and collects what its peers
  published for recent rounds, waiting at most `timeout_s`, with no barrier anywhere.

Peers are named by `peer_id` (a string: the rank under torch, the libp2p peer id under hivemind).
The exchange's int32 source field carries `source`, a number every receiver can derive from the
sender's id alone (`source_of`), so the parser's "source" check holds under both.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Optional, Protocol

# Why a transport refused a peer's record before the parser saw it (the exchange's DROP_KINDS
# are the parser's and the receiver's checks after it).
REJECT_KINDS = (
    "forged",  # signed by another key than the one its subkey names
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
    """A record the transport refused, with the `kind` (one of REJECT_KINDS) and why."""

    peer: str
    kind: str
    reason: str


def source_of(peer_id: str) -> int:
    """The exchange's int32 source field for a peer: the rank under torch (peer ids "0", "1",
    ...), else the first 31 bits of the SHA-256 of the id."""
    if peer_id.isdigit():
        return int(peer_id)
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "little") & 0x7FFFFFFF


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
