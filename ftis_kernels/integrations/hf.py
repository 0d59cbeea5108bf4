"""Hugging Face causal LMs -> the inputs of `ftis_linear_loss`, without computing any logits.

    from ftis_kernels import ftis_linear_loss
    from ftis_kernels.integrations.hf import lm_head_inputs

    x = lm_head_inputs(model, input_ids, attention_mask, completion_mask)
    loss, metrics = ftis_linear_loss(x.hidden, x.weight, x.tokens, gen_logprobs, advantages,
                                     x.mask, bias=x.bias)

The decoder is run on its own (the lm-head never sees the full sequence), and its last hidden
states are shifted so that hidden[b, j] is the state that predicts tokens[b, j].

**The lm-head as one linear map.** `ftis_linear_loss` needs logits = hidden @ weight.T + bias.
- A plain `nn.Linear` lm-head, tied to the input embedding or not, is that map as it stands
  (tied: the weight is the embedding `Parameter`, so its gradient reaches the embedding).
- A LoRA adapter on the lm-head computes W x + b + sum_a s_a B_a A_a drop_a(x). Rather than
  materialising W + s B A (which is wrong under LoRA dropout, where the update sees another x),
  the helper returns the equivalent *augmented* map: hidden' = [x, s_a A_a drop_a(x), ...] and
  weight' = [W, B_a, ...] along the hidden axis, bias' = b + sum_a s_a bias(B_a). This is exact
  with dropout (drawn in the same order as the model's own forward), with several active
  adapters, and autograd carries the gradients to A_a, B_a (and W when it trains). Merged or
  disabled adapters are the base layer, as in peft's forward. Adapter variants that are not a
  low-rank sum (DoRA and friends) are refused.
- `modules_to_save` copies of the lm-head are followed to the active copy.
- Models whose logits are not the lm-head output (soft-capping, logit scales) are refused, as are
  heads that are not one linear map on the decoder's output (a prediction head's dense and norm
  before it, another module with parameters beside it, a learned logit scale in it, a vocabulary
  slice after it).

Only module-level adapters (LoRA and the like) are supported on peft models; prompt-learning
adapters change the input sequence and are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

# Config fields under which some architectures transform the lm-head output before the softmax.
_LOGIT_TRANSFORMS = {
    "final_logit_softcapping": None,
    "logits_soft_cap": None,  # RecurrentGemma
    "logit_scale": 1.0,
    "logits_scaling": 1.0,
    "lm_head_multiplier": 1.0,  # Falcon-H1
    "output_multiplier_scale": 1.0,
    "logits_mup_width_multiplier": 1.0,  # Inkling divides the final hidden states by it
}


@dataclass
class LMHeadInputs:
    """What `ftis_linear_loss` takes, aligned: hidden[b, j] predicts tokens[b, j].

    hidden (B, C, H') in the lm-head weight's dtype; weight (V, H'); bias (V,) or None; tokens
    (B, C) int64; mask (B, C) bool, the completion tokens; start: column of input_ids that
    column 0 of tokens is (slice per-token inputs given over input_ids with [:, start:]).
    H' = H, or H plus the LoRA ranks when the lm-head carries LoRA adapters.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    tokens: torch.Tensor
    mask: torch.Tensor
    start: int


def _unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (adapters stay injected in its modules)."""
    peft_config = getattr(model, "peft_config", None)
    if peft_config is None or not hasattr(model, "get_base_model"):
        return model
    for name in getattr(model, "active_adapters", None) or []:
        if getattr(peft_config.get(name), "is_prompt_learning", False):
            raise ValueError(
                f"model: prompt-learning adapter {name!r} is not supported "
                "(only module adapters such as LoRA)"
            )
    return model.get_base_model()


def _active_module(head: nn.Module) -> nn.Module:
    """Follows a peft `ModulesToSaveWrapper` to the copy its forward would call."""
    try:
        from peft.utils.other import ModulesToSaveWrapper
    except ImportError:  # pragma: no cover - no peft, no peft modules
        return head
    if not isinstance(head, ModulesToSaveWrapper):
        return head
    active = head.active_adapters
    if head.disable_adapters or not active or any(a not in head.modules_to_save for a in active):
        return head.original_module
    return head.modules_to_save[active[0]]


def _lora_layer_cls():
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - no peft, no peft modules
        return None
    return LoraLayer


def linear_head(head: nn.Module, hidden: torch.Tensor) -> tuple:
    """The lm-head `head` applied to `hidden` (..., H) as one linear map: returns (hidden',
    weight, bias) with head(hidden) == hidden' @ weight.T + bias (see the module docstring)."""
    head = _active_module(head)
    lora_cls = _lora_layer_cls()
    if lora_cls is not None and isinstance(head, lora_cls):
        return _lora_linear_head(head, hidden)
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"model: expected an nn.Linear lm-head (or a LoRA-wrapped one), "
            f"got {type(head).__name__}"
        )
    _check_no_extra_parameters(head)
    return hidden.to(head.weight.dtype), head.weight, head.bias


def _check_no_extra_parameters(head: nn.Linear) -> None:
    """An nn.Linear subclass with parameters of its own (Dory's logit scale) is not W x + b."""
    extra = sorted({name for name, _ in head.named_parameters()} - {"weight", "bias"})
    if extra:
        raise ValueError(
            f"model: its lm-head {type(head).__name__} has parameters beside weight and bias "
            f"({', '.join(extra)}); its output is not hidden @ weight.T + bias"
        )


def _lora_linear_head(layer: nn.Module, hidden: torch.Tensor):
    """Mirrors peft's `lora.Linear.forward` as an augmented linear map."""
    base = layer.get_base_layer()
    if not isinstance(base, nn.Linear) or getattr(layer, "fan_in_fan_out", False):
        raise ValueError(
            f"model: expected a LoRA lm-head over an nn.Linear, got {type(base).__name__}"
        )
    _check_no_extra_parameters(base)
    dtype = base.weight.dtype
    x = hidden.to(dtype)
    if layer.disable_adapters:
        if layer.merged:
            layer.unmerge()  # what peft's forward does with a merged, disabled adapter
        return x, base.weight, base.bias
    if layer.merged:
        return x, base.weight, base.bias
    columns, blocks, bias = [x], [base.weight], base.bias
    for name in layer.active_adapters:
        if name not in layer.lora_A.keys():
            continue
        if name in getattr(layer, "lora_variant", {}):
            raise ValueError(
                f"model: LoRA adapter {name!r} on the lm-head uses a variant (e.g. DoRA) "
                "that is not a low-rank sum; not supported"
            )
        lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
        scaling = layer.scaling[name]
        a_in = layer._cast_input_dtype(hidden, lora_a.weight.dtype)
        z = lora_a(layer.lora_dropout[name](a_in)) * scaling
        columns.append(z.to(dtype))
        blocks.append(lora_b.weight.to(dtype))
        if lora_b.bias is not None:
            extra = (lora_b.bias * scaling).to(dtype)
            bias = extra if bias is None else bias + extra
    if len(blocks) == 1:
        return x, base.weight, bias
    return torch.cat(columns, dim=-1), torch.cat(blocks, dim=1), bias


def _check_plain_logits(config) -> None:
    for field, neutral in _LOGIT_TRANSFORMS.items():
        value = getattr(config, field, neutral)
        if value is not None and value != neutral:
            raise ValueError(
                f"model: its logits are not the lm-head output ({field}={value!r}); "
                "ftis_linear_loss would compute another loss"
            )


def _check_head_on_decoder(causal_lm: nn.Module, decoder: nn.Module, head: nn.Module) -> None:
    """The output embedding must be a child of the causal LM applied to the decoder's output: no
    prediction head around it (BERT's `cls`, RoBERTa's `lm_head`: dense, activation, norm), no other
    module with parameters beside it (Electra's `generator_predictions`, a final norm)."""
    if not any(child is head for child in causal_lm.children()):
        raise ValueError(
            f"model: its output embedding ({type(head).__name__}) sits inside another module; "
            "the logits are not the lm-head of the decoder's hidden states"
        )
    for name, child in causal_lm.named_children():
        if child is head or any(m is decoder for m in child.modules()):
            continue
        if any(True for _ in child.parameters()):
            raise ValueError(
                f"model: module {name!r} ({type(child).__name__}) holds parameters beside the "
                "decoder and the lm-head; the logits may not be the lm-head of the decoder's output"
            )
    active = _active_module(head)
    lora_cls = _lora_layer_cls()
    if lora_cls is not None and isinstance(active, lora_cls):
        active = active.get_base_layer()
    if isinstance(active, nn.Linear):
        _check_no_extra_parameters(active)
    unpadded = getattr(causal_lm.config, "unpadded_vocab_size", None)
    weight = getattr(head, "weight", None)
    if unpadded is not None and weight is not None and unpadded < weight.shape[0]:
        raise ValueError(
            f"model: its logits are sliced to unpadded_vocab_size={unpadded} of the lm-head's "
            f"{weight.shape[0]} rows; ftis_linear_loss would compute another loss"
        )


def lm_head_inputs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    completion_mask: torch.Tensor,
    states: Optional[torch.Tensor] = None,
) -> LMHeadInputs:
    """Hidden states of the completion positions, their target tokens and the lm-head.

    Args:
        model: a transformers causal LM (`get_decoder()` + `get_output_embeddings()`), plain or
            peft-wrapped.
        input_ids: (B, L) int, prompt and completion.
        attention_mask: (B, L) 0/1 or bool, or None (all ones).
        completion_mask: (B, L) 0/1 or bool over input_ids; or (B, C) over its last C columns
            (TRL's layout, prompt and completion concatenated).
        states: (B, L, H) the decoder's last hidden states when the caller ran the model itself
            (e.g. through a DDP wrapper, whose forward arms the gradient all-reduce); None = run
            the decoder here.

    The columns returned start at the first column holding a completion token (`start`, >= 1)
    and run to L; mask = completion_mask & attention_mask on them. The decoder runs on the whole
    sequence; its states are taken at columns start - 1 .. L - 2 (one predicts the next token).
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids: expected a (B, L) tensor, got {getattr(input_ids, 'shape', input_ids)!r}"
        )
    B, L = input_ids.shape
    if attention_mask is not None and tuple(attention_mask.shape) != (B, L):
        raise ValueError(
            f"attention_mask: expected shape ({B}, {L}) or None, got {tuple(attention_mask.shape)}"
        )
    if (
        not isinstance(completion_mask, torch.Tensor)
        or completion_mask.dim() != 2
        or completion_mask.shape[0] != B
        or not 1 <= completion_mask.shape[1] <= L
    ):
        raise ValueError(
            f"completion_mask: expected a (B, L) or (B, C <= L) tensor with B={B}, L={L}, "
            f"got {getattr(completion_mask, 'shape', completion_mask)!r}"
        )
    comp = completion_mask != 0
    if comp.shape[1] < L:
        comp = torch.cat([comp.new_zeros(B, L - comp.shape[1]), comp], dim=1)
    any_col = comp.any(dim=0)
    if not bool(any_col.any()):
        raise ValueError("completion_mask: expected at least one completion token")
    start = int(any_col.nonzero()[0, 0])
    if start < 1:
        raise ValueError(
            "completion_mask: column 0 holds a completion token, which no hidden state predicts"
        )

    causal_lm = _unwrap_peft(model)
    _check_plain_logits(causal_lm.config)
    decoder = causal_lm.get_decoder()
    head = causal_lm.get_output_embeddings()
    _check_head_on_decoder(causal_lm, decoder, head)
    if states is None:
        states = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    # The head sees every position, as in the model's forward, so LoRA dropout draws the same masks.
    hidden, weight, bias = linear_head(head, states)
    hidden = hidden[:, start - 1 : L - 1]
    mask = comp[:, start:]
    if attention_mask is not None:
        mask = mask & (attention_mask[:, start:] != 0)
    return LMHeadInputs(
        hidden=hidden,
        weight=weight,
        bias=bias,
        tokens=input_ids[:, start:].long(),
        mask=mask,
        start=start,
    )
