"""The hivemind transport on loopback: peers exchange a round's payloads over their streams,
with the staleness window, the dedupe, the wait bound, the refusals (forged announcements charged
to their signer, untrusted, size, incompatible), a hostile peer's replies and pulls, the DHT read
again when a newcomer pulls, the identity kept across a restart, the start errors, the late
joiner's round and the swarm's round a peer left behind skips to."""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time

import pytest

pytest.importorskip("hivemind", reason="the hivemind transport needs the `swarm` extra")

from hivemind import DHT  # noqa: E402
from hivemind.dht.validation import RecordValidatorBase  # noqa: E402
from hivemind.utils import MSGPackSerializer, get_dht_time  # noqa: E402
from hivemind.utils.crypto import RSAPrivateKey  # noqa: E402

from ftis_kernels.grpo.swarm import (  # noqa: E402
    _REPLY_MARGIN_S,
    KEY_FILE,
    HivemindTransport,
    SwarmStartError,
)
from ftis_kernels.grpo.transport import REJECT_KINDS  # noqa: E402

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture
def swarm(tmp_path):
    """start(name, joins=None, **overrides) -> a transport; all closed at the end."""
    started: list[HivemindTransport] = []

    def start(name, joins=None, **overrides):
        kwargs = dict(
            out=tmp_path / name,
            swarm_key="test",
            fingerprints={"configuration": "c1", "vocabulary": "v1", "wire": "w1"},
            initial_peers=[] if joins is None else joins.visible_maddrs,
            host_maddrs=LOOPBACK,
            trusted_peers=None,
            max_payload_bytes=4096,
            record_ttl_s=60.0,
            start_timeout_s=10.0,
        )
        kwargs.update(overrides)
        transport = HivemindTransport(**kwargs)
        started.append(transport)
        return transport

    yield start
    for transport in started:
        transport.close()


def payloads(incoming):
    return sorted((item.peer, item.round, item.payload) for item in incoming)


def test_three_peers_exchange_a_round(swarm):
    a = swarm("a")
    b, c = swarm("b", joins=a), swarm("c", joins=a)
    assert a.kind == "hivemind" and len({a.peer_id, b.peer_id, c.peer_id}) == 3
    for peer in (a, b, c):
        peer.publish(0, peer.peer_id.encode())
    for peer in (a, b, c):
        started = time.monotonic()
        incoming, rejected = peer.collect(0, max_staleness=0, timeout_s=10.0)
        others = sorted({a.peer_id, b.peer_id, c.peer_id} - {peer.peer_id})
        assert payloads(incoming) == [(p, 0, p.encode()) for p in others]
        assert rejected == []
        # Every live peer had published: no waiting for the timeout.
        assert time.monotonic() - started < 5.0
    assert (a.barrier("x"), a.gather({"k": 1}), a.common_round([3, 5]), a.common_round([])) == (
        None,
        [{"k": 1}],
        5,
        None,
    )


def test_staleness_window_and_dedupe(swarm):
    a = swarm("a")
    b = swarm("b", joins=a)
    for r in range(4):
        a.publish(r, f"r{r}".encode())
    incoming, _ = b.collect(3, max_staleness=1, timeout_s=5.0)
    assert [(i.round, i.payload) for i in incoming] == [(2, b"r2"), (3, b"r3")]
    # Collected once: the same call again brings nothing new, and returns at once.
    started = time.monotonic()
    assert b.collect(3, max_staleness=3, timeout_s=5.0)[0] == [
        dataclasses.replace(incoming[0], round=r, payload=f"r{r}".encode()) for r in (0, 1)
    ]
    assert b.collect(3, max_staleness=3, timeout_s=5.0) == ([], [])
    assert time.monotonic() - started < 5.0


