"""Collaborative GRPO driver: heterogeneous nodes training together with F-TIS over torch.distributed.

Modules, in the order a round uses them: `task` (problems and the binary reward), `tokenizer`,
`models` (presets, warm-up, LoRA), `rollout` (sampling with logprobs, group advantages), `exchange`
(the wire format and the collective), `train` (the update with `ftis_kernels.ftis_loss`),
`checkpoint`, `report`; `config` (the run's schema), `node` runs one torchrun worker,
`launch` starts and supervises the swarm, `cli` is the command line.
"""  # noqa: E501

import sys

from ftis_kernels._extras import MissingExtraError, require

try:
    require("grpo", "ftis_kernels.grpo")
except MissingExtraError as err:
    # `python -m ftis_kernels.grpo` imports this package first, with sys.argv[0] set to "-m"
    # (Python's documented marker): answer as the `ftis-grpo` console script does, one line and
    # exit code 2, rather than with a traceback.
    if sys.argv[:1] == ["-m"]:
        print(f"ftis-grpo: {str(err).split(': ', 1)[1]}", file=sys.stderr)
        raise SystemExit(2) from None
    raise
