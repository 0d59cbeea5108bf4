"""`ftis_logprobs`: log pi of the taken tokens and the per-token entropy, for the no-grad passes
(pi_old, the reference model), with the row kernels of the losses (`kernels/logp_lse.py`).

From logits, one streaming pass per row. From hidden states and the lm-head weight, a chunk of
rows at a time (`chunks.linear_logp_lse`): the logits of one chunk exist at once, so
memory stays flat in the number of tokens, where TRL's and verl's versions materialise (B, T, V).
Any leading shape works, padded (B, T) or packed (N,): each row is independent.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ftis_kernels import chunks
from ftis_kernels.kernels import FORWARD, select_backend
from ftis_kernels.options import CHECKS
from ftis_kernels.validate import LOGIT_DTYPES, TOKEN_DTYPES, check_tensor


def _described(x: object) -> str:
    """x for an error message, in one line: a tensor by its shape, anything else by its repr."""
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return repr(x)[:80]


def _check_tokens(tokens: torch.Tensor, mask: Optional[torch.Tensor], V: int) -> None:
    """Token ids in [0, V) where they are read (one synchronisation)."""
    bad = (tokens < 0) | (tokens >= V)
    if mask is not None:
        bad &= mask
    count = int(bad.sum())
    if count:
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"tokens: expected ids in [0, {V}) at every unmasked position, got {count} outside, "
            f"the first at {first}: {int(tokens[first])}"
        )


@torch.no_grad()
def ftis_logprobs(
    inputs: torch.Tensor,
    tokens: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    *,
    bias: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / temperature)[token] and the entropy of softmax(logits / temperature),
    per token, without gradients and without a (B, T, V) temporary.

    Args:
        inputs: the logits (*, V) when `weight` is None, else the hidden states (*, H); fp32 |
            bf16 | fp16, any strides. (*) is any leading shape: (B, T) padded, (N,) packed.
        tokens: (*) int64 | int32, ids in [0, V) at unmasked positions.
        weight: (V, H) lm-head weight in the hidden dtype, or None (inputs are logits).
        bias: (V,) in the hidden dtype, or None; only with `weight`.
        mask: (*) bool, positions to compute; None = all. Masked positions read nothing and give 0.
        temperature: a finite number > 0, as the sampler's (and the losses' option).
        chunk_size: rows per chunk from hidden states (None: AUTO_CHUNK_ELEMENTS logits a chunk).

    Returns:
        logp, entropy: (*) fp32. Non-finite logits give non-finite values, as log_softmax would.
    """
    if not isinstance(inputs, torch.Tensor) or inputs.dim() < 1 or inputs.numel() < 1:
        got = _described(inputs)
        raise ValueError(f"inputs: expected a non-empty (*, V) or (*, H) tensor, got {got}")
    what, valid = CHECKS["positive_finite"]  # as the losses' temperature option
    if not valid(temperature):
        raise ValueError(f"temperature: expected {what}, got {temperature!r}")
    lead, device = tuple(inputs.shape[:-1]), inputs.device
    check_tensor("inputs", inputs, tuple(inputs.shape), LOGIT_DTYPES, device)
    check_tensor("tokens", tokens, lead, TOKEN_DTYPES, device)
    if mask is not None:
        check_tensor("mask", mask, lead, (torch.bool,), device)
    backend = select_backend(device)
    # The row passes take (B, T, *): a (B, T) lead passes as it is (any strides), others as one row.
    B, T = lead if len(lead) == 2 else (1, math.prod(lead))
    flat_mask = None if mask is None else mask.reshape(B, T)
    flat_tokens = tokens.reshape(B, T)
    if weight is None:
        if bias is not None:
            raise ValueError("bias: expected None when inputs are logits (no weight)")
        V = inputs.shape[-1]
        _check_tokens(tokens, mask, V)
        logits = inputs.reshape(B, T, V)
        logp, _, _, entropy = FORWARD[backend](logits, flat_tokens, flat_mask, float(temperature))
    else:
        H = inputs.shape[-1]
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] < 1:
            raise ValueError(f"weight: expected a (V, {H}) tensor, got {_described(weight)}")
        V = weight.shape[0]
        check_tensor("weight", weight, (V, H), (inputs.dtype,), device)
        if bias is not None:
            check_tensor("bias", bias, (V,), (inputs.dtype,), device)
        chunk = chunks.check_chunk_size(chunk_size) or chunks.auto_chunk_size(V)
        _check_tokens(tokens, mask, V)
        rows = chunks.as_rows(inputs.reshape(B, T, H))
        flat = None if flat_mask is None else flat_mask.reshape(B * T)
        stats = chunks.linear_logp_lse(
            rows,
            weight,
            bias,
            flat_tokens.reshape(B * T),
            flat,
            float(temperature),
            chunks.row_chunks(B * T, chunk),
            backend,
        )
        logp, entropy = stats[0], stats[3]
    return logp.reshape(lead), entropy.reshape(lead)
