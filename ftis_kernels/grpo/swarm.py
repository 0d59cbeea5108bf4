"""The hivemind transport: one peer per process, on any host, over hivemind's DHT and streams.

A peer's identity is one RSA key kept in its output folder (`peer.key`, libp2p's protobuf
format, mode 0600): the libp2p identity (so the peer id survives a restart) and the key that
signs the peer's announcement and payloads. The DHT holds who is in the swarm: under
`<swarm_key>/peers`, each peer's announcement (its fingerprints: configuration, vocabulary, wire
version, what `agree` recorded; the transport's wire version; its newest round when written),
under a subkey that carries the owner's public key (hivemind's `RSASignatureValidator` marker),
so that only the owner can write it and every reader checks its signature. It expires
`record_ttl_s` after it was written; `publish` writes it again after a third of that.

The payloads go from peer to peer over libp2p streams (`streams`): `publish` keeps a round's
payload, signed, to serve; `collect` pulls from each live, compatible, trusted peer the rounds
within `max_staleness` it has not collected, one long poll per peer that answers as soon as the
peer has them, waiting at most `timeout_s` for the current round. A reply's rounds are checked:
asked for, within the cap ("size"), signed by the key of the peer's announcement ("forged");
announced peers not in `trusted_peers` ("untrusted") or whose fingerprints differ from ours
("incompatible", naming the keys) are refused once each; a record the DHT's validator refused
("forged": charged to the key that signed it) too, all as `Rejection`s. Nothing a peer stores
or sends can make a receiver raise.

There is no barrier. A peer that let a round pass (it sent nothing for it in time) is probed
without waiting from then on, until it sends a current round again; one that cannot be reached
is asked again after `_MEMBERS_REFRESH_S`. The DHT is read again at a collect after that long
too, or when a peer it does not know has pulled from this one (a new peer), or when a peer's
reply says that its fingerprints changed. Each reply says the newest round its peer published:
`swarm_round` is where the others are, and `waited_by` the peers that still wait for this one,
so that a peer left behind can tell when to skip ahead.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, Optional

from ftis_kernels._extras import require
from ftis_kernels.grpo.identity import (
    VALIDATORS,
    SwarmStartError,
    drain_refused,
    key_bytes,
    load_private_key,
    owner_of,
    peer_of,
    validator_class,
)
from ftis_kernels.grpo.streams import (
    MAX_HOLD_S,
    MAX_OFFER_BYTES,
    Streams,
    digest,
    signed_bytes,
    verifies,
)
from ftis_kernels.grpo.transport import Incoming, Rejection, SwarmError

log = logging.getLogger(__name__)

# The layout of this transport's announcements and streams; peers that differ are
# "incompatible" with the reason "wire".
SWARM_WIRE_VERSION = 2
KEY_FILE = "peer.key"
# The largest payload a peer may publish a round: one reply of hivemind's daemon carries it.
MAX_PAYLOAD_BYTES = MAX_OFFER_BYTES - 4096
# The largest announcement a validator stores: fingerprints and a few numbers.
_ANNOUNCEMENT_BYTES = 16 << 10
# How long the announced peers read from the DHT are used before it is read again (a new peer
# that pulls from this one, or a changed fingerprint, has it read at once).
_MEMBERS_REFRESH_S = 10.0
# A peer a pull could not reach is left alone this long, twice as long after each further
# failure in a row, at most _MEMBERS_REFRESH_S.
_GONE_FIRST_S = 1.0
# A long poll asks for a reply this long before the collect's deadline; a probe of a peer not
# waited for is given at least this long to answer.
_REPLY_MARGIN_S = 0.1
_PROBE_GRACE_S = 1.0
# How long a store or a call into the DHT's process may take before it counts as failed.
_CALL_TIMEOUT_S = 30.0
# A record may expire at most record_ttl_s plus this (clocks of hosts differ) after it is seen:
# a far-future expiry would pin it in every node.
_MAX_TTL_SLACK_S = 300.0


def _check_maddrs(maddrs: Sequence[str], flag: str, need_peer: bool) -> list[str]:
    from hivemind.utils.multiaddr import Multiaddr

    for addr in maddrs:
        try:
            parsed = Multiaddr(addr)
        except Exception as e:
            raise SwarmStartError(flag, f"{addr!r} is not a multiaddr ({e})") from None
        if need_peer and "p2p" not in parsed.protocols():
            raise SwarmStartError(flag, f"{addr!r} names no peer (it needs /p2p/<peer id>)")
    return list(maddrs)


class _Member:
    """An announced peer as read from the DHT: why it is refused (None: it is not), its
    announcement's expiry, its public key and fingerprints' digest."""

    def __init__(self, why: Optional[str], round_: int, expiry: float, key: Any, digest: bytes):
        self.why, self.round, self.expiry, self.key, self.digest = why, round_, expiry, key, digest


class HivemindTransport:
    """A `Transport` over hivemind: the DHT for who is in the swarm, direct streams for the
    payloads (see the module's docstring). Keyword arguments: `out` (the peer's folder, which
    keeps its key), `swarm_key` (the name its records live under), `fingerprints` (what a
    compatible peer reports identically, by key), `initial_peers` (multiaddrs of running peers;
    empty for the first), `host_maddrs` (where to listen), `trusted_peers` (peer ids allowed to
    contribute, or None for any), `max_payload_bytes`, `record_ttl_s` (how long announcements
    live, and payloads are served) and `start_timeout_s` (how long to wait to join)."""

    kind = "hivemind"

    def __init__(
        self,
        *,
        out: Path,
        swarm_key: str,
        fingerprints: dict[str, str],
        initial_peers: list[str],
        host_maddrs: list[str],
        trusted_peers: Optional[list[str]],
        max_payload_bytes: int,
        record_ttl_s: float,
        start_timeout_s: float,
    ):
        require("swarm", "the hivemind transport")
        if not swarm_key:
            raise ValueError("swarm_key: must not be empty")
        for name, value in (
            ("max_payload_bytes", max_payload_bytes),
            ("record_ttl_s", record_ttl_s),
            ("start_timeout_s", start_timeout_s),
        ):
            if not value > 0:
                raise ValueError(f"{name}: must be > 0, got {value}")
        if max_payload_bytes > MAX_PAYLOAD_BYTES:
            raise ValueError(
                f"max_payload_bytes: at most {MAX_PAYLOAD_BYTES} (what one reply of hivemind's "
                f"daemon carries), got {max_payload_bytes}"
            )
        initial_peers = _check_maddrs(initial_peers, "--initial-peers", need_peer=True)
        host_maddrs = _check_maddrs(host_maddrs, "--host-maddr", need_peer=False)
        from hivemind import DHT

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        key_path = out / KEY_FILE
        private_key = load_private_key(key_bytes(key_path), key_path)
        validator = validator_class()(
            private_key, _ANNOUNCEMENT_BYTES, record_ttl_s + _MAX_TTL_SLACK_S
        )
        self._token = f"{os.getpid()}-{id(self)}"
        VALIDATORS[self._token] = validator
        self._owner: bytes = validator.local_public_key
        self.swarm_key = swarm_key
        self.fingerprints = dict(fingerprints)
        self.trusted_peers = None if trusted_peers is None else set(trusted_peers)
        self.max_payload_bytes = max_payload_bytes
        self.record_ttl_s = record_ttl_s
        self._published: Optional[int] = None
        self._collected: set[tuple[str, int]] = set()  # (peer, round) returned or refused
        self._members: dict[str, _Member] = {}
        self._members_at = -math.inf  # when the DHT was last read
        self._announced_at = -math.inf
        self._absent: dict[str, float] = {}  # peer -> since when it is not waited for
        # peer -> (when a pull last could not reach it, how long it is left alone since): the
        # pause doubles from _GONE_FIRST_S with each failure in a row, up to the members'
        # refresh period, so that one reset stream (a lossy link, a busy host) costs a round or
        # two of that peer, not the rest of a short run.
        self._gone: dict[str, tuple[float, float]] = {}
        self._reported: set[tuple[str, str]] = set()  # (peer, why) of refused peers
        # peer -> (the newest round its last reply reported, when): `swarm_round`
        self._newest: dict[str, tuple[int, float]] = {}
        self._collect_began = math.inf  # when the last collect began
        self._closed = False
        self._streams = None
        self._dht = DHT(
            initial_peers=initial_peers or None,
            start=False,
            record_validators=[validator],
            host_maddrs=host_maddrs,
            identity_path=str(key_path),
            startup_timeout=start_timeout_s,
            bootstrap_timeout=start_timeout_s,
            wait_timeout=min(3.0, start_timeout_s),
        )
        started = time.monotonic()
        try:
            self._dht.run_in_background(await_ready=True, timeout=start_timeout_s)
        except Exception as e:
            self._stop()
            why = (str(e).strip().splitlines() or [type(e).__name__])[-1]
            if initial_peers:
                raise SwarmStartError(
                    "--initial-peers",
                    f"could not join through {' '.join(initial_peers)} within "
                    f"{start_timeout_s:g} s ({why})",
                ) from None
            raise SwarmStartError(
                "--host-maddr", f"could not listen on {' '.join(host_maddrs)} ({why})"
            ) from None
        self.peer_id: str = self._dht.peer_id.to_base58()
        self.visible_maddrs: list[str] = [str(m) for m in self._dht.get_visible_maddrs()]
        try:
            self._streams = self._start_streams(private_key)
        except BaseException:
            self._stop()
            raise
        self._announce()
        log.info(
            "swarm peer %s up in %.1f s at %s",
            self.peer_id,
            time.monotonic() - started,
            " ".join(self.visible_maddrs),
        )

    def _start_streams(self, private_key) -> Streams:
        """This peer's end of the direct streams (a hook: the tests' hostile peers replace it)."""
        return Streams(
            self._dht,
            swarm_key=self.swarm_key,
            private_key=private_key._private_key,
            digest_of=lambda: digest(self.fingerprints, SWARM_WIRE_VERSION),
            record_ttl_s=self.record_ttl_s,
        )

    @property
    def _peers_key(self) -> str:
        return f"{self.swarm_key}/peers"

    def _announce(self) -> None:
        from hivemind.utils import get_dht_time

        value = {
            "wire": SWARM_WIRE_VERSION,
            "round": -1 if self._published is None else self._published,
            "fingerprints": self.fingerprints,
        }
        self._announced_at = time.monotonic()
        expiry = get_dht_time() + self.record_ttl_s
        if not self._store(self._peers_key, value, expiry):
            log.warning("swarm: the announcement of %s was not stored", self.peer_id)

    # The protocol's lockstep steps: without a fixed world they concern this peer alone.
    def agree(self, what: str, fingerprint: str) -> None:
        self.fingerprints[what] = fingerprint
        self._announce()

    def barrier(self, phase: str, *, setup: bool = False) -> None:
        return None

    def common_round(self, good: list[int]) -> Optional[int]:
        return max(good) if good else None

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def publish(self, round_: int, payload: bytes) -> None:
        if len(payload) > self.max_payload_bytes:
            raise ValueError(
                f"max_payload_bytes: this peer's payload of round {round_} has "
                f"{len(payload)} B, over the cap of {self.max_payload_bytes} B its peers enforce"
            )
        self._published = round_ if self._published is None else max(self._published, round_)
        self._streams.offer(round_, bytes(payload))
        if time.monotonic() - self._announced_at > self.record_ttl_s / 3:
            self._announce()

    def _store(self, key: str, value: Any, expiry: float) -> bool:
        """Store under this peer's subkey, waiting at most `_CALL_TIMEOUT_S`: False when the
        store failed or timed out; SwarmError when the DHT's process is gone."""
        future = self._dht.store(key, value, expiry, subkey=self._owner, return_future=True)
        return bool(self._result(future, f"storing {key}", default=False))

    def _result(self, future, what: str, default: Any) -> Any:
        """A DHT call's result within `_CALL_TIMEOUT_S`, else `default` (a slow swarm costs a
        warning, not a hang); SwarmError when the DHT's process is gone."""
        try:
            return future.result(timeout=_CALL_TIMEOUT_S)
        except Exception as exc:
            future.cancel()
            if not self._dht.is_alive():
                raise SwarmError(f"during {what}: the DHT's process is gone") from exc
            log.warning("swarm: %s failed: %s", what, f"{type(exc).__name__}: {exc}")
            return default

    def _read_members(self, deadline: float) -> None:
        """Read the announced peers from the DHT (this peer's left out) into `_members`."""
        from cryptography.hazmat.primitives import serialization

        future = self._dht.get(self._peers_key, latest=True, return_future=True)
        try:
            result = future.result(timeout=max(0.05, deadline - time.monotonic()))
        except Exception as e:  # the deadline, or a failed read: keep what we knew
            log.debug("swarm: reading %s failed: %s", self._peers_key, e)
            future.cancel()
            return
        members = {}
        if result is not None and isinstance(result.value, dict):
            for subkey, item in result.value.items():
                owner = owner_of(subkey) if isinstance(subkey, bytes) else None
                peer = peer_of(owner) if owner is not None else None
                if peer is None or subkey == self._owner:
                    continue
                why, round_ = self._judge(peer, item.value)
                key = serialization.load_ssh_public_key(owner)
                theirs = item.value.get("fingerprints") if isinstance(item.value, dict) else None
                print_ = digest(theirs, SWARM_WIRE_VERSION) if why is None else b""
                members[peer] = _Member(why, round_, item.expiration_time, key, print_)
        self._members, self._members_at = members, time.monotonic()
        with self._streams._lock:
            self._streams.known = set(members)

    def _judge(self, peer: str, value: Any) -> tuple[Optional[str], int]:
        """Why a peer's announcement makes its records refused ("kind: reason"), or None."""
        if self.trusted_peers is not None and peer not in self.trusted_peers:
            return "untrusted: not in the trusted peers", -1
        theirs = value.get("fingerprints") if isinstance(value, dict) else None
        # Fingerprints are text by text (keys of other types could not be compared or digested).
        if not isinstance(theirs, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in theirs.items()
        ):
            return "incompatible: wire (a malformed announcement)", -1
        round_ = value.get("round")
        round_ = round_ if type(round_) is int and 0 <= round_ < 2**31 else -1
        if value.get("wire") != SWARM_WIRE_VERSION:
            return (
                f"incompatible: wire (version {value.get('wire')!r}, ours {SWARM_WIRE_VERSION})",
                round_,
            )
        differ = sorted(
            str(k)
            for k in set(theirs) | set(self.fingerprints)
            if theirs.get(k) != self.fingerprints.get(k)
        )
        if differ:
            return (
                f"incompatible: {', '.join(differ)} differ{'s' if len(differ) == 1 else ''}",
                round_,
            )
        return None, round_

    def _live(self) -> dict[str, _Member]:
        from hivemind.utils import get_dht_time

        now = get_dht_time()
        return {p: m for p, m in self._members.items() if m.why is None and m.expiry > now}

    def latest_round(self) -> Optional[int]:
        """Where a peer that joins late starts: the newest round the live, compatible, trusted
        peers (this one included) published, each asked directly, as their lower median (one
        peer that claims a far round cannot move it), None before any did."""
        self._read_members(time.monotonic() + 10.0)
        live = self._live()
        asks = {peer: ([], 0.0) for peer in live}
        replies = self._streams.pull_all(
            asks, waited=set(asks), deadline=time.monotonic() + 10.0, grace_s=0.0
        )
        rounds = [
            r.newest if r.error is None and r.digest == live[p].digest else live[p].round
            for p, r in replies.items()
        ]
        rounds = [r for r in rounds if r >= 0]
        if self._published is not None:
            rounds.append(self._published)
        return sorted(rounds)[(len(rounds) - 1) // 2] if rounds else None

    def swarm_round(self) -> Optional[int]:
        """The round the swarm is at as this peer's last collect heard it, with no call of its
        own: the lower median of the newest rounds that the live, compatible, trusted peers
        reported in their replies to it (this peer left out, and those unreachable), None when
        none replied. One peer that claims a far round cannot move it when two others replied;
        in a swarm of two, the other's word is the swarm's round (as for `latest_round`)."""
        live = self._live()
        rounds = sorted(
            r
            for peer, (r, at) in self._newest.items()
            if peer in live and r >= 0 and at >= self._collect_began
        )
        return rounds[(len(rounds) - 1) // 2] if rounds else None

    def waited_by(self, since: float, from_round: int = 0) -> set[str]:
        """The live, compatible, trusted peers that wait for this peer's samples (a long poll of
        its stream held now, or answered with a round at or after `since`, a
        `time.monotonic()`), at round `from_round` or later by their last reply: those that
        still take its current rounds."""
        live = self._live()
        return {
            peer
            for peer in self._streams.polled_since(since)
            if peer in live and self._newest.get(peer, (-1, 0.0))[0] >= from_round
        }

    def collect(
        self, round_: int, *, max_staleness: int, timeout_s: float
    ) -> tuple[list[Incoming], list[Rejection]]:
        self._collect_began = time.monotonic()
        deadline = self._collect_began + timeout_s
        window = list(range(max(0, round_ - max_staleness), round_ + 1))
        incoming: list[Incoming] = []
        rejected: list[Rejection] = []
        knocked = self._streams.knocked()
        if knocked or time.monotonic() - self._members_at > _MEMBERS_REFRESH_S:
            self._read_members(max(deadline, time.monotonic() + 1.0))
        self._report_refused(round_, rejected)
        waited: set[str] = set()
        done: set[str] = set()  # peers not asked again in this collect
        refreshed = False
        while True:
            now = time.monotonic()
            asks: dict[str, tuple[list[int], float]] = {}
            for peer in self._live():
                want = [r for r in window if (peer, r) not in self._collected]
                since, pause = self._gone.get(peer, (0.0, 0.0))
                if not want or peer in done or now - since < pause:
                    continue
                # A long poll for this round from the peers it waits for; a probe (no wait)
                # of the others: those that let a round pass, and what is left of older rounds.
                waits = (peer, round_) not in self._collected and peer not in self._absent
                asks[peer] = (want, max(0.0, deadline - now - _REPLY_MARGIN_S) if waits else 0.0)
                if waits:
                    waited.add(peer)
            if not asks:
                break
            replies = self._streams.pull_all(
                asks, waited=waited & set(asks), deadline=deadline, grace_s=_PROBE_GRACE_S
            )
            held = {}
            for peer, reply in replies.items():
                want, wait_s = asks[peer]
                if reply.error is not None:
                    done.add(peer)
                    self._newest.pop(peer, None)
                    if reply.error != "timeout":
                        pause = self._gone.get(peer, (0.0, _GONE_FIRST_S / 2))[1]
                        pause = min(2 * pause, _MEMBERS_REFRESH_S)
                        self._gone[peer] = (time.monotonic(), pause)
                        log.info(
                            "swarm: peer %s unreachable (left alone %.0f s): %s",
                            peer,
                            pause,
                            reply.error,
                        )
                    continue
                self._gone.pop(peer, None)
                if reply.digest != self._members[peer].digest:
                    held[peer] = reply  # it changed its fingerprints since we read them
                    continue
                self._newest[peer] = (reply.newest, time.monotonic())
                if not self._take(peer, reply, want, round_, incoming, rejected):
                    # A reply against the protocol, or an early one without a round asked
                    # for (a long poll is held until one is there): not asked again now.
                    if reply.took < min(wait_s, MAX_HOLD_S) - _REPLY_MARGIN_S or reply.rounds:
                        done.add(peer)
            if held and not refreshed:
                refreshed = True
                self._read_members(max(deadline, time.monotonic() + 1.0))
                self._report_refused(round_, rejected)
                live = self._live()
                for peer, reply in held.items():
                    if peer in live and reply.digest == live[peer].digest:
                        self._newest[peer] = (reply.newest, time.monotonic())
                        self._take(peer, reply, asks[peer][0], round_, incoming, rejected)
                    else:
                        done.add(peer)
            again = [
                p for p in waited - done if (p, round_) not in self._collected and p in self._live()
            ]
            if not again or time.monotonic() >= deadline - _REPLY_MARGIN_S:
                break
        for peer in waited:
            if (peer, round_) not in self._collected:
                # It let the round pass: probed, not waited for, until it sends a round again.
                self._absent.setdefault(peer, time.monotonic())
                log.info(
                    "swarm: peer %s sent nothing for round %d within %g s", peer, round_, timeout_s
                )
        drain = self._dht.run_coroutine(
            partial(drain_refused, token=self._token), return_future=True
        )
        rejected += self._result(drain, "reading the refused records", default=[])
        incoming.sort(key=lambda item: (item.round, item.peer))
        return incoming, rejected

    def _take(self, peer, reply, asked: list[int], round_: int, incoming, rejected) -> bool:
        """Check a peer's reply round by round: asked for, within the cap, signed by its key.
        Whether it brought a round asked for and nothing against the protocol."""
        member = self._members[peer]
        fresh = False
        for r, payload, signature in reply.rounds:
            if r not in asked or (peer, r) in self._collected:
                why = f"round {r}: a round it was not asked for ({asked})"
                if (peer, r) in self._collected:
                    why = f"round {r}: a round it sent already"
                rejected.append(Rejection(peer, "incompatible", why))
                return False  # one refusal per reply: the rest of it is not read
            self._collected.add((peer, r))
            fresh = True
            if len(payload) > self.max_payload_bytes:
                why = f"round {r}: {len(payload)} B, over the cap of {self.max_payload_bytes} B"
                rejected.append(Rejection(peer, "size", why))
            elif not verifies(member.key, signed_bytes(self.swarm_key, r, payload), signature):
                why = f"round {r}: a payload not signed by its key"
                rejected.append(Rejection(peer, "forged", why))
            else:
                incoming.append(Incoming(peer, r, payload))
                if r == round_:
                    self._absent.pop(peer, None)
        return fresh

    def _report_refused(self, round_: int, rejected: list[Rejection]) -> None:
        """Each announced peer refused (untrusted, incompatible), once per peer and reason."""
        for peer, member in sorted(self._members.items()):
            if member.why is not None and (peer, member.why) not in self._reported:
                self._reported.add((peer, member.why))
                kind, reason = member.why.split(": ", 1)
                rejected.append(Rejection(peer, kind, f"round {round_}: {reason}"))

    def _stop(self) -> None:
        if self._streams is not None:
            self._streams.close()
        if self._dht.is_alive():
            self._dht.shutdown()
        VALIDATORS.pop(self._token, None)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._stop()
