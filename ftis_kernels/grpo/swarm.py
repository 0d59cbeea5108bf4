"""The hivemind transport: one peer per process, on any host, over hivemind's DHT.

A peer's identity is one RSA key kept in its output folder (`peer.key`, libp2p's protobuf
format, mode 0600): it is the libp2p identity (so the peer id survives a restart) and the key
that signs the peer's records. Two kinds of record live in the DHT, both under a subkey that
carries the owner's public key (hivemind's `RSASignatureValidator` marker), so only the owner
can write them and every reader checks the signature:

- `<swarm_key>/round/<r>`: one peer's exchange payload of round r (`exchange.pack`'s bytes);
- `<swarm_key>/peers`: the peer's announcement: its fingerprints (configuration, vocabulary,
  wire version, what `agree` recorded), the newest round it published and the transport's own
  wire version. Readers learn from it which peers are live (the record has not expired) and
  compatible.

Both expire `record_ttl_s` after they were written; `publish` refreshes the announcement. A
record refused on the way is not lost silently: the validator counts the ones whose signature
does not match their subkey ("forged") and `collect` returns them, with the peers that are not
in `trusted_peers` ("untrusted"), payloads over the cap ("size") and peers whose fingerprints
differ from ours ("incompatible", naming the key), as `Rejection`s. Nothing a peer stores can
make a receiver raise.

There is no barrier: `collect` takes what the peers published for the recent rounds, waits at
most `timeout_s` for the live peers' payloads of the current round, and stops waiting for a
peer that let a round pass without publishing until it announces itself again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, Optional

from ftis_kernels._extras import require
from ftis_kernels.grpo.transport import Incoming, Rejection, SwarmError

log = logging.getLogger(__name__)

# The layout of this transport's records (keys, announcement fields); peers that differ are
# "incompatible" with the reason "wire".
SWARM_WIRE_VERSION = 1
KEY_FILE = "peer.key"
# How often `collect` asks the DHT again while it waits: from the first to the last, growing.
_POLL_FIRST_S = 0.05
_POLL_MAX_S = 0.5
# A signed record's bytes beyond its payload: the msgpack header and the base64 RSA signature.
_RECORD_SLACK = 1024
# How long a store or a call into the DHT's process may take before it counts as failed.
_CALL_TIMEOUT_S = 30.0
# How many refused records a validator remembers so that each is reported once.
_SEEN_CAP = 4096
# At most this many refusals are kept between two collects (a flood of forged records costs
# neither memory nor log lines without bound).
_REFUSED_CAP = 256
# How many keys that signed valid records a validator keeps, to name the signer of a forgery.
_KNOWN_KEYS = 256
# A record may expire at most record_ttl_s plus this (clocks of hosts differ) after it is seen:
# a far-future expiry would pin it in every node.
_MAX_TTL_SLACK_S = 300.0


class SwarmStartError(ValueError):
    """The peer could not join: a malformed multiaddr or initial peers that did not answer.
    `flag` names the command-line flag to fix (`--initial-peers`, `--host-maddr`)."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


def _key_bytes(path: Path) -> bytes:
    """This peer's private key in libp2p's protobuf form, created (mode 0600) on first use."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from hivemind.proto import crypto_pb2

    if not path.exists():
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        der = key.private_bytes(
            serialization.Encoding.DER,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
        proto = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=der)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(proto.SerializeToString())
    return path.read_bytes()


def _load_private_key(data: bytes, path: Path):
    """hivemind's RSAPrivateKey for the key file's bytes (SwarmStartError naming --out if the
    file is not an RSA key)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    try:
        proto = crypto_pb2.PrivateKey.FromString(data)
        key = serialization.load_der_private_key(proto.data, password=None)
    except Exception as e:
        raise SwarmStartError("--out", f"{path} is not a peer key ({e})") from None
    if proto.key_type != crypto_pb2.KeyType.RSA or not isinstance(key, rsa.RSAPrivateKey):
        raise SwarmStartError("--out", f"{path} is not an RSA peer key")
    private = RSAPrivateKey.__new__(RSAPrivateKey)
    private.__setstate__({"_private_key": proto.data})  # its pickling path: DER in, key out
    return private


_PEER_IDS: dict[bytes, str] = {}


def _peer_of(owner: bytes) -> Optional[str]:
    """The libp2p peer id (base58) of an owner marker's OpenSSH public key; None if the bytes
    are not an RSA public key. A record's peer is derived from the key that signs it."""
    if owner not in _PEER_IDS:
        if len(_PEER_IDS) > _SEEN_CAP:  # forged records may name any number of keys
            _PEER_IDS.clear()
        import multihash
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from hivemind.p2p import PeerID
        from hivemind.proto import crypto_pb2

        try:
            key = serialization.load_ssh_public_key(owner)
        except Exception:
            return None
        if not isinstance(key, rsa.RSAPublicKey):
            return None
        der = key.public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        proto = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
        digest = multihash.encode(hashlib.sha256(proto).digest(), "sha2-256")
        _PEER_IDS[owner] = PeerID(digest).to_base58()
    return _PEER_IDS[owner]


