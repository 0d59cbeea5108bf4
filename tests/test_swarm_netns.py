"""Two hivemind peers on separate hosts, as far as one machine can make them: each in its own
network namespace, joined by veth pairs through a switch namespace, 10.77.0.x addresses on the
veths only, every frame delayed 50 ms one way and 1% of frames dropped (`tc netem` where the
kernel has it, else the bench's user-space switch). Needs root; skipped with the reason where the
kernel or the user refuses namespaces."""

from __future__ import annotations

import pytest

pytest.importorskip("hivemind", reason="the hivemind transport needs the `swarm` extra")

from bench.swarm import namespaces_refused, payload_bytes, run_scenario  # noqa: E402

_REFUSED = namespaces_refused()
pytestmark = pytest.mark.skipif(_REFUSED is not None, reason=_REFUSED or "")


def test_two_peers_across_namespaces_with_delay_and_loss():
    rounds, delay_s = 3, 0.05
    result = run_scenario(
        "hivemind",
        peers=2,
        rounds=rounds,
        payload=payload_bytes(32, 20),
        timeout=30.0,
        delay_s=delay_s,
        loss=0.01,
    )
    # Every round, each peer got the other's payload of that round.
    assert result["complete"] == 1.0, result
    # The delay was on the path: a round (a store, then reads that find the other's record) takes
    # at least one round trip, 2 x 50 ms.
    assert min(result["round_s"]) >= 2 * delay_s, result
    # Both payloads crossed the veths: at least their bytes went out on them.
    assert result["moved_bytes"] >= rounds * 2 * payload_bytes(32, 20), result
    assert "netem" in result["shaper"] or "user-space switch" in result["shaper"]
