"""Integrations with training frameworks, each in its own module and imported on demand.

- `ftis_kernels.integrations.hf`: `lm_head_inputs`, the completion hidden states and the lm-head
  of a Hugging Face causal LM (peft-aware), the inputs of `ftis_linear_loss`.
- `ftis_kernels.integrations.trl` (needs the `trl` extra): `FTISGRPOConfig` and `FTISGRPOTrainer`,
  TRL's GRPOTrainer with the F-TIS loss, and `PeerRollout`, a rollout_func whose prompt groups
  are sampled in turn by the trained model and by peer models.
- `ftis_kernels.integrations.genrl` (needs the `genrl` extra): `FTISGRPOLanguageTrainerModule`,
  GenRL's GRPO trainer (Gensyn's RL Swarm) with the generator's log-probabilities carried with each
  rollout and the F-TIS loss.
- `ftis_kernels.integrations.verl` (needs the `verl` extra): registers F-TIS as verl's policy
  loss `ftis`; `FTISPolicyLossConfig` carries its options in verl's actor config.

Nothing here is imported by `import ftis_kernels`, and this package imports none of its modules,
so the core never pulls in a training framework.
"""
