"""Starting a local swarm: torchrun (or one `ftis-grpo peer` per node), its supervision, signals.

Every check runs before any node starts, so a bad `--out` or `--resume` costs no warm-up: the
launcher takes the lock on `--out` and checks the folder (`run_folder`), then holds the lock
shared with the nodes, each of which takes it too (`run_folder.hold_out`). It starts torchrun in a
session of its own, set to die with the launcher, and forwards SIGINT, SIGTERM and SIGHUP to
every node (and kills torchrun); nodes still alive `STOP_GRACE_S` seconds later are killed. A node
whose launcher or torchrun is gone stops by itself (`worker.watch_parent`), so nothing outlives
the launcher, even one killed by SIGKILL. What the launcher and its processes agree on (exit
codes, environment variables, files) is in `process`.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import psutil
import yaml

from ftis_kernels.grpo import checkpoint
from ftis_kernels.grpo.errors import ConfigError
from ftis_kernels.grpo.process import (
    EXIT_DIVERGED,
    EXIT_REFUSED,
    EXIT_REPORTS_ENV,
    EXIT_SWARM,
    EXIT_USAGE,
    LAUNCHER_ENV,
    PEER_FILE,
    READY_FILE,
    START_ENV,
    STOP_SIGNALS,
    die_with_parent,
    read_exit_reports,
    read_peer_file,
    report_exit,
    threads_per_node,
)
from ftis_kernels.grpo.report import merge, read_metrics, skipped_in_a_row
from ftis_kernels.grpo.run_folder import OutLock, check_out, make_out
from ftis_kernels.grpo.schema import RunConfig, to_dict

log = logging.getLogger("ftis_kernels.grpo")

STOP_GRACE_S = 20.0  # how long the nodes get to stop after a forwarded signal before SIGKILL
_POLL_S = 0.2


# -- torchrun and its supervision -----------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_out_or_clean(
    cfg: RunConfig, overwrite: bool, lock: OutLock, created: bool, peers_resume: bool = False
) -> None:
    """`check_out` of the locked --out; on a ConfigError, a folder this call created is removed
    again (no trace of a run that did not start) before it propagates."""
    try:
        check_out(cfg, overwrite, peers_resume=peers_resume)
    except ConfigError:
        if created:
            lock.release()
            lock.path.unlink()
            Path(cfg.out).rmdir()
        raise


def launch(argv: Sequence[str], cfg: RunConfig, overwrite: bool = False) -> int:
    """Start the local swarm (torchrun, one process per node on 127.0.0.1) into the locked output
    folder and supervise it; returns the exit code. ConfigError before anything starts."""
    out = Path(cfg.out)
    created = not out.exists()
    make_out(out)
    with OutLock(out) as lock:
        _check_out_or_clean(cfg, overwrite, lock, created)
        n = len(cfg.nodes)
        cmd = [
            sys.executable,
            "-m",
            "ftis_kernels.grpo.launch",  # torchrun, without its traceback (`_torchrun`)
            "--nnodes=1",
            f"--nproc-per-node={n}",
            "--max-restarts=0",
            "--master-addr=127.0.0.1",
            f"--master-port={_free_port()}",
            "-m",
            "ftis_kernels.grpo",
            *(a for a in argv if a != "--overwrite"),
        ]
        env = dict(os.environ)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # a local swarm talks over loopback only
        if cfg.threads or "OMP_NUM_THREADS" not in env:
            # Set, torchrun keeps it (and prints no banner about choosing one itself).
            env["OMP_NUM_THREADS"] = str(threads_per_node(cfg.threads, n))
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        env[LAUNCHER_ENV] = str(os.getpid())
        lock.share()
        log.info("starting a local swarm of %d nodes: %s", n, " ".join(cmd[1:]))
        with tempfile.TemporaryDirectory(prefix="ftis-grpo-exit-") as reports:
            env[EXIT_REPORTS_ENV] = reports
            rc = supervise(
                subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=die_with_parent)
            )
            code, reason = swarm_exit(rc, read_exit_reports(Path(reports)))
    if code != 0:
        hint = "" if code in (EXIT_REFUSED, EXIT_USAGE) else _resume_hint(argv, cfg)
        log.error("the swarm stopped with exit code %d: %s%s", code, reason, hint)
    return code


# The local swarm of separate peers (`--transport hivemind`): how long the first peer may take to
# start listening, and where it listens (loopback, any port).
PEER_START_S = 120.0
LOOPBACK_MADDR = "/ip4/127.0.0.1/tcp/0"


def peer_folder(out: Path, k: int) -> Path:
    """Where peer `k` of a local swarm writes: `out`/node_`k`."""
    return out / f"node_{k}"


def launch_peers(cfg: RunConfig, overwrite: bool = False, argv: Sequence[str] = ()) -> int:
    """Start a local swarm of separate `ftis-grpo peer` processes over loopback, one per node,
    each into `cfg.out`/node_k with its `node.yaml` there; node 0 first, the others joining by its
    multiaddr. Signals are forwarded as `launch` does; returns the swarm's exit code (`swarm_exit`
    over the peers' codes, a peer killed by a signal as 128 + its number), and merges the peers'
    metrics into `cfg.out`/curves.png and summary.txt. ConfigError before anything starts."""
    out, n = Path(cfg.out), len(cfg.nodes)
    created = not out.exists()
    make_out(out)
    with OutLock(out) as lock:  # one local swarm per folder; each peer locks its own node_k
        # The folder itself, as a run's (its merged summary.txt and curves.png replace no one's
        # files and no other run's); each peer checks its node_k folder and a --resume there.
        _check_out_or_clean(cfg, overwrite, lock, created, peers_resume=True)
        threads = threads_per_node(cfg.threads, n)
        configs = []
        for k in range(n):
            folder = peer_folder(out, k)
            make_out(folder)
            d = to_dict(cfg)
            d.update(
                nodes=[d["nodes"][k]],
                out=str(folder),
                resume=False,
                threads=threads,
                progress=cfg.progress and k == 0,
            )
            (folder / "node.yaml").write_text(yaml.safe_dump(d, sort_keys=False))
            configs.append(folder / "node.yaml")
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        env["OMP_NUM_THREADS"] = str(threads)
        flags = (["--resume"] if cfg.resume else []) + (["--overwrite"] if overwrite else [])
        # The peers' first rounds start together, once every one is warmed up (`wait_for_start`).
        start_file = out / ".ftis-grpo-start"
        start_file.unlink(missing_ok=True)
        env[START_ENV] = str(start_file)

        def start(k: int, join: list[str]) -> subprocess.Popen:
            folder = peer_folder(out, k)
            cmd = [sys.executable, "-m", "ftis_kernels.grpo", "peer", "--config", str(configs[k])]
            cmd += ["--out", str(folder), "--host-maddr", LOOPBACK_MADDR, *flags]
            cmd += ["--initial-peers", *join] if join else []
            # Its own session: a terminal's Ctrl-C reaches the launcher, which forwards it once.
            return subprocess.Popen(
                cmd, env=env, start_new_session=True, preexec_fn=die_with_parent
            )

        for k in range(n):
            (peer_folder(out, k) / PEER_FILE).unlink(missing_ok=True)
            (peer_folder(out, k) / READY_FILE).unlink(missing_ok=True)
        log.info("starting a local swarm of %d peers over loopback in %s", n, out)
        procs = [start(0, [])]
        deadline = time.monotonic() + PEER_START_S
        first = None
        while first is None and procs[0].poll() is None and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            first = read_peer_file(peer_folder(out, 0))
        if first is None:
            if procs[0].poll() is None:
                procs[0].kill()
                procs[0].wait()
                log.error("peer 0 did not start listening within %.0f s", PEER_START_S)
                return EXIT_SWARM
            return procs[0].returncode  # it said why
        log.info("peer 0 listens at %s", " ".join(first["maddrs"]))
        procs += [start(k, first["maddrs"]) for k in range(1, n)]

        def start_when_ready() -> None:
            ready = all((peer_folder(out, k) / READY_FILE).exists() for k in range(n))
            if not start_file.exists() and (ready or any(p.poll() is not None for p in procs)):
                start_file.touch()

        codes, stopped_by = supervise_peers(procs, tick=start_when_ready)
    reports = {
        k: (c, f"peer {k} ({cfg.node(k).name}) exited with code {c}.") for k, c in codes.items()
    }
    # Stopped by a signal to the launcher: that signal's code first, as `launch` gives it.
    rc = 128 + stopped_by if stopped_by else int(any(codes.values()))
    code, reason = swarm_exit(rc, reports)
    try:
        _, table = merge([peer_folder(out, k) for k in range(n)], out)
        print(
            f"\n{table}\n\nmerged: {out / 'summary.txt'}\ncurves: {out / 'curves.png'}", flush=True
        )
    except (OSError, ValueError) as exc:
        log.warning("no merged summary of the peers: %s", exc)
    if code != 0:
        hint = ""
        if argv and code not in (EXIT_REFUSED, EXIT_USAGE):
            hint = _resume_hint(argv, cfg, [peer_folder(out, k) for k in range(n)])
        log.error("the swarm stopped with exit code %d: %s%s", code, reason, hint)
    return code


def supervise_peers(
    procs: list[subprocess.Popen], grace_s: float = STOP_GRACE_S, tick=lambda: None
) -> tuple[dict[int, int], Optional[int]]:
    """Wait for every peer; SIGINT, SIGTERM or SIGHUP to this process is forwarded to each (a
    second one kills them), and what is alive `grace_s` seconds after the first is killed.
    `tick()` runs every poll. Returns ({peer: exit code}, a peer stopped by a signal as 128 + its
    number; the first signal forwarded, None when none was)."""
    received: list[int] = []

    def forward(signum: int, _frame) -> None:
        received.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum if len(received) == 1 else signal.SIGKILL)

    previous = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    try:
        deadline = None
        while any(p.poll() is None for p in procs):
            time.sleep(_POLL_S)
            tick()
            if received and deadline is None:
                deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    codes = {
        k: (128 - p.returncode if p.returncode < 0 else p.returncode) for k, p in enumerate(procs)
    }
    return codes, (received[0] if received else None)


def swarm_exit(rc: int, reports: dict[int, tuple[int, str]]) -> tuple[int, str]:
    """The swarm's exit code and why, from torchrun's `rc` and the nodes' reports: a stop by a
    signal to the launcher (rc >= 128) first, then the cause before its effects: a divergence, a
    node's own failure, then a lost peer, then a node stopped by a signal."""
    if rc == 0 or rc >= 128:
        return rc, "stopped by a signal; the nodes were stopped" if rc else ""

    def rank_of(code: int) -> int:
        if code == EXIT_DIVERGED:
            return 0
        if code == EXIT_SWARM:
            return 2
        # Stopped by a signal it handles (torchrun's SIGTERM to the rest, say): an effect. Killed
        # by one it cannot handle (SIGKILL, SIGSEGV; `_report_the_killed`): its own failure.
        return 3 if code - 128 in STOP_SIGNALS else 1

    failed = sorted((rank_of(c), rank, c, why) for rank, (c, why) in reports.items() if c != 0)
    if not failed:
        return rc, "a node failed without saying why (see the log lines above)"
    _, _, code, why = failed[0]
    return code, why


