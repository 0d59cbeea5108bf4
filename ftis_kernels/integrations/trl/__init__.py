"""TRL integration: `FTISGRPOTrainer`, TRL's `GRPOTrainer` with its loss replaced by F-TIS.

    from ftis_kernels.integrations.trl import FTISGRPOConfig, FTISGRPOTrainer
    args = FTISGRPOConfig(output_dir="out", is_mode="tis", filter="negative_offpolicy")
    trainer = FTISGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds)

Everything but the loss is TRL's: generation, rewards, group advantages, the reference model,
logging. The loss of each micro-batch is `ftis_loss` on the completion logits, or
`ftis_linear_loss` on the completion hidden states and the lm-head (`ftis_op`), with:

    pi_gen  = the generator's sampling logprobs when TRL has them (the vLLM path, or a custom
              `rollout_func`, which is how another node's completions and logprobs come in),
              else TRL's old logprobs, else the current policy (detached, from one extra
              gradient-free pass of the op): TRL generated the batch with this very model, so
              w = 1 and KL = 0;
    pi_old  = TRL's old logprobs when it computed them (num_iterations > 1, or generation not
              aligned with optimiser steps), else stop_grad(current), as in TRL;
    ref     = TRL's reference logprobs when beta > 0.

Without sampler logprobs pi_gen is pi_old and F-TIS corrects nothing (the loss is GRPO's); the
trainer logs that once. `PeerRollout` is a `rollout_func` for collaboration in one process: the
prompt groups are sampled in turn by the trained model and by peer models, with their sampler
logprobs as pi_gen.

pi_gen must be the distribution the tokens were sampled from: with a vLLM server, start it with
`--logprobs-mode processed_logprobs` (after temperature and top-p/top-k), as TRL asks for its own
correction. Without generator logprobs, top_p/top_k/min_p/repetition_penalty are ignored in pi_gen,
as TRL ignores them in its ratio.

TRL's loss options keep their meaning: all eight loss types, importance_sampling_level (the op's
ratio_level), delta, beta with use_bias_correction_kl, entropy_coef (static, or with
use_adaptive_entropy TRL's controller, fed by the op's per-token entropy), the SAPO and VESPO
parameters, epsilon, epsilon_high and temperature; off_policy_mask_threshold (OPSM) and, on the
vLLM path, vllm_importance_sampling_correction with its four modes and clip bounds are mapped onto
the op's filter and IS weight. The loss is scaled exactly as TRL scales it (gradient accumulation;
the generation-batch token count of dapo / cispo / vespo; dr_grpo's max_completion_length), so
with is_mode="none" and filter=None the loss is TRL's own. What F-TIS cannot reproduce
(top_entropy_quantile < 1, a MoE router loss) is refused with a ValueError
naming it, at config and at trainer construction.

Several processes: DDP, FSDP2 and DeepSpeed ZeRO-1/2/3 (`FTISGRPOTrainer`'s docstring).

Tested with trl 1.11 to 1.16 (TESTED_TRL); other versions get a warning at import. The package:
`config` (FTISGRPOConfig and the mapping of TRL's options), `trainer` (FTISGRPOTrainer, and how
an engine holds the lm-head), `rollout` (PeerRollout).
"""

from __future__ import annotations

import warnings

from ftis_kernels._extras import require

require("trl", "ftis_kernels.integrations.trl")

import trl  # noqa: E402
from packaging.specifiers import SpecifierSet  # noqa: E402
from packaging.version import Version  # noqa: E402

TESTED_TRL = ">=1.11,<1.17"
if Version(trl.__version__) not in SpecifierSet(TESTED_TRL):
    warnings.warn(
        f"ftis_kernels.integrations.trl is tested with trl{TESTED_TRL}, "
        f"found trl {trl.__version__}",
        stacklevel=2,
    )

from ftis_kernels.integrations.trl.config import OWN_OPTIONS, TRL_NAMES, FTISGRPOConfig  # noqa: E402
from ftis_kernels.integrations.trl.rollout import PeerRollout  # noqa: E402
from ftis_kernels.integrations.trl.trainer import FTISGRPOTrainer  # noqa: E402

__all__ = [
    "OWN_OPTIONS",
    "TESTED_TRL",
    "TRL_NAMES",
    "FTISGRPOConfig",
    "FTISGRPOTrainer",
    "PeerRollout",
]
