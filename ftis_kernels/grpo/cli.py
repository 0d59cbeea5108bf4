"""`ftis-grpo`: start a local swarm (it calls torchrun itself) or, under torchrun, run one node;
`ftis-grpo peer`: one peer of a swarm over hivemind, on any host.

    ftis-grpo --preset demo --nodes 3 --out runs/demo
    ftis-grpo --preset demo --out runs/demo --resume --rounds 80
    ftis-grpo --config swarm.yaml --loss nois --set nodes.1.hostile=random_tokens
    ftis-grpo --preset demo --transport hivemind --nodes 3 --out runs/swarm   (peer processes)
    ftis-grpo peer --config node.yaml --out runs/b --initial-peers /ip4/10.0.0.1/tcp/31337/p2p/Qm...

Run by hand with torchrun (for example across hosts) the same command runs one node: the CLI
sees torchrun's environment (RANK, WORLD_SIZE, ...) and does not launch again; rank 0 then checks
and locks `--out` as the launcher does (`run_folder.hold_out`).

Every configuration or usage error is found here, before any process starts, and printed as one
line `ftis-grpo: <key>: expected <what>, got <value>` with exit code `EXIT_USAGE`.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, Optional

from ftis_kernels.grpo.config import (
    COLLABS,
    LOSSES,
    PRESET_HELP,
    PRESETS,
    TRANSPORTS,
    ConfigError,
    RunConfig,
    build_config,
    render_config,
    render_keys,
    show,
)
from ftis_kernels.grpo.process import EXIT_USAGE
from ftis_kernels.options import KL_ESTIMATORS, option_default

_DEFAULTS = RunConfig()
# The flags that set a config key of the same name (`dest`), after the preset and --config.
_KEY_FLAGS = (
    "out",
    "rounds",
    "collab",
    "loss",
    "is_cap",
    "kl_threshold",
    "kl_estimator",
    "epsilon",
    "seed",
    "resume",
    "timeout_s",
    "threads",
    "progress",
    "transport",
)

EPILOG = """presets:
{presets}

examples:
  ftis-grpo --preset demo --nodes 3 --out runs/demo        the README's main job
  ftis-grpo --preset demo --out runs/demo --resume --rounds 100
  ftis-grpo --preset smoke --loss nois --set nodes.1.hostile=random_tokens --out runs/bad
  ftis-grpo --preset demo --print-config > swarm.yaml      edit it, then: --config swarm.yaml
  ftis-grpo export runs/demo --node 1 --to models/small    a node's checkpoint as a model folder
  ftis-grpo report runs/demo --baseline runs/on-policy     curves.png with a baseline run
  ftis-grpo peer --config node.yaml --out runs/a           one peer of a swarm over hivemind
  ftis-grpo report runs/a runs/b --to runs/ab              several peers' runs merged

Configuration layers, later wins: defaults < --preset < --config FILE < flags < --set.
Every key, its allowed values and default: ftis-grpo --list-keys."""


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors as one line in the house format, exit code EXIT_USAGE."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"ftis-grpo: {_usage_line(message)}\n")


def _usage_line(message: str) -> str:
    """argparse's message ('argument --rounds: invalid int value: 'x'') as `key: expected ...`."""
    m = re.fullmatch(r"argument (\S+?)(?:/\S+)?: (.*)", message, re.S)
    if m is None:
        m2 = re.fullmatch(r"unrecognized arguments: (.*)", message)
        if m2:
            return f"{m2.group(1)}: expected a flag of ftis-grpo --help, got an unknown argument"
        return f"{message} (see ftis-grpo --help)"
    flag, what = m.groups()
    kinds = {"int": "an integer", "float": "a number"}
    typed = re.fullmatch(r"invalid (\w+) value: (.*)", what)
    if typed:
        return f"{flag}: expected {kinds.get(typed.group(1), typed.group(1))}, got {typed.group(2)}"
    choice = re.fullmatch(r"invalid choice: (.*?) \(choose from (.*)\)", what)
    if choice:
        return f"{flag}: expected one of {choice.group(2)}, got {choice.group(1)}"
    if what.startswith("expected"):
        return f"{flag}: {what.rstrip('.')}, got none"
    return f"{flag}: {what}"