def _torchrun(argv: Sequence[str]) -> int:
    """torchrun (`torch.distributed.run`) for the launcher: a node's failure is the node's to
    report (and the launcher's, in one line), so torchrun's traceback, failure table and notices
    of stopping the other nodes are left out; returns 1 when a node failed."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(list(argv)))
    except ChildFailedError as exc:
        _report_the_killed({rank: f.exitcode for rank, f in exc.failures.items()})
        return 1
    return 0


def _report_the_killed(exit_codes: dict[int, int]) -> None:
    """For the launcher, the exit report of each node that torchrun saw killed by a signal (a
    negative exit code) and that left none: a node killed by SIGKILL (the out-of-memory killer
    sends it) or crashed by SIGSEGV cannot write its own, and its peers' lost contact, or
    torchrun's SIGTERM to them, would be reported in its place."""
    folder = os.environ.get(EXIT_REPORTS_ENV)
    if not folder:
        return
    reported = read_exit_reports(Path(folder))
    for rank, code in exit_codes.items():
        if code >= 0 or rank in reported:
            continue
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = " (the out-of-memory killer sends it)" if -code == signal.SIGKILL else ""
        report_exit(rank, 128 - code, f"node {rank}: killed by {name}{why}")


def _resume_args(argv: Sequence[str]) -> list[str]:
    """argv without --resume / --overwrite and without the settings that inject a fault
    (`nodes.K.fail_at_round`): a resume with them would fail again at once."""
    args: list[str] = []
    skip = False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a in ("--resume", "--overwrite"):
            continue
        if a == "--set" and i + 1 < len(argv) and ".fail_at_round=" in argv[i + 1]:
            skip = True
            continue
        if a.startswith("--set=") and ".fail_at_round=" in a:
            continue
        args.append(a)
    return args