def test_a_silent_peer_costs_at_most_the_timeout(swarm):
    a = swarm("a")
    b = swarm("b", joins=a)  # announces itself, never publishes
    a.publish(0, b"x")
    started = time.monotonic()
    assert a.collect(0, max_staleness=0, timeout_s=1.5) == ([], [])
    waited = time.monotonic() - started
    # Its long poll asks the peer for an answer _REPLY_MARGIN_S before the deadline.
    assert 1.5 - _REPLY_MARGIN_S <= waited < 6.0
    # It let a round pass: later rounds do not wait for it until it announces itself again.
    started = time.monotonic()
    assert a.collect(1, max_staleness=0, timeout_s=6.0) == ([], [])
    assert time.monotonic() - started < 4.0
    b.publish(1, b"late")
    assert payloads(a.collect(1, max_staleness=0, timeout_s=5.0)[0]) == [(b.peer_id, 1, b"late")]


class _SignedByAnotherKey(RecordValidatorBase):
    """An attacker's signer: appends a signature in hivemind's format made with its own key
    (`key`, a fresh one by default), whatever owner the subkey names."""

    def __init__(self, key=None):
        self.key = key or RSAPrivateKey()

    def sign_value(self, record):
        signature = self.key.sign(MSGPackSerializer.dumps(dataclasses.astuple(record)))
        return record.value + b"[signature:" + signature + b"]"

    def validate(self, record):
        return True


@pytest.mark.parametrize("signer", ["none", "another key"])
def test_a_record_under_another_peers_subkey_is_forged(swarm, signer):
    a = swarm("a")
    b = swarm("b", joins=a)
    attacker = DHT(
        initial_peers=a.visible_maddrs,
        start=True,
        host_maddrs=LOOPBACK,
        record_validators=[_SignedByAnotherKey()] if signer == "another key" else [],
    )
    try:
        a.publish(0, b"honest")
        # The attacker writes round 0 under a's subkey: a's owner marker, not its key.
        attacker.store("test/round/0", b"forged", get_dht_time() + 60, subkey=a._owner)
    finally:
        attacker.shutdown()
    incoming, rejected = b.collect(0, max_staleness=0, timeout_s=5.0)
    assert payloads(incoming) == [(a.peer_id, 0, b"honest")]
    # Signed by no key this swarm knows, or not at all: charged to nobody, never to a.
    assert [(r.peer, r.kind) for r in rejected] == [("", "forged")]
    assert "not signed by its key" in rejected[0].reason and a.peer_id in rejected[0].reason


def test_a_record_forged_in_an_honest_peers_name_is_charged_to_the_forger(swarm, tmp_path):
    from ftis_kernels.grpo.exchange import exchange
    from ftis_kernels.grpo.identity import key_bytes, load_private_key
    from ftis_kernels.grpo.transport import source_of

    honest = swarm("honest")
    b = swarm("b", joins=honest)
    forger = swarm("forger", joins=honest)  # a peer of the swarm, its key known to the others
    forger.publish(0, b"")
    key_path = tmp_path / "forger" / KEY_FILE
    signer = _SignedByAnotherKey(load_private_key(key_bytes(key_path), key_path))
    attacker = DHT(
        initial_peers=honest.visible_maddrs,
        start=True,
        host_maddrs=LOOPBACK,
        record_validators=[signer],
    )
    try:
        honest.publish(0, b"honest")
        # The forger writes under the honest peer's subkey, signing with its own key.
        for key, value in (("test/round/0", b"forged"), ("test/peers", {"wire": 1})):
            attacker.store(key, value, get_dht_time() + 60, subkey=honest._owner)
    finally:
        attacker.shutdown()
    incoming, rejected = b.collect(0, max_staleness=0, timeout_s=5.0)
    # The honest peer's own record still counts; every forgery is charged to the forger.
    assert payloads(incoming) == sorted([(forger.peer_id, 0, b""), (honest.peer_id, 0, b"honest")])
    assert rejected and {(r.peer, r.kind) for r in rejected} == {(forger.peer_id, "forged")}
    assert all(f"names {honest.peer_id}" in r.reason for r in rejected)

    # Above the seam: the drops name the forger as their sender, never the honest peer.
    again = DHT(
        initial_peers=honest.visible_maddrs,
        start=True,
        host_maddrs=LOOPBACK,
        record_validators=[signer],
    )
    try:
        honest.publish(1, b"")
        again.store("test/round/1", b"forged again", get_dht_time() + 60, subkey=honest._owner)
    finally:
        again.shutdown()
    got, drops, _ = exchange(
        [], vocab_size=8, max_tokens=4, max_samples=4, transport=b, round_=1, timeout_s=5.0
    )
    assert got == [] and drops
    assert {(d.kind, d.sender) for d in drops} == {("forged", source_of(forger.peer_id))}


