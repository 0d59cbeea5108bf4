"""Collaborative GRPO driver: heterogeneous nodes training together with F-TIS over torch.distributed.

Modules, in the order a round uses them: `task` (problems and the binary reward), `tokenizer`,
`models` (presets, warm-up, LoRA), `rollout` (sampling with logprobs, group advantages), `exchange`
(the wire format and the collective), `train` (the update with `ftis_kernels.ftis_loss`),
`checkpoint`, `report`; `config` (the run's schema), `node` runs one torchrun worker,
`launch` starts and supervises the swarm, `cli` is the command line.
"""  # noqa: E501

from ftis_kernels._extras import require

require("grpo", "ftis_kernels.grpo")
