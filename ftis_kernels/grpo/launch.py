"""Starting a local swarm: the output folder (lock, checks, clean-up), torchrun, and signals.

Every check here runs before any node starts, so a bad `--out` or `--resume` costs no warm-up.
The launcher holds an exclusive lock on `--out` for the run's lifetime, starts torchrun in a
session of its own, and forwards SIGINT, SIGTERM and SIGHUP to every node (and kills torchrun);
nodes still alive `STOP_GRACE_S` seconds later are killed, so nothing outlives the launcher.
"""

from __future__ import annotations

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
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Optional

import psutil

from ftis_kernels.grpo import checkpoint
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
# What a run writes into --out: a folder holding any of these holds a run.
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
    """An exclusive lock on the output folder: `<out>/.ftis-grpo.lock`, holding the holder's PID,
    host and start time. The kernel releases it when the holder exits, however it exits."""

    def __init__(self, out: Path):
        self.path = out / LOCK_FILE
        self._file: Optional[IO[str]] = None

    def acquire(self) -> None:
        """Take the lock, or ConfigError naming the run that holds it."""
        f = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
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
        f.seek(0)
        f.truncate()
        since = datetime.datetime.now().isoformat(timespec="seconds")
        f.write(f"ftis-grpo PID {os.getpid()} on host {socket.gethostname()} since {since}\n")
        f.flush()
        self._file = f

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
    holds no run, unless `overwrite` (then the previous run's outputs are deleted); a --resume
    needs a complete checkpoint of the same configuration and rounds left to run. Stale
    `round_*.tmp` folders of a killed checkpoint write are removed. ConfigError otherwise."""
    out = Path(cfg.out)
    previous = [name for name in RUN_OUTPUTS if (out / name).exists()]
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
            "torch.distributed.run",
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
        log.info("starting a local swarm of %d nodes: %s", n, " ".join(cmd[1:]))
        rc = supervise(subprocess.Popen(cmd, env=env, start_new_session=True))
    if rc != 0:
        log.error(
            "the swarm stopped with exit code %d: a node failed or was stopped (see the "
            "log lines above); the others were stopped.%s",
            rc,
            _resume_hint(argv, cfg),
        )
    return rc


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
