"""Vocabulary-sharded logits (tensor-parallel lm-heads): each rank of a process group holds the
columns vocab_start : vocab_start + V_local of the logits (or those rows of the lm-head weight).

Each rank runs the row pass on its shard with its local token ids (tokens - vocab_start; a token
another rank owns is read by nobody here). Per row r and rank k the pass gives the shard's max m_k,
log_sum l_k (relative to m_k) and entropy H_k. With M = max_k m_k (one all-reduce of max) and
w_k = exp(m_k - M + l_k) (the shard's share of sum_v exp(x_v - M)), one all-reduce of sum over
[w_k, w_k * (l_k - H_k + m_k - M), owner's x_token - M] gives the global row statistics:
    log_sum = log S,   H = log_sum - U / S,   logp = (x_token - M) - log_sum,
with S, U the first two sums. The backward needs nothing more: each rank writes d loss / d logits
for its own columns from the global statistics; from hidden states the partial grad_hidden of each
shard is summed (one all-reduce), and each rank's grad_weight stays local.

The process group travels into the custom ops by name (a custom op's schema takes no process
group object), and is resolved there, so the ops stay opaque nodes under torch.compile.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group


def group_name(process_group: object, vocab_start: object) -> Optional[str]:
    """The name a custom op carries for `process_group` (None without one), after checking
    vocab_start."""
    bad_start = isinstance(vocab_start, bool) or not isinstance(vocab_start, int) or vocab_start < 0
    if bad_start:
        raise ValueError(f"vocab_start: expected an int >= 0, got {vocab_start!r}")
    if process_group is None:
        if vocab_start != 0:
            raise ValueError(
                f"vocab_start: expected 0 without a process_group (an unsharded vocabulary), got "
                f"{vocab_start}"
            )
        return None
    if not isinstance(process_group, dist.ProcessGroup):
        raise ValueError(
            f"process_group: expected a torch.distributed ProcessGroup or None, got "
            f"{type(process_group).__name__}"
        )
    return process_group.group_name


def check_shards(
    name: str,
    device: torch.device,
    vocab_start: int,
    V_local: int,
    H: int = 0,
    rows: tuple[int, int] = (0, 0),
) -> tuple[dist.ProcessGroup, int]:
    """(the process group, the global V), after one all-gather of (vocab_start, V_local, H, B, T):
    the shards must tile [0, V) in rank order and agree on H and on the rows' shape `rows` (B, T)
    (the all-reduces over (B, T) statistics would otherwise wait forever, or mix other rows).
    Raises the same ValueError on every rank."""
    group = _resolve_process_group(name)
    mine = torch.tensor([vocab_start, V_local, H, *rows], dtype=torch.int64, device=device)
    shards = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, mine, group=group)
    starts, sizes, hs, *shapes = zip(*(s.tolist() for s in shards))
    by_rank = list(zip(*shapes))
    if len(set(by_rank)) > 1:
        raise ValueError(
            f"tokens: expected the same (B, T) on every rank of process_group, got {by_rank} "
            "by rank"
        )
    if len(set(hs)) > 1:
        raise ValueError(
            f"process_group: expected shards that agree on H, got H = {list(hs)} by rank"
        )
    expected = 0
    for rank, (start, size) in enumerate(zip(starts, sizes)):
        if start != expected:
            where = f"where rank {rank - 1} ends at {expected}" if rank else "instead of at 0"
            raise ValueError(
                f"vocab_start: expected shards that tile the vocabulary in rank order, got rank "
                f"{rank} starting at {start} {where} "
                f"(vocab_start by rank {list(starts)}, V_local by rank {list(sizes)})"
            )
        expected += size
    return group, expected


def combine_row_stats(
    group: dist.ProcessGroup,
    local_tokens: torch.Tensor,
    V_local: int,
    mask: Optional[torch.Tensor],
    logp: torch.Tensor,
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    entropy: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The global (logp, row_max, log_sum, entropy), each (B, T) fp32, from this shard's row
    statistics (module docstring); 0 at masked rows."""
    global_max = row_max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    shift = row_max - global_max
    w = torch.exp(shift + log_sum)
    # A shard whose row is all -inf (vocabulary masking) adds nothing (not 0 * nan).
    u = torch.where(w > 0, w * ((log_sum - entropy) + shift), 0.0)
    owned = (local_tokens >= 0) & (local_tokens < V_local)
    token_shifted = torch.where(owned, (logp + log_sum) + shift, 0.0)
    sums = torch.stack([w, u, token_shifted])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    s, u, token_shifted = sums.unbind(0)
    log_sum = torch.log(s)
    stats = (token_shifted - log_sum, global_max, log_sum, log_sum - u / s)
    if mask is None:
        return stats
    return tuple(torch.where(mask, x, 0.0) for x in stats)


def all_reduce_sum(x: torch.Tensor, name: str) -> torch.Tensor:
    """x summed over the ranks of the named group, in place."""
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=_resolve_process_group(name))
    return x
