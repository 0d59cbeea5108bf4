"""A swarm transport in one process, for the tests of everything above the seam.

`MemorySwarm` plays the DHT: it stores each peer's payload under (round, peer) and wakes the
collectors when one arrives. `MemoryTransport` is one peer's view of it, with the semantics the
round loop relies on from `swarm.HivemindTransport`: no barrier, `gather` of this peer alone, a
`collect` that returns the payloads of rounds within `max_staleness` not collected before and
waits at most `timeout_s` for the live peers' payloads of this round, a peer whose fingerprints
differ refused as "incompatible", `latest_round`, `swarm_round` and `waited_by`. A peer is live
from its `publish` until it closes; a peer that stops without closing (a killed process) stays
live, so its peers wait for it at most `timeout_s` per collect.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

from ftis_kernels.grpo.checkpoint import newest_common
from ftis_kernels.grpo.transport import Incoming, Rejection


class MemorySwarm:
    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.records: dict[tuple[int, str], tuple[bytes, dict[str, str]]] = {}
        self.live: set[str] = set()
        self.polls: dict[tuple[str, str], float] = {}  # (waiter, waited for) -> when, last


class MemoryTransport:
    kind = "hivemind"

    def __init__(self, swarm: MemorySwarm, peer_id: str, fingerprints: dict[str, str]):
        self.swarm, self.peer_id, self.fingerprints = swarm, peer_id, dict(fingerprints)
        self.visible_maddrs = [f"/memory/{peer_id}"]
        self.collected: set[tuple[int, str]] = set()
        self.waits: list[float] = []  # seconds each collect waited

    def agree(self, what: str, fingerprint: str) -> None:
        self.fingerprints[what] = fingerprint

    def barrier(self, phase: str, *, setup: bool = False) -> None:
        pass

    def common_round(self, good: list[int]) -> Optional[int]:
        return newest_common([good])

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def publish(self, round_: int, payload: bytes) -> None:
        with self.swarm.changed:
            self.swarm.records[round_, self.peer_id] = (payload, dict(self.fingerprints))
            self.swarm.live.add(self.peer_id)
            self.swarm.changed.notify_all()

    def collect(
        self, round_: int, *, max_staleness: int, timeout_s: float
    ) -> tuple[list[Incoming], list[Rejection]]:
        t0 = time.monotonic()
        with self.swarm.changed:
            waited_for = self.swarm.live - {self.peer_id}
            for peer in waited_for:
                self.swarm.polls[self.peer_id, peer] = t0

            def others_in() -> bool:
                return all(
                    (round_, peer) in self.swarm.records
                    for peer in self.swarm.live
                    if peer != self.peer_id
                )

            self.swarm.changed.wait_for(others_in, timeout=timeout_s)
            records = dict(self.swarm.records)
            for peer in waited_for:
                self.swarm.polls[self.peer_id, peer] = time.monotonic()
        self.waits.append(time.monotonic() - t0)
        incoming, rejected = [], []
        for (r, peer), (payload, prints) in sorted(records.items()):
            if peer == self.peer_id or not round_ - max_staleness <= r <= round_:
                continue
            if (r, peer) in self.collected:
                continue
            self.collected.add((r, peer))
            differ = [k for k in self.fingerprints if prints.get(k) != self.fingerprints[k]]
            if differ:
                rejected.append(Rejection(peer, "incompatible", f"another {differ[0]}"))
            else:
                incoming.append(Incoming(peer, r, payload))
        return incoming, rejected

    def latest_round(self) -> Optional[int]:
        with self.swarm.changed:
            return max((r for r, _ in self.swarm.records), default=None)

    def swarm_round(self) -> Optional[int]:
        """The lower median of the other live peers' newest rounds (the hivemind transport's
        rule, read from the records instead of the replies)."""
        with self.swarm.changed:
            newest: dict[str, int] = {}
            for r, peer in self.swarm.records:
                if peer != self.peer_id and peer in self.swarm.live:
                    newest[peer] = max(r, newest.get(peer, r))
        rounds = sorted(newest.values())
        return rounds[(len(rounds) - 1) // 2] if rounds else None

    def waited_by(self, since: float, from_round: int = 0) -> set[str]:
        """The live peers whose collect waited for this one at or after `since`, with a round
        published at `from_round` or later."""
        with self.swarm.changed:
            newest: dict[str, int] = {}
            for r, peer in self.swarm.records:
                newest[peer] = max(r, newest.get(peer, r))
            return {
                waiter
                for (waiter, peer), at in self.swarm.polls.items()
                if peer == self.peer_id
                and at >= since
                and waiter in self.swarm.live
                and newest.get(waiter, -1) >= from_round
            }

    def close(self) -> None:
        with self.swarm.changed:
            self.swarm.live.discard(self.peer_id)
            self.swarm.changed.notify_all()