def test_the_validator_refuses_what_could_hide_the_owned_records():
    from hivemind.dht.validation import DHTRecord

    from ftis_kernels.grpo.identity import validator_class

    validator = validator_class()(RSAPrivateKey(), 4096, 360.0)
    now = get_dht_time()
    owned = MSGPackSerializer.dumps(validator.local_public_key)

    def record(value, subkey=owned, expiry=now + 60, raw=False):
        value = value if raw else MSGPackSerializer.dumps(value)
        signed = validator.sign_value(DHTRecord(b"key", subkey, value, expiry))
        return DHTRecord(b"key", subkey, signed, expiry)

    assert validator.validate(record(b"payload")) and validator.validate(record({"round": 1}))
    refused = {
        "unowned": record(b"junk", subkey=MSGPackSerializer.dumps(None)),
        "far expiry": record(b"payload", expiry=now + 1e6),
        "undecodable": record(b"\xc1", raw=True),
        "not bytes or a dict": record(7),
        "over the cap": record(bytes(5000)),
    }
    assert [name for name, r in refused.items() if validator.validate(r)] == []
    assert [(r.peer == "", r.kind) for r in validator.take_refused()] == [
        (True, "forged"),
        (False, "incompatible"),
        (False, "incompatible"),
        (False, "incompatible"),
        (False, "size"),
    ]


def test_an_unowned_far_future_record_hides_no_peer(swarm):
    a = swarm("a")
    b = swarm("b", joins=a)
    attacker = DHT(initial_peers=a.visible_maddrs, start=True, host_maddrs=LOOPBACK)
    try:
        # A regular value with a far expiry would replace a key's owned records in storage.
        for key in ("test/peers", "test/round/0"):
            attacker.store(key, b"junk", get_dht_time() + 1e6)
        a.publish(0, b"honest")
    finally:
        attacker.shutdown()
    incoming, _ = b.collect(0, max_staleness=0, timeout_s=10.0)
    assert payloads(incoming) == [(a.peer_id, 0, b"honest")]


def test_untrusted_and_incompatible_peers_are_refused(swarm):
    a = swarm("a")
    stranger = swarm("stranger", joins=a)
    b = swarm("b", joins=a, trusted_peers=[a.peer_id, "QmSomebodyElse"])
    other_vocab = swarm("vocab", joins=a, fingerprints={"configuration": "c1", "vocabulary": "v2"})
    for peer in (a, stranger, b, other_vocab):
        peer.publish(0, peer.peer_id.encode())
    incoming, rejected = b.collect(0, max_staleness=0, timeout_s=5.0)
    assert payloads(incoming) == [(a.peer_id, 0, a.peer_id.encode())]
    # The allowlist is checked first: the peer of another vocabulary is untrusted here.
    assert sorted((r.peer, r.kind) for r in rejected) == sorted(
        [(stranger.peer_id, "untrusted"), (other_vocab.peer_id, "untrusted")]
    )

    incoming, rejected = a.collect(0, max_staleness=0, timeout_s=5.0)
    assert payloads(incoming) == sorted((p.peer_id, 0, p.peer_id.encode()) for p in (stranger, b))
    [refused] = rejected
    assert (refused.peer, refused.kind) == (other_vocab.peer_id, "incompatible")
    assert refused.reason == "round 0: vocabulary, wire differ"
    assert {r.kind for r in rejected} <= set(REJECT_KINDS)

    # agree(): a fingerprint recorded later makes a peer incompatible from then on.
    stranger.agree("checkpoint", "step-7")
    for peer in (stranger, b):
        peer.publish(1, b"after")
    incoming, rejected = a.collect(1, max_staleness=0, timeout_s=5.0)
    assert payloads(incoming) == [(b.peer_id, 1, b"after")]
    assert [(r.peer, r.kind, r.reason) for r in rejected] == [
        (stranger.peer_id, "incompatible", "round 1: checkpoint differs")
    ]


