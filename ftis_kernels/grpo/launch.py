"""Starting a local swarm: the output folder (lock, checks, clean-up), torchrun, and signals.

Every check here runs before any node starts, so a bad `--out` or `--resume` costs no warm-up.
The launcher takes an exclusive lock on `--out`, checks the folder, then holds the lock shared
with the nodes, each of which takes it too (`hold_out`): the lock lasts as long as any process of
the swarm, and a second run is refused until the last has exited. It starts torchrun in a
session of its own, set to die with the launcher, and forwards SIGINT, SIGTERM and SIGHUP to
every node (and kills torchrun); nodes still alive `STOP_GRACE_S` seconds later are killed. A node
whose launcher or torchrun is gone stops by itself (`node.watch_parent`), so nothing outlives the
launcher, even one killed by SIGKILL.
"""

from __future__ import annotations

import ctypes
import datetime
import fcntl
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Optional

import psutil
import torch.distributed as torch_dist
import yaml

from ftis_kernels.grpo import checkpoint
from ftis_kernels.grpo.cli import EXIT_USAGE
from ftis_kernels.grpo.config import (
    RESUMABLE,
    ConfigError,
    RunConfig,
    Verbatim,
    resume_changes,
    show,
)
from ftis_kernels.grpo.report import read_metrics, skipped_in_a_row

log = logging.getLogger("ftis_kernels.grpo")

LOCK_FILE = ".ftis-grpo.lock"
# Written into --out when a run starts there: the folder holds a run (`holds_a_run`).
RUN_MARKER = ".ftis-grpo-run"
# What a run writes into --out, all that --overwrite deletes (with the marker).
RUN_OUTPUTS = (
    "ckpt",
    "metrics.jsonl",
    "config.json",
    "config.yaml",
    "curves.png",
    "summary.txt",
    "tokenizer",
    "received.jsonl",
    "environment.json",
)
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Set by the launcher for the nodes: its PID. Without it (torchrun by hand) rank 0 checks --out.
LAUNCHER_ENV = "FTIS_GRPO_LAUNCHER_PID"
# Set by the launcher for the nodes: a folder where each node leaves `node<rank>.json`, its exit
# code and why (`report_exit`), for the launcher to report the swarm's own.
EXIT_REPORTS_ENV = "FTIS_GRPO_EXIT_REPORTS"
# Exit codes of a node and of the launcher (ftis-grpo's 2 is cli.EXIT_USAGE).
EXIT_REFUSED = 1  # a node refused to start (vocabulary or configuration mismatch, bad --resume)
EXIT_SWARM = 3  # a peer died or stopped answering
EXIT_DIVERGED = 4  # a node skipped max_skipped_steps non-finite optimizer steps in a row
EXIT_WRITE = 5  # a node could not write its output (a full disk, say)
EXIT_FAULT_INJECTION = 17  # a node's `fail_at_round` fired: it dies as a crashing machine would
_PR_SET_PDEATHSIG = 1  # prctl(2)
STOP_GRACE_S = 20.0  # how long the nodes get to stop after a forwarded signal before SIGKILL
_POLL_S = 0.2


def threads_per_node(threads: int, local_nodes: int) -> int:
    """Torch (and OpenMP) threads of each node: `threads`, or 0 for this machine's cores shared
    evenly by the `local_nodes` nodes it runs."""
    if threads:
        return threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // local_nodes)