def _resume_hint(argv: Sequence[str], cfg: RunConfig, folders: Sequence[Path] = ()) -> str:
    """' Continue ... with: ftis-grpo ... --resume' when a resume can work (a complete checkpoint
    with rounds left after it, and no node that stopped the run by diverging), else ''. folders:
    the run's folders holding `ckpt/` and `metrics.jsonl` (a local swarm of peers: its node_k
    folders, the resume continuing from the earliest of their checkpoints, none of them done);
    by default --out."""
    folders = list(folders) or [Path(cfg.out)]
    latest = [checkpoint.latest_round(folder / "ckpt") for folder in folders]
    if any(r is None for r in latest):
        return ""
    done = min(r for r in latest if r is not None)
    # Every folder needs rounds left: a swarm peer that has done them all refuses a --resume.
    if max(r for r in latest if r is not None) >= cfg.rounds:
        return ""
    for folder in folders:
        try:
            rows = read_metrics(folder / "metrics.jsonl", warn=False)
        except (OSError, ValueError):
            rows = []
        if rows and max(skipped_in_a_row(rows).values()) >= cfg.max_skipped_steps:
            return " The training diverged (see the error above): a --resume would repeat it."
    return (
        f" Continue from the checkpoint of round {done} with: "
        f"ftis-grpo {shlex.join(_resume_args(argv) + ['--resume'])}"
    )


