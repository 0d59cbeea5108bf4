"""`ftis-grpo`: start a local swarm (it calls torchrun itself) or, under torchrun, run one node.

    ftis-grpo --preset demo --nodes 3 --out runs/demo
    ftis-grpo --preset demo --out runs/demo --resume --rounds 80
    ftis-grpo --config swarm.yaml --loss nois --set nodes.1.hostile=random_tokens

Run by hand with torchrun (for example across hosts) the same command runs one node: the CLI
sees torchrun's environment (RANK, WORLD_SIZE, ...) and does not launch again.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from ftis_kernels.grpo.config import COLLABS, LOSSES, PRESETS, RunConfig, build_config

log = logging.getLogger("ftis_kernels.grpo")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="ftis-grpo",
        description="Collaborative GRPO with F-TIS across heterogeneous nodes (torch.distributed).",
    )
    p.add_argument("--preset", choices=sorted(PRESETS), help="a built-in configuration")
    p.add_argument("--config", help="a YAML or TOML file (applied over the preset)")
    p.add_argument("--nodes", type=int, help="number of nodes (default: the config's node list)")
    p.add_argument("--out", help="output folder (metrics.jsonl, curves.png, ckpt/, tokenizer/)")
    p.add_argument("--rounds", type=int)
    p.add_argument("--collab", choices=COLLABS)
    p.add_argument("--loss", choices=LOSSES, help="loss mode; on-policy = isolated, no exchange")
    p.add_argument("--is-cap", type=float, dest="is_cap", help="C, the IS weight truncation")
    p.add_argument("--kl-threshold", type=float, dest="kl_threshold", help="g, the filter's KL")
    p.add_argument("--kl-estimator", choices=("k1", "k2", "k3"), dest="kl_estimator")
    p.add_argument("--epsilon", type=float, help="PPO clip range")
    p.add_argument("--seed", type=int)
    p.add_argument("--model", action="append", metavar="PATH",
                   help="local Hugging Face checkpoint for every node, or once per node")
    p.add_argument("--resume", action="store_true", default=None,
                   help="continue from the last complete checkpoint in --out")
    p.add_argument("--timeout", type=float, dest="timeout_s",
                   help="seconds to wait for a silent peer before stopping (default 120)")
    p.add_argument("--threads", type=int, help="torch threads per node (default cores / nodes)")
    p.add_argument("--no-progress", action="store_false", dest="progress", default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. nodes.0.lr=1e-3 (repeatable)")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    overrides = {k: getattr(args, k) for k in (
        "out", "rounds", "collab", "loss", "is_cap", "kl_threshold", "kl_estimator", "epsilon",
        "seed", "resume", "timeout_s", "threads", "progress")}
    cfg = build_config(args.preset, args.config, overrides, tuple(args.set), args.nodes)
    if args.model:
        if len(args.model) not in (1, len(cfg.nodes)):
            raise SystemExit(f"--model: give one path or one per node ({len(cfg.nodes)}), "
                             f"got {len(args.model)}")
        for i, spec in enumerate(cfg.nodes):
            spec.model = args.model[i % len(args.model)]
    return cfg


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: Sequence[str], cfg: RunConfig) -> int:
    """Start the local swarm: torchrun with one process per node on 127.0.0.1."""
    n = len(cfg.nodes)
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=1", f"--nproc-per-node={n}", "--max-restarts=0",
        "--master-addr=127.0.0.1", f"--master-port={_free_port()}",
        "-m", "ftis_kernels.grpo", *argv,
    ]
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # a local swarm talks over loopback only
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    log.info("starting a local swarm of %d nodes: %s", n, " ".join(cmd[1:]))
    rc = subprocess.call(cmd, env=env)
    if rc != 0:
        log.error("the swarm stopped with exit code %d: a node failed (see its log lines above); "
                  "the others were stopped. Continue from the last complete checkpoint with: "
                  "ftis-grpo %s --resume", rc, " ".join(a for a in argv if a != "--resume"))
    return rc


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"ftis-grpo: {exc}") from None
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from ftis_kernels.grpo.node import run_worker

        return run_worker(cfg)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(levelname)s: %(message)s",
                        datefmt="%H:%M:%S")
    try:
        cfg.validate(len(cfg.nodes))
    except ValueError as exc:
        raise SystemExit(f"ftis-grpo: {exc}") from None
    return launch(argv, cfg)
