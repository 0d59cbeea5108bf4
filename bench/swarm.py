"""What the exchange moves on the wire: torch's gloo collectives vs hivemind, per round.

Each scenario runs `--peers` processes in Linux network namespaces (as root), so that the bytes
are counted at the interface and only the exchange's own traffic is counted:

- `gloo-loopback`: one namespace, the processes in one gloo world on its loopback, each round
  the driver's two `all_gather`s (payload lengths, then the payloads padded to the longest);
- `hivemind-loopback`: one namespace, one `HivemindTransport` per process on its loopback (the
  DHT for who is in the swarm, the payloads pulled over libp2p streams);
- `gloo-delay`, `hivemind-delay`: one namespace per peer, each joined by a veth pair to a hub
  namespace where a user-space switch (`hub`) forwards every frame after `--delay-ms` and drops
  `--loss` of them (what `tc qdisc ... netem delay 50ms loss 1%` on each link would do; used
  because kernels without `sch_netem` refuse that qdisc). Addresses are 10.77.0.x on the veths
  only.

A round: every peer publishes a payload of `--samples` records of `--tokens` completion tokens
(the exchange's wire format: 24 B header + 8 B per token, random bytes: the transports neither
compress nor parse) and collects the others' payloads of that round; with `--pace-s`, a peer
starts its rounds that many seconds apart (a driver's round takes seconds: what a transport does
in the background, between rounds, is counted too). Bytes are the interfaces'
transmit counters (loopback: `lo`; across namespaces: every peer's veth), from before the first
round to after the last, over the rounds; a peer's start and its DHT's join are not counted.

    sudo python -m bench.swarm --rounds 10 --out bench/results/swarm.json

writes the JSON and prints, per scenario, the round time and the bytes moved per payload byte
and per completion token (the overhead over the 8 B per token the format itself needs).
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HEADER_BYTES, BYTES_PER_TOKEN = 24, 8
SUBNET = "10.77.0"
# linux/socket.h, linux/if_packet.h: frames carry their offload header (GSO, checksum)
_SOL_PACKET, _PACKET_VNET_HDR = 263, 15
_ETH_P_ALL = 0x0003


def payload_bytes(samples: int, tokens: int) -> int:
    return samples * (HEADER_BYTES + BYTES_PER_TOKEN * tokens)


# --- network namespaces ---------------------------------------------------------------------


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class Namespaces:
    """`peers` namespaces ("<tag>p0", ...), each with a veth `eth0` at 10.77.0.<i+1>/24 whose
    other end `h<i>` is in the hub namespace "<tag>hub" (or, with `peers` == 0, one namespace
    "<tag>p0" with its loopback only). Removed on `close`."""

    def __init__(self, tag: str, peers: int):
        self.tag, self.names = tag, []
        try:
            if peers == 0:
                self._add(f"{tag}p0")
                _ip("-n", f"{tag}p0", "link", "set", "lo", "up")
                return
            self.hub = self._add(f"{tag}hub")
            for i in range(peers):
                ns = self._add(f"{tag}p{i}")
                _ip(
                    "link",
                    "add",
                    "name",
                    f"{tag}v{i}",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    f"{tag}h{i}",
                )
                _ip("link", "set", f"{tag}v{i}", "netns", ns)
                _ip("link", "set", f"{tag}h{i}", "netns", self.hub)
                _ip("-n", ns, "link", "set", f"{tag}v{i}", "name", "eth0")
                _ip("-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
                for dev in ("eth0", "lo"):
                    _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", self.hub, "link", "set", f"{tag}h{i}", "up")
        except BaseException:
            self.close()
            raise

    def _add(self, name: str) -> str:
        _ip("netns", "add", name)
        self.names.append(name)
        return name

    def peer(self, i: int) -> str:
        return f"{self.tag}p{i}"

    def tx_bytes(self, ns: str, dev: str) -> int:
        out = subprocess.run(
            ["ip", "-n", ns, "-j", "-s", "link", "show", "dev", dev],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def close(self) -> None:
        for name in reversed(self.names):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self.names = []


def namespaces_refused() -> str | None:
    """Why this machine cannot run the namespaces (not root, or the kernel refuses), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"ftisprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (OSError, subprocess.SubprocessError) as e:
        return f"`ip netns add` refused: {getattr(e, 'stderr', '') or e}".strip()
    try:
        _ip("-n", probe, "link", "add", "name", "a", "type", "veth", "peer", "name", "b")
    except subprocess.CalledProcessError as e:
        return f"veth pairs refused: {e.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