def test_an_announcement_of_fingerprints_not_text_is_refused_not_fatal(swarm):
    a = swarm("a")
    # Our fingerprints plus a bytes key whose value, None, equals what ours lack: no key differs,
    # and such keys cannot be digested (sorted with text ones, or written as JSON).
    prints = {"configuration": "c1", "vocabulary": "v1", "wire": "w1", b"extra": None}
    odd = swarm("odd", joins=a, fingerprints=prints)
    incoming, rejected = a.collect(0, max_staleness=0, timeout_s=1.0)
    assert incoming == []
    assert [(r.peer, r.kind, r.reason) for r in rejected] == [
        (odd.peer_id, "incompatible", "round 0: wire (a malformed announcement)")
    ]


def test_size_cap(swarm):
    a = swarm("a", max_payload_bytes=100_000)
    b = swarm("b", joins=a, max_payload_bytes=1000)
    a.publish(0, bytes(5000))
    a.publish(1, bytes(1001))
    incoming, rejected = b.collect(1, max_staleness=1, timeout_s=1.0)
    assert incoming == []
    assert [(r.peer, r.kind, r.reason) for r in rejected] == [
        (a.peer_id, "size", f"round {r}: {n} B, over the cap of 1000 B")
        for r, n in ((0, 5000), (1, 1001))
    ]
    with pytest.raises(ValueError, match="max_payload_bytes"):
        b.publish(0, bytes(1001))
    with pytest.raises(ValueError, match="max_payload_bytes: at most"):
        swarm("c", max_payload_bytes=4 << 20)


def test_identity_is_kept_across_a_restart(swarm, tmp_path):
    a = swarm("a")
    b = swarm("b", joins=a)
    first = b.peer_id
    assert os.stat(tmp_path / "b" / KEY_FILE).st_mode & 0o777 == 0o600
    b.close()
    again = swarm("b", joins=a)
    assert again.peer_id == first != a.peer_id
    again.publish(0, b"back")
    assert payloads(a.collect(0, max_staleness=0, timeout_s=5.0)[0]) == [(first, 0, b"back")]


def test_the_dht_is_read_again_when_a_newcomer_pulls(swarm, monkeypatch):
    from ftis_kernels.grpo import swarm as swarm_module

    monkeypatch.setattr(swarm_module, "_MEMBERS_REFRESH_S", 600.0)  # no read on a timer here
    a = swarm("a")
    b = swarm("b", joins=a)
    for peer in (a, b):
        peer.publish(0, peer.peer_id.encode())
    assert payloads(a.collect(0, max_staleness=0, timeout_s=5.0)[0]) == [
        (b.peer_id, 0, b.peer_id.encode())
    ]
    late = swarm("late", joins=b)
    late.publish(0, b"late")
    # a read the swarm's members once; it does not read the DHT each round, so the newcomer is
    # not one of them yet.
    assert a.collect(0, max_staleness=0, timeout_s=1.0) == ([], [])
    # Its first pull from a makes a read the DHT again at its next collect.
    late.collect(0, max_staleness=0, timeout_s=5.0)
    assert payloads(a.collect(0, max_staleness=0, timeout_s=5.0)[0]) == [(late.peer_id, 0, b"late")]


def test_a_late_joiner_learns_the_round(swarm):
    a = swarm("a")
    b = swarm("b", joins=a)
    assert b.latest_round() is None
    for r in range(3):
        a.publish(r, b"x")
    late = swarm("late", joins=b)
    assert late.latest_round() == 2