def _owner_of(subkey: bytes) -> Optional[bytes]:
    """The owner's public key in a subkey's marker, or None."""
    from hivemind.dht.crypto import RSASignatureValidator

    found = RSASignatureValidator._PUBLIC_KEY_RE.findall(subkey)
    return found[0] if len(found) == 1 else None


def _subkey_owner(subkey: Optional[bytes]) -> Optional[bytes]:
    """The owner's public key when a record's (serialized) subkey is exactly one owner marker,
    else None."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils.serializer import MSGPackSerializer

    try:
        decoded = MSGPackSerializer.loads(subkey) if subkey else None
    except Exception:
        return None
    if not isinstance(decoded, bytes):
        return None
    found = RSASignatureValidator._PUBLIC_KEY_RE.fullmatch(decoded)
    return found.group(1) if found else None


def _validator_class():
    """`OwnedRecords`, built on first use so that importing this module needs no hivemind."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils import get_dht_time
    from hivemind.utils.crypto import RSAPublicKey
    from hivemind.utils.serializer import MSGPackSerializer

    class OwnedRecords(RSASignatureValidator):
        """hivemind's signature validator that remembers what it refused: a record whose
        subkey names an owner's key but whose signature is not that key's ("forged"), or
        one larger than the payload cap ("size"). It runs inside the DHT's process; the
        transport drains its refusals from there (`_drain_refused`)."""

        def __init__(self, private_key, max_record_bytes: int, max_ttl_s: float):
            super().__init__(private_key)
            self.max_record_bytes = max_record_bytes
            self.max_ttl_s = max_ttl_s
            # Refusals as (peer charged, kind, reason, what a forgery's signer is sought by).
            self.refused: list[tuple[str, str, str, Optional[tuple[bytes, bytes, bytes]]]] = []
            self._seen: dict[bytes, None] = {}
            self._keys: dict[bytes, Any] = {}  # owner -> its public key, of records it signed

        def validate(self, record) -> bool:
            # Every record of the swarm sits under exactly one owner's subkey: an unowned one
            # (a regular value, or a subkey without the marker) could replace or hide the
            # owned ones in every node's storage, so none is stored or read.
            owner = _subkey_owner(record.subkey)
            if owner is None or self._PUBLIC_KEY_RE.search(record.key):
                return self._refuse(record, None, "forged", "a record under no owner's key")
            if not super().validate(record):
                # Charged to the key that signed it, never to the owner it names: found among
                # the keys that signed valid records (`take_refused`), else to nobody.
                reason = "a record under its subkey is not signed by its key"
                return self._refuse(record, None, "forged", reason, forgery=owner)
            if owner not in self._keys:
                if len(self._keys) >= _KNOWN_KEYS:
                    del self._keys[next(iter(self._keys))]
                self._keys[owner] = RSAPublicKey.from_bytes(owner)
            value = self.strip_value(record)
            if len(value) > self.max_record_bytes:
                reason = f"a signed record of {len(value)} B, over the cap"
                return self._refuse(record, owner, "size", reason)
            ahead = record.expiration_time - get_dht_time()
            if ahead > self.max_ttl_s:
                reason = f"a record that expires in {ahead:.0f} s, more than {self.max_ttl_s:g} s"
                return self._refuse(record, owner, "incompatible", reason)
            try:  # hivemind decodes a key's records together: one that does not decode hides all
                decoded = MSGPackSerializer.loads(value)
            except Exception:
                decoded = None
            if not isinstance(decoded, (bytes, dict)):
                return self._refuse(record, owner, "incompatible", "a value that does not decode")
            return True

        def _refuse(
            self,
            record,
            owner: Optional[bytes],
            kind: str,
            reason: str,
            forgery: Optional[bytes] = None,
        ) -> bool:
            """Refuse `record`, charged to `owner` (the key that signed it; None: nobody);
            `forgery`: the owner a record not signed by its key names, its signer sought later."""
            digest = hashlib.sha256(record.key + (record.subkey or b"") + record.value).digest()
            if digest not in self._seen and len(self.refused) < _REFUSED_CAP:
                self._seen[digest] = None
                if len(self._seen) > _SEEN_CAP:
                    del self._seen[next(iter(self._seen))]
                peer = (_peer_of(owner) if owner is not None else None) or ""
                sought = None
                if forgery is not None:
                    signatures = self._SIGNATURE_RE.findall(record.value)
                    stripped = dataclasses.replace(record, value=self.strip_value(record))
                    signature = signatures[0] if len(signatures) == 1 else b""
                    sought = (self._serialize_record(stripped), signature, forgery)
                self.refused.append((peer, kind, reason, sought))
            return False

        def take_refused(self) -> list[Rejection]:
            """The refusals since the last call, each forgery charged to the key among those
            that signed valid records whose signature it carries (the one it names excepted),
            or to nobody ("")."""
            refused, self.refused = self.refused, []
            out = []
            for peer, kind, reason, sought in refused:
                if sought is not None:
                    data, signature, named = sought
                    for owner, key in list(self._keys.items()) if signature else ():
                        if owner != named and _verifies(key, data, signature):
                            peer = _peer_of(owner) or ""
                            break
                    named_peer = _peer_of(named)
                    reason += f" (it names {named_peer}" if named_peer else " (it names a key"
                    reason += f"; signed by {peer})" if peer else "; signed by no known key)"
                out.append(Rejection(peer, kind, reason))
            return out

    return OwnedRecords


