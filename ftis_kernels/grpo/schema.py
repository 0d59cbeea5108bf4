"""The run's schema: `RunConfig` and `NodeSpec`, every key's type, range, default and meaning,
and the checks of how the keys fit together (`RunConfig.validate`).

`config` builds one from the layers (defaults, preset, file, flags) and describes it for people.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

from ftis_kernels.grpo.errors import ConfigError, Described, Verbatim
from ftis_kernels.grpo.exchange import HOSTILE_KINDS
from ftis_kernels.grpo.model_folder import model_folder_problem
from ftis_kernels.grpo.task import OPERATIONS, Difficulty, load_jsonl
from ftis_kernels.options import OPTION_NAMES, FTISOptions, option_choices, option_help
from ftis_kernels.options import PRESETS as LOSS_PRESETS
from ftis_kernels.options import loss_type as loss_type_of

COLLABS = ("vertical", "horizontal")
# What moves the exchange's bytes (`transport.Transport`): torchrun's lockstep world on this host,
# or hivemind (its DHT, libp2p streams), one peer per process on any host (`ftis-grpo peer`).
TRANSPORTS = ("torch", "hivemind")
# A run's loss: a preset of FTISOptions (docs/options.md), or on-policy (isolated nodes, GRPO).
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
Share = Annotated[float, Field(ge=0, le=1)]
Steps = Annotated[list[Count], Field(min_length=2, max_length=2)]
_SCHEMA = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def _loss_option(name: str) -> Any:
    """A run config key for the loss option `name`: its help from FTISOptions, default null (the
    loss preset's value)."""
    return Field(None, description=f"{option_help(name)} null: the loss preset's value")


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
        description="loss mode: a preset of FTISOptions (docs/options.md); on-policy = "
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
        "{ratio_level: sequence, entropy_coef: 0.01} (docs/options.md)",
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
        "hivemind, no barrier (ftis-grpo peer; needs the swarm extra)",
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
        except ValueError as exc:  # "<option>: expected ...": an option set in loss_options
            name, colon, rest = str(exc).partition(": ")  # is named by its key there
            key = f"loss_options.{name}" if colon and name in self.loss_options else name
            raise ConfigError(f"{key}{colon}{rest}") from None
        if options.beta > 0:
            raise ConfigError(
                ("loss_options.beta", "0 (the driver has no reference model)", options.beta)
            )
        for rank in range(len(self.nodes)):
            opt = self.ftis_options(rank)
            rejects = opt.reject_mode == "mask" and opt.filter is not None
            by_tokens = loss_type_of(opt.loss_type).batch_normalised
            if rejects and opt.entropy_coef > 0 and not by_tokens:
                raise ConfigError(
                    (
                        "loss_options.reject_mode",
                        f'"advantage" with an entropy bonus and loss_type {opt.loss_type!r} (the '
                        "bonus is a mean over the kept tokens of the whole batch, known only "
                        "after every micro-batch's forward; a token-mean loss type (bnpo, dapo, "
                        "cispo, vespo) takes it)",
                        opt.reject_mode,
                    )
                )

    def input_problems(self) -> list[tuple[str, str, Any]]:
        """What is wrong with the files the run reads, before any node starts: every line of
        each data file (`task: jsonl`; its path:line), and each node's model folder."""
        problems: list[tuple[str, str, Any]] = []
        if self.task == "jsonl":
            for split, path in self.data.items():
                if Path(path).is_file():
                    try:
                        found = load_jsonl(path, split)
                    except (OSError, ValueError) as exc:
                        problems.append(
                            (
                                f"data.{split}",
                                'a JSONL file of {"question" (or "problem"), "answer"} objects',
                                Verbatim(str(exc)),
                            )
                        )
                        continue
                    # A node's prompts of a round are consecutive problems of the file (wrapping
                    # around): fewer than prompts_per_node repeat a prompt, whose two groups a
                    # receiver reads as one group of the wrong size and drops as a false claim.
                    if split == "train" and len(found) < self.prompts_per_node:
                        problems.append(
                            (
                                "data.train",
                                f"at least prompts_per_node = {self.prompts_per_node} problems "
                                "(a node's prompts of a round must differ)",
                                Verbatim(f"{str(path)!r}, which holds {len(found)}"),
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


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