def test_the_swarms_round_is_what_the_peers_replies_said(swarm):
    a = swarm("a")
    b, c = swarm("b", joins=a), swarm("c", joins=a)
    assert c.swarm_round() is None  # no collect yet: nobody was heard from
    for r in range(6):
        a.publish(r, b"a")
    b.publish(0, b"b")
    # c, behind at round 0, takes what it asks for; the replies say a is at 5, b at 0.
    incoming, _ = c.collect(0, max_staleness=0, timeout_s=5.0)
    assert payloads(incoming) == sorted([(a.peer_id, 0, b"a"), (b.peer_id, 0, b"b")])
    # The lower median of the others' rounds: one peer far ahead alone cannot move it...
    assert c.swarm_round() == 0
    # ...but two can; and one that cannot be reached any more no longer counts.
    for r in range(1, 5):
        b.publish(r, b"b")
    c.collect(1, max_staleness=0, timeout_s=5.0)
    assert c.swarm_round() == 4
    a.close()
    b.publish(5, b"b")
    c.collect(2, max_staleness=0, timeout_s=2.0)
    assert c.swarm_round() == 5  # b alone: a's stream is gone


def test_a_peer_knows_which_peers_wait_for_it(swarm):
    a = swarm("a")
    b = swarm("b", joins=a)
    a.publish(0, b"a")
    b.collect(0, max_staleness=0, timeout_s=5.0)  # b reads who is in the swarm, hears a at 0
    since = time.monotonic()
    a.publish(1, b"a")
    waiting = threading.Thread(
        target=a.collect, args=(1,), kwargs=dict(max_staleness=0, timeout_s=10.0)
    )
    waiting.start()
    # a's long poll of b's round 1 is held: a waits for b now, whatever the time asked about.
    deadline = time.monotonic() + 5.0
    while b.waited_by(math.inf) != {a.peer_id} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert b.waited_by(math.inf) == {a.peer_id}
    b.publish(1, b"b")
    waiting.join(10.0)
    # Answered with a round since `since`; a at round 0 or later by its last reply to b.
    assert b.waited_by(since) == {a.peer_id} and b.waited_by(since, from_round=1) == set()
    # b lets round 2 pass: a's long poll runs out empty (a peer about to stop waiting), then a
    # only probes b (no wait): neither counts.
    since = time.monotonic()
    a.publish(2, b"a")
    a.collect(2, max_staleness=0, timeout_s=1.0)
    a.publish(3, b"a")
    a.collect(3, max_staleness=0, timeout_s=5.0)
    assert b.waited_by(since) == set()


@pytest.mark.parametrize(
    "overrides, flag, message",
    [
        ({"initial_peers": ["/ip4/127.0.0.1/tcp/1x/p2p/Qm"]}, "--initial-peers", "not a multiaddr"),
        ({"initial_peers": ["/ip4/127.0.0.1/tcp/4001"]}, "--initial-peers", "names no peer"),
        ({"host_maddrs": ["/ip4/300.0.0.1/tcp/0"]}, "--host-maddr", "not a multiaddr"),
    ],
)
def test_malformed_multiaddrs(swarm, overrides, flag, message):
    started = time.monotonic()
    with pytest.raises(SwarmStartError, match=message) as caught:
        swarm("x", **overrides)
    assert caught.value.flag == flag and str(caught.value).startswith(flag)
    assert time.monotonic() - started < 3.0


def test_an_unreachable_initial_peer(swarm):
    # A peer id that no one runs, on a port where no one listens.
    gone = swarm("gone")
    address = gone.visible_maddrs[0]
    gone.close()
    started = time.monotonic()
    with pytest.raises(SwarmStartError, match="could not join through") as caught:
        swarm("x", initial_peers=[address], start_timeout_s=5.0)
    assert caught.value.flag == "--initial-peers" and address in str(caught.value)
    assert time.monotonic() - started < 10.0


def test_a_damaged_key_file_names_out(swarm, tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / KEY_FILE).write_bytes(b"not a key")
    with pytest.raises(SwarmStartError, match="is not a peer key") as caught:
        swarm("x")
    assert caught.value.flag == "--out"


