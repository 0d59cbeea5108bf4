"""A swarm peer's samples over direct libp2p streams, beside hivemind's DHT.

The DHT (`swarm.HivemindTransport`) says who is in the swarm and what each peer is (its signed
announcement: fingerprints, public key); the payloads go from peer to peer. Each peer serves one
unary handler on the libp2p daemon its DHT runs (`PULL`, through a replica of the DHT's `P2P`, as
hivemind's averagers serve theirs), and pulls its peers' payloads from theirs:

    Pull  {swarm_key, rounds (at most MAX_ROUNDS_ASKED), wait_s (at most MAX_HOLD_S)}
    Offer {newest round published (-1: none), digest of the fingerprints, [Round]}
    Round {round, payload, signature}

A pull is answered as soon as the peer holds one of the rounds asked for, or after `wait_s` with
none: a long poll, so a receiver asks once per peer and round, not in a loop. An offer holds the
asked rounds the peer still keeps (the last KEEP_ROUNDS it published), oldest first, at most
MAX_OFFER_BYTES. Each round's payload is signed with the peer's key (RSA PKCS#1 v1.5, SHA-256,
over the swarm key, the round and the payload): the receiver checks it against the key of the
peer's announcement, whose id libp2p's handshake proved the stream's other end holds.

Everything here runs on an asyncio loop in a daemon thread; the transport calls `offer` and
`pull_all` from its own thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

log = logging.getLogger(__name__)

PULL = "ftis-swarm/pull/1"
# What a pull may ask: this many rounds, held at most this long.
MAX_ROUNDS_ASKED = 64
MAX_HOLD_S = 60.0
# How many of its latest rounds a peer keeps to serve.
KEEP_ROUNDS = 16
# An offer's bytes at most: hivemind's daemon carries a unary reply of at most 2 MiB.
MAX_OFFER_BYTES = (2 << 20) - (16 << 10)
# How many peers that called without being known are remembered between two `knocked` calls.
_KNOCK_CAP = 256
_ROUND_MAX = 2**31


def _messages():
    """The protocol's protobuf classes (Pull, Round, Offer), built at run time: no generated
    module to keep in step."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    T = descriptor_pb2.FieldDescriptorProto
    spec = {
        "Pull": [
            ("swarm_key", T.TYPE_STRING, 0),
            ("rounds", T.TYPE_INT64, 1),
            ("wait_s", T.TYPE_DOUBLE, 0),
        ],
        "Round": [
            ("round", T.TYPE_INT64, 0),
            ("payload", T.TYPE_BYTES, 0),
            ("signature", T.TYPE_BYTES, 0),
        ],
        "Offer": [
            ("newest", T.TYPE_INT64, 0),
            ("digest", T.TYPE_BYTES, 0),
            ("rounds", T.TYPE_MESSAGE, 1),
        ],
    }
    proto = descriptor_pb2.FileDescriptorProto(name="ftis_swarm.proto", package="ftis_swarm")
    proto.syntax = "proto3"
    for name, fields in spec.items():
        message = proto.message_type.add(name=name)
        for number, (field, kind, repeated) in enumerate(fields, 1):
            f = message.field.add(name=field, number=number, type=kind)
            f.label = T.LABEL_REPEATED if repeated else T.LABEL_OPTIONAL
            if kind == T.TYPE_MESSAGE:
                f.type_name = ".ftis_swarm.Round"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return tuple(
        message_factory.GetMessageClass(pool.FindMessageTypeByName(f"ftis_swarm.{n}")) for n in spec
    )


def digest(fingerprints: dict[str, Any], wire: int) -> bytes:
    """16 bytes that two peers of the same fingerprints and transport wire version share."""
    text = json.dumps({"fingerprints": fingerprints, "wire": wire}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).digest()[:16]


def signed_bytes(swarm_key: str, round_: int, payload: bytes) -> bytes:
    return b"ftis-swarm-round\0" + swarm_key.encode() + b"\0" + struct.pack("<q", round_) + payload