def _default(key: str) -> str:
    value = getattr(_DEFAULTS, key)
    if value is None and key in ("is_cap", "kl_threshold", "kl_estimator", "epsilon"):
        return f"the loss preset's; F-TIS {show(option_default(key))}"
    return value if isinstance(value, str) else show(value)


def build_parser() -> argparse.ArgumentParser:
    """The command line: every flag with its help and default, the presets in the epilog."""
    p = _Parser(
        prog="ftis-grpo",
        description="Collaborative GRPO with F-TIS across heterogeneous nodes "
        "(torch.distributed).\nStarts one process per node on this machine through "
        "torchrun.",
        epilog=EPILOG.format(
            presets="\n".join(f"  {name:<7} {PRESET_HELP[name]}" for name in PRESETS)
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run = p.add_argument_group("the run")
    run.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="a built-in configuration (listed below; default: none, the defaults)",
    )
    run.add_argument(
        "--config",
        metavar="FILE",
        help="a YAML or TOML file of config keys, applied over the preset",
    )
    run.add_argument(
        "--nodes",
        type=int,
        metavar="N",
        help="number of nodes; more than the config lists repeats its node specs "
        "with new init seeds (default: the config's node list)",
    )
    run.add_argument(
        "--out",
        metavar="DIR",
        help="output folder: metrics.jsonl, curves.png, summary.txt, config.yaml, "
        f"ckpt/, tokenizer/ (default {_default('out')})",
    )
    run.add_argument(
        "--rounds",
        type=int,
        metavar="N",
        help=f"GRPO rounds to run in all (default {_default('rounds')})",
    )
    run.add_argument(
        "--seed",
        type=int,
        help=f"moves the problems and every node's initial weights (default {_default('seed')})",
    )
    run.add_argument(
        "--model",
        action="append",
        metavar="PATH",
        help="a local Hugging Face checkpoint for every node, or once per node "
        "(default: the preset's small Qwen2 models)",
    )
    run.add_argument(
        "--resume",
        action="store_true",
        default=None,
        help="continue the run in --out from its last complete checkpoint",
    )
    run.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run already in --out (without it, a fresh run refuses "
        "a folder that holds one)",
    )
    loss = p.add_argument_group("the loss")
    loss.add_argument(
        "--loss",
        choices=LOSSES,
        help=f"loss mode; on-policy = isolated nodes, no exchange (default {_default('loss')})",
    )
    loss.add_argument(
        "--collab",
        choices=COLLABS,
        help=f"vertical: each node its own prompts; horizontal: every prompt's "
        f"group split over the nodes (default {_default('collab')})",
    )
    loss.add_argument(
        "--is-cap",
        type=float,
        dest="is_cap",
        metavar="C",
        help=f"truncation of the IS weight (default {_default('is_cap')})",
    )
    loss.add_argument(
        "--kl-threshold",
        type=float,
        dest="kl_threshold",
        metavar="G",
        help=f"the filter's KL threshold g (default {_default('kl_threshold')})",
    )
    loss.add_argument(
        "--kl-estimator",
        choices=KL_ESTIMATORS,
        dest="kl_estimator",
        help=f"the filter's KL estimator (default {_default('kl_estimator')})",
    )
    loss.add_argument(
        "--epsilon", type=float, help=f"PPO clip range, in (0, 1) (default {_default('epsilon')})"
    )
    proc = p.add_argument_group("processes and output")
    proc.add_argument(
        "--transport",
        choices=TRANSPORTS,
        help="what moves the samples: torch (one torchrun world, lockstep) or hivemind (one "
        "`ftis-grpo peer` process per node over loopback, no barrier; the swarm extra) "
        f"(default {_default('transport')})",
    )
    proc.add_argument(
        "--timeout",
        type=float,
        dest="timeout_s",
        metavar="SECONDS",
        help=f"how long to wait for a silent peer before stopping "
        f"(default {_default('timeout_s')})",
    )
    proc.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch and OpenMP threads per node (default: cores / nodes)",
    )
    proc.add_argument(
        "--no-progress",
        action="store_false",
        dest="progress",
        default=None,
        help="no progress bar (default: a bar over the rounds)",
    )
    keys = p.add_argument_group("any config key")
    keys.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, value in YAML, e.g. nodes.0.lr=1e-3 or "
        "verify_rewards=true (repeatable; applied last)",
    )
    keys.add_argument(
        "--list-keys",
        action="store_true",
        help="list every config key with its allowed values and default, and exit",
    )
    keys.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective configuration (a valid --config file) and exit",
    )
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _flags_setting(args: argparse.Namespace) -> dict[str, str]:
    """Config key -> the flag that set it on this command line (a later --set of the key wins):
    an error in a value the user gave as `--rounds -3` names `--rounds`, as argparse's own
    errors (`--rounds x`) do."""
    set_by_set = {assignment.split("=", 1)[0] for assignment in args.set}
    return {
        action.dest: action.option_strings[0]
        for action in build_parser()._actions
        if action.dest in _KEY_FLAGS
        and getattr(args, action.dest) is not None
        and action.dest not in set_by_set
    }


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The run's configuration from the command line; ConfigError naming the flag or key of each
    value refused."""
    overrides: dict[str, Any] = {k: getattr(args, k) for k in _KEY_FLAGS}
    try:
        cfg = build_config(args.preset, args.config, overrides, tuple(args.set), args.nodes)
    except ConfigError as exc:
        raise exc.renamed(_flags_setting(args)) from None
    if args.model:
        if len(args.model) not in (1, len(cfg.nodes)):
            raise ConfigError(
                (
                    "--model",
                    f"one path, or one per node ({len(cfg.nodes)})",
                    f"{len(args.model)} paths",
                )
            )
        set_by_set = _set_models(args, len(cfg.nodes))
        for i, spec in enumerate(cfg.nodes):
            if i not in set_by_set:  # --set comes last: its model stays
                spec.model = args.model[i % len(args.model)]
    return cfg


def _set_models(args: argparse.Namespace, n_nodes: int) -> set[int]:
    """The nodes whose model a --set gives (`nodes`, `nodes.<i>` or `nodes.<i>.model`)."""
    keys = {assignment.split("=", 1)[0] for assignment in args.set}
    if "nodes" in keys:
        return set(range(n_nodes))
    return {i for i in range(n_nodes) if {f"nodes.{i}", f"nodes.{i}.model"} & keys}


def _layers(args: argparse.Namespace) -> str:
    parts = ["defaults"]
    if args.preset:
        parts.append(f"--preset {args.preset}")
    if args.config:
        parts.append(f"--config {args.config}")
    return " < ".join(parts + ["flags"])


def build_export_parser() -> argparse.ArgumentParser:
    """`ftis-grpo export`: a node's checkpoint as a Hugging Face model folder."""
    p = _Parser(
        prog="ftis-grpo export",
        description="Write one node's checkpoint of a run as a Hugging Face model folder "
        "(config.json, model.safetensors, tokenizer; a LoRA adapter merged into its base), "
        "which --model, AutoModelForCausalLM and AutoTokenizer load.",
    )
    p.add_argument("run", metavar="RUN", help="the run's output folder (its --out)")
    p.add_argument("--node", type=int, default=0, metavar="I", help="the node (default 0)")
    p.add_argument(
        "--round",
        type=int,
        metavar="R",
        help="the checkpointed round (default: the run's latest complete checkpoint)",
    )
    p.add_argument("--to", required=True, metavar="DIR", help="the model folder to write")
    return p


