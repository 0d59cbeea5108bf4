"""`ftis_linear_loss`: the F-TIS loss from the last hidden states and the lm-head, without ever
materialising the (B, T, V) logits (FTIS_SPEC.md §2, applied to `hidden @ weight.T + bias`).

The completion positions are processed in chunks of `chunk_size` rows. Forward: for each chunk,
one matmul gives the chunk's logits (c, V) in the hidden dtype, and the streaming row kernel of
`ftis_loss` (`kernels/logp_lse.py`) reads them for log pi_theta of the taken token and the row's
log-sum-exp. The per-sample part (`per_sample.py`) then needs every token of a sample at once
(KL filter, sequence-level weight, normaliser), so it runs after the loop and yields the loss, the
metrics and coef = d loss / d logp. Backward: each chunk's logits are recomputed, the row backward
kernel overwrites them with dlogits = coef * (onehot - softmax) / temperature, and two matmuls
accumulate grad_hidden and grad_weight (fp32 accumulation). Rows without gradient (masked,
filtered, zero advantage) are skipped in both passes, so their hidden states may hold anything.

Extra memory is one chunk of logits (c * V in the hidden dtype, plus the CPU row passes' fp32
scratch), for bf16/fp16 weights an fp32 grad_weight accumulator and one fp32 partial product of
GRAD_WEIGHT_BLOCK_V vocabulary rows, and O(B * T) per-token scalars: nothing grows with
B * T * V (`bench/linear_memory.py` measures it).

This is the "cuBLAS matmul per chunk + the row kernels" design. The matmul itself is torch's
(cuBLAS on GPU, oneDNN/MKL on CPU); only the row passes are Triton. Fusing the log-sum-exp into a
Triton matmul epilogue (Cut Cross-Entropy style) would drop the chunk buffer and one read of it.

Dispatch, by where `hidden` lives, exactly as `ftis_loss`: CUDA -> Triton row kernels; CPU with
the kernels decorated under TRITON_INTERPRET=1 -> the same kernels, interpreted; CPU otherwise ->
the chunked PyTorch row passes.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch

from ftis_kernels.ftis_loss import (
    arguments,
    backward_stats,
    fake_forward_outputs,
    forward_outputs,
    forward_schema,
    public_metrics,
    save_for_backward,
)
from ftis_kernels.kernels import BACKWARD, FORWARD, select_backend
from ftis_kernels.options import (
    FTISOptions,
    option_args,
    options_from_args,
    resolve_options,
    with_option_keywords,
)
from ftis_kernels.sharded import all_reduce_sum, check_shards, combine_row_stats, group_name
from ftis_kernels.packing import check_cu_seqlens, packed_rows, per_sample_part
from ftis_kernels.validate import LOGIT_DTYPES, check_row_tensors, check_tensor, check_values

# With chunk_size=None, a chunk holds at most this many logits (2^25: 64 MiB in bf16, 128 MiB in
# fp32, i.e. 220 rows of Qwen2.5's 151,936-token vocabulary; still a GEMM of 100 GFLOP at H=1536).
AUTO_CHUNK_ELEMENTS = 1 << 25

# Vocabulary rows per fp32 partial product of grad_weight when the weight is bf16/fp16
# (8192 x H x 4 bytes: 48 MiB at H = 1536).
GRAD_WEIGHT_BLOCK_V = 8192



def auto_chunk_size(V: int) -> int:
    """Rows per chunk when `chunk_size` is None: AUTO_CHUNK_ELEMENTS // V, at least 1."""
    return max(1, AUTO_CHUNK_ELEMENTS // V)


def _chunks(rows: tuple[torch.Tensor, torch.Tensor], chunk_size: int) -> Iterator[tuple]:
    """(b, t) index tensors of at most chunk_size positions each."""
    b, t = rows
    for i in range(0, b.numel(), chunk_size):
        yield b[i : i + chunk_size], t[i : i + chunk_size]


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """(c, V) logits of (c, H) hidden states, in their dtype: the same matmul as the model's."""
    return h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())


