"""Collaborative GRPO driver: heterogeneous nodes training together with F-TIS over torch.distributed.

Modules, in the order a round uses them: `task` (problems and the binary reward), `tokenizer`,
`models` (presets, warm-up, LoRA), `rollout` (sampling with logprobs, group advantages), `exchange`
(the wire format and the collective), `train` (the update with `ftis_kernels.ftis_loss`),
`checkpoint`, `report`; `config` (the run's schema), `node` runs one torchrun worker,
`launch` starts and supervises the swarm, `cli` is the command line.
"""  # noqa: E501

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
