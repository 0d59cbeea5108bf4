"""Run configuration: dataclasses, presets, YAML/TOML files and `key=value` overrides.

Layers, later wins: the dataclass defaults, `--preset`, `--config FILE`, then the command-line
flags (`--rounds 8`, `--set nodes.1.hostile=random_tokens`, ...).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import yaml

from ftis_kernels.options import VARIANTS, FTISOptions

COLLABS = ("vertical", "horizontal")
LOSSES = ("on-policy",) + tuple(VARIANTS)
# Fields that may change between a run and its --resume.
RESUMABLE = ("rounds", "out", "resume", "timeout_s", "progress", "threads", "eval_every", "ckpt_every",
             "warmup_cache", "max_skipped_steps")
# Seed strides: `--seed s` moves every node's init seed by s * RUN_SEED_STRIDE; `--nodes n` beyond
# the config's list repeats its specs, the k-th repetition with init seeds k * REPEAT_SEED_STRIDE
# further, so no two nodes share initial weights.
RUN_SEED_STRIDE = 1000
REPEAT_SEED_STRIDE = 100


@dataclass
class NodeSpec:
    """One node: its model (size, initial weights, trainable parameters) and its behaviour."""

    name: str = "node"
    arch: str = "tiny"  # a preset architecture (models.ARCHS), used when `model` is None
    model: Optional[str] = None  # local Hugging Face checkpoint folder instead of a preset
    init_seed: int = 0  # initial weights and warm-up draw from init_seed + RUN_SEED_STRIDE * seed
    warmup_steps: int = 200  # supervised warm-up of a preset model: its "expertise"
    warmup_ops: list[str] = field(default_factory=lambda: ["add", "sub"])
    warmup_lr: float = 3e-3
    warmup_format: float = 1.0  # share of warm-up answers in GSM8K's '#### x' format
    lora: bool = False  # train a peft LoRA adapter instead of every weight
    lora_r: int = 8
    lora_alpha: float = 16.0
    lr: float = 1e-4
    hostile: Optional[str] = None  # None | forged_logprobs | flipped_rewards | random_tokens
    fail_at_round: Optional[int] = None  # fault injection: the node exits at this round's start


@dataclass
class RunConfig:
    """A whole swarm run; `nodes[i % len(nodes)]` is the spec of node i."""

    out: str = "runs/grpo"
    seed: int = 0
    rounds: int = 20
    collab: str = "vertical"  # vertical | horizontal
    loss: str = "f-tis"  # on-policy | nois | vis | tis | f-nois | f-vis | f-tis
    is_cap: float = 2.0  # C
    kl_threshold: float = 50.0  # g
    kl_estimator: str = "k3"
    epsilon: float = 0.2
    loss_type: str = "grpo"
    prompts_per_node: int = 4  # vertical: own prompts per round; horizontal: shared prompts
    group_size: int = 8  # G
    temperature: float = 1.0
    max_new_tokens: int = 32
    micro_batch: int = 32
    grad_clip: float = 1.0
    eval_size: int = 64
    eval_every: int = 1
    eval_max_new_tokens: int = 48
    ckpt_every: int = 5
    # A node's optimizer step with a non-finite loss or gradient is skipped; this many in a row
    # (counted from the run's start or its --resume) stop the swarm: the training diverges.
    max_skipped_steps: int = 3
    warmup_batch: int = 32
    task: str = "arith"  # arith | jsonl
    data: dict[str, str] = field(default_factory=dict)  # jsonl: {"train":..., "test":..., "ood":...}
    verify_rewards: bool = False  # rescore each received completion; drop it if its reward lies
    warmup_cache: Optional[str] = None  # folder of warmed-up weights, reused by identical warm-ups
    timeout_s: float = 120.0  # collective / barrier timeout: how long to wait for a silent peer
    threads: int = 0  # torch threads per node; 0 = cores / nodes
    progress: bool = True
    resume: bool = False
    nodes: list[NodeSpec] = field(default_factory=lambda: [NodeSpec()])

    def node(self, rank: int) -> NodeSpec:
        return self.nodes[rank % len(self.nodes)]

    def init_seed(self, rank: int) -> int:
        """Seed of node `rank`'s initial weights, warm-up data and LoRA init: `--seed` moves all."""
        return self.node(rank).init_seed + RUN_SEED_STRIDE * self.seed

    def ftis_options(self) -> FTISOptions:
        """The loss options of this run (on-policy = plain GRPO: no IS weight, no filter)."""
        common = dict(is_cap=self.is_cap, kl_threshold=self.kl_threshold,
                      kl_estimator=self.kl_estimator, epsilon=self.epsilon,
                      temperature=self.temperature, loss_type=self.loss_type)
        if self.loss == "on-policy":
            return FTISOptions(is_mode="none", filter=None, **common)
        return FTISOptions.for_variant(self.loss, **common)

    def validate(self, world: int) -> None:
        if self.collab not in COLLABS:
            raise ValueError(f"collab: expected one of {COLLABS}, got {self.collab!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss: expected one of {LOSSES}, got {self.loss!r}")
        if self.group_size < 2:
            raise ValueError(f"group_size: expected >= 2, got {self.group_size}")
        if self.collab == "horizontal" and self.loss != "on-policy":
            if self.group_size % world:
                raise ValueError(f"group_size: horizontal mode splits each group over the "
                                 f"{world} nodes, got {self.group_size} (not a multiple)")
        if self.max_skipped_steps < 1:
            raise ValueError(f"max_skipped_steps: expected >= 1, got {self.max_skipped_steps}")
        if self.task not in ("arith", "jsonl"):
            raise ValueError(f"task: expected 'arith' or 'jsonl', got {self.task!r}")
        self.ftis_options()

    def fingerprint(self) -> str:
        """Hash of everything a resumed run must share with the run it continues."""
        d = dataclasses.asdict(self)
        for key in RESUMABLE:
            d.pop(key)
        for node in d["nodes"]:
            node.pop("fail_at_round")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 floats: `3e-4` and `1E5` are numbers, not strings
    (YAML 1.1, which PyYAML follows, demands a dot and a signed exponent: `3.0e-4`)."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                 |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                 |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                 |[-+]?\.(?:inf|Inf|INF)
                 |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_YamlLoader)


