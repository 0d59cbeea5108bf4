"""One peer of a swarm without lockstep, one per process, on any host: `ftis-grpo peer`.

    ftis-grpo peer --config node.yaml --out runs/a --host-maddr /ip4/0.0.0.0/tcp/31337
    ftis-grpo peer --config node.yaml --out runs/b --initial-peers /ip4/10.0.0.1/tcp/31337/p2p/Qm...

`node.yaml` is a run configuration (`--config`, as `ftis-grpo --print-config` writes one) whose
`nodes` list holds one spec: this peer's. The peer's samples reach the others through a swarm
transport (`swarm.HivemindTransport`: hivemind's DHT for who is in the swarm, libp2p streams
for the samples), and each round is: publish this peer's
samples under (round, peer), collect the peers' samples of rounds within `max_staleness` not used
yet (waiting at most `collect_timeout_s` for the live peers' samples of this round), train,
checkpoint. No barrier: a peer that dies costs the others at most `collect_timeout_s` once. A
fresh peer joins at the swarm's latest round (`latest_round`, after its warm-up), a `--resume`d one
continues from its own checkpoint with the identity key kept in `--out` (`peer.key`), first
skipping ahead when the swarm (`latest_round`) is out of its reach; a peer that
fell out of the others' reach (`catch_up_round`: `max(max_staleness, 1)` or more rounds behind
`swarm_round` + 1, and no peer near that round waits for it) skips to `swarm_round` + 1, or they
would never take its samples. Each peer
writes its own metrics.jsonl, curves.png and summary.txt; `ftis-grpo report DIR...` merges them.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional, Protocol

import torch

from ftis_kernels.grpo import checkpoint
from ftis_kernels.grpo.errors import ConfigError
from ftis_kernels.grpo.exchange import WIRE_VERSION, SwarmError, record_bytes
from ftis_kernels.grpo.node import Diverged, Node
from ftis_kernels.grpo.process import (
    EXIT_DIVERGED,
    EXIT_ERROR,
    EXIT_REFUSED,
    EXIT_SWARM,
    EXIT_WRITE,
    PEER_FILE,
    READY_FILE,
    START_ENV,
    STOP_SIGNALS,
    die_with_parent,
    set_threads,
    threads_per_node,
)
from ftis_kernels.grpo.run_folder import OutLock, check_out, make_out
from ftis_kernels.grpo.schema import RunConfig
from ftis_kernels.grpo.transport import Transport, source_of

log = logging.getLogger("ftis_kernels.grpo")

# A peer's vertical prompts are those of slot (source mod PEER_SLOTS) of PEER_SLOTS per round:
# peers draw different problems without knowing how many they are. A prime, so that the windows
# of a JSONL task (indices taken modulo its length) cover every prompt of any length.
PEER_SLOTS = 65521
# The largest payload a peer may publish a round: a peer's reply over its stream carries its
# rounds asked for in one message of hivemind's daemon, of at most 2 MiB.
MAX_PEER_PAYLOAD_BYTES = 1 << 20
# How long a peer's announcement stays in the DHT, and the longest it serves a published round
# (it keeps its last 16): long enough for a peer `max_staleness` rounds behind to collect it.
RECORD_TTL_S = 900.0


class Stopped(BaseException):
    """SIGINT, SIGTERM or SIGHUP reached the peer (`stop_on_signals`): it leaves the swarm
    (closing its transport, so that its DHT daemon goes too) with exit code 128 + `signum`."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def stop_on_signals() -> None:
    """SIGINT, SIGTERM and SIGHUP raise `Stopped` in the peer's main thread."""

    def stop(signum: int, _frame) -> None:
        for sig in STOP_SIGNALS:  # once: the way out runs
            signal.signal(sig, signal.SIG_IGN)
        raise Stopped(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)


class SwarmTransport(Transport, Protocol):
    """A transport of a swarm that peers join and leave: `transport.Transport`, plus where its
    peers are."""

    visible_maddrs: list[str]

    def latest_round(self) -> Optional[int]:
        """The round the live peers are at, asking them (the hivemind transport: the lower
        median of their newest rounds; None: no peer has published one)."""
        ...

    def swarm_round(self) -> Optional[int]:
        """The round the other live peers are at, as this peer's last collect heard it, asking
        nobody (None: none was heard from)."""
        ...

    def waited_by(self, since: float, from_round: int = 0) -> set[str]:
        """The live peers that wait for this peer's samples (a wait held now or answered at or
        after `since`, a `time.monotonic()`), at round `from_round` or later."""
        ...


