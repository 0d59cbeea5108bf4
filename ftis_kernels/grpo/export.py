"""`ftis-grpo export`: a node's checkpoint as a Hugging Face model folder.

A checkpoint round (`<out>/ckpt/node<i>/round_<r>/`) holds weights and training state, not a model
folder: a preset node's architecture and tokenizer come from the run's configuration, a LoRA node's
weights are its base plus an adapter. `export` rebuilds the node's model as the run built it, loads
the checkpoint's weights (merging a LoRA adapter into its base) and writes `config.json`,
`model.safetensors` and the tokenizer's files, which `--model`, `AutoModelForCausalLM` and
`AutoTokenizer` load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ftis_kernels.grpo import checkpoint
from ftis_kernels.grpo.config import from_dict
from ftis_kernels.grpo.errors import ConfigError, Described, Verbatim
from ftis_kernels.grpo.model_folder import model_folder_problem
from ftis_kernels.grpo.schema import RunConfig


def _run_config(run: Path) -> RunConfig:
    try:
        return from_dict(json.loads((run / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(
            (
                "RUN",
                "the output folder of an ftis-grpo run (with config.json and ckpt/)",
                Verbatim(f"{str(run)!r} ({getattr(exc, 'strerror', None) or exc})"),
            )
        ) from None


def export(run: Path, node: int, round_: Optional[int], to: Path) -> Path:
    """Write node `node`'s checkpoint of `round_` (None: the run's latest complete round) in the
    run folder `run` as a Hugging Face model folder `to` (new or empty); returns the checkpoint
    folder it read. ConfigError naming the argument of anything missing or damaged."""
    cfg = _run_config(run)
    root = run / "ckpt"
    nodes = sorted(int(p.name[len("node") :]) for p in root.glob("node[0-9]*") if p.is_dir())
    if node not in nodes:
        raise ConfigError(("--node", f"a node of the run in {run}: {nodes}", node))
    rounds = checkpoint.node_rounds(root, node)
    if round_ is None:
        round_ = checkpoint.latest_round(root)
        if round_ is None:
            raise ConfigError(("--round", f"a complete checkpoint in {root}", Verbatim("none")))
    if round_ not in rounds:
        raise ConfigError(
            ("--round", f"a round checkpointed for node {node}: {sorted(rounds)}", round_)
        )
    damage = checkpoint.verify_node(root, node, round_)
    if damage is not None:
        raise ConfigError(("--round", "an undamaged checkpoint", Verbatim(damage)))
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        raise ConfigError(("--to", "a new or empty folder", str(to)))
    spec = cfg.node(node)
    # The run's model folder, as its config names it (a relative path: from where the run began).
    found = None if spec.model is None else model_folder_problem(spec.model)
    if found is not None:
        expected = "the run's model folder (a relative path is read from the current folder)"
        raise ConfigError((f"nodes.{node}.model", expected, Described(found)))

    from safetensors.torch import load_model

    from ftis_kernels.grpo.models import apply_lora, build_model, load_pretrained
    from ftis_kernels.grpo.task import ArithmeticTask
    from ftis_kernels.grpo.tokenizer import build_tokenizer

    if spec.model is not None:
        model, tokenizer = load_pretrained(spec.model)
    else:
        # The run's own task settings (ood_surface adds words), as its nodes built it.
        tokenizer = build_tokenizer(ArithmeticTask(cfg.seed, cfg.difficulty()).vocabulary_text())
        model = build_model(spec.arch, tokenizer, cfg.init_seed(node))
    if spec.lora:
        model = apply_lora(model, spec.lora_r, spec.lora_alpha)
    folder = checkpoint.node_dir(root, node, round_)
    load_model(model, str(folder / "model.safetensors"), strict=True)
    if spec.lora:
        model = model.merge_and_unload()
    to.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(to)
    tokenizer.save_pretrained(to)
    return folder
