"""The optional extras, and the `ftis-grpo` console script that checks its extra before importing.

`pip install ftis-kernels` brings the ops only (torch, triton, numpy). The driver and the
integrations need more; each names its extra when a package is missing, in one line, instead of
failing deep inside an import.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

# Import names (not distribution names) that each extra provides, as pyproject.toml lists them.
EXTRAS: dict[str, tuple[str, ...]] = {
    "grpo": (
        "transformers",
        "peft",
        "tokenizers",
        "safetensors",
        "yaml",
        "tqdm",
        "matplotlib",
        "pydantic",
        "psutil",
    ),
    "hf": ("transformers", "peft"),
    "plot": ("matplotlib",),
    "trl": ("trl", "transformers"),
    "genrl": ("genrl", "transformers"),
}


class MissingExtraError(ImportError):
    """An optional package is missing; the message names the extra that installs it."""


def missing(extra: str) -> list[str]:
    """The import names of `extra` that cannot be found (no import is done)."""
    return [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]


def require(extra: str, what: str) -> None:
    """Raise `MissingExtraError` ("<what>: needs the '<extra>' extra: pip install ...") when a
    package of `extra` is missing."""
    absent = missing(extra)
    if absent:
        raise MissingExtraError(
            f"{what}: needs the '{extra}' extra: pip install \"ftis-kernels[{extra}]\" "
            f"(missing: {', '.join(absent)})"
        )


def grpo_cli(argv: Sequence[str] | None = None) -> int:
    """The `ftis-grpo` console script: without the 'grpo' extra, one line and exit code 2."""
    try:
        require("grpo", "ftis-grpo")
    except MissingExtraError as err:
        print(err, file=sys.stderr)
        return 2
    from ftis_kernels.grpo.cli import main

    return main(argv)