# (out, fingerprints, max_payload_bytes) -> a started transport; ConfigError naming the flag when
# it cannot start.
Connect = Callable[[Path, dict[str, str], int], SwarmTransport]


def check_peer_config(cfg: RunConfig) -> None:
    """ConfigError unless `cfg` describes one peer of a swarm: one node spec, transport
    hivemind, and every other key valid (`RunConfig.validate`)."""
    problems = []
    if len(cfg.nodes) != 1:
        problems.append(("nodes", "one node spec: this peer's", f"{len(cfg.nodes)} specs"))
    if cfg.transport != "hivemind":
        problems.append(
            ("transport", "'hivemind' (ftis-grpo peer runs one peer of a swarm)", cfg.transport)
        )
    cap = cfg.samples_per_round(1) * record_bytes(cfg.max_new_tokens)
    if cap > MAX_PEER_PAYLOAD_BYTES:
        problems.append(
            (
                "max_new_tokens",
                f"a round's payload in bytes (prompts_per_node x group_size records of "
                f"max_new_tokens tokens) of at most {MAX_PEER_PAYLOAD_BYTES} (a peer's reply "
                "carries its rounds in one message of hivemind's daemon, of at most 2 MiB)",
                cap,
            )
        )
    if problems:
        raise ConfigError(*problems)
    cfg.validate(1)


def vocabulary_fingerprint(cfg: RunConfig) -> str:
    """The peer's vocabulary fingerprint, before its model is built: its model folder's tokenizer,
    or the built-in task's."""
    from ftis_kernels.grpo.task import Problems
    from ftis_kernels.grpo.tokenizer import build_tokenizer, vocab_fingerprint

    spec = cfg.node(0)
    if spec.model is not None:
        from transformers import AutoTokenizer

        return vocab_fingerprint(AutoTokenizer.from_pretrained(spec.model))
    problems = Problems(cfg.seed, cfg.task, cfg.data, cfg.difficulty())
    return vocab_fingerprint(build_tokenizer(problems.arith.vocabulary_text()))


def fingerprints(cfg: RunConfig) -> dict[str, str]:
    """What a peer must share with another to use its samples, by what it is."""
    return {
        "configuration": cfg.swarm_fingerprint(),
        "vocabulary": vocabulary_fingerprint(cfg),
        "wire": str(WIRE_VERSION),
    }


# The output folder's lock of the peer running in this process (its file), for `_forked`.
_HELD: list = []


def _forked() -> None:
    """In a child the peer's process forks (hivemind's DHT process): drop the child's copy of
    the lock on --out, so that the lock goes with the peer, and die with the peer (Linux), so
    that a peer killed with SIGKILL leaves no DHT process holding its identity behind."""
    for f in _HELD:
        try:
            os.close(f.fileno())
        except OSError:
            pass
    if _HELD:  # the peer's Stopped is the peer's: the child ends as its own code says
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
    if _HELD:
        die_with_parent()


os.register_at_fork(after_in_child=_forked)


def join_address(maddrs: list[str]) -> str:
    """The multiaddr to tell other hosts: the first that is not loopback (a peer listening on
    0.0.0.0 lists 127.0.0.1 too), else the first."""
    remote = [m for m in maddrs if not m.startswith(("/ip4/127.", "/ip6/::1/"))]
    return (remote or list(maddrs) or ["MADDR"])[0]


