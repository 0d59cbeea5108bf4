"""The check of the model folders a run is given (`nodes.<i>.model`, `--model`): what makes a
folder one that `from_pretrained` loads, and a checkpoint round of ftis-grpo that is not one
(`ftis-grpo export` makes a model folder of it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

from ftis_kernels.grpo.errors import echo

# Any one of these makes a folder's weights, and of its tokenizer, for `from_pretrained`.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
_ROUND_RE = re.compile(r"round_(\d+)")


def checkpoint_round(folder: Path) -> Optional[tuple[Path, int, int]]:
    """(run folder, node, round) when `folder` is a checkpoint round of ftis-grpo
    (`<run>/ckpt/node<i>/round_<r>/`), else None."""
    m = _ROUND_RE.fullmatch(folder.name)
    node = folder.parent.name
    if m is None or not re.fullmatch(r"node\d+", node) or not (folder / "state.json").is_file():
        return None
    return folder.parents[2], int(node[len("node") :]), int(m.group(1))


def model_folder_problem(path: str) -> Optional[str]:
    """None when `path` is a Hugging Face model folder (config.json with a model_type, weights,
    a tokenizer); else what it is instead, in a few words (for a checkpoint round of a run, the
    `ftis-grpo export` command that makes one of it)."""
    folder, shown = Path(path), echo(repr(path))
    if not folder.exists():
        return f"{shown}, which does not exist"
    if not folder.is_dir():
        return f"{shown}, which is a file"
    found = checkpoint_round(folder)
    if found is not None:
        run, node, round_ = found
        return (
            f"{shown}, a checkpoint of ftis-grpo, not a model folder "
            f"(ftis-grpo export {run} --node {node} --round {round_} --to DIR writes one)"
        )
    lacks = []
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        if not (isinstance(config, dict) and config.get("model_type")):
            lacks.append("model_type in its config.json")
    except (OSError, ValueError):
        lacks.append("readable config.json")
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        lacks.append(f"weights ({' or '.join(WEIGHT_FILES[::2])})")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        lacks.append(f"tokenizer ({' or '.join(TOKENIZER_FILES)})")
    return f"{shown}, which has no {', no '.join(lacks)}" if lacks else None