def export_main(argv: Sequence[str]) -> int:
    """`ftis-grpo export RUN [--node I] [--round R] --to DIR`; ConfigError lines exit 2."""
    args = build_export_parser().parse_args(argv)
    from pathlib import Path

    from ftis_kernels.grpo.export import export

    try:
        folder = export(Path(args.run), args.node, args.round, Path(args.to))
    except ConfigError as exc:
        for line in exc.lines:
            print(f"ftis-grpo export: {line}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{args.to}: node {args.node}'s model from {folder} (use it with --model {args.to})")
    return 0


def report_main(argv: Sequence[str]) -> int:
    """`ftis-grpo report RUN [RUN ...] [--baseline OTHER] [--to DIR]`: curves.png again, with a
    baseline run; several RUNs (the peers of a swarm, each its own folder) merged into one."""
    p = _Parser(
        prog="ftis-grpo report",
        description="Draw a run's curves.png again from its metrics.jsonl, with another run of "
        "the same nodes (for example --loss on-policy) dashed beside it as the baseline. "
        "Several RUNs (the peers of a swarm, each with its own --out) are merged: their nodes "
        "in one curves.png and summary.txt, written into --to.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="a run's output folder (its --out)")
    p.add_argument("--baseline", metavar="OTHER", help="the baseline run's output folder")
    p.add_argument(
        "--to",
        metavar="DIR",
        help="where the merged curves.png and summary.txt of several RUNs go (default: their "
        "common parent folder)",
    )
    args = p.parse_args(argv)
    import os
    from pathlib import Path

    from ftis_kernels.grpo.report import merge, redraw
    from ftis_kernels.grpo.run_folder import check_report_to, mark_report

    runs = [Path(r) for r in args.runs]
    try:
        if len(runs) == 1 and args.to is None:
            path = redraw(runs[0], Path(args.baseline) if args.baseline else None)
        else:
            to = Path(args.to or os.path.commonpath([r.resolve() for r in runs]))
            check_report_to(to)
            path, summary = merge(runs, to, Path(args.baseline) if args.baseline else None)
            mark_report(to)
            print(summary)
    except ConfigError as exc:
        for line in exc.lines:
            print(f"ftis-grpo report: {line}", file=sys.stderr)
        return EXIT_USAGE
    except (OSError, ValueError) as exc:
        # The baseline's error names its metrics file (a RUN's path may start with its folder's).
        about = str(Path(args.baseline) / "metrics.jsonl") if args.baseline else None
        where = "--baseline" if about is not None and about in str(exc) else "RUN"
        what = "the output folder of a run (with metrics.jsonl)"
        print(f"ftis-grpo report: {where}: expected {what}, got {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"curves: {path}")
    return 0


def build_peer_parser() -> argparse.ArgumentParser:
    """`ftis-grpo peer`: one peer of a swarm over hivemind, in this process."""
    p = _Parser(
        prog="ftis-grpo peer",
        description="Run one peer of a swarm without lockstep, on this host: its samples go "
        "to the others over hivemind (pip install 'ftis-kernels[swarm]'). The first "
        "peer logs the multiaddrs the others pass to --initial-peers. Every peer writes its "
        "own metrics.jsonl, curves.png and summary.txt into its --out; ftis-grpo report "
        "DIR... merges several.",
    )
    p.add_argument(
        "--config",
        required=True,
        metavar="FILE",
        help="the peer's run configuration (YAML or TOML): any config key, and `nodes` with "
        "one spec, this peer's (transport: hivemind is implied)",
    )
    p.add_argument("--out", metavar="DIR", help="the peer's output folder (default: the config's)")
    p.add_argument("--rounds", type=int, metavar="N", help="rounds to run in all")
    p.add_argument(
        "--initial-peers",
        nargs="+",
        default=[],
        metavar="MADDR",
        help="multiaddrs of running peers to join by (default: none, this peer starts a swarm)",
    )
    p.add_argument(
        "--host-maddr",
        nargs="+",
        default=[],
        metavar="MADDR",
        help="multiaddrs to listen on (default /ip4/0.0.0.0/tcp/0: every interface, any port)",
    )
    p.add_argument(
        "--trusted-peers",
        nargs="+",
        metavar="ID",
        help="a closed swarm: take samples only from these peer ids (default: any peer)",
    )
    p.add_argument(
        "--swarm-key",
        default="ftis-grpo",
        metavar="NAME",
        help="the name the swarm's records are kept under in the DHT (default ftis-grpo)",
    )
    p.add_argument(
        "--resume", action="store_true", default=None, help="continue from --out's checkpoint"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace the run already in --out (its key stays)"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, value in YAML (repeatable; applied last)",
    )
    return p


def peer_main(argv: Sequence[str]) -> int:
    """`ftis-grpo peer --config FILE ...`; every usage error, and an unreachable or malformed
    multiaddr, is one line naming the flag or key, exit code 2."""
    args = build_peer_parser().parse_args(argv)
    if not args.swarm_key:
        return _usage_lines("ftis-grpo peer", ConfigError("--swarm-key: must not be empty"))
    overrides = {"out": args.out, "rounds": args.rounds, "resume": args.resume}
    try:
        cfg = build_config(
            None, args.config, {**overrides, "transport": "hivemind"}, tuple(args.set)
        )
    except ConfigError as exc:
        flags = {k: f"--{k}" for k, v in overrides.items() if v is not None}
        return _usage_lines("ftis-grpo peer", exc.renamed(flags))
    from ftis_kernels.grpo.peer import RECORD_TTL_S, Stopped, run_peer, stop_on_signals
    from ftis_kernels.grpo.process import setup_logging

    setup_logging(0, tag=cfg.node(0).name)
    stop_on_signals()

    def connect(out, fingerprints, max_payload_bytes):
        _require_swarm()
        from ftis_kernels.grpo.swarm import HivemindTransport, SwarmStartError

        try:
            return HivemindTransport(
                out=out,
                swarm_key=args.swarm_key,
                fingerprints=fingerprints,
                initial_peers=list(args.initial_peers),
                host_maddrs=list(args.host_maddr) or ["/ip4/0.0.0.0/tcp/0"],
                trusted_peers=args.trusted_peers,
                max_payload_bytes=max_payload_bytes,
                record_ttl_s=RECORD_TTL_S,
                start_timeout_s=cfg.timeout_s,
            )
        except SwarmStartError as exc:
            raise ConfigError(str(exc)) from None  # "--flag: what is wrong"

    try:
        return run_peer(cfg, connect, overwrite=args.overwrite)
    except ConfigError as exc:
        return _usage_lines("ftis-grpo peer", exc)
    except Stopped as exc:  # before the peer joined
        return 128 + exc.signum


def _require_swarm() -> None:
    """ConfigError naming `transport` when the swarm extra (hivemind) is not installed."""
    from ftis_kernels._extras import MissingExtraError, require

    try:
        require("swarm", "'hivemind'")
    except MissingExtraError as exc:
        raise ConfigError(f"transport: {exc}") from None


def _usage_lines(prog: str, exc: ConfigError) -> int:
    """Print each line of `exc` as `prog: line`; returns EXIT_USAGE."""
    for line in exc.lines:
        print(f"{prog}: {line}", file=sys.stderr)
    return EXIT_USAGE


def _model_flag(args: argparse.Namespace, cfg: RunConfig) -> dict[str, str]:
    """nodes.<i>.model -> "--model" for the nodes whose model --model set."""
    if not args.model:
        return {}
    set_by_set = _set_models(args, len(cfg.nodes))
    return {f"nodes.{i}.model": "--model" for i in range(len(cfg.nodes)) if i not in set_by_set}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["export"]:
        return export_main(argv[1:])
    if argv[:1] == ["report"]:
        return report_main(argv[1:])
    if argv[:1] == ["peer"]:
        return peer_main(argv[1:])
    args = parse_args(argv)
    if args.list_keys:
        print(render_keys())
        return 0
    worker = "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        cfg = config_from_args(args)
        if worker:
            from ftis_kernels.grpo.worker import run_worker

            return run_worker(cfg, overwrite=args.overwrite)
        try:
            cfg.validate(len(cfg.nodes))
        except ConfigError as exc:
            raise exc.renamed({**_flags_setting(args), **_model_flag(args, cfg)}) from None
        if args.print_config:
            print(render_config(cfg, _layers(args)))
            return 0
        logging.basicConfig(
            level=logging.INFO,
            datefmt="%H:%M:%S",
            format="%(asctime)s launcher %(levelname)s: %(message)s",
        )
        from ftis_kernels.grpo.launch import launch, launch_peers

        if cfg.transport == "hivemind":
            _require_swarm()
            return launch_peers(cfg, overwrite=args.overwrite, argv=argv)
        return launch(argv, cfg, overwrite=args.overwrite)
    except ConfigError as exc:
        for line in exc.lines:
            print(f"ftis-grpo: {line}", file=sys.stderr)
        return EXIT_USAGE
