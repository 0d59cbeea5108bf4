"""One node under torchrun (`ftis-grpo` run by the launcher, or torchrun by hand): the process
around a `node.Node`.

`run_worker` joins the process group, takes the node's share of the lock on `--out`
(`run_folder.hold_out`) and runs the node over the lockstep `TorchTransport`, whose collectives
turn a peer that dies or falls silent into a `SwarmError` naming the phase (after at most
`timeout_s`, the process group's timeout): the node then stops with a clear message and exit code
`EXIT_SWARM` instead of hanging. A node whose optimizer steps keep coming out non-finite
(`max_skipped_steps` in a row) stops the whole swarm with exit code `EXIT_DIVERGED`; any other
error of its own (out of memory, say), logged with its traceback, with `EXIT_ERROR`. Each way out
is reported to the launcher (`process.report_exit`), which names the cause, not its effects.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from ftis_kernels.grpo import checkpoint
from ftis_kernels.grpo.exchange import SwarmError, record_bytes
from ftis_kernels.grpo.node import Diverged, Node
from ftis_kernels.grpo.process import (
    EXIT_DIVERGED,
    EXIT_ERROR,
    EXIT_REFUSED,
    EXIT_SWARM,
    EXIT_WRITE,
    LAUNCHER_ENV,
    STOP_SIGNALS,
    leave,
    report_exit,
    set_threads,
    setup_logging,
    threads_per_node,
)
from ftis_kernels.grpo.run_folder import hold_out
from ftis_kernels.grpo.schema import RunConfig
from ftis_kernels.grpo.transport import TorchTransport

log = logging.getLogger("ftis_kernels.grpo")


def stop_on_signals(rank: int) -> None:
    """SIGINT, SIGTERM or SIGHUP (forwarded by the launcher) stop the node with one log line and
    exit code 128 + the signal's number. A checkpoint write it interrupts leaves a `.tmp` folder
    that the next --resume removes."""

    def stop(signum: int, _frame) -> None:
        why = f"node {rank}: stopped by {signal.Signals(signum).name}"
        log.warning("%s", why)
        leave(128 + signum, rank, why)

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)


def watch_parent(rank: int, poll_s: float = 0.5, grace_s: float = 1.0) -> None:
    """Stop the node within `poll_s` + `grace_s` seconds of its torchrun, or of the launcher that
    started torchrun, being gone (killed by SIGKILL, say), with one log line and exit code
    128 + SIGHUP: the lock on --out it holds is then released, and no orphan keeps writing into a
    folder another run may take. The grace lets a stop signal delivered with the parent's end
    (the launcher stopping the swarm signals the nodes, then kills torchrun) be handled first by
    the main thread, so that the node reports that signal, not its torchrun's end."""
    torchrun = os.getppid()
    launcher_pid = os.environ.get(LAUNCHER_ENV)
    try:
        launcher = psutil.Process(int(launcher_pid)) if launcher_pid else None
    except (ValueError, psutil.NoSuchProcess):
        log.error("node %d: its launcher (PID %s) is gone; stopping", rank, launcher_pid)
        leave(128 + signal.SIGHUP, rank, f"node {rank}: its launcher is gone")

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != torchrun:
                gone = f"its torchrun (PID {torchrun})"
            elif launcher is not None and not launcher.is_running():
                gone = f"its launcher (PID {launcher.pid})"
            else:
                continue
            time.sleep(grace_s)  # a stop signal's handler, if one is due, exits the node here
            log.error("node %d: %s is gone; stopping", rank, gone)
            leave(128 + signal.SIGHUP, rank, f"node {rank}: {gone} is gone")

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def run_worker(cfg: RunConfig, overwrite: bool = False) -> int:
    """Entry point of one torchrun worker; returns the process exit code. `overwrite`: torchrun by
    hand with --overwrite (under the launcher, the launcher has done it)."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    setup_logging(rank)
    stop_on_signals(rank)
    watch_parent(rank)
    cfg.validate(world)
    set_threads(threads_per_node(cfg.threads, local_world))
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    # The exchange moves CPU tensors, so gloo carries it even next to nccl on GPUs.
    backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.timeout_s))
    setup_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.setup_timeout_s))
    lock = hold_out(cfg, rank, overwrite, setup_group)
    transport = TorchTransport(
        names=[cfg.node(i).name for i in range(world)],
        max_payload_bytes=cfg.samples_per_round(world) * record_bytes(cfg.max_new_tokens),
        timeout_s=cfg.timeout_s,
        setup_group=setup_group,
    )
    try:
        Node(cfg, rank, world, device, transport).run()
        transport.barrier("the final barrier")
    except SwarmError as exc:
        resumable = checkpoint.latest_round(Path(cfg.out) / "ckpt") is not None
        why = (
            f"node {rank}: lost contact with the swarm {exc}. A peer node died or stopped "
            "answering; stopping."
        )
        log.error(
            "%s%s", why, " Continue from the last checkpoint with --resume." if resumable else ""
        )
        leave(EXIT_SWARM, rank, why)
    except Diverged as exc:  # rank 0 logged why
        report_exit(rank, EXIT_DIVERGED, str(exc))
        dist.destroy_process_group()
        return EXIT_DIVERGED
    except SystemExit as exc:  # a refusal to start: the same line on every node, said once,
        if not isinstance(exc.code, str):  # or this node's own (torchrun by hand shows no other)
            raise
        if rank == 0 or exc.code.startswith(f"node {rank}:"):
            log.error("%s", exc.code)
        leave(EXIT_REFUSED, rank, exc.code)
    except OSError as exc:  # a full disk, a folder gone: the path and the cause, in one line
        why = f"node {rank}: cannot write {exc.filename or 'its output'}: {exc.strerror or exc}"
        log.error("%s; stopping (the last complete checkpoint is kept)", why)
        leave(EXIT_WRITE, rank, why)
    except Exception as exc:  # anything else (out of memory, say): the cause, not its effect
        # Left to torchrun, this node's exit said nothing to the launcher, which then reported
        # its peers' lost contact (EXIT_SWARM) as the swarm's exit code and reason.
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        why = f"node {rank}: {type(exc).__name__}{': ' + first if first else ''}"
        log.exception("%s; stopping", why)
        leave(EXIT_ERROR, rank, why)
    finally:  # the ways out through leave() release it as the process ends
        lock.release()
    dist.destroy_process_group()
    return 0
