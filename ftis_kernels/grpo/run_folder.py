"""The run's output folder (`--out`): its lock, the checks before a run starts into it, and a
node's share of the lock.

The launcher takes an exclusive lock on `--out` (`OutLock`), checks the folder (`check_out`),
then holds the lock shared with the nodes, each of which takes it too (`hold_out`): the lock lasts
as long as any process of the swarm, and a second run is refused until the last has exited. A
peer (`peer.run_peer`) locks and checks its own `--out` the same way.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import shutil
import socket
from pathlib import Path
from typing import IO, Optional

import torch.distributed as torch_dist

from ftis_kernels.grpo import checkpoint
from ftis_kernels.grpo.errors import ConfigError, Verbatim, show
from ftis_kernels.grpo.process import LAUNCHER_ENV
from ftis_kernels.grpo.report import read_metrics
from ftis_kernels.grpo.schema import RESUMABLE, RunConfig, resume_changes

log = logging.getLogger("ftis_kernels.grpo")

LOCK_FILE = ".ftis-grpo.lock"
# Written into --out when a run starts there: the folder holds a run (`holds_a_run`).
RUN_MARKER = ".ftis-grpo-run"
# Written beside the curves.png and summary.txt that `ftis-grpo report` merges into a folder.
REPORT_MARKER = ".ftis-grpo-report"
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


def check_out(cfg: RunConfig, overwrite: bool, peers_resume: bool = False) -> None:
    """Before a run starts into `cfg.out` (locked by the caller): a fresh run needs a folder that
    holds no run, unless `overwrite` (then the previous run's `RUN_OUTPUTS` are deleted, nothing
    else); a --resume needs a complete checkpoint of the same configuration and rounds left to
    run. A folder with files of those names that no run wrote (no `RUN_MARKER`) is refused
    either way. Stale `round_*.tmp` folders of a killed checkpoint write are removed. Writes the
    marker; ConfigError otherwise.

    peers_resume: the folder of a local swarm of peers (`--transport hivemind`), whose peers
    keep their checkpoints in its node_k folders and check a --resume there themselves."""
    out = Path(cfg.out)
    previous = [name for name in RUN_OUTPUTS if (out / name).exists()]
    # A local swarm's folder from before it had a marker of its own: its peers' folders have.
    ran = holds_a_run(out) or (peers_resume and any(map(holds_a_run, out.glob("node_*"))))
    if previous and not ran:
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
        if not peers_resume:  # a swarm's peers check their own checkpoints
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


def check_report_to(to: Path) -> None:
    """Before `ftis-grpo report` merges runs into `to`: its curves.png and summary.txt may replace
    only files of those names that a run or an earlier report wrote (a user's are refused)."""
    mine = [name for name in ("curves.png", "summary.txt") if (to / name).exists()]
    if mine and not (holds_a_run(to) or (to / REPORT_MARKER).is_file()):
        raise ConfigError(
            (
                "--to",
                "a folder without a curves.png or summary.txt that no run or report wrote",
                Verbatim(f"{str(to)!r}, which holds {', '.join(mine)} (move them, or pass --to)"),
            )
        )


def mark_report(to: Path) -> None:
    """Marks `to` as a folder `ftis-grpo report` merged runs into (`check_report_to`)."""
    (to / REPORT_MARKER).write_text("ftis-grpo report writes curves.png and summary.txt here\n")


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