# The validators of this process's transports, by token: after the DHT's process forks, its
# copy of this table points at the validator its DHT node uses.
_VALIDATORS: dict[str, Any] = {}


async def _drain_refused(_dht, _node, token: str) -> list[Rejection]:
    return _VALIDATORS[token].take_refused()


def _verifies(key, data: bytes, signature: bytes) -> bool:
    """Whether hivemind's base64 RSA `signature` of `data` is `key`'s."""
    try:
        return bool(key.verify(data, signature))
    except Exception:  # not base64, not a signature
        return False


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


class HivemindTransport:
    """A `Transport` over hivemind's DHT (see the module's docstring). Keyword arguments:
    `out` (the peer's folder, which keeps its key), `swarm_key` (the name its records live
    under), `fingerprints` (what a compatible peer reports identically, by key), `initial_peers`
    (multiaddrs of running peers; empty for the first), `host_maddrs` (where to listen),
    `trusted_peers` (peer ids allowed to contribute, or None for any), `max_payload_bytes`,
    `record_ttl_s` (how long records live) and `start_timeout_s` (how long to wait to join)."""

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
        initial_peers = _check_maddrs(initial_peers, "--initial-peers", need_peer=True)
        host_maddrs = _check_maddrs(host_maddrs, "--host-maddr", need_peer=False)
        from hivemind import DHT

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        key_path = out / KEY_FILE
        private_key = _load_private_key(_key_bytes(key_path), key_path)
        validator = _validator_class()(
            private_key, max_payload_bytes + _RECORD_SLACK, record_ttl_s + _MAX_TTL_SLACK_S
        )
        self._token = f"{os.getpid()}-{id(self)}"
        _VALIDATORS[self._token] = validator
        self._owner: bytes = validator.local_public_key
        self.swarm_key = swarm_key
        self.fingerprints = dict(fingerprints)
        self.trusted_peers = None if trusted_peers is None else set(trusted_peers)
        self.max_payload_bytes = max_payload_bytes
        self.record_ttl_s = record_ttl_s
        self._published: Optional[int] = None
        self._collected: set[tuple[str, int]] = set()  # (peer, round) returned or refused
        self._absent: dict[str, float] = {}  # peer -> its announcement's expiry when it missed
        self._closed = False
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
        self._announce()
        log.info(
            "swarm peer %s up in %.1f s at %s",
            self.peer_id,
            time.monotonic() - started,
            " ".join(self.visible_maddrs),
        )

    # The records' keys.
    def _round_key(self, round_: int) -> str:
        return f"{self.swarm_key}/round/{round_}"

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
        from hivemind.utils import get_dht_time

        if len(payload) > self.max_payload_bytes:
            raise ValueError(
                f"max_payload_bytes: this peer's payload of round {round_} has "
                f"{len(payload)} B, over the cap of {self.max_payload_bytes} B its peers enforce"
            )
        self._published = round_ if self._published is None else max(self._published, round_)
        self._announce()
        expiry = get_dht_time() + self.record_ttl_s
        if not self._store(self._round_key(round_), bytes(payload), expiry):
            log.warning("swarm: round %d of %s was not stored", round_, self.peer_id)

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

    def _get(self, keys: list[str], deadline: float) -> list[dict[str, Any]]:
        """The records under `keys` as {peer: value} (this peer's left out), read in parallel;
        a key whose read fails or times out reads as empty."""
        futures = [self._dht.get(key, latest=True, return_future=True) for key in keys]
        found: list[dict[str, Any]] = []
        for key, future in zip(keys, futures):
            records: dict[str, Any] = {}
            try:
                result = future.result(timeout=max(0.05, deadline - time.monotonic()))
            except Exception as e:  # a peer's undecodable record, or the deadline
                log.debug("swarm: reading %s failed: %s", key, e)
                future.cancel()
                result = None
            if result is not None and isinstance(result.value, dict):
                for subkey, item in result.value.items():
                    if subkey == self._owner or not isinstance(subkey, bytes):
                        continue
                    owners = _owner_of(subkey)
                    peer = _peer_of(owners) if owners else None
                    if peer is not None:
                        records[peer] = item.value, item.expiration_time
            found.append(records)
        return found

    def _peers(self, deadline: float) -> dict[str, tuple[Optional[str], int, float]]:
        """The announced peers: peer -> (why it is refused or None, newest round, expiry)."""
        (announced,) = self._get([self._peers_key], deadline)
        peers = {}
        for peer, (value, expiry) in announced.items():
            peers[peer] = (*self._judge(peer, value), expiry)
        return peers

    def _judge(self, peer: str, value: Any) -> tuple[Optional[str], int]:
        """Why a peer's announcement makes its records refused ("kind: reason"), or None."""
        if self.trusted_peers is not None and peer not in self.trusted_peers:
            return "untrusted: not in the trusted peers", -1
        if not isinstance(value, dict) or not isinstance(value.get("fingerprints"), dict):
            return "incompatible: wire (a malformed announcement)", -1
        round_ = value.get("round")
        round_ = round_ if type(round_) is int and 0 <= round_ < 2**31 else -1
        if value.get("wire") != SWARM_WIRE_VERSION:
            return (
                f"incompatible: wire (version {value.get('wire')!r}, ours {SWARM_WIRE_VERSION})",
                round_,
            )
        theirs = value["fingerprints"]
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

    def latest_round(self) -> Optional[int]:
        """Where a peer that joins late starts: the newest round the live, compatible, trusted
        peers (this one included) published, as their lower median (one peer that claims a far
        round cannot move it), None before any did."""
        peers = self._peers(time.monotonic() + 10.0)
        rounds = [r for why, r, _ in peers.values() if why is None and r >= 0]
        if self._published is not None:
            rounds.append(self._published)
        return sorted(rounds)[(len(rounds) - 1) // 2] if rounds else None

    def collect(
        self, round_: int, *, max_staleness: int, timeout_s: float
    ) -> tuple[list[Incoming], list[Rejection]]:
        from hivemind.utils import get_dht_time

        deadline = time.monotonic() + timeout_s
        rounds = list(range(max(0, round_ - max_staleness), round_ + 1))
        incoming: list[Incoming] = []
        rejected: list[Rejection] = []
        wait = _POLL_FIRST_S
        while True:
            # A read is bounded by the deadline, yet given at least a second, so that a
            # zero timeout still reads what is there.
            read_by = max(deadline, time.monotonic() + 1.0)
            peers = self._peers(read_by)
            records = self._get([self._round_key(r) for r in rounds], read_by)
            now = get_dht_time()
            for r, by_peer in zip(rounds, records):
                for peer, (value, _) in sorted(by_peer.items()):
                    if (peer, r) in self._collected or peer not in peers:
                        continue  # a payload without an announcement waits for it
                    self._collected.add((peer, r))
                    why = peers[peer][0]
                    if why is None and not isinstance(value, bytes):
                        why = "incompatible: wire (a payload that is not bytes)"
                    if why is None and len(value) > self.max_payload_bytes:
                        why = f"size: {len(value)} B, over the cap of {self.max_payload_bytes} B"
                    if why is None:
                        incoming.append(Incoming(peer, r, value))
                    else:
                        kind, reason = why.split(": ", 1)
                        rejected.append(Rejection(peer, kind, f"round {r}: {reason}"))
            waiting = [
                peer
                for peer, (why, _, expiry) in peers.items()
                if why is None
                and expiry > now
                and (peer, round_) not in self._collected
                and self._absent.get(peer) != expiry
            ]
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(min(wait, max(0.0, deadline - time.monotonic())))
            wait = min(wait * 1.5, _POLL_MAX_S)
        for peer in waiting:
            # It let the round pass: wait for it again once it announces itself anew.
            self._absent[peer] = peers[peer][2]
            log.info(
                "swarm: peer %s sent nothing for round %d within %g s", peer, round_, timeout_s
            )
        drain = self._dht.run_coroutine(
            partial(_drain_refused, token=self._token), return_future=True
        )
        rejected += self._result(drain, "reading the refused records", default=[])
        incoming.sort(key=lambda item: (item.round, item.peer))
        return incoming, rejected

    def _stop(self) -> None:
        if self._dht.is_alive():
            self._dht.shutdown()
        _VALIDATORS.pop(self._token, None)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._stop()
