"""The optional extras: `pip install ftis-kernels` brings the ops only (torch, triton, numpy).

The driver and the integrations need more; each names its extra when a package is missing, in one
line, instead of failing deep inside an import (`require`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import urllib.parse
from pathlib import Path
from typing import Any, Optional

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
    "verl": ("verl",),
    "swarm": ("hivemind",),
}


class MissingExtraError(ImportError):
    """An optional package is missing; the message names the extra that installs it."""


def missing(extra: str) -> list[str]:
    """The import names of `extra` that cannot be found (no import is done)."""
    return [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]


# The source tree this package was imported from, when it was (a clone, installed editable or
# put on PYTHONPATH): the folder above `ftis_kernels/` that holds the project's pyproject.toml.
_TREE = Path(__file__).resolve().parents[1]


def _direct_url() -> Optional[dict[str, Any]]:
    """What pip recorded of where it installed ftis-kernels from (PEP 610 `direct_url.json`):
    a file or folder, or None (an index, or not installed)."""
    try:
        text = importlib.metadata.distribution("ftis-kernels").read_text("direct_url.json")
        return json.loads(text) if text else None
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def install_command(extra: str) -> str:
    """The pip command that adds `extra` to this installation, from where it came: a source tree
    (`pip install -e "<tree>[extra]"`, "." when it is the working directory), the wheel or folder
    pip installed from, else the package index."""
    pyproject = _TREE / "pyproject.toml"
    if pyproject.is_file() and 'name = "ftis-kernels"' in pyproject.read_text(encoding="utf-8"):
        where = "." if _TREE == Path.cwd().resolve() else str(_TREE)
        return f'pip install -e "{where}[{extra}]"'
    direct = _direct_url()
    url = (direct or {}).get("url", "")
    if url.startswith("file://"):
        return f'pip install "{urllib.parse.unquote(urllib.parse.urlparse(url).path)}[{extra}]"'
    return f'pip install "ftis-kernels[{extra}]"'


def require(extra: str, what: str) -> None:
    """Raise `MissingExtraError` ("<what>: needs the '<extra>' extra: pip install ...", the
    command of `install_command`) when a package of `extra` is missing."""
    absent = missing(extra)
    if absent:
        raise MissingExtraError(
            f"{what}: needs the '{extra}' extra: {install_command(extra)} "
            f"(missing: {', '.join(absent)})"
        )