def sign(private_key, data: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding

    return private_key.sign(data, padding.PKCS1v15(), hashes.SHA256())


def verifies(public_key, data: bytes, signature: bytes) -> bool:
    """Whether `signature` is `public_key`'s (a cryptography RSA key) over `data`."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding

    try:
        public_key.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False


@dataclass
class Reply:
    """A peer's answer to a pull: its newest round, its fingerprints' digest, and
    [(round, payload, signature)]; or `error` (why no answer came: "timeout" when none came in
    time, else the call's failure: the peer is unreachable or its reply does not parse)."""

    newest: int = -1
    digest: bytes = b""
    rounds: Sequence[tuple[int, bytes, bytes]] = ()
    error: Optional[str] = None
    took: float = 0.0  # seconds from the pull to the reply


class Streams:
    """This peer's end of the streams, over the daemon of the started DHT `dht`: serves what
    `offer` was given to whoever pulls (`serve` may be replaced to answer otherwise: the tests'
    hostile peers do), and pulls from peers (`pull_all`). `digest_of()` gives the digest of this
    peer's current fingerprints."""

    def __init__(self, dht, *, swarm_key: str, private_key, digest_of, record_ttl_s: float):
        from hivemind import DHT
        from hivemind.p2p import P2P

        self.Pull, self.Round, self.Offer = _messages()
        self.swarm_key, self.digest_of = swarm_key, digest_of
        self._private_key = private_key
        self.record_ttl_s = record_ttl_s
        self._kept: dict[int, tuple[bytes, bytes, float]] = {}  # round -> payload, sig, when
        self.newest = -1
        self.known: set[str] = set()  # peers the transport knows (others knock)
        self._knocked: set[str] = set()
        # Long polls of known peers (they wait for this peer's round): when one was last answered
        # with a round, and how many are held now.
        self._polled: dict[str, float] = {}
        self._holding: dict[str, int] = {}
        self._lock = threading.Lock()
        maddr = dht.run_coroutine(DHT._get_p2p_daemon_listen_maddr)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._changed: Optional[asyncio.Condition] = None

        async def start():
            self._changed = asyncio.Condition()
            p2p = await P2P.replicate(maddr)
            await p2p.add_protobuf_handler(PULL, self._handle, self.Pull)
            return p2p

        self.p2p = self._run(start(), 30.0)

    def _run(self, coro, timeout: Optional[float]):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # -- serving --------------------------------------------------------------------------------
    def offer(self, round_: int, payload: bytes) -> None:
        """Serve `payload` as this peer's of `round_` from now on (signed here)."""
        signature = sign(self._private_key, signed_bytes(self.swarm_key, round_, payload))

        async def keep():
            async with self._changed:
                now = time.monotonic()
                self._kept[round_] = (payload, signature, now)
                self.newest = max(self.newest, round_)
                for r in [r for r, (_, _, t) in self._kept.items()]:
                    if r <= self.newest - KEEP_ROUNDS or now - self._kept[r][2] > self.record_ttl_s:
                        del self._kept[r]
                self._changed.notify_all()

        self._run(keep(), 30.0)

    async def _handle(self, request, context):
        remote = context.remote_id.to_base58()
        with self._lock:
            if remote not in self.known and len(self._knocked) < _KNOCK_CAP:
                self._knocked.add(remote)
        if request.swarm_key != self.swarm_key:
            return self.Offer(newest=-1, digest=b"")
        asked = sorted({r for r in request.rounds[:MAX_ROUNDS_ASKED] if 0 <= r < _ROUND_MAX})
        wait = (
            min(max(float(request.wait_s), 0.0), MAX_HOLD_S)
            if request.wait_s == request.wait_s
            else 0.0
        )
        deadline = time.monotonic() + wait
        held, rounds = wait > 0 and self._poll_begins(remote), []
        try:
            async with self._changed:
                while asked and not any(r in self._kept for r in asked):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    try:
                        await asyncio.wait_for(self._changed.wait(), left)
                    except asyncio.TimeoutError:
                        break
                rounds = self.serve(asked)
        finally:
            if held:
                self._poll_ends(remote, bool(rounds))
        offer = self.Offer(newest=self.newest, digest=self.digest_of())
        size = 0
        for r, payload, signature in rounds:
            size += len(payload) + len(signature) + 32
            if size > MAX_OFFER_BYTES:
                break
            offer.rounds.add(round=r, payload=payload, signature=signature)
        return offer

    def serve(self, asked: list[int]) -> list[tuple[int, bytes, bytes]]:
        """[(round, payload, signature)] of the `asked` rounds this peer keeps, oldest first."""
        return [(r, *self._kept[r][:2]) for r in asked if r in self._kept]

    def _poll_begins(self, remote: str) -> bool:
        with self._lock:
            if remote not in self.known:
                return False
            self._holding[remote] = self._holding.get(remote, 0) + 1
            return True

    def _poll_ends(self, remote: str, answered: bool) -> None:
        with self._lock:
            left = self._holding.pop(remote, 1) - 1
            if left > 0:
                self._holding[remote] = left
            if answered:
                self._polled[remote] = time.monotonic()

    def polled_since(self, since: float) -> set[str]:
        """The known peers that wait for this peer's rounds: a long poll of theirs (a pull that
        waits) is held now, or was answered with a round at `time.monotonic()` >= `since` (one
        that ran out empty is a peer about to stop waiting)."""
        with self._lock:
            answered = {peer for peer, at in self._polled.items() if at >= since}
            return answered | set(self._holding)

    def knocked(self) -> set[str]:
        """The peers not in `known` that pulled from this one since the last call."""
        with self._lock:
            got, self._knocked = self._knocked, set()
        return got

    # -- pulling --------------------------------------------------------------------------------
    def pull_all(
        self,
        asks: dict[str, tuple[list[int], float]],
        *,
        waited: set[str],
        deadline: float,
        grace_s: float,
    ) -> dict[str, Reply]:
        """Pull from every peer of `asks` ({peer: (rounds, wait_s)}) at once. Returns when every
        peer of `waited` has answered (or at `deadline`), the others given until at least
        `grace_s` from now to answer; a peer without an answer then gets Reply(error="timeout")."""
        return self._run(self._pull_all(asks, waited, deadline, grace_s), None)

    async def _pull_all(self, asks, waited, deadline, grace_s) -> dict[str, Reply]:
        start = time.monotonic()
        tasks = {
            peer: asyncio.ensure_future(self._pull(peer, rounds, wait_s))
            for peer, (rounds, wait_s) in asks.items()
        }
        must = [tasks[p] for p in tasks if p in waited]
        if must:
            await asyncio.wait(must, timeout=max(0.0, deadline - time.monotonic()))
        rest = [t for t in tasks.values() if not t.done()]
        if rest:
            until = min(max(start + grace_s, time.monotonic()), max(deadline, start + grace_s))
            await asyncio.wait(rest, timeout=max(0.0, until - time.monotonic()))
        out = {}
        for peer, task in tasks.items():
            if task.done():
                out[peer] = task.result()
            else:
                task.cancel()
                out[peer] = Reply(error="timeout")
        return out

    async def _pull(self, peer: str, rounds: list[int], wait_s: float) -> Reply:
        from hivemind.p2p import PeerID

        request = self.Pull(swarm_key=self.swarm_key, rounds=rounds, wait_s=wait_s)
        started = time.monotonic()
        try:
            offer = await self.p2p.call_protobuf_handler(
                PeerID.from_base58(peer), PULL, request, self.Offer
            )
        except asyncio.CancelledError:
            raise
        except Exception as e:  # unreachable, a failed handler, a reply that does not parse
            return Reply(error=f"{type(e).__name__}: {str(e).strip()[:200]}")
        newest = offer.newest if -1 <= offer.newest < _ROUND_MAX else -1
        got = [(item.round, item.payload, item.signature) for item in offer.rounds]
        return Reply(newest, offer.digest, got, None, time.monotonic() - started)

    def close(self) -> None:
        if not self._loop.is_running():
            return

        async def stop():
            try:
                await self.p2p.remove_protobuf_handler(
                    PULL, stream_input=False, stream_output=False
                )
            except Exception:
                pass
            await self.p2p.shutdown()

        try:
            self._run(stop(), 10.0)
        except Exception as e:  # the daemon went first
            log.debug("swarm streams: closing: %s", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