def run_peer(cfg: RunConfig, connect: Connect, overwrite: bool = False) -> int:
    """Run one peer into `cfg.out` (checked and locked as a run's folder is), its samples moved
    by the transport `connect` starts; returns the exit code (of `process`: 0 done, 1 refused, 3
    the swarm lost, 4 diverged, 5 a write failed). ConfigError before anything starts."""
    check_peer_config(cfg)
    out = Path(cfg.out)
    make_out(out)
    lock = OutLock(out)
    lock.acquire()
    try:
        check_out(cfg, overwrite)
        (out / PEER_FILE).unlink(missing_ok=True)
        cap = cfg.samples_per_round(1) * record_bytes(cfg.max_new_tokens)
        _HELD[:] = [lock._file]
        transport = connect(out, fingerprints(cfg), cap)
    except BaseException:
        _HELD.clear()
        lock.release()
        raise
    try:
        set_threads(threads_per_node(cfg.threads, 1))
        checkpoint.write_json_atomic(
            out / PEER_FILE,
            {"peer_id": transport.peer_id, "maddrs": list(transport.visible_maddrs)},
        )
        log.info(
            "peer %s (%s) is reachable at: %s (others join with --initial-peers %s)",
            transport.peer_id,
            cfg.node(0).name,
            " ".join(transport.visible_maddrs),
            join_address(transport.visible_maddrs),
        )
        node = Node(
            cfg,
            0,
            1,
            torch.device("cpu"),
            transport,
            slot=source_of(transport.peer_id) % PEER_SLOTS,
            slots=PEER_SLOTS,
        )

        def join_round() -> int:
            wait_for_start(out, cfg.setup_timeout_s)
            latest = transport.latest_round()
            if latest is not None and latest >= cfg.rounds:
                raise SystemExit(
                    f"rounds: the swarm is at round {latest}, past this peer's last round "
                    f"({cfg.rounds} rounds); set rounds above {latest} to join it"
                )
            if latest is not None:
                log.info(
                    "peer %s: the swarm is at round %d, joining there", transport.peer_id, latest
                )
            return latest or 0

        def catch_up(next_round: int) -> int:
            if node.ran_before is None:  # resumed, before its first round: ask the peers
                # Under the local swarm's launcher, the resumed peers start together too: one
                # that went alone could finish its rounds before the others could join it.
                wait_for_start(out, cfg.setup_timeout_s)
                swarm, waited = transport.latest_round(), False
            else:
                # Waited for: by a peer near the swarm's round during the round just run (peers
                # as far behind as this one, waiting for each other, do not hold it back).
                swarm = transport.swarm_round()
                waited = swarm is not None and bool(
                    transport.waited_by(node.round_began, swarm - cfg.max_staleness - 1)
                )
            target = catch_up_round(swarm, next_round, cfg.max_staleness, waited)
            if target > next_round:
                log.info(
                    "peer %s: the others are at round %s and none waits for it: its round %d "
                    "is out of their reach, skipping to round %d",
                    transport.peer_id,
                    swarm,
                    next_round,
                    target,
                )
            return target

        node.run(join_round, catch_up)
        return 0
    except SwarmError as exc:
        log.error("peer %s: lost the swarm %s; stopping", transport.peer_id, exc)
        return EXIT_SWARM
    except Diverged:  # the node logged why
        return EXIT_DIVERGED
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        log.error("%s", exc.code)
        return EXIT_REFUSED
    except Stopped as exc:
        name = signal.Signals(exc.signum).name
        log.warning("peer %s: stopped by %s; leaving the swarm", transport.peer_id, name)
        return 128 + exc.signum
    except OSError as exc:
        why = f"cannot write {exc.filename or 'its output'}: {exc.strerror or exc}"
        log.error(
            "peer %s: %s; stopping (the last complete checkpoint is kept)", transport.peer_id, why
        )
        return EXIT_WRITE
    except Exception as exc:  # anything else (out of memory, say): its traceback, then code 6
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        why = f"{type(exc).__name__}{': ' + first if first else ''}"
        log.exception("peer %s: %s; stopping", transport.peer_id, why)
        return EXIT_ERROR
    finally:
        transport.close()
        _HELD.clear()
        lock.release()


def catch_up_round(
    swarm: Optional[int], next_round: int, max_staleness: int, waited: bool = False
) -> int:
    """The round a peer runs after its last (`next_round - 1`): `next_round`, or a later one
    when it fell behind. `swarm` is the round the others were in at its last collect (the newest
    they had published; None: it heard from none); `waited`: some peer waited for its samples
    during its last round. A peer waited for is within that peer's reach whatever the rounds
    say (replies crossing a slow link can show the others a round ahead), and a skip would make
    it miss the round that peer waits for: it does not skip. Otherwise the others take only its
    samples of rounds within `max_staleness` of theirs, and they are at `swarm + 1` by the time
    its next round's samples come out: from `max(max_staleness, 1)` rounds behind that on, a
    peer keeping their pace would never be taken, and it goes to `swarm + 1` instead."""
    if waited or swarm is None or swarm + 1 - next_round < max(max_staleness, 1):
        return next_round
    return swarm + 1


def wait_for_start(out: Path, timeout_s: float) -> None:
    """Under the local swarm's launcher (`START_ENV` set): say this peer is ready, then wait for
    the launcher's start (at most `timeout_s`); nothing otherwise."""
    start = os.environ.get(START_ENV)
    if not start:
        return
    (out / READY_FILE).touch()
    deadline = time.monotonic() + timeout_s
    while not Path(start).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