def netem_refused(ns: Namespaces) -> str | None:
    """Why `tc qdisc ... netem` cannot run on the namespaces' veths, or None."""
    result = subprocess.run(
        ["ip", "netns", "exec", ns.peer(0), "tc", "qdisc", "add", "dev", "eth0", "root", "netem"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if result.returncode:
        return f"tc netem refused: {result.stderr.strip() or result.returncode}"
    subprocess.run(
        ["ip", "netns", "exec", ns.peer(0), "tc", "qdisc", "del", "dev", "eth0", "root"],
        capture_output=True,
        timeout=30,
    )
    return None


# --- the hub: a learning switch that delays and drops frames --------------------------------


def hub(ports: list[str], delay_s: float, loss: float, seed: int) -> None:
    """Forward frames among `ports` (interfaces of this namespace), each after `delay_s`, and
    drop a fraction `loss` of them; runs until killed. Frames keep their offload header
    (PACKET_VNET_HDR), so the kernel segments and checksums them on the way out."""
    rng = random.Random(seed)
    socks = {}
    for port in ports:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
        s.setsockopt(_SOL_PACKET, _PACKET_VNET_HDR, 1)
        s.bind((port, 0))
        socks[s.fileno()] = (port, s)
    where: dict[bytes, socket.socket] = {}  # MAC -> the port's socket it was seen on
    queue: list[tuple[float, int, bytes, list[socket.socket]]] = []
    lock, wake = threading.Lock(), threading.Event()
    counter = 0

    def send() -> None:
        while True:
            with lock:
                due = queue[0][0] if queue else None
            if due is None or due > time.monotonic():
                wake.wait(None if due is None else max(0.0, due - time.monotonic()))
                wake.clear()
                continue
            with lock:
                _, _, frame, outs = heapq.heappop(queue)
            for out in outs:
                try:
                    out.send(frame)
                except OSError:
                    pass  # the peer's namespace is gone

    threading.Thread(target=send, daemon=True).start()
    while True:
        ready, _, _ = select.select(list(socks), [], [])
        for fd in ready:
            port, s = socks[fd]
            frame, address = s.recvfrom(1 << 17)  # 10 B offload header, the Ethernet frame
            if address[2] == socket.PACKET_OUTGOING:
                continue  # what this switch sent
            dst, src = frame[10:16], frame[16:22]
            where[src] = s
            if rng.random() < loss:
                continue
            outs = [where[dst]] if dst in where else [o for _, o in socks.values() if o is not s]
            counter += 1
            with lock:
                heapq.heappush(queue, (time.monotonic() + delay_s, counter, frame, outs))
            wake.set()


# --- one peer ------------------------------------------------------------------------------


def _emit(obj) -> None:
    print(json.dumps(obj), flush=True)


def run_hivemind_peer(args) -> None:
    """Start a transport, print {"peer_id", "maddrs"}, wait for "go", run the rounds, print
    {"round_s", "received"}, then stay until stdin closes (so that the others can read it)."""
    from ftis_kernels.grpo.swarm import HivemindTransport

    transport = HivemindTransport(
        out=Path(args.out),
        swarm_key="bench",
        fingerprints={"configuration": "bench"},
        initial_peers=args.initial_peers,
        host_maddrs=[args.host_maddr],
        trusted_peers=None,
        max_payload_bytes=1 << 20,
        record_ttl_s=600.0,
        start_timeout_s=60.0,
    )
    _emit({"peer_id": transport.peer_id, "maddrs": transport.visible_maddrs})
    sys.stdin.readline()
    payload = os.urandom(args.payload_bytes)
    round_s, received = [], []
    first = time.monotonic()
    for r in range(args.rounds):
        time.sleep(max(0.0, first + r * args.pace_s - time.monotonic()))
        started = time.monotonic()
        transport.publish(r, payload)
        incoming, _ = transport.collect(r, max_staleness=0, timeout_s=args.timeout)
        round_s.append(time.monotonic() - started)
        received.append(sorted(item.peer for item in incoming if item.round == r))
    _emit({"round_s": round_s, "received": received})
    sys.stdin.read()
    transport.close()


def run_gloo_peer(args) -> None:
    """One rank of a gloo world: the driver's two all_gathers per round; prints as above."""
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=args.init, rank=args.rank, world_size=args.world, timeout=None
    )
    _emit({"peer_id": str(args.rank), "maddrs": []})
    sys.stdin.readline()
    payload = torch.frombuffer(bytearray(os.urandom(args.payload_bytes)), dtype=torch.uint8)
    round_s, received = [], []
    first = time.monotonic()
    for r in range(args.rounds):
        time.sleep(max(0.0, first + r * args.pace_s - time.monotonic()))
        started = time.monotonic()
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(args.world)]
        dist.all_gather(lengths, torch.tensor([payload.numel()], dtype=torch.int64))
        longest = int(max(n.item() for n in lengths))
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: payload.numel()] = payload
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(args.world)]
        dist.all_gather(out, padded)
        round_s.append(time.monotonic() - started)
        received.append([str(i) for i in range(args.world) if i != args.rank])
    _emit({"round_s": round_s, "received": received})
    sys.stdin.read()
    dist.destroy_process_group()


