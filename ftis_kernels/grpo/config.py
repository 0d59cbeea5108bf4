"""Run configuration: dataclasses, presets, YAML/TOML files and `key=value` overrides.

Layers, later wins: the dataclass defaults, `--preset`, `--config FILE`, then the command-line
flags (`--rounds 8`, `--set nodes.1.hostile=random_tokens`, ...).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import re
import textwrap
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

import yaml
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

from ftis_kernels.grpo.exchange import HOSTILE_KINDS
from ftis_kernels.grpo.task import OPERATIONS, Difficulty
from ftis_kernels.options import OPTION_NAMES, FTISOptions, option_choices, option_help
from ftis_kernels.options import PRESETS as LOSS_PRESETS

COLLABS = ("vertical", "horizontal")
# What moves the exchange's bytes (`transport.Transport`): torchrun's lockstep world on this host,
# or hivemind's DHT, one peer per process on any host (`ftis-grpo peer`).
TRANSPORTS = ("torch", "hivemind")
# A run's loss: a preset of FTISOptions (README), or on-policy (isolated nodes, plain GRPO).
LOSSES = ("on-policy",) + tuple(LOSS_PRESETS)
# The loss options a run config names as its own keys (null: the preset's value); any other
# option of FTISOptions goes in `loss_options`.
RUN_LOSS_OPTIONS = ("is_cap", "kl_threshold", "kl_estimator", "epsilon", "loss_type")
TASKS = ("arith", "jsonl")
SPLITS = ("train", "test", "ood")  # the JSONL files a `task: jsonl` run reads
# Preset architectures (Qwen2 sizes) a node without `model` is built from.
ARCHS: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "small": dict(
        hidden_size=96,
        intermediate_size=288,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "base": dict(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}
# Fields that may change between a run and its --resume.
RESUMABLE = (
    "rounds",
    "out",
    "resume",
    "timeout_s",
    "progress",
    "threads",
    "eval_every",
    "ckpt_every",
    "warmup_cache",
    "setup_timeout_s",
    "max_skipped_steps",
    "pack",
    "pack_row_tokens",
    "max_staleness",
    "collect_timeout_s",
)
# What peers of a hivemind swarm must share to exchange samples (`RunConfig.swarm_fingerprint`):
# the problems and their rewards, the groups and the wire's bounds. The rest (the node spec, the
# loss, the defences, the schedule) is each peer's own.
SWARM_KEYS = (
    "seed",
    "collab",
    "prompts_per_node",
    "group_size",
    "max_new_tokens",
    "task",
    "format_credit",
    "task_steps",
    "task_operand_max",
    "ood_steps",
    "ood_operand_max",
    "ood_surface",
    "disjoint_splits",
)
# Seed strides: `--seed s` moves every node's init seed by s * RUN_SEED_STRIDE; `--nodes n` beyond
# the config's list repeats its specs, the k-th repetition with init seeds k * REPEAT_SEED_STRIDE
# further, so no two nodes share initial weights.
RUN_SEED_STRIDE = 1000
REPEAT_SEED_STRIDE = 100

# The schema's building blocks: every field's type and range is checked when a config is built.
Count = Annotated[int, Field(ge=1)]
Index = Annotated[int, Field(ge=0)]
Positive = Annotated[float, Field(gt=0)]
# Bounds where a larger value passes the schema only to crash every node at run time: a seed
# times the seed mixes overflows the generators' 64 bits, a timeout the process group's clock,
# and a learning rate above 1 writes non-finite weights into the first checkpoint.
MAX_SEED = 2**32 - 1
MAX_TIMEOUT_S = 1e6  # 11.6 days
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
Seconds = Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S)]
LearningRate = Annotated[float, Field(gt=0, le=1.0)]
# What an error message echoes of a value at most: a config's value can be megabytes.
MAX_ECHO = 200
Share = Annotated[float, Field(ge=0, le=1)]
Steps = Annotated[list[Count], Field(min_length=2, max_length=2)]
_SCHEMA = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def _loss_option(name: str) -> Any:
    """A run config key for the loss option `name`: its help from FTISOptions, default null (the
    loss preset's value)."""
    return Field(None, description=f"{option_help(name)} null: the loss preset's value")


class ConfigError(ValueError):
    """Configuration or usage errors, one line each: `key: expected ..., got value`."""

    def __init__(self, *problems: tuple[str, str, Any] | str):
        """Each problem is (key, what was expected, the value got), or a line already written
        in that form (the loss options' own errors)."""
        self.problems = problems
        self.lines = [
            p if isinstance(p, str) else f"{p[0]}: expected {p[1]}, got {_got(p[2])}"
            for p in problems
        ]
        super().__init__("\n".join(self.lines))

    def renamed(self, names: dict[str, str]) -> ConfigError:
        """The same problems, each key found in `names` shown as its value there (the flag that
        set the key on the command line), and each line once."""
        renamed = ConfigError(
            *(p if isinstance(p, str) else (names.get(p[0], p[0]), *p[1:]) for p in self.problems)
        )
        renamed.lines = list(dict.fromkeys(renamed.lines))  # one flag that set several keys
        renamed.args = ("\n".join(renamed.lines),)
        return renamed


def _got(value: Any) -> str:
    """The `got` part of a problem: a `Described` value whole, any other cut by `_echo`."""
    return show(value) if isinstance(value, Described) else _echo(show(value))


def _echo(text: str) -> str:
    """`text` as an error message echoes it: at most `MAX_ECHO` characters."""
    if len(text) <= MAX_ECHO:
        return text
    return f"{text[:MAX_ECHO]}... ({len(text)} characters)"


def show(value: Any) -> str:
    """A value as the user wrote it: strings quoted, None as null, the rest as YAML scalars."""
    if isinstance(value, Verbatim):
        return str(value)
    if isinstance(value, str):
        return repr(value)
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return str(value)


@dataclass(config=_SCHEMA)
class NodeSpec:
    """One node: its model (size, initial weights, trainable parameters) and its behaviour."""

    name: str = Field("node", min_length=1, description="the node's name in logs and metrics")
    arch: Literal[tuple(ARCHS)] = Field(
        "tiny", description="preset architecture, used when `model` is null"
    )
    model: Optional[str] = Field(
        None, description="local Hugging Face checkpoint folder instead of a preset"
    )
    init_seed: Seed = Field(
        0, description="initial weights and warm-up draw from init_seed + 1000 * seed"
    )
    warmup_steps: Index = Field(
        200, description="supervised warm-up steps of a preset model: its expertise"
    )
    warmup_ops: list[Literal[OPERATIONS]] = Field(
        default_factory=lambda: ["add", "sub"],
        min_length=1,
        description="operations the warm-up problems use",
    )
    warmup_lr: LearningRate = Field(3e-3, description="learning rate of the warm-up")
    warmup_format: Share = Field(
        1.0, description="share of warm-up answers in GSM8K's '#### x' format"
    )
    lora: bool = Field(False, description="train a peft LoRA adapter instead of every weight")
    lora_r: Count = Field(8, description="LoRA rank")
    lora_alpha: Positive = Field(16.0, description="LoRA scale numerator")
    lr: LearningRate = Field(1e-4, description="GRPO learning rate (AdamW)")
    kl_threshold: Optional[Annotated[float, Field(ge=0, allow_inf_nan=True)]] = Field(
        None, description="this node's g, its filter's KL threshold; null: the run's kl_threshold"
    )
    hostile: Optional[Literal[HOSTILE_KINDS]] = Field(
        None, description="what a hostile node sends its peers instead of its samples"
    )
    fail_at_round: Optional[Index] = Field(
        None, description="fault injection: the node exits at this round's start"
    )


@dataclass(config=_SCHEMA)
class RunConfig:
    """A whole swarm run; `nodes[i % len(nodes)]` is the spec of node i."""

    out: str = Field("runs/grpo", min_length=1, description="output folder")
    seed: Seed = Field(0, description="moves the task's problems and every node's init seed")
    rounds: Count = Field(20, description="GRPO rounds (generate, exchange, train)")
    collab: Literal[COLLABS] = Field(
        "vertical", description="vertical: own prompts per node; horizontal: shared groups"
    )
    loss: Literal[LOSSES] = Field(
        "f-tis",
        description="loss mode: a preset of FTISOptions (README's presets); on-policy = "
        "isolated nodes, no exchange",
    )
    is_cap: Optional[Annotated[float, Field(gt=0, allow_inf_nan=True)]] = _loss_option("is_cap")
    kl_threshold: Optional[Annotated[float, Field(ge=0, allow_inf_nan=True)]] = _loss_option(
        "kl_threshold"
    )
    kl_estimator: Optional[Literal[option_choices("kl_estimator")]] = _loss_option("kl_estimator")
    epsilon: Optional[Annotated[float, Field(gt=0, lt=1)]] = _loss_option("epsilon")
    loss_type: Optional[Literal[option_choices("loss_type")]] = _loss_option("loss_type")
    loss_options: dict[Literal[OPTION_NAMES], Any] = Field(
        default_factory=dict,
        description="any other option of FTISOptions by name, e.g. "
        "{ratio_level: sequence, entropy_coef: 0.01} (README's options table)",
    )
    prompts_per_node: Count = Field(
        4, description="vertical: own prompts per round; horizontal: shared prompts"
    )
    group_size: Annotated[int, Field(ge=2)] = Field(8, description="G, completions per prompt")
    temperature: Positive = Field(1.0, description="sampling temperature")
    max_new_tokens: Count = Field(32, description="completion length limit in training")
    micro_batch: Count = Field(32, description="sequences per forward pass")
    pack: bool = Field(
        True,
        description="train on packed micro-batches: whole prompt + completion sequences "
        "concatenated into rows of at most pack_row_tokens tokens, each attending to itself "
        "only (position ids restart); false: one padded row per sequence",
    )
    pack_row_tokens: Count = Field(
        128,
        description="longest packed row (a longer sequence gets a row of its own); attention "
        "on CPU costs the square of a row's length, masked or not",
    )
    grad_clip: Positive = Field(1.0, description="gradient norm clip")
    eval_size: Count = Field(64, description="problems per accuracy evaluation")
    eval_every: Count = Field(1, description="rounds between evaluations")
    eval_start: bool = Field(
        True,
        description="evaluate before the first round too; false: only every eval_every rounds "
        "after it and after the last (runs that share a start need its evaluation once)",
    )
    eval_max_new_tokens: Count = Field(48, description="completion length limit in evaluation")
    ckpt_every: Count = Field(5, description="rounds between checkpoints")
    max_skipped_steps: Count = Field(
        3,
        description="a node's non-finite optimizer steps are skipped; this many in a row (since "
        "the start or --resume) stop the swarm",
    )
    blame_peers: bool = Field(
        True,
        description="a non-finite step is retried without each peer's samples in turn: the first "
        "peer without whose samples it is finite is named and dropped for the round (drop kind "
        "'diverged'), and that step is taken; false: the step is skipped and counts against "
        "this node",
    )
    warmup_batch: Count = Field(32, description="sequences per warm-up step")
    task: Literal[TASKS] = Field(
        "arith", description="arith: the built-in generator; jsonl: the files in `data`"
    )
    data: dict[Literal[SPLITS], str] = Field(
        default_factory=dict, description="task jsonl: {train: PATH, test: PATH, ood: PATH}"
    )
    format_credit: Annotated[float, Field(ge=0, lt=1)] = Field(
        0.0,
        description="reward of a well-formed but wrong answer ('#### x'), a right one earns 1; "
        "0: the paper's binary reward",
    )
    task_steps: Steps = Field(
        default_factory=lambda: [1, 2],
        description="arith: [fewest, most] steps of a train or test problem",
    )
    task_operand_max: Count = Field(9, description="arith: largest operand of a train/test problem")
    ood_steps: Steps = Field(
        default_factory=lambda: [3, 4], description="arith: [fewest, most] steps of an ood problem"
    )
    ood_operand_max: Count = Field(19, description="arith: largest operand of an ood problem")
    ood_surface: bool = Field(
        False,
        description="arith: ood problems name people and things no train or test problem names "
        "(the same arithmetic in unseen words)",
    )
    disjoint_splits: bool = Field(
        False,
        description="arith: no test or ood problem computes a chain of steps that a train "
        "problem computes (a hash of the worked solution puts each chain in one side)",
    )
    verify_rewards: bool = Field(
        False, description="rescore each received completion; drop it if its reward lies"
    )
    sample_log: bool = Field(
        False,
        description="write received.jsonl: per received sample and node, its KL, advantage, "
        "whether the filter changed it, its truncated share, or why it was dropped",
    )
    warmup_cache: Optional[str] = Field(
        None, description="folder of warmed-up weights, reused by identical warm-ups"
    )
    timeout_s: Seconds = Field(
        120.0, description="seconds to wait for a silent peer before stopping"
    )
    setup_timeout_s: Seconds = Field(
        3600.0, description="seconds nodes wait for each other's warm-up or model load"
    )
    transport: Literal[TRANSPORTS] = Field(
        "torch",
        description="what moves the samples: torch: one torchrun world on this host, every "
        "round in lockstep (bit-reproducible); hivemind: one peer per process on any host over "
        "hivemind's DHT, no barrier (ftis-grpo peer; needs the swarm extra)",
    )
    max_staleness: Index = Field(
        1,
        description="hivemind: a peer trains on its peers' samples of rounds up to this many "
        "before its own, each once (0: its own round only); under torch every sample is of "
        "the round (staleness 0)",
    )
    collect_timeout_s: Seconds = Field(
        30.0,
        description="hivemind: how long a peer waits for its live peers' samples of its round "
        "before it trains without the missing ones",
    )
    threads: Index = Field(0, description="torch threads per node; 0 = cores / nodes")
    progress: bool = Field(True, description="a progress bar over the rounds")
    resume: bool = Field(False, description="continue from the last checkpoint in `out`")
    nodes: list[NodeSpec] = Field(
        default_factory=lambda: [NodeSpec()],
        min_length=1,
        description="the node specs; node i runs nodes[i % len(nodes)]",
    )

    def node(self, rank: int) -> NodeSpec:
        return self.nodes[rank % len(self.nodes)]

    def init_seed(self, rank: int) -> int:
        """Seed of node `rank`'s initial weights, warm-up data and LoRA init: `--seed` moves all."""
        return self.node(rank).init_seed + RUN_SEED_STRIDE * self.seed

    def ftis_options(self, rank: Optional[int] = None) -> FTISOptions:
        """The loss options of this run: the `loss` preset (on-policy = the "grpo" preset: no IS
        weight, no filter), the sampling temperature, the keys set here, then `loss_options`;
        for node `rank`, its own `kl_threshold` if it sets one."""
        explicit = {k: getattr(self, k) for k in RUN_LOSS_OPTIONS if getattr(self, k) is not None}
        preset = "grpo" if self.loss == "on-policy" else self.loss
        overrides = {"temperature": self.temperature, **explicit, **self.loss_options}
        if rank is not None and self.node(rank).kl_threshold is not None:
            overrides["kl_threshold"] = self.node(rank).kl_threshold
        return FTISOptions.preset(preset, **overrides)

    def difficulty(self) -> Difficulty:
        """The built-in task's difficulty (`task_steps`, `task_operand_max`, `ood_*`)."""
        return Difficulty(
            *self.task_steps,
            self.task_operand_max,
            *self.ood_steps,
            self.ood_operand_max,
            self.ood_surface,
            self.disjoint_splits,
        )

    def validate(self, world: int) -> None:
        """ConfigError unless the fields fit together for a swarm of `world` nodes (each field's
        own type and range is checked when the config is built)."""
        problems = []
        for key in ("task_steps", "ood_steps"):
            if getattr(self, key)[0] > getattr(self, key)[1]:
                problems.append((key, "[fewest, most] with fewest <= most", getattr(self, key)))
        horizontal = self.collab == "horizontal" and self.loss != "on-policy"
        if self.transport == "hivemind" and horizontal:
            problems.append(
                (
                    "collab",
                    "vertical under transport hivemind (horizontal mode needs every peer's "
                    "rewards of the same round: a lockstep exchange, torch only)",
                    self.collab,
                )
            )
        elif horizontal and self.group_size % world:
            problems.append(
                (
                    "group_size",
                    f"a multiple of the {world} nodes (horizontal mode "
                    "splits each group over the nodes)",
                    self.group_size,
                )
            )
        if self.task == "jsonl":
            for split in SPLITS:
                path = self.data.get(split)
                if path is None or not Path(path).is_file():
                    problems.append((f"data.{split}", "a JSONL file (task jsonl)", path))
            for i, spec in enumerate(self.nodes):
                if spec.model is None:
                    problems.append(
                        (
                            f"nodes.{i}.model",
                            "a model folder: preset models know "
                            "only the built-in task's vocabulary (task jsonl)",
                            None,
                        )
                    )
        problems += self.input_problems()
        if problems:
            raise ConfigError(*problems)
        try:
            options = self.ftis_options()
            for rank in range(len(self.nodes)):
                self.ftis_options(rank)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if options.beta > 0:
            raise ConfigError(
                ("loss_options.beta", "0 (the driver has no reference model)", options.beta)
            )

    def input_problems(self) -> list[tuple[str, str, Any]]:
        """What is wrong with the files the run reads, before any node starts: every line of
        each data file (`task: jsonl`; its path:line), and each node's model folder."""
        from ftis_kernels.grpo.export import model_folder_problem
        from ftis_kernels.grpo.task import load_jsonl

        problems: list[tuple[str, str, Any]] = []
        if self.task == "jsonl":
            for split, path in self.data.items():
                if Path(path).is_file():
                    try:
                        load_jsonl(path, split)
                    except (OSError, ValueError) as exc:
                        problems.append(
                            (
                                f"data.{split}",
                                'a JSONL file of {"question" (or "problem"), "answer"} objects',
                                Verbatim(str(exc)),
                            )
                        )
        for i, spec in enumerate(self.nodes):
            found = None if spec.model is None else model_folder_problem(spec.model)
            if found is not None:
                problems.append(
                    (
                        f"nodes.{i}.model",
                        "a Hugging Face model folder (config.json, weights, tokenizer)",
                        Described(found),
                    )
                )
        return problems

    def fingerprint(self) -> str:
        """Hash of everything a resumed run must share with the run it continues."""
        return hashlib.sha256(
            json.dumps(_shared(to_dict(self)), sort_keys=True).encode()
        ).hexdigest()[:16]

    def swarm_fingerprint(self) -> str:
        """Hash of what every node must share to exchange samples: under torch the whole run
        (`fingerprint`: every node runs one configuration); under hivemind, where each peer has
        its own node spec, loss and schedule, the `SWARM_KEYS` and the data files' contents."""
        if self.transport == "torch":
            return self.fingerprint()
        shared: dict[str, Any] = {k: getattr(self, k) for k in SWARM_KEYS}
        shared["data"] = {
            split: hashlib.sha256(Path(path).read_bytes()).hexdigest()
            for split, path in sorted(self.data.items())
        }
        return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]

    def samples_per_round(self, world: int) -> int:
        """How many samples a node sends each round in a swarm of `world` nodes."""
        if self.collab == "horizontal" and self.loss != "on-policy":
            return self.prompts_per_node * (self.group_size // world)
        return self.prompts_per_node * self.group_size


def _shared(d: dict[str, Any]) -> dict[str, Any]:
    """The part of a config dict a resumed run must share with the run it continues."""
    # The transport is not the run's state (and runs from before the key keep their fingerprint).
    d = {k: v for k, v in d.items() if k not in RESUMABLE and k != "transport"}
    d["nodes"] = [{k: v for k, v in n.items() if k != "fail_at_round"} for n in d["nodes"]]
    return d


def resume_changes(before: dict[str, Any], now: RunConfig) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) of each setting `now` changes that a --resume must keep."""
    old, new = _flatten(_shared(before)), _flatten(_shared(to_dict(now)))
    return [
        (k, old.get(k), new.get(k))
        for k in sorted(set(old) | set(new), key=_key_order)
        if old.get(k) != new.get(k)
    ]


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict) and d:
        items = d.items()
    elif isinstance(d, list) and d and all(isinstance(x, dict) for x in d):
        items = enumerate(d)
    else:
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _key_order(key: str) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split("."))


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 floats: `3e-4` and `1E5` are numbers, not strings
    (YAML 1.1, which PyYAML follows, demands a dot and a signed exponent: `3.0e-4`), and without
    aliases (`*name`): a config needs none, and a few hundred bytes of nested aliases expand to
    gigabytes."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None,
                None,
                "aliases (*name) are not allowed in a config",
                self.peek_event().start_mark,
            )
        return super().compose_node(parent, index)


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                 |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                 |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                 |[-+]?\.(?:inf|Inf|INF)
                 |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_YamlLoader)


# One line each for `ftis-grpo --help`.
PRESET_HELP = {
    "smoke": "2 tiny nodes (full fine-tune and LoRA), 4 rounds: the driver end to end in ~20 s",
    "demo": "3 heterogeneous nodes (tiny, small, LoRA), 80 rounds: the README's main job",
}
PRESETS: dict[str, dict[str, Any]] = {
    # End to end in well under 2 minutes on 2 CPU cores.
    "smoke": dict(
        rounds=4,
        prompts_per_node=2,
        group_size=4,
        max_new_tokens=24,
        eval_size=16,
        eval_max_new_tokens=24,
        ckpt_every=2,
        micro_batch=16,
        nodes=[
            dict(
                name="tiny-full",
                arch="tiny",
                init_seed=0,
                warmup_steps=100,
                warmup_format=0.5,
                lr=3e-4,
            ),
            dict(
                name="tiny-lora",
                arch="tiny",
                init_seed=1,
                warmup_steps=80,
                warmup_format=0.5,
                lora=True,
                lr=1e-3,
            ),
        ],
    ),
    # The README's main job: three heterogeneous nodes, a few minutes on CPU. Their warm-ups
    # differ in length, operations and how often they use GSM8K's '#### x' answer format.
    "demo": dict(
        rounds=80,
        prompts_per_node=8,
        group_size=8,
        max_new_tokens=28,
        eval_size=64,
        eval_every=5,
        ckpt_every=10,
        micro_batch=64,
        temperature=0.8,
        nodes=[
            dict(
                name="tiny-add",
                arch="tiny",
                init_seed=0,
                warmup_steps=500,
                warmup_ops=["add"],
                warmup_format=0.4,
                lr=3e-4,
            ),
            dict(
                name="small",
                arch="small",
                init_seed=1,
                warmup_steps=300,
                warmup_format=0.3,
                lr=2e-4,
            ),
            dict(
                name="tiny-lora",
                arch="tiny",
                init_seed=2,
                warmup_steps=500,
                warmup_format=0.5,
                lora=True,
                lr=1e-3,
            ),
        ],
    ),
}


def _from_dict(d: dict[str, Any]) -> RunConfig:
    try:
        return _ADAPTER.validate_python(d)
    except ValidationError as exc:
        raise ConfigError(*(_problem(e) for e in exc.errors())) from None


_ADAPTER = TypeAdapter(RunConfig)
_KNOWN = {f.name for f in fields(RunConfig)} | {f.name for f in fields(NodeSpec)}
# What the schema expected, by pydantic error type, where its own message is not the clearest.
_EXPECTED = {
    "int_parsing": "an integer",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "int_parsing_size": "an integer in range (ftis-grpo --list-keys gives the bounds)",
    "float_parsing": "a number",
    "float_type": "a number",
    "finite_number": "a finite number",
    "bool_parsing": "true or false",
    "bool_type": "true or false",
    "string_type": "a string",
    "dict_type": "a mapping",
    "list_type": "a list",
    "dataclass_type": "a mapping of node keys",
}


class Verbatim(str):
    """A `got` value shown as is (a description rather than the user's value)."""


class Described(Verbatim):
    """A description whose user values are already cut (`_echo`), shown whole: its advice (a
    command to run) must not be cut off."""


def _problem(err: dict[str, Any]) -> tuple[str, str, Any]:
    """(key, expected, got) of one pydantic error."""
    loc = [str(p) for p in err["loc"] if p != "[key]"]
    key, kind, ctx = ".".join(loc), err["type"], err.get("ctx") or {}
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        close = difflib.get_close_matches(loc[-1], sorted(_KNOWN), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        return (
            key,
            f"a known key ({hint}ftis-grpo --list-keys lists them)",
            Verbatim(f"{key}={show(err['input'])}"),
        )
    if kind in _EXPECTED:
        return key, _EXPECTED[kind], err["input"]
    bounds = {
        "greater_than": "> {gt}",
        "greater_than_equal": ">= {ge}",
        "less_than": "< {lt}",
        "less_than_equal": "<= {le}",
    }
    if kind in bounds:
        return key, "a value " + bounds[kind].format(**ctx), err["input"]
    if kind == "literal_error":
        return key, "one of " + ctx["expected"], err["input"]
    if kind == "too_short":
        return key, f"at least {ctx['min_length']} item(s)", err["input"]
    msg = err["msg"].removeprefix("Input should be ").removeprefix("Value error, ")
    return key, msg, err["input"]


def load_file(path: str) -> dict[str, Any]:
    """A YAML (.yaml/.yml) or TOML (.toml) config file as a dict; ConfigError naming the file if it
    cannot be read or parsed, or holds anything but a mapping of config keys."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            (
                "--config",
                "a readable YAML or TOML file",
                Verbatim(f"{path!r} ({getattr(exc, 'strerror', None) or exc})"),
            )
        ) from None
    try:
        if path.endswith(".toml"):
            try:
                import tomllib
            except ImportError:  # Python 3.10
                import tomli as tomllib

            content = tomllib.loads(text)
        else:
            content = _yaml(text)
    except Exception as exc:  # yaml.YAMLError, tomllib.TOMLDecodeError
        where = " ".join(str(exc).split())
        raise ConfigError(
            ("--config", "valid YAML or TOML", Verbatim(f"{path}: {where}"))
        ) from None
    if content is None:
        return {}
    if not isinstance(content, dict):
        raise ConfigError(
            (f"--config {path}", "a mapping of config keys (key: value lines)", content)
        )
    return content


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
        raise ConfigError(("--set", "KEY=VALUE", assignment))
    key, raw = assignment.split("=", 1)
    try:
        value = _yaml(raw)
    except yaml.YAMLError:
        raise ConfigError((key, "a YAML value", raw)) from None
    parts = key.split(".")
    target: Any = d
    for depth, part in enumerate(parts):
        here = ".".join(parts[: depth + 1])
        last = depth == len(parts) - 1
        if isinstance(target, list):
            if not (part.isdigit() and int(part) < len(target)):
                within = f"{len(target)} items of {'.'.join(parts[:depth])}"
                raise ConfigError(
                    (
                        here,
                        f"an index from 0 to {len(target) - 1} into the {within}",
                        Verbatim(part),
                    )
                )
            if last:
                target[int(part)] = value
            else:
                target = target[int(part)]
        elif isinstance(target, dict):
            if last:
                target[part] = value
            else:
                target = target.setdefault(part, {})
        else:
            raise ConfigError(
                (
                    here,
                    f"a key inside a mapping, but {'.'.join(parts[:depth])} is a single value",
                    Verbatim(assignment),
                )
            )


def build_config(
    preset: Optional[str] = None,
    config_file: Optional[str] = None,
    overrides: Optional[dict[str, Any]] = None,
    sets: tuple[str, ...] = (),
    n_nodes: Optional[int] = None,
) -> RunConfig:
    """Defaults < preset < config file < flags (`overrides`, then each `--set`); ConfigError
    naming the key of every value the schema refuses."""
    d: dict[str, Any] = to_dict(RunConfig())
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(("--preset", f"one of {', '.join(PRESETS)}", preset))
        d = _merge(d, PRESETS[preset])
    if config_file is not None:
        d = _merge(d, load_file(config_file))
    d = _merge(d, {k: v for k, v in (overrides or {}).items() if v is not None})
    if n_nodes is not None:
        if n_nodes < 1:
            raise ConfigError(("--nodes", "a number of nodes >= 1", n_nodes))
        base = d["nodes"]
        if isinstance(base, list) and base and all(isinstance(n, dict) for n in base):
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


# -- the schema, described for people (`--list-keys`, `--print-config`) ---------------------------
def _allowed(annotation: Any, metadata: list[Any] = ()) -> str:
    """What a field accepts, in words: 'integer >= 1', "'vertical' | 'horizontal'", ..."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _allowed(args[0], list(args[1:]) + list(metadata))
    if origin is Literal:
        text = " | ".join(show(a) for a in args)
    elif origin is Union:
        text = " | ".join(_allowed(a) for a in args)
    elif origin is list:
        text = f"list of ({_allowed(args[0])})"
    elif origin is dict:
        text = f"mapping ({_allowed(args[0])}) -> ({_allowed(args[1])})"
    else:
        text = {
            bool: "true | false",
            int: "integer",
            float: "number",
            str: "string",
            type(None): "null",
        }.get(annotation, getattr(annotation, "__name__", "mapping"))
    bounds = []
    for m in metadata:
        for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                bounds.append(f"{op} {getattr(m, attr)}")
        for item in getattr(m, "metadata", ()):  # a FieldInfo inside Annotated
            for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
                if getattr(item, attr, None) is not None:
                    bounds.append(f"{op} {getattr(item, attr)}")
    return " ".join([text] + [", ".join(bounds)] if bounds else [text])


def describe_keys() -> list[tuple[str, str, str, str]]:
    """(key, allowed values, default, meaning) of every config key; node keys as nodes.<i>.KEY."""
    rows = []
    for cls, prefix in ((RunConfig, ""), (NodeSpec, "nodes.<i>.")):
        defaults = to_dict(cls())
        for name, info in cls.__pydantic_fields__.items():
            if cls is RunConfig and name == "nodes":
                allowed, default = "list of node mappings (the nodes.<i>.* keys)", "[one node]"
            else:
                allowed = _allowed(info.annotation, info.metadata)
                default = (
                    yaml.safe_dump(defaults[name], default_flow_style=True, width=1 << 30)
                    .strip()
                    .removesuffix("\n...")
                )
            rows.append((prefix + name, allowed, default, info.description or ""))
    return rows


LIST_WIDTH = 100  # columns of `--list-keys`


def render_keys(width: int = LIST_WIDTH) -> str:
    """`--list-keys`: every config key with its allowed values and default, then its meaning
    indented below, in lines of at most `width` columns (a longer word keeps its line)."""
    wrap = dict(width=width, break_long_words=False, break_on_hyphens=False)
    blocks = []
    for key, allowed, default, meaning in describe_keys():
        head = textwrap.wrap(
            f"{key}: {allowed}; default {default}", subsequent_indent="      ", **wrap
        )
        body = textwrap.wrap(meaning, initial_indent="    ", subsequent_indent="    ", **wrap)
        blocks.append("\n".join(head + body))
    return "\n".join(blocks)


def render_config(cfg: RunConfig, layers: str) -> str:
    """`--print-config`: the effective configuration as YAML (a valid `--config` file), each key
    commented with its allowed values and meaning."""
    described = {key: (allowed, meaning) for key, allowed, _, meaning in describe_keys()}
    lines = [f"# the effective configuration: {layers}", "# key: value  # allowed values: meaning"]

    def line(indent: str, key: str, value: Any, described_as: Optional[str]) -> str:
        text = f"{indent}{key}: " + yaml.safe_dump(
            value, default_flow_style=True, width=1 << 30
        ).strip().removesuffix("\n...")
        if described_as is None:
            return text
        allowed, meaning = described[described_as]
        return f"{text:<40}  # {allowed}: {meaning}"

    d = to_dict(cfg)
    for key, value in d.items():
        if key != "nodes":
            lines.append(line("", key, value, key))
    lines.append(f"nodes:{'':<33}  # {described['nodes'][1]}")
    for i, node in enumerate(d["nodes"]):
        for j, (key, value) in enumerate(node.items()):
            lines.append(
                line("- " if j == 0 else "  ", key, value, f"nodes.<i>.{key}" if i == 0 else None)
            )
    return "\n".join(lines)
