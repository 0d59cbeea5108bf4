"""Collaborative GRPO driver: heterogeneous nodes training together with F-TIS over torch.distributed.

Modules, in the order a round uses them: `task` (problems and the binary reward), `tokenizer`,
`models` (presets, warm-up, LoRA), `rollout` (sampling with logprobs, group advantages), `exchange`
(the wire format and the collective), `train` (the update with `ftis_kernels.ftis_loss`),
`checkpoint`, `report`; `node` runs one torchrun worker and `cli` starts the swarm.
"""

from ftis_kernels._extras import require

require("grpo", "ftis_kernels.grpo")
