"""Collaborative GRPO driver: heterogeneous nodes training together with F-TIS.

Its layers, from the top: the command line (`cli`; `__main__` runs it for `python -m
ftis_kernels.grpo`), the launcher (`launch`: starts a local swarm's processes as commands and
supervises them), one process of a swarm (`worker`: a node under torchrun; `peer`: a peer of a
swarm over hivemind, `swarm`, on any host: its DHT for who is in the swarm, with each peer's
`identity` and signed records, and direct `streams` for the samples), then the round (`node`:
set up, then generate, exchange, train each round; `claims`: what a node holds its peers'
samples to). A module imports
none of a layer above its own, and no import goes round in a circle (tests/test_layers.py).

Below the round, what it uses: `train` (the update with `ftis_kernels.ftis_loss`), `rollout`
(sampling with logprobs, group advantages), `exchange` (the wire format), `transport` (how the
bytes move: the seam, and torchrun's lockstep transport), `models` (presets, warm-up, LoRA),
`task` (problems and the binary reward), `tokenizer`, `audit` (what each defence did), `report`
(metrics, curves, summary), `checkpoint`, `provenance` (what a run ran on). The configuration:
`config` (presets, files and overrides; `--list-keys`, `--print-config`) over `schema` (every
key, its range, the checks of how the keys fit) and `model_folder` (the check of a `--model`
folder); `export` (`ftis-grpo export`: a node's checkpoint as a model folder). Shared by the
processes of a run: `run_folder` (the lock and checks of `--out`), `process` (exit codes, the
launcher's environment, signals, the log format), `errors` (the one-line usage errors).
"""

import sys
from pathlib import Path

from ftis_kernels._extras import MissingExtraError, require

try:
    require("grpo", "ftis_kernels.grpo")
except MissingExtraError as err:
    # Run as the command, answer as a command does: one line and exit code 2, not a traceback.
    # `python -m ftis_kernels.grpo` imports this package with sys.argv[0] set to "-m" (Python's
    # documented marker); the `ftis-grpo` console script imports it from a file of that name.
    if sys.argv[:1] == ["-m"] or Path(sys.argv[0] if sys.argv else "").name == "ftis-grpo":
        print(f"ftis-grpo: {str(err).split(': ', 1)[1]}", file=sys.stderr)
        raise SystemExit(2) from None
    raise