def _accumulate_grad_weight(acc: torch.Tensor, dlogits: torch.Tensor, h: torch.Tensor) -> None:
    """acc (V, H) fp32 += dlogits.T @ h, with fp32 accumulation across chunks."""
    if dlogits.dtype == torch.float32:
        acc.addmm_(dlogits.t(), h)
        return
    # No GEMM accumulates bf16/fp16 products into an fp32 tensor in place, and a whole (V, H) fp32
    # product per chunk would be as large as the accumulator: go a block of vocabulary at a time.
    for v0 in range(0, acc.shape[0], GRAD_WEIGHT_BLOCK_V):
        block = slice(v0, v0 + GRAD_WEIGHT_BLOCK_V)
        if dlogits.is_cuda:
            # cuBLAS half-precision GEMM with an fp32 result: the chunk's partial sum is not rounded.
            acc[block].add_(torch.mm(dlogits[:, block].t(), h, out_dtype=torch.float32))
        else:
            # CPU half-precision GEMMs return their dtype: upcast the block instead.
            acc[block].addmm_(dlogits[:, block].t().float(), h.float())


def linear_logp_lse(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    tokens: torch.Tensor,
    rows: tuple[torch.Tensor, torch.Tensor],
    temperature: float,
    chunk_size: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward pass. hidden (B, T, H), weight (V, H), bias (V,) or None, tokens (B, T);
    rows = (b, t) int64 index tensors of the positions to compute.

    Returns logp, row_max, log_sum, entropy (B, T) fp32: log pi_theta(token), the row statistics
    of logits / temperature and the entropy of softmax(logits / temperature)
    (`kernels/logp_lse.py`) at `rows`, 0 elsewhere.
    """
    B, T, _ = hidden.shape
    logp, row_max, log_sum, entropy = (
        torch.zeros(B, T, dtype=torch.float32, device=hidden.device) for _ in range(4)
    )
    for b, t in _chunks(rows, chunk_size):
        chunk = _chunk_forward(hidden[b, t], weight, bias, tokens[b, t], temperature, backend)
        logp[b, t], row_max[b, t], log_sum[b, t], entropy[b, t] = chunk
    return logp, row_max, log_sum, entropy


def _chunk_forward(h, weight, bias, tokens, temperature, backend):
    # One function per chunk so that its logits are freed before the next chunk allocates its own.
    logits = _chunk_logits(h, weight, bias)
    stats = FORWARD[backend](logits[None], tokens[None], None, temperature)
    return tuple(x[0] for x in stats)


def linear_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    tokens: torch.Tensor,
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    coef: torch.Tensor,
    entropy: Optional[torch.Tensor],
    entropy_coef: Optional[torch.Tensor],
    temperature: float,
    chunk_size: int,
    backend: str,
    needs: tuple[bool, bool, bool],
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Backward pass. row_max, log_sum, entropy (B, T) fp32 from the forward; coef, entropy_coef
    (B, T) fp32 = d loss / d logp and d loss / d entropy times the incoming gradient, over
    temperature (entropy and entropy_coef None without an entropy bonus); needs = which of
    (hidden, weight, bias) want a grad.

    With dlogits[r, v] = coef[r] * (1[v == token[r]] - p[r, v]) - entropy_coef[r] * p[r, v] *
    (log p[r, v] + entropy[r]), p = softmax(logits / temperature) (`kernels/logp_lse.py`):
    grad_hidden = dlogits @ weight (hidden dtype), grad_weight = dlogits.T @ hidden and
    grad_bias = sum_r dlogits[r] (fp32 accumulation, returned in the weight's dtype).
    """
    need_h, need_w, need_b = needs
    f32 = torch.float32
    grad_hidden = torch.zeros_like(hidden) if need_h else None
    grad_weight = None
    if need_w:
        grad_weight = torch.zeros(weight.shape, dtype=f32, device=weight.device)
    grad_bias = torch.zeros(weight.shape[0], dtype=f32, device=weight.device) if need_b else None
    if any(needs):
        live = coef != 0 if entropy_coef is None else (coef != 0) | (entropy_coef != 0)
        for b, t in _chunks(live.nonzero(as_tuple=True), chunk_size):
            per_row = (row_max, log_sum, coef, entropy, entropy_coef)
            stats = tuple(None if x is None else x[b, t] for x in per_row)
            _chunk_backward(hidden[b, t], weight, bias, tokens[b, t], stats, temperature,
                            backend, grad_hidden, (b, t), grad_weight, grad_bias)  # fmt: skip
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    if grad_bias is not None:
        grad_bias = grad_bias.to(weight.dtype)
    return grad_hidden, grad_weight, grad_bias


def _chunk_backward(h, weight, bias, tokens, stats, temperature, backend, grad_hidden, rows,
                    grad_weight, grad_bias) -> None:  # fmt: skip
    logits = _chunk_logits(h, weight, bias)[None]
    # In place: the chunk's logits become their gradient.
    row_max, log_sum, coef, entropy, entropy_coef = (None if x is None else x[None] for x in stats)
    dlogits = BACKWARD[backend](logits, tokens[None], row_max, log_sum, coef, temperature, logits,
                                entropy, entropy_coef)[0]
    if grad_hidden is not None:
        grad_hidden[rows] = dlogits @ weight
    if grad_weight is not None:
        _accumulate_grad_weight(grad_weight, dlogits, h)
    if grad_bias is not None:
        grad_bias += dlogits.sum(dim=0, dtype=torch.float32)


def _completion_rows(mask: Optional[torch.Tensor], B: int, T: int, device) -> tuple[torch.Tensor, ...]:
    """(b, t) int64 index tensors of the completion positions, in row-major order."""
    if mask is None:
        pos = torch.arange(B * T, device=device)
        return pos // T, pos % T
    return mask.nonzero(as_tuple=True)


# Registered with torch.library like `ftis_loss`, so that torch.compile(fullgraph=True) sees one
# opaque node per pass with a fake (shape-only) implementation and an autograd formula. The
# options travel unpacked: a custom op's schema takes tensors and plain scalars only.


_FWD_SCHEMA = forward_schema(
    "Tensor hidden, Tensor weight, Tensor? bias, Tensor tokens, Tensor gen_logprobs, "
    "Tensor advantages, Tensor? mask, Tensor? old_logprobs, Tensor? ref_logprobs"
).format(
    trailing="Tensor? cu_seqlens, int max_seqlen, int vocab_start, str? group_name, "
    "int chunk_size, str backend"
)


def _ftis_linear_loss_fwd_impl(*inputs):
    """Checks the input values and the logits' row statistics right after the row pass, with
    one synchronisation: here they run eagerly even under torch.compile."""
    args = arguments(_ftis_linear_loss_fwd, inputs)
    opt = options_from_args(args)
    hidden, weight, bias, tokens = (args[k] for k in ("hidden", "weight", "bias", "tokens"))
    gen, adv, mask = args["gen_logprobs"], args["advantages"], args["mask"]
    old, ref = args["old_logprobs"], args["ref_logprobs"]
    B, T, _ = hidden.shape
    m = None if mask is None else mask != 0
    rows = _completion_rows(m, B, T, hidden.device)
    V, name, start = weight.shape[0], args["group_name"], args["vocab_start"]
    local = tokens if name is None else tokens - start
    if name is not None:
        group, V = check_shards(name, hidden.device, start, weight.shape[0], hidden.shape[2])
    chunking = (opt.temperature, args["chunk_size"], args["backend"])
    logp, row_max, log_sum, entropy = linear_logp_lse(hidden, weight, bias, local, rows, *chunking)
    if name is not None:
        stats = (logp, row_max, log_sum, entropy)
        shard = (group, local, weight.shape[0], m)
        logp, row_max, log_sum, entropy = combine_row_stats(*shard, *stats)
    stats = (logp, row_max, log_sum)
    check_values(V, tokens, gen, adv, mask, old, ref, stats, logits_name="hidden")
    packing = (args["cu_seqlens"], args["max_seqlen"])
    result = per_sample_part(logp, gen, adv, m, old, ref, opt, entropy, *packing)
    return forward_outputs(result, row_max, log_sum)


_ftis_linear_loss_fwd = torch.library.custom_op(
    "ftis_kernels::ftis_linear_loss_fwd",
    _ftis_linear_loss_fwd_impl,
    mutates_args=(),
    schema=_FWD_SCHEMA,
)


@_ftis_linear_loss_fwd.register_fake
def _(*inputs):
    args = arguments(_ftis_linear_loss_fwd, inputs)
    hidden = args["hidden"]
    return fake_forward_outputs(hidden, hidden.shape[0], hidden.shape[1], args["cu_seqlens"])


@torch.library.custom_op("ftis_kernels::ftis_linear_loss_bwd", mutates_args=())
def _ftis_linear_loss_bwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    tokens: torch.Tensor,
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    coef: torch.Tensor,
    entropy: Optional[torch.Tensor],
    entropy_coef: Optional[torch.Tensor],
    temperature: float,
    chunk_size: int,
    backend: str,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    group_name: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_hidden, grad_weight, grad_bias); an empty tensor for each one not needed (a custom
    op returns no None). coef and entropy_coef already scaled by the incoming gradient and
    1 / temperature. With group_name (a vocabulary shard per rank), grad_hidden is summed over the
    ranks; grad_weight and grad_bias stay this shard's."""
    needs = (need_hidden, need_weight, need_bias)
    stats = (row_max, log_sum, coef, entropy, entropy_coef)
    grads = linear_grads(hidden, weight, bias, tokens, *stats, temperature, chunk_size, backend,
                         needs)
    if group_name is not None and grads[0] is not None:
        all_reduce_sum(grads[0], group_name)
    return tuple(hidden.new_empty(0) if g is None else g for g in grads)