# --- the scenarios -------------------------------------------------------------------------


def _spawn(ns: str, argv: list[str], **extra_env: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), **extra_env)
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "bench.swarm", *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _line(proc: subprocess.Popen, timeout_s: float) -> dict:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line:
        raise RuntimeError(f"a peer said nothing within {timeout_s:g} s (exit {proc.poll()})")
    return json.loads(line)


def run_scenario(
    kind: str, *, peers: int, rounds: int, payload: int, timeout: float, pace_s: float = 0.0, **net
):
    """Run one scenario; returns its measurements. `net`: delay_s, loss (across namespaces)."""
    tag = f"fs{os.getpid() % 10000}{kind[0]}{'d' if net else 'l'}"
    across = bool(net)
    ns = Namespaces(tag, peers if across else 0)
    procs: list[subprocess.Popen] = []
    hub_proc = None
    shaper = "none"
    try:
        if across:
            delay_ms, loss = net["delay_s"] * 1000, net["loss"]
            refused = netem_refused(ns)
            if refused is None:  # the kernel's netem on each peer's link, a plain switch
                shaper = f"tc netem delay {delay_ms:g}ms loss {loss * 100:g}% on each peer's veth"
                for i in range(peers):
                    netem = ["tc", "qdisc", "add", "dev", "eth0", "root", "netem"]
                    netem += ["delay", f"{delay_ms:g}ms", "loss", f"{loss * 100:g}%"]
                    _ip("netns", "exec", ns.peer(i), *netem)
                delay_ms, loss = 0.0, 0.0
            else:
                shaper = f"user-space switch: {delay_ms:g} ms one way, {loss:.0%} lost ({refused})"
            hub_proc = subprocess.Popen(
                ["ip", "netns", "exec", ns.hub, sys.executable, "-m", "bench.swarm", "hub"]
                + ["--ports", *[f"{tag}h{i}" for i in range(peers)]]
                + ["--delay-ms", str(delay_ms), "--loss", str(loss)],
                env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])),
            )
        common = ["--rounds", str(rounds), "--payload-bytes", str(payload)]
        common += ["--pace-s", str(pace_s)]
        hellos = []
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(peers):
                where = ns.peer(i) if across else ns.peer(0)
                env = {}
                if kind == "gloo":
                    argv = ["gloo-peer", "--rank", str(i), "--world", str(peers)]
                    argv += ["--init", f"tcp://{f'{SUBNET}.1' if across else '127.0.0.1'}:29517"]
                    argv += common
                    env = {"GLOO_SOCKET_IFNAME": "eth0" if across else "lo"}
                else:
                    host = f"{SUBNET}.{i + 1}" if across else "127.0.0.1"
                    argv = ["hivemind-peer", "--out", f"{tmp}/p{i}", "--timeout", str(timeout)]
                    argv += ["--host-maddr", f"/ip4/{host}/tcp/0", *common]
                    if hellos:
                        argv += ["--initial-peers", *hellos[0]["maddrs"]]
                procs.append(_spawn(where, argv, **env))
                if kind != "gloo":
                    hellos.append(_line(procs[-1], 120))
            if kind == "gloo":
                hellos = [_line(p, 120) for p in procs]
            devices = (
                [(ns.peer(i), "eth0") for i in range(peers)] if across else [(ns.peer(0), "lo")]
            )
            before = sum(ns.tx_bytes(*d) for d in devices)
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            results = [_line(p, rounds * (timeout + 30) + 60) for p in procs]
            moved = sum(ns.tx_bytes(*d) for d in devices) - before
            for p in procs:
                p.stdin.close()
            for p in procs:
                p.wait(60)
    finally:
        for p in procs + ([hub_proc] if hub_proc else []):
            if p.poll() is None:
                p.kill()
                p.wait(30)
        ns.close()
    round_s = [max(r["round_s"][k] for r in results) for k in range(rounds)]
    complete = sum(len(r["received"][k]) == peers - 1 for r in results for k in range(rounds)) / (
        rounds * peers
    )
    return {"round_s": round_s, "moved_bytes": moved, "complete": complete, "shaper": shaper}


