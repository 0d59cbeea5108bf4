"""What the processes of a run agree on: their exit codes, the environment and files by which the
launcher and the processes it starts talk, how a process stops, and how it logs.

The launcher (`launch`) starts the nodes (`worker`, under torchrun) or the peers (`peer`) and
reports the swarm's exit code from theirs; each side reads its half of the contract here, so
neither imports the other.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import NoReturn, Optional

# Exit codes of a node, a peer and the launcher.
EXIT_REFUSED = 1  # a node refused to start (vocabulary or configuration mismatch, bad --resume)
EXIT_USAGE = 2  # a configuration or usage error (`errors.ConfigError`): nothing was started
EXIT_SWARM = 3  # a peer died or stopped answering
EXIT_DIVERGED = 4  # a node skipped max_skipped_steps non-finite optimizer steps in a row
EXIT_WRITE = 5  # a node could not write its output (a full disk, say)
EXIT_ERROR = 6  # a node failed with an error of its own (out of memory, say): its traceback
EXIT_FAULT_INJECTION = 17  # a node's `fail_at_round` fired: it dies as a crashing machine would

# Set by the launcher for the nodes: its PID. Without it (torchrun by hand) rank 0 checks --out.
LAUNCHER_ENV = "FTIS_GRPO_LAUNCHER_PID"
# Set by the launcher for the nodes: a folder where each node leaves `node<rank>.json`, its exit
# code and why (`report_exit`), for the launcher to report the swarm's own.
EXIT_REPORTS_ENV = "FTIS_GRPO_EXIT_REPORTS"
# The local swarm of `ftis-grpo --transport hivemind` starts its peers' first rounds together:
# each peer, warmed up, leaves READY_FILE in its --out and waits for the file this variable names
# (the launcher writes it once every peer is ready, or one has exited).
START_ENV = "FTIS_GRPO_START_FILE"
READY_FILE = ".ftis-grpo-ready"
# Written into a peer's --out once it is reachable: its peer id and the multiaddrs others join by.
PEER_FILE = "peer.json"

# The signals that stop a run: the launcher forwards them to its nodes and peers, which stop on
# them with exit code 128 + the signal's number.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1  # prctl(2)


def threads_per_node(threads: int, local_nodes: int) -> int:
    """Torch (and OpenMP) threads of each node: `threads`, or 0 for this machine's cores shared
    evenly by the `local_nodes` nodes it runs."""
    if threads:
        return threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // local_nodes)


def set_threads(threads: int) -> None:
    """Sets torch's intra-op threads for this process, and starts them before any result depends
    on them.

    A fresh process's first parallel region can compute on the worker threads it starts less
    accurately than every later region does. Measured with torch 2.13.0+cpu (an MKL build, which
    hands float32 `exp` and `log` to MKL's vector library) on 2 threads, in fresh processes whose
    first parallel region was a (21, 1000) `exp`: the half the second thread took was up to
    1.5e-4 off (relative) in 2 to 6 of 30 processes, a log-sum-exp over it 3e-5; `log` in the
    first region, 1 of 24 processes off. After one parallel `exp` region, 30 of 30 `exp` and 24
    of 24 `log` were exact. A run that must be bit-identical when rerun (the driver's studies)
    therefore runs such a region first and drops its result: 65,536 elements a thread, enough
    for torch to split it over every thread (it splits `exp` by 2,048 elements, `sum` by
    32,768)."""
    import torch

    torch.set_num_threads(threads)
    if threads > 1:
        torch.ones(threads << 16).exp_().sum()


def die_with_parent() -> None:
    """In a child process (Linux): SIGKILL when its parent dies, however it dies. The launcher
    runs it in torchrun and in each peer before exec (their nodes then see torchrun gone and stop,
    `worker.watch_parent`); a peer runs it in the DHT process it forks."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


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


def leave(code: int, rank: int, why: str) -> NoReturn:
    """Exit now with `code`, reported with `why` to the launcher, the log flushed, without running
    destructors: a gloo group whose peer is gone can abort in its C++ teardown, which would
    replace `code` by SIGABRT."""
    report_exit(rank, code, why)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def read_peer_file(out: Path) -> Optional[dict]:
    """The peer id and multiaddrs a running peer wrote into `out` (None before it has)."""
    try:
        got = json.loads((out / PEER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) and isinstance(got.get("maddrs"), list) else None


# On a terminal: back to column 0 and clear the line, so that a log line (of any node) written
# while node 0's progress bar is drawn replaces the bar, which redraws below it at its next update,
# instead of being glued to the bar's end.
CLEAR_LINE = "\r\x1b[K"


def log_formatter(rank: int, terminal: bool, tag: Optional[str] = None) -> logging.Formatter:
    """The nodes' log format, tagged with the node (`tag`, default node<rank>); on a
    `terminal`, each line starts with `CLEAR_LINE`."""
    start = CLEAR_LINE if terminal else ""
    tag = f"node{rank}" if tag is None else tag
    return logging.Formatter(
        f"{start}%(asctime)s {tag} %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )


def setup_logging(rank: int, tag: Optional[str] = None) -> None:
    """Log lines tagged with the node (`tag`, default node<rank>); third-party advisories a user
    cannot act on silenced."""
    # peft asks transformers the deprecated `is_gradient_checkpointing` on every LoRA wrap.
    warnings.filterwarnings(
        "ignore", message=r".*is_gradient_checkpointing.* is deprecated", category=FutureWarning
    )
    handler = logging.StreamHandler()
    handler.setFormatter(log_formatter(rank, sys.stderr.isatty(), tag))
    logging.basicConfig(level=os.environ.get("FTIS_LOG_LEVEL", "INFO"), handlers=[handler])
