"""Where a run's numbers came from: library versions, the CPU and its threads, the commit.

A run is bit-identical when rerun on the same machine with the same code and libraries (the
sampling generators, the initial weights, the warm-up data and the hostile peers' forgeries are
all seeded). Across machines the floating-point kernels torch picks may differ (the CPU's vector
capability, the thread count, the BLAS), and one different rounding in a sampled token's
probability changes every later round. `environment.json` records what a rerun must match.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Optional

import torch

ENVIRONMENT = "environment.json"
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
_LIBRARIES = ("torch", "triton", "numpy", "transformers", "peft", "tokenizers")


def _version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str:
    if not (_PACKAGE_ROOT / ".git").exists():  # installed, not a checkout (maybe in one's venv)
        return ""
    try:
        return subprocess.run(
            ["git", *args], cwd=_PACKAGE_ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(
    nodes: Optional[int] = None, code: tuple[str, ...] = ("ftis_kernels",)
) -> dict[str, Any]:
    """The run's environment, as this process sees it: versions (`torch` is torch.__version__,
    the others their installed distributions), python, the CPU, torch's vector capability and
    threads per node, the GPU if any, and the commit of the package's source tree ("unknown"
    outside a git checkout; "-dirty" when its tracked files under the `code` paths differ).
    `nodes` (the processes of a run) is recorded as given. The experiments record the same."""
    commit = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", "--", *code))
    return {
        **{name: _version(name) for name in _LIBRARIES},
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "threads_per_node": torch.get_num_threads(),
        "nodes": nodes,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "commit": commit[:12] + ("-dirty" if dirty else "") if commit else "unknown",
    }


def describe(env: dict[str, Any]) -> str:
    """One line for summary.txt."""
    threads = env["threads_per_node"]
    return (
        f"environment: torch {env['torch']}, triton {env['triton']}, numpy {env['numpy']}, "
        f"transformers {env['transformers']}; {env['cpu']} ({env['cpu_capability']}, "
        f"{env['cpu_count']} cores), {threads} thread{'s' * (threads != 1)} per node; "
        f"commit {env['commit']}"
    )


def record_environment(
    out: Path, env: dict[str, Any], first_round: int, resumed_at: Optional[int] = None
) -> None:
    """Add `env` to `environment.json`, a list with one entry per start of the run (a fresh run,
    then each --resume), each with the first round it ran. The entries of starts at or after
    `resumed_at` (default: `first_round`; a resumed swarm peer may skip ahead of its checkpoint)
    are dropped: their rounds were rolled back."""
    path = out / ENVIRONMENT
    starts = []
    keep_before = first_round if resumed_at is None else resumed_at
    if keep_before > 0 and path.exists():
        try:
            starts = [e for e in json.loads(path.read_text()) if e["first_round"] < keep_before]
        except (ValueError, TypeError, KeyError):
            starts = []
    starts.append({"first_round": first_round, **env})
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(starts, indent=1) + "\n")
    os.replace(tmp, path)