def supervise(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> int:
    """Wait for `proc` (torchrun, started in a session of its own). SIGINT, SIGTERM or SIGHUP to
    this process is forwarded to every process below `proc` (the nodes, which log it and exit;
    a second signal kills them) and `proc` is killed; whatever is still alive `grace_s` seconds
    later is killed. Returns `proc`'s exit code, or 128 + the signal's number when a signal
    stopped the run."""
    received: list[int] = []
    tree: list[psutil.Process] = []

    def forward(signum: int, _frame) -> None:
        received.append(signum)
        if len(received) == 1:
            log.warning(
                "%s received: stopping the swarm (nodes still running in %.0f s are killed)",
                signal.Signals(signum).name,
                grace_s,
            )
        tree[:] = _process_tree(proc.pid, tree)
        for p in tree:
            if p.pid != proc.pid:
                _send(p, signum if len(received) == 1 else signal.SIGKILL)
        # torchrun only manages the nodes, which stop themselves: stopped politely it would
        # print a traceback of its own and a failure report for every node.
        try:
            proc.kill()
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    try:
        deadline = None
        while True:
            try:
                rc = proc.wait(timeout=_POLL_S)
                break
            except subprocess.TimeoutExpired:
                if received and deadline is None:
                    deadline = time.monotonic() + grace_s
                if deadline is not None and time.monotonic() > deadline:
                    for p in _process_tree(proc.pid, tree):
                        _send(p, signal.SIGKILL)
        if received:
            # torchrun may exit before its nodes have: wait for them too, then kill the rest.
            left = max(0.0, (deadline or time.monotonic() + grace_s) - time.monotonic())
            _, alive = psutil.wait_procs(tree, timeout=left)
            for p in alive:
                _send(p, signal.SIGKILL)
            psutil.wait_procs(alive, timeout=5)
            return 128 + received[0]
        return rc
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _process_tree(pid: int, known: list[psutil.Process]) -> list[psutil.Process]:
    """`pid` and every process below it, plus the `known` ones (orphans once torchrun is gone)."""
    found = list(known)
    try:
        root = psutil.Process(pid)
        found += [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        pass
    unique = {p.pid: p for p in found}
    return list(unique.values())


def _send(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


if __name__ == "__main__":
    sys.exit(_torchrun(sys.argv[1:]))