def test_without_hivemind_the_error_names_the_extra(monkeypatch, tmp_path):
    from ftis_kernels import _extras

    monkeypatch.setattr(_extras, "missing", lambda extra: ["hivemind"] if extra == "swarm" else [])
    with pytest.raises(_extras.MissingExtraError, match="needs the 'swarm' extra"):
        HivemindTransport(
            out=tmp_path,
            swarm_key="test",
            fingerprints={},
            initial_peers=[],
            host_maddrs=LOOPBACK,
            trusted_peers=None,
            max_payload_bytes=1,
            record_ttl_s=1.0,
            start_timeout_s=1.0,
        )


def _evil_key():
    from cryptography.hazmat.primitives.asymmetric import rsa

    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.mark.parametrize("lie", ["another key", "unsigned", "a round not asked for", "oversize"])
def test_a_hostile_peers_stream_replies_are_refused_and_charged_to_it(swarm, lie):
    from ftis_kernels.grpo.streams import sign, signed_bytes

    a = swarm("a")
    hostile = swarm("hostile", joins=a)
    b = swarm("b", joins=a)
    evil = _evil_key()

    def serve(asked):
        if lie == "a round not asked for":
            return [(max(asked) + 7, b"evil", b"")]
        payload = bytes(5000) if lie == "oversize" else b"evil"
        key = evil if lie == "another key" else hostile._streams._private_key
        signature = b"" if lie == "unsigned" else sign(key, signed_bytes("test", 0, payload))
        return [(r, payload, signature) for r in asked]

    hostile._streams.serve = serve  # what its handler answers every pull with
    for peer in (a, hostile):
        peer.publish(0, peer.peer_id.encode())
    incoming, rejected = b.collect(0, max_staleness=0, timeout_s=5.0)
    # The honest peer's payload counts; the hostile one's is refused, charged to it alone.
    assert payloads(incoming) == [(a.peer_id, 0, a.peer_id.encode())]
    kind, reason = {
        "another key": ("forged", "round 0: a payload not signed by its key"),
        "unsigned": ("forged", "round 0: a payload not signed by its key"),
        "a round not asked for": ("incompatible", "round 7: a round it was not asked for ([0])"),
        "oversize": ("size", "round 0: 5000 B, over the cap of 4096 B"),
    }[lie]
    assert [(r.peer, r.kind, r.reason) for r in rejected] == [(hostile.peer_id, kind, reason)]


def test_the_pull_handler_bounds_what_a_hostile_caller_asks(swarm):
    from hivemind.p2p import PeerID

    from ftis_kernels.grpo.streams import MAX_ROUNDS_ASKED, PULL

    a = swarm("a")
    caller = swarm("caller", joins=a)
    for r in range(3):
        a.publish(r, f"r{r}".encode())
    streams = caller._streams

    def pull(**request):
        started = time.monotonic()
        call = streams.p2p.call_protobuf_handler(
            PeerID.from_base58(a.peer_id), PULL, streams.Pull(**request), streams.Offer
        )
        offer = streams._run(call, 20.0)
        return (
            [(x.round, x.payload) for x in offer.rounds],
            offer.newest,
            time.monotonic() - started,
        )

    # Rounds out of range are ignored, and only the first MAX_ROUNDS_ASKED are read; a wait of
    # years is not held once a round asked for is there.
    got, newest, took = pull(swarm_key="test", rounds=[-5, 2**40, *range(200)], wait_s=1e9)
    assert got == [(r, f"r{r}".encode()) for r in range(3)] and newest == 2 and took < 5.0
    beyond = [10**6] * MAX_ROUNDS_ASKED + [0]
    got, _, took = pull(swarm_key="test", rounds=beyond, wait_s=0.5)
    assert got == [] and 0.4 < took < 5.0
    # A wait that is no number, or negative, is none; another swarm's caller gets nothing.
    for wait in (float("nan"), -1.0):
        got, _, took = pull(swarm_key="test", rounds=[100], wait_s=wait)
        assert got == [] and took < 2.0
    assert pull(swarm_key="other", rounds=[0], wait_s=0.0)[:2] == ([], -1)
    # The peer still serves its own swarm.
    assert pull(swarm_key="test", rounds=[1], wait_s=0.0)[0] == [(1, b"r1")]