def summarize(name: str, result: dict, *, peers: int, rounds: int, samples: int, tokens: int):
    payload = payload_bytes(samples, tokens)
    # Each peer's payload reaches the peers - 1 others: what the exchange must move at least.
    payload_moved = rounds * peers * (peers - 1) * payload
    tokens_moved = rounds * peers * (peers - 1) * samples * tokens
    per_token = result["moved_bytes"] / tokens_moved
    return {
        "scenario": name,
        "round_s_median": statistics.median(result["round_s"]),
        "round_s_max": max(result["round_s"]),
        "complete_fraction": result["complete"],
        "moved_bytes": result["moved_bytes"],
        "payload_bytes_delivered": payload_moved,
        "bytes_per_payload_byte": result["moved_bytes"] / payload_moved,
        "bytes_per_token": per_token,
        "overhead_over_8B_per_token": per_token / BYTES_PER_TOKEN,
        "shaper": result["shaper"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd")
    p = sub.add_parser("hub")
    p.add_argument("--ports", nargs="+", required=True)
    p.add_argument("--delay-ms", type=float, default=50.0)
    p.add_argument("--loss", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    for name in ("hivemind-peer", "gloo-peer"):
        p = sub.add_parser(name)
        p.add_argument("--rounds", type=int, required=True)
        p.add_argument("--payload-bytes", type=int, required=True)
        p.add_argument("--pace-s", type=float, default=0.0)
        if name == "hivemind-peer":
            p.add_argument("--out", required=True)
            p.add_argument("--host-maddr", required=True)
            p.add_argument("--initial-peers", nargs="*", default=[])
            p.add_argument("--timeout", type=float, required=True)
        else:
            p.add_argument("--rank", type=int, required=True)
            p.add_argument("--world", type=int, required=True)
            p.add_argument("--init", required=True)
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--samples", type=int, default=32, help="samples per peer per round")
    parser.add_argument("--tokens", type=int, default=20, help="completion tokens per sample")
    parser.add_argument("--delay-ms", type=float, default=50.0)
    parser.add_argument("--loss", type=float, default=0.01)
    parser.add_argument("--timeout", type=float, default=30.0, help="collect's timeout_s")
    parser.add_argument("--pace-s", type=float, default=0.0, help="seconds between round starts")
    parser.add_argument("--out", type=Path, default=Path("bench/results/swarm.json"))
    args = parser.parse_args(argv)
    if args.cmd == "hub":
        hub(args.ports, args.delay_ms / 1000, args.loss, args.seed)
        return 0
    if args.cmd == "hivemind-peer":
        run_hivemind_peer(args)
        return 0
    if args.cmd == "gloo-peer":
        run_gloo_peer(args)
        return 0
    refused = namespaces_refused()
    if refused:
        print(f"bench.swarm: {refused}", file=sys.stderr)
        return 2
    shape = dict(peers=args.peers, rounds=args.rounds)
    payload = payload_bytes(args.samples, args.tokens)
    rows = []
    delayed = {"delay_s": args.delay_ms / 1000, "loss": args.loss}
    for name, kind, net in (
        ("gloo-loopback", "gloo", {}),
        ("hivemind-loopback", "hivemind", {}),
        ("gloo-delay", "gloo", delayed),
        ("hivemind-delay", "hivemind", delayed),
    ):
        result = run_scenario(
            kind, payload=payload, timeout=args.timeout, pace_s=args.pace_s, **shape, **net
        )
        rows.append(summarize(name, result, samples=args.samples, tokens=args.tokens, **shape))
        print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    setup = dict(vars(args), out=str(args.out), payload_bytes=payload, cmd=None)
    args.out.write_text(json.dumps({"setup": setup, "results": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