@_ftis_linear_loss_bwd.register_fake
def _(hidden, weight, bias, tokens, *stats_and_flags, group_name=None):
    need_hidden, need_weight, need_bias = stats_and_flags[-3:]
    return (
        torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
        torch.empty_like(weight) if need_weight else hidden.new_empty(0),
        weight.new_empty(weight.shape[0]) if need_bias else hidden.new_empty(0),
    )


def _setup_context(ctx, inputs, output):
    args = arguments(_ftis_linear_loss_fwd, inputs)
    tokens = args["tokens"]
    if args["group_name"] is not None:  # this shard's ids; another shard's token is never hit
        tokens = tokens - args["vocab_start"]
    tensors = (args["hidden"], args["weight"], args["bias"], tokens)
    save_for_backward(ctx, args, inputs, output, *tensors)
    ctx.chunk_size, ctx.group_name = args["chunk_size"], args["group_name"]


def _backward(ctx, grad_loss, *_):
    hidden, weight, bias, tokens = ctx.saved_tensors[:4]
    stats = backward_stats(ctx, grad_loss)
    needs = ctx.needs_input_grad
    need_bias = bias is not None and needs[2]
    grad_hidden, grad_weight, grad_bias = torch.ops.ftis_kernels.ftis_linear_loss_bwd(
        hidden, weight, bias, tokens, *stats, ctx.temperature, ctx.chunk_size, ctx.backend,
        needs[0], needs[1], need_bias, ctx.group_name,
    )
    grads = (
        grad_hidden if needs[0] else None,
        grad_weight if needs[1] else None,
        grad_bias if need_bias else None,
    )
    return grads + (None,) * (ctx.n_inputs - len(grads))


