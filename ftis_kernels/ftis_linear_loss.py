"""`ftis_linear_loss`: the F-TIS loss from the last hidden states and the lm-head, without ever
materialising the (B, T, V) logits (docs/method.md §2, applied to `hidden @ weight.T + bias`).

The completion positions are processed in chunks of rows. For each chunk, one matmul gives the
chunk's logits (c, V) in the hidden dtype, and the streaming row kernel of `ftis_loss`
(`kernels/logp_lse.py`) reads them for log pi_theta of the taken token and the row's statistics.
The per-sample part (`per_sample.py`) needs every token of a sample (KL filter, sequence-level
weight, normaliser) and yields the loss, the metrics and coef = d loss / d logp. The gradients
follow in one of two orders, with the same results:

- In the forward (6 N H V FLOPs, as Liger's chunked losses do), when every chunk holds whole
  samples and a sample's coef depends on no other sample's logits (`grad_in_forward_blocker`):
  each chunk's coef is known as soon as its logits are, so the row backward kernel overwrites
  them at once with dlogits = coef * (onehot - softmax) / temperature and two matmuls accumulate
  grad_hidden and grad_weight (fp32 accumulation), for an incoming gradient of 1; the backward
  only multiplies them by the incoming gradient (in place, nothing at 1).
- In the backward (8 N H V FLOPs): each chunk's logits are recomputed, turned into dlogits and
  fed to the same two matmuls.

Rows without gradient (masked, filtered, zero advantage) are skipped by the matmuls of the
gradients, and masked rows are never read, so their hidden states may hold anything.

Extra memory is bounded independently of B * T: one chunk of logits, at most
max(AUTO_CHUNK_ELEMENTS, AUTO_SAMPLE_CHUNK_ELEMENTS) of them with chunk_size=None (c * V in the
hidden dtype, plus the CPU row passes' fp32 scratch; in the forward order a chunk with rows
without gradient copies out its other rows, up to a second chunk), for bf16/fp16 weights an fp32
grad_weight accumulator and one fp32 partial product of GRAD_WEIGHT_BLOCK_V vocabulary rows, and
O(B * T) per-token scalars (`bench/linear_memory.py` measures it). In the forward order the
gradients exist from the forward on instead of from the backward on.

This is the "cuBLAS matmul per chunk + the row kernels" design. The matmul itself is torch's
(cuBLAS on GPU, oneDNN/MKL on CPU); only the row passes are Triton. Fusing the log-sum-exp into a
Triton matmul epilogue (Cut Cross-Entropy style) would drop the chunk buffer and one read of it.

Dispatch, by where `hidden` lives, exactly as `ftis_loss`: CUDA -> Triton row kernels; CPU with
the kernels decorated under TRITON_INTERPRET=1 -> the same kernels, interpreted; CPU otherwise ->
the chunked PyTorch row passes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Optional

import torch

from ftis_kernels.ftis_loss import (
    N_OUTPUTS,
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
    OptionKeywords,
    option_args,
    options_from_args,
    resolve_options,
    with_option_keywords,
)
from ftis_kernels.packing import (
    check_cu_seqlens,
    packed_rows,
    per_sample_part,
    segment_index,
)
from ftis_kernels.per_sample import PerSample
from ftis_kernels.sharded import all_reduce_sum, check_shards, combine_row_stats, group_name
from ftis_kernels.validate import LOGIT_DTYPES, check_row_tensors, check_tensor, check_values

if TYPE_CHECKING:
    from typing_extensions import Unpack

# With chunk_size=None, a chunk holds at most this many logits (2^27: 256 MiB in bf16, 512 MiB in
# fp32, i.e. 883 rows of Qwen2.5's 151,936-token vocabulary): CPU GEMMs run about 1.3x faster at
# 1,024 rows than at 220, and no chunk grows with B * T...
AUTO_CHUNK_ELEMENTS = 1 << 27
# ...or the longest sample, when its logits are at most this many (2^28: 1 GiB in fp32, 1,766 rows
# of 151,936): chunks of whole samples let the forward compute the gradients (6 N H V FLOPs).
AUTO_SAMPLE_CHUNK_ELEMENTS = 1 << 28

# Vocabulary rows per fp32 partial product of grad_weight when the weight is bf16/fp16
# (8192 x H x 4 bytes: 48 MiB at H = 1536).
GRAD_WEIGHT_BLOCK_V = 8192

# Loss types whose normaliser counts the loss's tokens over the whole batch (`per_sample.py`'s
# scale: 1 / n_all); grpo and sapo divide by the sample's own count, dr_grpo and luspo by
# constants.
BATCH_NORMALISED = ("bnpo", "dapo", "cispo", "vespo")


def auto_chunk_size(V: int, longest: int = 0) -> int:
    """Rows per chunk when `chunk_size` is None: AUTO_CHUNK_ELEMENTS // V (at least 1), raised to
    `longest` (the most completion rows one sample can have) when that many rows hold at most
    AUTO_SAMPLE_CHUNK_ELEMENTS logits."""
    rows = max(1, AUTO_CHUNK_ELEMENTS // V)
    return max(rows, longest) if longest * V <= AUTO_SAMPLE_CHUNK_ELEMENTS else rows


def grad_in_forward_blocker(
    opt: FTISOptions, *, with_old: bool, sharded: bool, longest: int, chunk_size: int
) -> Optional[str]:
    """Why the forward cannot compute the gradients chunk by chunk (a phrase), or None when it
    can: every chunk must hold whole samples (`longest` completion rows a sample can have, at
    most `chunk_size`), and one sample's d loss / d logp must depend on no other sample's logits.

    Per sample, the KL filter, the sequence-level IS weight and PPO ratio, VESPO's weight and
    grpo/sapo's per-sample token count read that sample's tokens only. What couples samples
    (`per_sample.py`): rejection by mask (`reject_mode="mask"`) that depends on pi_theta (a
    KL filter on the current policy) takes a rejected sample's tokens out of the batch-wide
    token count of the loss types in BATCH_NORMALISED and of the entropy bonus; a sharded
    vocabulary completes each row's statistics only with an all-reduce after the forward.
    """
    if sharded:
        return (
            "with a vocabulary-sharded lm-head (process_group: the row statistics are complete "
            "only after an all-reduce)"
        )
    filter_reads_logp = opt.filter not in (None, "negative") and (
        opt.kl_source == "current" or not with_old
    )
    if opt.reject_mode == "mask" and filter_reads_logp:
        why = "(a sample's rejection changes every sample's normaliser)"
        if opt.loss_type in BATCH_NORMALISED:
            return f"with reject_mode='mask' and loss_type={opt.loss_type!r} {why}"
        if opt.entropy_coef > 0:
            return f"with reject_mode='mask' and entropy_coef > 0 {why}"
    if longest > chunk_size:
        return (
            f"when a sample ({longest} rows) does not fit in a chunk of chunk_size={chunk_size} "
            "rows (raise chunk_size)"
        )
    return None


def _chunks(rows: tuple[torch.Tensor, torch.Tensor], chunk_size: int) -> Iterator[tuple]:
    """(b, t) index tensors of at most chunk_size positions each."""
    b, t = rows
    for i in range(0, b.numel(), chunk_size):
        yield b[i : i + chunk_size], t[i : i + chunk_size]


def _sample_chunks(
    rows: tuple[torch.Tensor, torch.Tensor], samples: torch.Tensor, chunk_size: int
) -> Optional[list[tuple]]:
    """(b, t) index tensors of chunks of whole samples, at most chunk_size positions each, from the
    completion positions `rows` and the sample of each (n,) (non-decreasing); None when a sample
    has more than chunk_size positions. One synchronisation (the samples' sizes)."""
    sizes = torch.unique_consecutive(samples, return_counts=True)[1].tolist()
    if max(sizes, default=0) > chunk_size:
        return None
    bounds, size = [0], 0
    for n in sizes:
        if size + n > chunk_size:
            bounds.append(bounds[-1] + size)
            size = 0
        size += n
    bounds.append(bounds[-1] + size)
    b, t = rows
    return [(b[i0:i1], t[i0:i1]) for i0, i1 in zip(bounds, bounds[1:]) if i1 > i0]


def _chunk_logits(
    h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """(c, V) logits of (c, H) hidden states, in their dtype: the same matmul as the model's."""
    return h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())


def _accumulate_grad_weight(acc: torch.Tensor, dlogits: torch.Tensor, h: torch.Tensor) -> None:
    """acc (V, H) fp32 += dlogits.T @ h, with fp32 accumulation across chunks."""
    if dlogits.dtype == torch.float32:
        acc.addmm_(dlogits.t(), h)
        return
    # No GEMM accumulates bf16/fp16 products into an fp32 tensor in place, and a whole (V, H) fp32
    # product per chunk would be as large as the accumulator: go a block of vocabulary at a time.
    h32 = None if dlogits.is_cuda else h.float()
    for v0 in range(0, acc.shape[0], GRAD_WEIGHT_BLOCK_V):
        block = slice(v0, v0 + GRAD_WEIGHT_BLOCK_V)
        if dlogits.is_cuda:
            # cuBLAS half-precision GEMM with an fp32 result: the chunk's partial sum is not rounded.  # noqa: E501
            acc[block].add_(torch.mm(dlogits[:, block].t(), h, out_dtype=torch.float32))
        else:
            # CPU half-precision GEMMs return their dtype: upcast the block instead.
            acc[block].addmm_(dlogits[:, block].t().float(), h32)


def linear_logp_lse(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    tokens: torch.Tensor,
    rows: tuple[torch.Tensor, torch.Tensor],
    temperature: float,
    chunk_size: int,
    backend: str,
    chunks: Optional[list[tuple]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward pass. hidden (B, T, H), weight (V, H), bias (V,) or None, tokens (B, T);
    rows = (b, t) int64 index tensors of the positions to compute, in chunks of chunk_size, or
    in `chunks` of them when given.

    Returns logp, row_max, log_sum, entropy (B, T) fp32: log pi_theta(token), the row statistics
    of logits / temperature and the entropy of softmax(logits / temperature)
    (`kernels/logp_lse.py`) at `rows`, 0 elsewhere.
    """
    B, T, _ = hidden.shape
    logp, row_max, log_sum, entropy = (
        torch.zeros(B, T, dtype=torch.float32, device=hidden.device) for _ in range(4)
    )
    for b, t in _chunks(rows, chunk_size) if chunks is None else chunks:
        chunk = _chunk_forward(hidden[b, t], weight, bias, tokens[b, t], temperature, backend)[1]
        logp[b, t], row_max[b, t], log_sum[b, t], entropy[b, t] = chunk
    return logp, row_max, log_sum, entropy


def _chunk_forward(h, weight, bias, tokens, temperature, backend):
    """(the chunk's logits (c, V), their (logp, row_max, log_sum, entropy) (c,)). One function
    per chunk, so that a chunk's logits are freed before the next chunk allocates its own."""
    logits = _chunk_logits(h, weight, bias)
    stats = FORWARD[backend](logits[None], tokens[None], None, temperature)
    return logits, tuple(x[0] for x in stats)


def _new_grads(hidden, weight, needs) -> tuple[Optional[torch.Tensor], ...]:
    """Zero grad_hidden (hidden's dtype), grad_weight and grad_bias (fp32 accumulators), each
    None unless flagged in needs = (hidden, weight, bias)."""
    need_h, need_w, need_b = needs
    f32, dev = torch.float32, weight.device
    return (
        torch.zeros_like(hidden) if need_h else None,
        torch.zeros(weight.shape, dtype=f32, device=dev) if need_w else None,
        torch.zeros(weight.shape[0], dtype=f32, device=dev) if need_b else None,
    )


def _finish_grads(grads, weight) -> tuple[Optional[torch.Tensor], ...]:
    """The accumulators of `_new_grads` in the weight's dtype."""
    grad_hidden, grad_weight, grad_bias = grads
    return (
        grad_hidden,
        None if grad_weight is None else grad_weight.to(weight.dtype),
        None if grad_bias is None else grad_bias.to(weight.dtype),
    )


def _chunk_grads(logits, h, weight, tokens, stats, temperature, backend, rows, grads) -> None:
    """Overwrites a chunk's logits (c, V) with their gradient (stats = row_max, log_sum, coef,
    entropy, entropy_coef (c,), the last two None without an entropy bonus) and accumulates it
    into grads = (grad_hidden at `rows`, grad_weight, grad_bias), each None when not needed."""
    row_max, log_sum, coef, entropy, entropy_coef = (None if x is None else x[None] for x in stats)
    dlogits = BACKWARD[backend](
        logits[None],
        tokens[None],
        row_max,
        log_sum,
        coef,
        temperature,
        logits[None],
        entropy,
        entropy_coef,
    )[0]
    grad_hidden, grad_weight, grad_bias = grads
    if grad_hidden is not None:
        grad_hidden[rows] = dlogits @ weight
    if grad_weight is not None:
        _accumulate_grad_weight(grad_weight, dlogits, h)
    if grad_bias is not None:
        grad_bias += dlogits.sum(dim=0, dtype=torch.float32)


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
    """Backward pass (the gradients in the backward order). row_max, log_sum, entropy (B, T) fp32
    from the forward; coef, entropy_coef (B, T) fp32 = d loss / d logp and d loss / d entropy
    times the incoming gradient, over temperature (entropy and entropy_coef None without an
    entropy bonus); needs = which of (hidden, weight, bias) want a grad.

    With dlogits[r, v] = coef[r] * (1[v == token[r]] - p[r, v]) - entropy_coef[r] * p[r, v] *
    (log p[r, v] + entropy[r]), p = softmax(logits / temperature) (`kernels/logp_lse.py`):
    grad_hidden = dlogits @ weight (hidden dtype), grad_weight = dlogits.T @ hidden and
    grad_bias = sum_r dlogits[r] (fp32 accumulation, returned in the weight's dtype).
    """
    grads = _new_grads(hidden, weight, needs)
    if any(needs):
        live = coef != 0 if entropy_coef is None else (coef != 0) | (entropy_coef != 0)
        for b, t in _chunks(live.nonzero(as_tuple=True), chunk_size):
            per_row = (row_max, log_sum, coef, entropy, entropy_coef)
            stats = tuple(None if x is None else x[b, t] for x in per_row)
            h = hidden[b, t]
            logits = _chunk_logits(h, weight, bias)
            _chunk_grads(
                logits, h, weight, tokens[b, t], stats, temperature, backend, (b, t), grads
            )
            del logits
    return _finish_grads(grads, weight)


def linear_loss_and_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    tokens: torch.Tensor,
    chunks: list[tuple],
    coefficients: Callable[[torch.Tensor, torch.Tensor], PerSample],
    temperature: float,
    entropy_grad: bool,
    backend: str,
    needs: tuple[bool, bool, bool],
) -> tuple[tuple[torch.Tensor, ...], tuple[Optional[torch.Tensor], ...]]:
    """The forward pass and the gradients in one (the forward order), for an incoming gradient
    of 1. hidden (B, T, H), weight (V, H), bias (V,) or None, tokens (B, T); chunks: (b, t) index
    tensors of chunks of whole samples; coefficients(logp, entropy) -> `PerSample` on (B, T)
    tensors (its coef and entropy_coef are read at a chunk's rows, after every earlier chunk);
    entropy_grad: whether the entropy bonus is on.

    Returns ((logp, row_max, log_sum, entropy) as `linear_logp_lse`, the gradients as
    `linear_grads`). Exact when a sample's coefficients depend on its own logp and entropy only
    (`grad_in_forward_blocker`): the rows not computed yet hold 0 and change no other sample's.
    """
    B, T, _ = hidden.shape
    f32 = torch.float32
    logp, row_max, log_sum, entropy = (
        torch.zeros(B, T, dtype=f32, device=hidden.device) for _ in range(4)
    )
    grads = _new_grads(hidden, weight, needs)
    # The scale `backward_stats` gives coef and entropy_coef, for an incoming gradient of 1.
    scale = torch.ones((), dtype=f32, device=hidden.device) / temperature
    for b, t in chunks:
        h, tok = hidden[b, t], tokens[b, t]
        logits, stats = _chunk_forward(h, weight, bias, tok, temperature, backend)
        logp[b, t], row_max[b, t], log_sum[b, t], entropy[b, t] = stats
        result = coefficients(logp, entropy)
        coef = result.coef[b, t] * scale
        ecoef = result.entropy_coef[b, t] * scale if entropy_grad else None
        live = coef != 0 if ecoef is None else (coef != 0) | (ecoef != 0)
        if not bool(live.any()):
            continue
        per_row = (stats[1], stats[2], coef, stats[3] if entropy_grad else None, ecoef)
        if not bool(live.all()):
            # Rows without gradient (a rejected sample, a zero advantage) cost no matmul: their
            # logits are left out (a copy of c * V, against 4 * c * H * V FLOPs of matmuls).
            logits, h, tok, b, t = logits[live], h[live], tok[live], b[live], t[live]
            per_row = tuple(None if x is None else x[live] for x in per_row)
        _chunk_grads(logits, h, weight, tok, per_row, temperature, backend, (b, t), grads)
        del logits
    return (logp, row_max, log_sum, entropy), _finish_grads(grads, weight)


def _completion_rows(
    mask: Optional[torch.Tensor], B: int, T: int, device
) -> tuple[torch.Tensor, ...]:
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
    "Tensor advantages, Tensor? mask, Tensor? old_logprobs, Tensor? ref_logprobs",
    extra_outputs=3,
).format(
    trailing="Tensor? cu_seqlens, int max_seqlen, int vocab_start, str? group_name, "
    "int chunk_size, str backend, bool grad_in_forward, bool need_hidden, bool need_weight, "
    "bool need_bias"
)


def _ftis_linear_loss_fwd_impl(*inputs):
    """The outputs of `ftis_loss`'s forward op, then grad_hidden, grad_weight, grad_bias for an
    incoming gradient of 1 when grad_in_forward (those flagged need_*; an empty tensor for the
    others and in the backward order). Checks the input values and the logits' row statistics
    right after the row pass, with one synchronisation: here they run eagerly even under
    torch.compile."""
    args = arguments(_ftis_linear_loss_fwd, inputs)
    opt = options_from_args(args)
    hidden, weight, bias, tokens = (args[k] for k in ("hidden", "weight", "bias", "tokens"))
    gen, adv, mask = args["gen_logprobs"], args["advantages"], args["mask"]
    old, ref = args["old_logprobs"], args["ref_logprobs"]
    cu_seqlens, max_seqlen = args["cu_seqlens"], args["max_seqlen"]
    chunk_size, backend = args["chunk_size"], args["backend"]
    B, T, _ = hidden.shape
    m = None if mask is None else mask != 0
    rows = _completion_rows(m, B, T, hidden.device)
    V, name, start = weight.shape[0], args["group_name"], args["vocab_start"]
    local = tokens if name is None else tokens - start
    if name is not None:
        group, V = check_shards(name, hidden.device, start, weight.shape[0], hidden.shape[2])
    # Chunks of whole samples when they fit (in both orders, so that both compute the same
    # logits), else of chunk_size rows.
    samples = rows[0] if cu_seqlens is None else segment_index(cu_seqlens, T)[0][rows[1]]
    chunks = _sample_chunks(rows, samples, chunk_size)
    needs = tuple(args[k] for k in ("need_hidden", "need_weight", "need_bias"))
    grads = (None, None, None)
    if args["grad_in_forward"]:
        if chunks is None:  # the public function checked the longest sample against chunk_size
            raise AssertionError("grad_in_forward with a sample longer than chunk_size")

        def coefficients(logp: torch.Tensor, entropy: torch.Tensor) -> PerSample:
            return per_sample_part(logp, gen, adv, m, old, ref, opt, entropy, *packing)

        packing = (cu_seqlens, max_seqlen)
        entropy_grad = opt.entropy_coef > 0
        loop = (opt.temperature, entropy_grad, backend, needs)
        stats, grads = linear_loss_and_grads(
            hidden, weight, bias, local, chunks, coefficients, *loop
        )
        logp, row_max, log_sum, entropy = stats
    else:
        chunking = (opt.temperature, chunk_size, backend)
        logp, row_max, log_sum, entropy = linear_logp_lse(
            hidden, weight, bias, local, rows, *chunking, chunks=chunks
        )
    if name is not None:
        stats = (logp, row_max, log_sum, entropy)
        shard = (group, local, weight.shape[0], m)
        logp, row_max, log_sum, entropy = combine_row_stats(*shard, *stats)
    stats = (logp, row_max, log_sum)
    check_values(V, tokens, gen, adv, mask, old, ref, stats, logits_name="hidden")
    result = per_sample_part(logp, gen, adv, m, old, ref, opt, entropy, cu_seqlens, max_seqlen)
    grads = tuple(hidden.new_empty(0) if g is None else g for g in grads)
    return (*forward_outputs(result, row_max, log_sum), *grads)


_ftis_linear_loss_fwd = torch.library.custom_op(
    "ftis_kernels::ftis_linear_loss_fwd",
    _ftis_linear_loss_fwd_impl,
    mutates_args=(),
    schema=_FWD_SCHEMA,
)


@_ftis_linear_loss_fwd.register_fake
def _(*inputs):
    args = arguments(_ftis_linear_loss_fwd, inputs)
    hidden, weight = args["hidden"], args["weight"]
    outputs = fake_forward_outputs(hidden, hidden.shape[0], hidden.shape[1], args["cu_seqlens"])
    on = args["grad_in_forward"]
    grads = (
        torch.empty_like(hidden) if on and args["need_hidden"] else hidden.new_empty(0),
        torch.empty_like(weight) if on and args["need_weight"] else hidden.new_empty(0),
        weight.new_empty(weight.shape[0]) if on and args["need_bias"] else hidden.new_empty(0),
    )
    return (*outputs, *grads)


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
    grads = linear_grads(
        hidden, weight, bias, tokens, *stats, temperature, chunk_size, backend, needs
    )
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


@torch.library.custom_op(
    "ftis_kernels::ftis_linear_loss_scale_",
    mutates_args=("grad_hidden", "grad_weight", "grad_bias"),
)
def _scale_grads_(
    grad_hidden: torch.Tensor,
    grad_weight: torch.Tensor,
    grad_bias: torch.Tensor,
    grad_loss: torch.Tensor,
) -> None:
    """Multiplies the gradients the forward computed for an incoming gradient of 1 by the
    incoming gradient grad_loss (0-dim), in place: nothing when it is 1 (the usual case, no pass
    over the (V, H) gradient; one synchronisation on CUDA)."""
    if bool(grad_loss == 1):
        return
    scale = float(grad_loss)
    for grad in (grad_hidden, grad_weight, grad_bias):
        grad.mul_(scale)


@_scale_grads_.register_fake
def _(grad_hidden, grad_weight, grad_bias, grad_loss):
    return None


def _setup_context(ctx, inputs, output):
    args = arguments(_ftis_linear_loss_fwd, inputs)
    tokens = args["tokens"]
    if args["group_name"] is not None:  # this shard's ids; another shard's token is never hit
        tokens = tokens - args["vocab_start"]
    ctx.grad_in_forward = args["grad_in_forward"]
    # The outputs other than the loss get no gradient: None, not a zero (V, H) grad_weight.
    ctx.set_materialize_grads(False)
    grads = output[N_OUTPUTS:] if ctx.grad_in_forward else ()
    tensors = (args["hidden"], args["weight"], args["bias"], tokens, *grads)
    save_for_backward(ctx, args, inputs, output[:N_OUTPUTS], *tensors)
    ctx.chunk_size, ctx.group_name = args["chunk_size"], args["group_name"]


def _backward(ctx, grad_loss, *_):
    if grad_loss is None:
        return (None,) * ctx.n_inputs
    hidden, weight, bias, tokens = ctx.saved_tensors[:4]
    needs = ctx.needs_input_grad
    need_bias = bias is not None and needs[2]
    if ctx.grad_in_forward:
        # Saved tensors scaled in place: a second backward through the same graph is refused by
        # autograd (modified by an inplace operation) instead of being scaled twice.
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors[4:7]
        torch.ops.ftis_kernels.ftis_linear_loss_scale_(
            grad_hidden, grad_weight, grad_bias, grad_loss
        )
    else:
        stats = backward_stats(ctx, grad_loss)
        grad_hidden, grad_weight, grad_bias = torch.ops.ftis_kernels.ftis_linear_loss_bwd(
            hidden,
            weight,
            bias,
            tokens,
            *stats,
            ctx.temperature,
            ctx.chunk_size,
            ctx.backend,
            needs[0],
            needs[1],
            need_bias,
            ctx.group_name,
        )
    grads = (
        grad_hidden if needs[0] else None,
        grad_weight if needs[1] else None,
        grad_bias if need_bias else None,
    )
    return grads + (None,) * (ctx.n_inputs - len(grads))


_ftis_linear_loss_fwd.register_autograd(_backward, setup_context=_setup_context)


def _check_linear_inputs(
    hidden: object, weight: object, bias: object, chunk_size: object
) -> tuple[int, ...]:
    """Shapes, dtypes and devices of hidden, weight, bias and chunk_size; returns (B, T, H, V)."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or min(hidden.shape) < 1:
        raise ValueError(
            f"hidden: expected a (B, T, H) tensor with B, T, H >= 1, got "
            f"{hidden.shape if isinstance(hidden, torch.Tensor) else hidden!r}"
        )
    B, T, H = hidden.shape
    check_tensor("hidden", hidden, (B, T, H), LOGIT_DTYPES, hidden.device)
    if hidden.device.type not in ("cuda", "cpu"):
        raise ValueError(f"hidden: expected a CUDA or CPU tensor, got a tensor on {hidden.device}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] < 1:
        raise ValueError(
            f"weight: expected a (V, {H}) tensor with V >= 1, got "
            f"{weight.shape if isinstance(weight, torch.Tensor) else weight!r}"
        )
    V = weight.shape[0]
    check_tensor("weight", weight, (V, H), (hidden.dtype,), hidden.device)
    if bias is not None:
        check_tensor("bias", bias, (V,), (hidden.dtype,), hidden.device)
    bad_chunk = isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    if chunk_size is not None and bad_chunk:
        raise ValueError(f"chunk_size: expected None or an int >= 1, got {chunk_size!r}")
    return B, T, H, V


def _check_grad_in_forward(grad_in_forward: object, blocker: Optional[str]) -> bool:
    """Whether the gradients may be computed in the forward: "auto" -> where exact (blocker is
    None), True -> yes (a ValueError naming the reason where not exact), False -> no."""
    valid = grad_in_forward is True or grad_in_forward is False or grad_in_forward == "auto"
    if not (valid and isinstance(grad_in_forward, (bool, str))):
        raise ValueError(
            f"grad_in_forward: expected 'auto', True or False, got {grad_in_forward!r}"
        )
    if grad_in_forward is True and blocker is not None:
        raise ValueError(f"grad_in_forward: expected 'auto' or False {blocker}, got True")
    return grad_in_forward is not False and blocker is None


def _needs_grad(hidden, weight, bias) -> tuple[bool, bool, bool]:
    """Which of (hidden, weight, bias) a backward would give a gradient (none under no_grad)."""
    on = torch.is_grad_enabled()
    return (
        on and hidden.requires_grad,
        on and weight.requires_grad,
        on and bias is not None and bias.requires_grad,
    )


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
    grad_in_forward: bool | str = "auto",
    **option_keywords: Unpack[OptionKeywords],
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
            chunk within AUTO_CHUNK_ELEMENTS logits, or the longest sample (T, or the longest
            segment when packed) when its logits are at most AUTO_SAMPLE_CHUNK_ELEMENTS. Only
            memory and speed depend on it (`auto_chunk_size`): one chunk of logits is the extra
            memory, whatever B * T.
        options, **option_keywords: as in `ftis_loss` (the fields of `FTISOptions`).
        cu_seqlens: packed batches as in `ftis_loss`: hidden (N, H) or (1, N, H).
        vocab_start, process_group: a vocabulary-sharded lm-head, as in `ftis_loss`: weight
            (V_local, H) (and bias (V_local,)) are the rows vocab_start : vocab_start + V_local of
            the full lm-head on this rank; hidden and the rows are the same on every rank.
            grad_hidden is summed over the ranks (one all-reduce of (B, T, H) in the backward);
            grad_weight and grad_bias are this shard's.
        grad_in_forward: "auto" (default), True or False: compute the gradients in the forward
            (6 N H V FLOPs; the backward multiplies them by the incoming gradient) or in the
            backward (8 N H V: each chunk's logits again). "auto" takes the forward whenever it
            is exact (`grad_in_forward_blocker`: every chunk holds whole samples, i.e. T, or the
            longest segment, <= the chunk size, and no option couples samples: reject_mode="mask"
            with a filter on pi_theta and a batch-wide normaliser or entropy bonus, or a sharded
            vocabulary); True raises a ValueError naming the reason there. Both orders give the
            same loss and metrics and the same gradients up to the matmuls' rounding. Without
            any gradient to compute (torch.no_grad(), no input requiring grad) neither order
            does gradient work. In the forward order the gradients are held from the forward
            on, and one backward through the graph is allowed.

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
    name = group_name(process_group, vocab_start)
    longest = T if cu_seqlens is None else max_seqlen
    chunk = auto_chunk_size(V, longest) if chunk_size is None else int(chunk_size)
    needs = _needs_grad(hidden, weight, bias)
    blocker = grad_in_forward_blocker(
        opt,
        with_old=old_logprobs is not None,
        sharded=name is not None,
        longest=longest,
        chunk_size=chunk,
    )
    in_forward = _check_grad_in_forward(grad_in_forward, blocker) and any(needs)
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
        name,
        chunk,
        backend,
        in_forward,
        *needs,
    )
    return outputs[0], public_metrics(outputs, T if flat else None)