# -- the output folder ----------------------------------------------------------------------------
class OutLock:
    """A lock on the output folder: `<out>/.ftis-grpo.lock`, holding the PID, host and start time
    of the process that checked the folder. One run's processes hold it shared (`share`, `join`);
    a run that starts needs it exclusive (`acquire`), so it is refused while any process of
    another run is alive. The kernel releases a holder's share when it exits, however it exits."""

    def __init__(self, out: Path):
        self.path = out / LOCK_FILE
        self._file: Optional[IO[str]] = None

    def _take(self, mode: int) -> IO[str]:
        f = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(f, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "a process that has not written its name yet"
            f.close()
            raise ConfigError(
                (
                    "--out",
                    "a folder no other run is writing to",
                    Verbatim(f"{str(self.path.parent)!r}, locked by {holder}"),
                )
            ) from None
        return f

    def acquire(self) -> None:
        """Take the lock exclusively, or ConfigError naming the run that holds it."""
        f = self._take(fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        since = datetime.datetime.now().isoformat(timespec="seconds")
        f.write(f"ftis-grpo PID {os.getpid()} on host {socket.gethostname()} since {since}\n")
        f.flush()
        self._file = f

    def share(self) -> None:
        """Hold the exclusive lock taken by `acquire` shared, for the nodes of this run to join."""
        fcntl.flock(self._file, fcntl.LOCK_SH)

    def join(self) -> None:
        """Take a share of the lock (a node of the run that holds it), or ConfigError naming the
        run that holds it exclusively."""
        self._file = self._take(fcntl.LOCK_SH)

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the descriptor drops the lock
            self._file = None

    def __enter__(self) -> OutLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def make_out(out: Path) -> None:
    """Create the output folder, or ConfigError if it is a file or cannot be created."""
    if out.exists() and not out.is_dir():
        raise ConfigError(("--out", "a folder", Verbatim(f"{str(out)!r}, which is a file")))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            ("--out", "a folder this user can create", Verbatim(f"{str(out)!r} ({exc.strerror})"))
        ) from None


def check_out(cfg: RunConfig, overwrite: bool) -> None:
    """Before a run starts into `cfg.out` (locked by the caller): a fresh run needs a folder that
    holds no run, unless `overwrite` (then the previous run's `RUN_OUTPUTS` are deleted, nothing
    else); a --resume needs a complete checkpoint of the same configuration and rounds left to
    run. A folder with files of those names that no run wrote (no `RUN_MARKER`) is refused
    either way. Stale `round_*.tmp` folders of a killed checkpoint write are removed. Writes the
    marker; ConfigError otherwise."""
    out = Path(cfg.out)
    previous = [name for name in RUN_OUTPUTS if (out / name).exists()]
    if previous and not holds_a_run(out):
        raise ConfigError(
            (
                "--out",
                "a folder without files of the names a run writes, or one a run wrote",
                Verbatim(
                    f"{str(out)!r}, which holds {', '.join(previous)} that no run wrote "
                    "(move them, or choose another --out)"
                ),
            )
        )
    if cfg.resume:
        if overwrite:
            raise ConfigError(
                (
                    "--overwrite",
                    "no --resume (--resume continues the run in --out, --overwrite replaces it)",
                    True,
                )
            )
        check_resume(cfg)
        stale = sorted((out / "ckpt").glob("node*/round_*.tmp"))
        for folder in stale:
            shutil.rmtree(folder)
        if stale:
            log.warning(
                "removed %d unfinished checkpoint write(s): %s",
                len(stale),
                ", ".join(str(p.relative_to(out)) for p in stale),
            )
    elif previous and not overwrite:
        raise ConfigError(
            (
                "--out",
                "an empty or new folder (--resume continues the run there, "
                "--overwrite replaces it)",
                Verbatim(f"{str(out)!r}, which holds a run: {', '.join(previous)}"),
            )
        )
    elif previous:
        for name in previous:
            path = out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        log.warning("--overwrite: deleted the previous run's %s in %s", ", ".join(previous), out)
    (out / RUN_MARKER).write_text(
        "ftis-grpo writes its run here; --overwrite deletes only this file and its outputs: "
        f"{', '.join(RUN_OUTPUTS)}\n"
    )


def holds_a_run(out: Path) -> bool:
    """Whether `out` holds a run: its marker, or (a run from before markers) `ckpt/latest.json`."""
    return (out / RUN_MARKER).is_file() or (out / "ckpt" / "latest.json").is_file()


def check_resume(cfg: RunConfig) -> None:
    """ConfigError unless `cfg.out` holds a complete checkpoint of the same configuration (the
    keys in `config.RESUMABLE` may change) with fewer than `cfg.rounds` rounds done."""
    out = Path(cfg.out)
    done = checkpoint.latest_round(out / "ckpt")
    if done is None:
        raise ConfigError(
            (
                "--resume",
                f"a complete checkpoint in {out / 'ckpt'}",
                Verbatim("none (start the run without --resume)"),
            )
        )
    config_file = out / "config.json"
    try:
        before = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:  # the nodes still compare the checkpoint's fingerprint
        log.warning(
            "--resume: cannot compare with the previous configuration (%s): %s", config_file, exc
        )
        before = None
    if before is not None:
        changes = resume_changes(before, cfg)
        if changes:
            raise ConfigError(
                *(
                    (
                        key,
                        f"{show(old)} as in the run being resumed (--resume may change only "
                        f"{', '.join(k for k in RESUMABLE if k not in ('out', 'resume'))})",
                        new,
                    )
                    for key, old, new in changes
                )
            )
    if cfg.rounds <= done:
        raise ConfigError(
            (
                "rounds",
                f"more than the {done} rounds the run in {out} has done (--rounds N extends it)",
                cfg.rounds,
            )
        )
    if (out / "metrics.jsonl").exists():
        try:  # rank 0 reads it again, and warns of a torn last line then
            read_metrics(out / "metrics.jsonl", warn=False)
        except ValueError as exc:
            raise ConfigError(f"--resume: {exc}") from None


# -- torchrun and its supervision -----------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: Sequence[str], cfg: RunConfig, overwrite: bool = False) -> int:
    """Start the local swarm (torchrun, one process per node on 127.0.0.1) into the locked output
    folder and supervise it; returns the exit code. ConfigError before anything starts."""
    out = Path(cfg.out)
    created = not out.exists()
    make_out(out)
    with OutLock(out) as lock:
        try:
            check_out(cfg, overwrite)
        except ConfigError:
            if created:  # leave no trace of a run that did not start
                lock.release()
                lock.path.unlink()
                out.rmdir()
            raise
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
                subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
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


def launch_peers(cfg: RunConfig, overwrite: bool = False) -> int:
    """Start a local swarm of separate `ftis-grpo peer` processes over loopback, one per node,
    each into `cfg.out`/node_k with its `node.yaml` there; node 0 first, the others joining by its
    multiaddr. Signals are forwarded as `launch` does; returns the swarm's exit code (`swarm_exit`
    over the peers' codes, a peer killed by a signal as 128 + its number), and merges the peers'
    metrics into `cfg.out`/curves.png and summary.txt. ConfigError before anything starts."""
    from ftis_kernels.grpo.config import to_dict
    from ftis_kernels.grpo.peer import READY_FILE, START_ENV, read_peer_file
    from ftis_kernels.grpo.report import merge

    out, n = Path(cfg.out), len(cfg.nodes)
    make_out(out)
    with OutLock(out):  # one local swarm per folder; each peer locks its own node_k
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
                cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent
            )

        for k in range(n):
            (peer_folder(out, k) / "peer.json").unlink(missing_ok=True)
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

        codes = supervise_peers(procs, tick=start_when_ready)
    reports = {
        k: (c, f"peer {k} ({cfg.node(k).name}) exited with code {c}") for k, c in codes.items()
    }
    code, reason = swarm_exit(1 if any(codes.values()) else 0, reports)
    try:
        _, table = merge([peer_folder(out, k) for k in range(n)], out)
        print(
            f"\n{table}\n\nmerged: {out / 'summary.txt'}\ncurves: {out / 'curves.png'}", flush=True
        )
    except (OSError, ValueError) as exc:
        log.warning("no merged summary of the peers: %s", exc)
    if code != 0:
        log.error("the swarm stopped with exit code %d: %s", code, reason)
    return code


