"""Typed use of the public API, checked by mypy (`mypy`, configured in pyproject.toml; .ci/run).

Every line must type-check, except those marked `# type: ignore[code]`: those must be errors of
that code, or mypy reports the ignore as unused (warn_unused_ignores). So the file checks both
what a user's correct call is typed as and that the mistakes a type checker can catch are caught.
"""

import torch
from typing_extensions import assert_type

from ftis_kernels import FTISOptions, ftis_linear_loss, ftis_logprobs, ftis_loss

B, T, V, H = 2, 3, 5, 4
logits = torch.randn(B, T, V, requires_grad=True)
tokens = torch.randint(0, V, (B, T))
gen = torch.full((B, T), -1.0)
advantages = torch.randn(B)

loss, metrics = ftis_loss(logits, tokens, gen, advantages, is_mode="tis", filter=None)
assert_type(loss, torch.Tensor)
assert_type(metrics, dict[str, torch.Tensor])
ftis_loss(logits, tokens, gen, advantages, options=FTISOptions.preset("gspo"), loss_type="dapo")

hidden, weight = torch.randn(B, T, H), torch.randn(V, H)
loss, metrics = ftis_linear_loss(hidden, weight, tokens, gen, advantages, chunk_size=2, beta=0.0)
assert_type(loss, torch.Tensor)
logp, entropy = ftis_logprobs(hidden, tokens, weight, temperature=0.7)
assert_type(logp, torch.Tensor)

# The mistakes: a misspelt option, a value outside its choices, a wrong type, a missing argument.
ftis_loss(logits, tokens, gen, advantages, is_mod="tis")  # type: ignore[call-arg]
ftis_loss(logits, tokens, gen, advantages, loss_type="ppo")  # type: ignore[arg-type]
ftis_linear_loss(hidden, weight, tokens, gen, advantages, is_cap="2")  # type: ignore[arg-type]
ftis_linear_loss(hidden, tokens, gen, advantages)  # type: ignore[call-arg]
ftis_logprobs(hidden, tokens, weight, temprature=0.7)  # type: ignore[call-arg]