_ftis_linear_loss_fwd.register_autograd(_backward, setup_context=_setup_context)


def _check_linear_inputs(hidden: object, weight: object, bias: object, chunk_size: object) -> tuple[int, ...]:
    """Shapes, dtypes and devices of hidden, weight, bias and chunk_size; returns (B, T, H, V)."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or min(hidden.shape) < 1:
        raise ValueError(f"hidden: expected a (B, T, H) tensor with B, T, H >= 1, got "
                         f"{hidden.shape if isinstance(hidden, torch.Tensor) else hidden!r}")  # fmt: skip
    B, T, H = hidden.shape
    check_tensor("hidden", hidden, (B, T, H), LOGIT_DTYPES, hidden.device)
    if hidden.device.type not in ("cuda", "cpu"):
        raise ValueError(f"hidden: expected a CUDA or CPU tensor, got a tensor on {hidden.device}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] < 1:
        raise ValueError(f"weight: expected a (V, {H}) tensor with V >= 1, got "
                         f"{weight.shape if isinstance(weight, torch.Tensor) else weight!r}")  # fmt: skip
    V = weight.shape[0]
    check_tensor("weight", weight, (V, H), (hidden.dtype,), hidden.device)
    if bias is not None:
        check_tensor("bias", bias, (V,), (hidden.dtype,), hidden.device)
    bad_chunk = isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    if chunk_size is not None and bad_chunk:
        raise ValueError(f"chunk_size: expected None or an int >= 1, got {chunk_size!r}")
    return B, T, H, V


@with_option_keywords
def ftis_linear_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    gen_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    old_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    *,
    bias: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
    options: Optional[FTISOptions] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    vocab_start: int = 0,
    process_group: Optional[Any] = None,
    **option_keywords: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and metrics of `ftis_loss(hidden @ weight.T + bias, ...)`, from the hidden
    states, a chunk of positions at a time: the (B, T, V) logits never exist.

    Args:
        hidden: (B, T, H) fp32 | bf16 | fp16, any strides; hidden[b, t] scores tokens[b, t].
        weight: (V, H), the hidden dtype: the lm-head (or tied embedding) weight.
        tokens, gen_logprobs, advantages, mask, old_logprobs, ref_logprobs: as in `ftis_loss`
            ((B, T) tokens in [0, V), (B, T) gen/old/ref logprobs, (B,) advantages, (B, T) mask).
        bias: (V,) in the hidden dtype, or None.
        chunk_size: positions per chunk (rows of logits alive at once); None = as many as keep a
            chunk within AUTO_CHUNK_ELEMENTS logits. Only memory and speed depend on it.
        options, **option_keywords: as in `ftis_loss` (the fields of `FTISOptions`).
        cu_seqlens: packed batches as in `ftis_loss`: hidden (N, H) or (1, N, H).
        vocab_start, process_group: a vocabulary-sharded lm-head, as in `ftis_loss`: weight
            (V_local, H) (and bias (V_local,)) are the rows vocab_start : vocab_start + V_local of
            the full lm-head on this rank; hidden and the rows are the same on every rank.
            grad_hidden is summed over the ranks (one all-reduce of (B, T, H) in the backward);
            grad_weight and grad_bias are this shard's.

    The logits of a chunk are computed in the hidden dtype, as the model's lm-head would; the
    row passes and the reductions accumulate in fp32. Hidden states at masked positions are never
    read into a loss or a gradient (they may hold anything).

    Returns:
        loss: 0-dim fp32; gradients flow to `hidden`, `weight` and `bias`.
        metrics: as `ftis_loss`.
    """
    opt = resolve_options(options, option_keywords)
    flat = cu_seqlens is not None and isinstance(hidden, torch.Tensor) and hidden.dim() == 2
    hidden = hidden.unsqueeze(0) if flat else hidden
    B, T, H, V = _check_linear_inputs(hidden, weight, bias, chunk_size)
    backend = select_backend(hidden.device)
    samples, max_seqlen = B, 0
    if cu_seqlens is not None:
        if B != 1:
            shape = tuple(hidden.shape)
            raise ValueError(f"hidden: expected (N, H) or (1, N, H) with cu_seqlens, got {shape}")
        samples, max_seqlen = check_cu_seqlens(cu_seqlens, T, hidden.device)
        tokens, gen_logprobs, mask, old_logprobs, ref_logprobs = packed_rows(
            T, tokens, gen_logprobs, mask, old_logprobs, ref_logprobs
        )
    rows = (tokens, gen_logprobs, advantages, mask, old_logprobs, ref_logprobs)
    check_row_tensors(B, T, hidden.device, *rows, opt.beta, samples=samples)
    outputs = _ftis_linear_loss_fwd(
        hidden,
        weight,
        bias,
        tokens,
        gen_logprobs.detach(),
        advantages.detach(),
        mask,
        None if old_logprobs is None else old_logprobs.detach(),
        None if ref_logprobs is None else ref_logprobs.detach(),
        *option_args(opt),
        cu_seqlens,
        max_seqlen,
        vocab_start,
        group_name(process_group, vocab_start),
        auto_chunk_size(V) if chunk_size is None else int(chunk_size),
        backend,
    )
    return outputs[0], public_metrics(outputs, T if flat else None)