def supervise_peers(
    procs: list[subprocess.Popen], grace_s: float = STOP_GRACE_S, tick=lambda: None
) -> dict[int, int]:
    """Wait for every peer; SIGINT, SIGTERM or SIGHUP to this process is forwarded to each (a
    second one kills them), and what is alive `grace_s` seconds after the first is killed.
    `tick()` runs every poll. Returns {peer: exit code}, a peer stopped by a signal as 128 + its
    number."""
    received: list[int] = []

    def forward(signum: int, _frame) -> None:
        received.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum if len(received) == 1 else signal.SIGKILL)

    previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
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
    return {
        k: (128 - p.returncode if p.returncode < 0 else p.returncode) for k, p in enumerate(procs)
    }


def read_exit_reports(folder: Path) -> dict[int, tuple[int, str]]:
    """{rank: (exit code, why)} of the nodes that left a report in `folder` (`report_exit`)."""
    reports = {}
    for path in folder.glob("node*.json"):
        try:
            got = json.loads(path.read_text())
            reports[int(path.stem[len("node") :])] = (int(got["code"]), str(got["reason"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a node killed while writing it: as if it had left none
    return reports


def report_exit(rank: int, code: int, reason: str) -> None:
    """A node's exit code and why, for its launcher (nothing under torchrun by hand)."""
    folder = os.environ.get(EXIT_REPORTS_ENV)
    if folder:
        try:
            tmp = Path(folder) / f"node{rank}.json.tmp"
            tmp.write_text(json.dumps({"code": code, "reason": reason}))
            os.replace(tmp, tmp.with_suffix(""))
        except OSError:
            pass  # the launcher is gone, or its temporary folder: nobody to tell


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
        return 3 if code >= 128 else 1

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
    except ChildFailedError:
        return 1
    return 0


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGKILL when the launcher dies, however it dies; its
    nodes then see torchrun gone and stop (`node.watch_parent`)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def hold_out(cfg: RunConfig, rank: int, overwrite: bool, group=None) -> OutLock:
    """A node's share of the lock on `cfg.out`, held until it exits. Under the launcher, which
    has checked the folder, each node joins its lock. Under torchrun by hand, rank 0 does what the
    launcher does (the lock, then `check_out`) while the others wait on `group`'s broadcast; a
    refusal stops every node with ConfigError (rank 0's carries the lines, the others' none)."""
    out, lock = Path(cfg.out), OutLock(Path(cfg.out))
    if os.environ.get(LAUNCHER_ENV):
        make_out(out)
        lock.join()
        return lock
    refusal: list[Optional[list[str]]] = [None]
    if rank == 0:
        try:
            make_out(out)
            lock.acquire()
            check_out(cfg, overwrite)
            lock.share()
        except ConfigError as exc:
            lock.release()
            refusal = [exc.lines]
    torch_dist.broadcast_object_list(refusal, src=0, group=group)
    if refusal[0] is not None:
        raise ConfigError(*refusal[0]) if rank == 0 else ConfigError()
    if rank != 0:
        make_out(out)
        lock.join()
    return lock


def _resume_hint(argv: Sequence[str], cfg: RunConfig) -> str:
    """' Continue ... with: ftis-grpo ... --resume' when a resume can work (a complete checkpoint
    with rounds left after it, and no node that stopped the run by diverging), else ''."""
    done = checkpoint.latest_round(Path(cfg.out) / "ckpt")
    if done is None or done >= cfg.rounds:
        return ""
    try:
        rows = read_metrics(Path(cfg.out) / "metrics.jsonl", warn=False)
    except (OSError, ValueError):
        rows = []
    if rows and max(skipped_in_a_row(rows).values()) >= cfg.max_skipped_steps:
        return " The training diverged (see the error above): a --resume would repeat it."
    args = [a for a in argv if a not in ("--resume", "--overwrite")]
    return (
        f" Continue from the checkpoint of round {done} with: "
        f"ftis-grpo {shlex.join(args + ['--resume'])}"
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

    previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
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
