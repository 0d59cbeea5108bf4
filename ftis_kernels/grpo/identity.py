"""A swarm peer's identity and the DHT records it signs.

The key file (`key_bytes`, `load_private_key`: one RSA key in libp2p's protobuf format, mode
0600), a peer's id from an owner marker's public key (`peer_of`), and `validator_class`: the
DHT's validator of the swarm's records, which remembers what it refused (`drain_refused` reads
that from the DHT's process), each refusal charged to the key that signed the record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Any, Optional

from ftis_kernels.grpo.transport import Rejection

# How many refused records a validator remembers so that each is reported once.
_SEEN_CAP = 4096
# At most this many refusals are kept between two collects (a flood of forged records costs
# neither memory nor log lines without bound).
_REFUSED_CAP = 256
# How many keys that signed valid records a validator keeps, to name the signer of a forgery.
_KNOWN_KEYS = 256
# A record may expire at most record_ttl_s plus this (clocks of hosts differ) after it is seen:


class SwarmStartError(ValueError):
    """The peer could not join: a malformed multiaddr or initial peers that did not answer.
    `flag` names the command-line flag to fix (`--initial-peers`, `--host-maddr`)."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


def key_bytes(path: Path) -> bytes:
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


def load_private_key(data: bytes, path: Path):
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


def peer_of(owner: bytes) -> Optional[str]:
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


def owner_of(subkey: bytes) -> Optional[bytes]:
    """The owner's public key in a subkey's marker, or None."""
    from hivemind.dht.crypto import RSASignatureValidator

    found = RSASignatureValidator._PUBLIC_KEY_RE.findall(subkey)
    return found[0] if len(found) == 1 else None


def subkey_owner(subkey: Optional[bytes]) -> Optional[bytes]:
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


def validator_class():
    """`OwnedRecords`, built on first use so that importing this module needs no hivemind."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils import get_dht_time
    from hivemind.utils.crypto import RSAPublicKey
    from hivemind.utils.serializer import MSGPackSerializer

    class OwnedRecords(RSASignatureValidator):
        """hivemind's signature validator that remembers what it refused: a record whose
        subkey names an owner's key but whose signature is not that key's ("forged"), or
        one larger than the payload cap ("size"). It runs inside the DHT's process; the
        transport drains its refusals from there (`drain_refused`)."""

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
            owner = subkey_owner(record.subkey)
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
                peer = (peer_of(owner) if owner is not None else None) or ""
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
                        if owner != named and verifies_b64(key, data, signature):
                            peer = peer_of(owner) or ""
                            break
                    named_peer = peer_of(named)
                    reason += f" (it names {named_peer}" if named_peer else " (it names a key"
                    reason += f"; signed by {peer})" if peer else "; signed by no known key)"
                out.append(Rejection(peer, kind, reason))
            return out

    return OwnedRecords


# The validators of this process's transports, by token: after the DHT's process forks, its
# copy of this table points at the validator its DHT node uses.
VALIDATORS: dict[str, Any] = {}


async def drain_refused(_dht, _node, token: str) -> list[Rejection]:
    return VALIDATORS[token].take_refused()


def verifies_b64(key, data: bytes, signature: bytes) -> bool:
    """Whether hivemind's base64 RSA `signature` of `data` is `key`'s."""
    try:
        return bool(key.verify(data, signature))
    except Exception:  # not base64, not a signature
        return False
