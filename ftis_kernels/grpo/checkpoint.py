"""Atomic checkpoints: safetensors weights, optimizer state, RNG states and the round.

Layout under `<out>/ckpt/`:

    node<i>/round_<r>/model.safetensors, optimizer.pt, rng.pt, state.json, manifest.json
    latest.json          {"round": r}: every node has written round r (rank 0 writes it last)

Each node writes into `round_<r>.tmp/`, fsyncs, and renames it into place; `latest.json` is replaced
atomically only after a barrier, so a crash at any moment leaves the previous complete round.
`manifest.json` holds the sha256 of every other file, so `--resume` can tell a damaged checkpoint
(a bad disk, a stray write) from a good one and fall back to an older round (`verify_node`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model

log = logging.getLogger(__name__)

KEEP = 2  # complete rounds kept per node
ROUND_FOLDER = re.compile(r"round_\d{5,}")  # a complete checkpoint's folder; nothing else counts
FULL_BELOW = 1 << 20  # bytes free under which a failed write is put down to a full disk
FILES = ("model.safetensors", "optimizer.pt", "rng.pt", "state.json")
MANIFEST = "manifest.json"  # {"sha256": {file: hex digest}} of FILES


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write `obj` as JSON to `path` through a temporary file and os.replace."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def node_dir(root: Path, node: int, round_: int) -> Path:
    return root / f"node{node}" / f"round_{round_:05d}"


def save_node(
    root: Path,
    node: int,
    round_: int,
    model,
    optimizer,
    sampler: torch.Generator,
    state: dict[str, Any],
) -> Path:
    """Write node `node`'s checkpoint after `round_` completed rounds; returns its folder."""
    final = node_dir(root, node, round_)
    tmp = final.with_name(final.name + ".tmp")
    try:
        _write(tmp, round_, node, model, optimizer, sampler, state)
    # On a full disk torch.save says "basic_ios::clear", safetensors raises its own error (not an
    # OSError: "No space left on device (os error 28)").
    except (OSError, RuntimeError, SafetensorError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        cause = getattr(exc, "strerror", None) or str(exc)
        if shutil.disk_usage(root).free < FULL_BELOW:
            cause = f"no space left on its disk ({cause})"
        raise OSError(getattr(exc, "errno", None) or errno.EIO, cause, str(tmp)) from exc
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    # Only rounds up to this one: a later round's folder is not this run's to delete.
    done = [r for r in node_rounds(root, node) if r <= round_]
    for old in done[KEEP:]:
        shutil.rmtree(node_dir(root, node, old), ignore_errors=True)
    return final


def _write(tmp: Path, round_: int, node: int, model, optimizer, sampler, state) -> None:
    """Write and fsync the files of one checkpoint into the folder `tmp`."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(model, str(tmp / "model.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(
        {
            "torch": torch.get_rng_state(),
            "sampler": sampler.get_state(),
            "python": random.getstate(),
        },
        tmp / "rng.pt",
    )
    (tmp / "state.json").write_text(json.dumps({"round": round_, "node": node, **state}, indent=1))
    digests = {name: _sha256(tmp / name) for name in FILES}
    (tmp / MANIFEST).write_text(json.dumps({"sha256": digests}, indent=1))
    for f in tmp.iterdir():
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(tmp)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def node_rounds(root: Path, node: int) -> list[int]:
    """The rounds of node `node`'s complete (renamed into place) checkpoints, newest first; any
    other entry (a `.tmp` write, a user's `round_00002.bak`) is not one and is ignored."""
    folders = (root / f"node{node}").glob("round_*")
    return sorted(
        (int(p.name[len("round_") :]) for p in folders if ROUND_FOLDER.fullmatch(p.name)),
        reverse=True,
    )


def verify_node(root: Path, node: int, round_: int) -> Optional[str]:
    """None when node `node`'s checkpoint of `round_` has every file with the sha256 its manifest
    records; else what is wrong with it, in a few words."""
    folder = node_dir(root, node, round_)
    try:
        recorded = json.loads((folder / MANIFEST).read_text())["sha256"]
    except FileNotFoundError:
        return f"no {MANIFEST} in {folder} (written before checksums, or not a checkpoint)"
    except (ValueError, KeyError, TypeError) as exc:
        return f"unreadable {folder / MANIFEST} ({exc!r})"
    for name in FILES:
        if not (folder / name).is_file():
            return f"{folder / name} is missing"
        if recorded.get(name) != _sha256(folder / name):
            return f"{folder / name} does not match its sha256 in {MANIFEST}"
    return None


def newest_common(good: list[list[int]]) -> Optional[int]:
    """The newest round that every node (one list of good rounds each) can resume from."""
    common = set.intersection(*(set(rounds) for rounds in good)) if good else set()
    return max(common, default=None)


def mark_latest(root: Path, round_: int) -> None:
    """Record that every node has a complete checkpoint of `round_` (call after a barrier)."""
    write_json_atomic(root / "latest.json", {"round": round_})


def latest_round(root: Path) -> Optional[int]:
    """The round `latest.json` records (None without one); a torn or damaged pointer is passed
    over with a warning for the newest round whose checkpoint is good on every node."""
    path = root / "latest.json"
    if not path.exists():
        return None
    try:
        got = json.loads(path.read_text())["round"]
        if type(got) is not int or got < 0:
            raise ValueError(f"round {got!r} is not a round number")
        return got
    except (OSError, ValueError, KeyError, TypeError) as exc:
        found = newest_common(
            [
                [r for r in node_rounds(root, node) if verify_node(root, node, r) is None]
                for node in _nodes(root)
            ]
        )
        log.warning(
            "%s is damaged (%s): %s",
            path,
            f"{type(exc).__name__}: {exc}",
            "no good checkpoint found"
            if found is None
            else f"using round {found}, the newest good on every node",
        )
        return found


def _nodes(root: Path) -> list[int]:
    """The node numbers with a checkpoint folder under `root`."""
    return sorted(
        int(p.name[len("node") :]) for p in root.glob("node*") if re.fullmatch(r"node\d+", p.name)
    )


def load_node(
    root: Path, node: int, round_: int, model, optimizer, sampler: torch.Generator
) -> dict[str, Any]:
    """Restore weights, optimizer and RNG states written by `save_node`; returns its state.json."""
    folder = node_dir(root, node, round_)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"--resume: no checkpoint of node {node} at round {round_} ({folder})"
        )
    load_model(model, str(folder / "model.safetensors"), strict=True)
    optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
    rng = torch.load(folder / "rng.pt", weights_only=True)
    torch.set_rng_state(rng["torch"])
    sampler.set_state(rng["sampler"])
    random.setstate(_as_tuple(rng["python"]))
    return json.loads((folder / "state.json").read_text())


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x