PRESETS: dict[str, dict[str, Any]] = {
    # End to end in well under 2 minutes on 2 CPU cores.
    "smoke": dict(
        rounds=4, prompts_per_node=2, group_size=4, max_new_tokens=24, eval_size=16,
        eval_max_new_tokens=24, ckpt_every=2, micro_batch=16,
        nodes=[
            dict(name="tiny-full", arch="tiny", init_seed=0, warmup_steps=100, warmup_format=0.5,
                 lr=3e-4),
            dict(name="tiny-lora", arch="tiny", init_seed=1, warmup_steps=80, warmup_format=0.5,
                 lora=True, lr=1e-3),
        ],
    ),
    # The README's main job: three heterogeneous nodes, a few minutes on CPU. Their warm-ups
    # differ in length, operations and how often they use GSM8K's '#### x' answer format.
    "demo": dict(
        rounds=80, prompts_per_node=8, group_size=8, max_new_tokens=28, eval_size=64,
        eval_every=5, ckpt_every=10, micro_batch=64, temperature=0.8,
        nodes=[
            dict(name="tiny-add", arch="tiny", init_seed=0, warmup_steps=500,
                 warmup_ops=["add"], warmup_format=0.4, lr=3e-4),
            dict(name="small", arch="small", init_seed=1, warmup_steps=300, warmup_format=0.3,
                 lr=2e-4),
            dict(name="tiny-lora", arch="tiny", init_seed=2, warmup_steps=500,
                 warmup_format=0.5, lora=True, lr=1e-3),
        ],
    ),
}


def _from_dict(d: dict[str, Any]) -> RunConfig:
    known = {f.name for f in fields(RunConfig)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"config: unknown keys {sorted(unknown)}")
    d = dict(d)
    node_keys = {f.name for f in fields(NodeSpec)}
    nodes = []
    for i, n in enumerate(d.pop("nodes", [{}])):
        bad = set(n) - node_keys
        if bad:
            raise ValueError(f"config: unknown keys {sorted(bad)} in nodes[{i}]")
        nodes.append(NodeSpec(**n))
    return RunConfig(nodes=nodes, **d)


def load_file(path: str) -> dict[str, Any]:
    """A YAML (.yaml/.yml) or TOML (.toml) config file as a dict."""
    text = Path(path).read_text(encoding="utf-8")
    if path.endswith(".toml"):
        try:
            import tomllib
        except ImportError:  # Python 3.10
            import tomli as tomllib

        return tomllib.loads(text)
    return _yaml(text) or {}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if key == "nodes":
            # A node list replaces the preset's; per-node edits go through --set nodes.i.key=...
            out[key] = copy.deepcopy(value)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_set(d: dict[str, Any], assignment: str) -> None:
    """Apply one 'a.b.c=value' override (value parsed as YAML) to the dict `d` in place."""
    if "=" not in assignment:
        raise ValueError(f"--set: expected key=value, got {assignment!r}")
    key, raw = assignment.split("=", 1)
    value = _yaml(raw)
    parts = key.split(".")
    target: Any = d
    for part in parts[:-1]:
        if isinstance(target, list):
            target = target[int(part)]
        else:
            target = target.setdefault(part, {})
    if isinstance(target, list):
        target[int(parts[-1])] = value
    else:
        target[parts[-1]] = value


def build_config(
    preset: Optional[str] = None,
    config_file: Optional[str] = None,
    overrides: Optional[dict[str, Any]] = None,
    sets: tuple[str, ...] = (),
    n_nodes: Optional[int] = None,
) -> RunConfig:
    """Defaults < preset < config file < flags (`overrides`, then each `--set`)."""
    d: dict[str, Any] = dataclasses.asdict(RunConfig())
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"preset: expected one of {tuple(PRESETS)}, got {preset!r}")
        d = _merge(d, PRESETS[preset])
    if config_file is not None:
        d = _merge(d, load_file(config_file))
    d = _merge(d, {k: v for k, v in (overrides or {}).items() if v is not None})
    if n_nodes is not None:
        base = d["nodes"]
        d["nodes"] = [dict(base[i % len(base)]) for i in range(n_nodes)]
        if n_nodes > len(base):
            for i, n in enumerate(d["nodes"]):
                n["name"] = f"{n.get('name', 'node')}-{i}"
                n["init_seed"] = n.get("init_seed", 0) + REPEAT_SEED_STRIDE * (i // len(base))
    for assignment in sets:
        apply_set(d, assignment)
    return _from_dict(d)


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
