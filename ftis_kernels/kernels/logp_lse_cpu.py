"""The row passes of `logp_lse.py` on CPU, in PyTorch: the same statistics and gradient (the
formulas are in that module's docstring), for CPU tensors without the Triton interpreter.

Two ways through a call, with the same arithmetic. Eager: a chunk of rows at a time, each pass a
parallel loop writing into memory allocated once per call (one fp32 scratch chunk, a second one for
the entropy's running sum, or the output itself). Fused, for calls of at least
CPU_FUSED_MIN_ELEMENTS logits: the element-wise part of each direction is one function that reads
each row once (hand-vectorised C++ for fp32 and bf16 rows with unit stride along V, `cpu_rows.py`;
the same functions compiled by torch.compile otherwise), so each pass over a row hits the cache.
Small calls stay eager: compiling would cost them more than it saves. Where neither fused form can
be built (no C++ compiler), a warning says so once and the eager passes run;
FTIS_CPU_FUSED=0 in the environment turns the fused passes off.

The exponential is exp2 of (x - max_v x) * (log2(e) / tau), one multiply per logit: on CPU exp2 is
several times faster than exp, and a division per logit is costly. The measurements behind these
choices: bench/README.md, "CPU row passes".
"""

from __future__ import annotations

import os
import warnings
from typing import Optional

import torch

from ftis_kernels.kernels import cpu_rows

# The lowest finite fp32: the start of a running max (tl_utils.NEG_BIG), so that an all -inf row
# gives log_sum = -inf rather than NaN from -inf - -inf.
FP32_LOWEST = torch.finfo(torch.float32).min
# Logits per chunk of the eager passes, and the size of their fp32 scratch buffer (16 MiB): few
# parallel loops, each of which waits for every thread to be scheduled.
CPU_CHUNK_ELEMENTS = 1 << 22

LOG2E = 1.4426950408889634
# Calls with fewer logits take the eager passes, never compiling: small calls (the tests, the
# driver's small models) would pay more for the compilation than they save.
CPU_FUSED_MIN_ELEMENTS = 1 << 24
# torch.compile'd row functions by name; "broken" once inductor failed to build one.
_FUSED: dict = {}


def _row_chunks(B: int, T: int, V: int):
    """(b, t0, t1) chunks of at most CPU_CHUNK_ELEMENTS logits each, within one sample, so that a
    strided (B, T, V) view is sliced, never copied whole."""
    rows = max(1, CPU_CHUNK_ELEMENTS // V)
    for b in range(B):
        for t0 in range(0, T, rows):
            yield b, t0, min(T, t0 + rows)


def _scratch(B: int, T: int, V: int, device) -> torch.Tensor:
    """One fp32 (rows, V) buffer a call's chunks share."""
    rows = min(T, max(1, CPU_CHUNK_ELEMENTS // V))
    return torch.empty(rows, V, dtype=torch.float32, device=device)


def _shifted(x: torch.Tensor, out: torch.Tensor):
    """(out, max_v x) with out = x - max_v x in fp32, the logits' own units. The subtraction comes
    first, where it is exact near the max (Sterbenz), so that only the one multiply by
    log2(e) / tau (`_exp2_scale`) rounds: scaling first would round every x / tau at |x| ~ 1e4 to
    ~1e-3. An all -inf row gets the lowest finite max (out = -inf, not NaN from -inf - -inf); NaN
    and +inf stay non-finite. x may be out itself."""
    m = x.amax(dim=-1, keepdim=True).clamp_(min=FP32_LOWEST)
    return torch.sub(x, m, out=out), m


def _exp2_scale(temperature: float) -> float:
    """log2(e) / tau: exp((x - m) / tau) = exp2((x - m) * this), one multiply per logit, not a
    division (bench/README.md, "CPU row passes"). Rounded to fp32 where it multiplies fp32."""
    return LOG2E / temperature


def logp_lse_fwd_torch(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: Optional[torch.Tensor],
    temperature: float,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """PyTorch forward with the signature and results of `logp_lse_fwd` (the same row statistics,
    the same non-finite semantics), a chunk of rows at a time. logits (B, T, V) fp32 | bf16 |
    fp16, any strides; tokens (B, T); mask (B, T) bool or None. fp32 scratch is bounded by one
    chunk (two with the entropy)."""
    B, T, V = logits.shape
    f32 = torch.float32
    logp, row_max, log_sum = (torch.zeros(B, T, dtype=f32, device=logits.device) for _ in range(3))
    entropy = torch.zeros_like(logp) if with_entropy else None
    if mask is not None and bool(mask.all()):
        mask = None
    out = (logp, row_max, log_sum, entropy)
    if _fused_wanted(logits) and _fused_call(
        _logp_lse_fwd_fused, logits, tokens, mask, temperature, out
    ):
        _inf_beside_nan(logits, row_max, temperature)
        return out
    scratch = _scratch(B, T, V, logits.device)
    scratch_e = torch.empty_like(scratch) if with_entropy else None
    for b, t0, t1 in _row_chunks(B, T, V):
        live = None if mask is None else mask[b, t0:t1]
        if live is not None:
            if not bool(live.any()):
                continue
            if bool(live.all()):
                live = None
        s = scratch[: t1 - t0]
        x = logits[b, t0:t1]
        if x.dtype != f32:
            # One up-cast into the scratch, then fp32 passes in place (mixed-dtype ops are slow).
            x = s.copy_(x)
        # A bad token id is refused by the caller after the forward: until then, read a valid one.
        x_token = x.gather(-1, tokens[b, t0:t1, None].long().clamp(0, V - 1))
        shifted, m_raw = _shifted(x, s)
        shifted_token = x_token.sub_(m_raw)
        m = m_raw
        if temperature != 1.0:
            shifted_token.div_(temperature)
            m = (m_raw / temperature).clamp_(min=FP32_LOWEST)
        scale = _exp2_scale(temperature)
        if with_entropy:
            e = torch.mul(shifted, scale, out=scratch_e[: t1 - t0]).exp2_()
            total = e.sum(dim=-1, keepdim=True)
            # H = log s - sum e * shifted / (tau s); a -inf logit adds 0 (not 0 * -inf = nan).
            u = e.mul_(shifted.clamp_(min=FP32_LOWEST)).sum(dim=-1, keepdim=True)
            if temperature != 1.0:
                u.div_(temperature)
            chunk_log_sum = total.log()
            parts = [m, chunk_log_sum, shifted_token.sub_(chunk_log_sum), chunk_log_sum - u / total]
        else:
            chunk_log_sum = shifted.mul_(scale).exp2_().sum(dim=-1, keepdim=True).log_()
            parts = [m, chunk_log_sum, shifted_token.sub_(chunk_log_sum)]
        chunk = torch.cat(parts, dim=1)
        if live is not None:
            # The chunk's masked rows were read with the rest (may hold anything): written as 0.
            chunk.masked_fill_(~live[:, None], 0.0)
        row_max[b, t0:t1] = chunk[:, 0]
        log_sum[b, t0:t1] = chunk[:, 1]
        logp[b, t0:t1] = chunk[:, 2]
        if with_entropy:
            entropy[b, t0:t1] = chunk[:, 3]
    _inf_beside_nan(logits, row_max, temperature)
    return logp, row_max, log_sum, entropy


def _inf_beside_nan(logits: torch.Tensor, row_max: torch.Tensor, temperature: float) -> None:
    """row_max = +inf, as the Triton kernels' max (which skips NaN) gives it, at the rows whose
    max here is NaN and that also hold +inf after dividing by temperature: the value check then
    names the same fault on both backends. Reads only those rows (a bad input's)."""
    nan = row_max.isnan()
    if bool(nan.any()):  # CPU tensors: no device synchronisation
        x = logits[nan].float()
        top = torch.where(x.isnan(), -torch.inf, x).amax(dim=-1) / temperature
        row_max[nan] = torch.where(top == torch.inf, torch.inf, row_max[nan])


def _logits_bwd_entropy_chunk(x, tokens, row_max, log_sum, c, ec, entropy, temperature, V):
    """One chunk's d loss / d logits (rows, V) fp32 with an entropy term, the plain formula."""
    x = x.float() / temperature
    log_p = (x - row_max[:, None]).sub_(log_sum[:, None])
    grad = log_p.exp()
    # -p_v (c + e (log p_v + H)), with dH/dlogit_v = -p_v (log p_v + H). log p_v is clamped where
    # p_v underflows to 0 anyway, so that 0 * -inf stays 0.
    h = (c + ec * entropy)[:, None]
    grad.mul_(log_p.clamp_(min=-1e4).mul_(ec[:, None]).add_(h)).neg_()
    # A token outside [0, V) is another vocabulary shard's (sharded.py): it adds nothing here.
    token = tokens.long()
    owned = (token >= 0) & (token < V)
    grad.scatter_add_(-1, token.clamp(0, V - 1)[:, None], torch.where(owned, c, 0.0)[:, None])
    return grad


def _put_taken(o: torch.Tensor, tok: torch.Tensor, taken: torch.Tensor) -> None:
    """o[r, tok[r, 0]] = taken[r, 0] for o (rows, V). By index_put_, not scatter_: on CPU,
    scatter_ into bf16 / fp16 up-casts all of o (measured: 135 ms against 0.01 ms for 256 rows of
    32,000 bf16 logits)."""
    rows = torch.arange(o.shape[0], device=o.device)
    o.index_put_((rows, tok[:, 0]), taken[:, 0])


def logits_bwd_torch(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    coef: torch.Tensor,
    temperature: float,
    out: torch.Tensor,
    entropy: Optional[torch.Tensor] = None,
    entropy_coef: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """PyTorch backward with the signature and results of `logits_bwd`. logits, out (B, T, V), out
    may be the logits themselves; tokens (B, T); row_max, log_sum, coef (B, T) fp32 from the
    forward, coef already scaled by the incoming gradient and 1 / temperature; entropy,
    entropy_coef (B, T) or both None. Returns out.

    Without an entropy term: out[r, v] = -coef_r * exp(x[r, v] / tau - row_max_r) *
    exp(-log_sum_r) (one multiply writes it), and at a taken token this shard owns
    -coef_r * expm1(logp_r) = coef_r * (1 - p_r) without the cancellation of 1 - p near p = 1.
    Rows with coef = entropy_coef = 0 are written as 0, whatever they hold.
    """
    B, T, V = logits.shape
    f32 = torch.float32
    no_entropy_grad = entropy_coef is None or not bool((entropy_coef != 0).any())
    stats = (row_max, log_sum, coef, temperature, out)
    if (
        no_entropy_grad
        and _fused_wanted(logits)
        and _fused_call(_logits_bwd_fused, logits, tokens, *stats)
    ):
        return out
    scratch = _scratch(B, T, V, out.device)
    for b, t0, t1 in _row_chunks(B, T, V):
        c = coef[b, t0:t1, None]
        ec = None if entropy_coef is None else entropy_coef[b, t0:t1, None]
        has_entropy_grad = ec is not None and bool((ec != 0).any())
        dead = c == 0 if not has_entropy_grad else (c == 0) & (ec == 0)
        o = out[b, t0:t1]
        if bool(dead.all()):
            o.zero_()
            continue
        x = logits[b, t0:t1]
        if has_entropy_grad:
            stats = (row_max[b, t0:t1], log_sum[b, t0:t1], c[:, 0], ec[:, 0], entropy[b, t0:t1])
            grad = _logits_bwd_entropy_chunk(x, tokens[b, t0:t1], *stats, temperature, V)
            # Rows without gradient may hold non-finite logits: 0 * nan must stay 0.
            o.copy_(grad.masked_fill_(dead, 0.0))
            continue
        token = tokens[b, t0:t1, None].long()
        # A token outside [0, V) is another vocabulary shard's (sharded.py): no 1 - p entry here.
        owned = (token >= 0) & (token < V)
        tok = token.clamp(0, V - 1)
        ls = log_sum[b, t0:t1, None]
        s = scratch[: t1 - t0]
        if x.dtype != f32:
            x = s.copy_(x)
        # Gathered before o is written: o may be the logits.
        x_token = x.gather(-1, tok)
        # The shift is redone in the logits' units (the forward keeps max / tau): see _shifted.
        # exp2 always runs on the contiguous scratch: its vectorised and scalar (tail) results
        # differ in the last bit, and where the tail falls must not depend on the layout of out.
        shifted, m_raw = _shifted(x, s)
        ls = _local_log_sum(ls, row_max[b, t0:t1, None], m_raw, temperature)
        logp = x_token.sub_(m_raw)
        if temperature != 1.0:
            logp.div_(temperature)
        logp.sub_(ls)
        e = shifted.mul_(_exp2_scale(temperature)).exp2_()
        k = ls.neg().exp_().mul_(c).neg_()
        if o.dtype == f32:
            torch.mul(e, k, out=o)
        else:
            o.copy_(e.mul_(k))
        taken = logp.expm1_().mul_(c).neg_().to(o.dtype)
        if not bool(owned.all()):
            taken = torch.where(owned, taken, o.gather(-1, tok))
        _put_taken(o, tok, taken)
        if bool(dead.any()):
            # Rows without gradient may hold non-finite logits: 0 * nan must stay 0.
            o.masked_fill_(dead, 0.0)
    return out


# --- CPU path, fused: the same arithmetic, one compiled loop per run of rows and direction -------


def _fwd_rows(x: torch.Tensor, scale: torch.Tensor, with_entropy: bool):
    """Row statistics of x (rows, V), any float dtype, as the eager forward computes them: m (the
    max, lowest finite for an all -inf row), s = sum_v e_v and, with the entropy, u = sum_v e_v
    shifted_v (the caller divides it by tau), with shifted = x - m and e = exp2(shifted scale);
    each (rows, 1) fp32. scale is `_exp2_scale` as a 0-dim fp32 tensor (a float would be compiled
    in as a constant)."""
    x = x.float()
    # Clamped before the max, not after: a point-wise clamp after the reduction would be its own
    # loop over the rows, between the max and the sums, so each row would be read twice.
    m = x.clamp(min=FP32_LOWEST).amax(dim=-1, keepdim=True)
    shifted = x - m
    e = torch.exp2(shifted * scale)
    if not with_entropy:
        return m, e.sum(dim=-1, keepdim=True)
    return (
        m,
        e.sum(dim=-1, keepdim=True),
        (e * shifted.clamp(min=FP32_LOWEST)).sum(-1, keepdim=True),
    )


def _bwd_rows(x: torch.Tensor, m: torch.Tensor, scale: torch.Tensor, k: torch.Tensor, out):
    """out = exp2((x - m) scale) * k in out's dtype (out (rows, V) may be x itself), as the eager
    backward computes it; m, k (rows, 1) fp32, m in the logits' units; scale as `_fwd_rows`."""
    out.copy_(torch.exp2((x.float() - m) * scale) * k)


def _bwd_rows_inplace(x: torch.Tensor, m: torch.Tensor, scale: torch.Tensor, k: torch.Tensor):
    """_bwd_rows with out = x: compiled apart, because inputs that alias each other make the
    compiled function copy them around its kernel (measured: the in-place backward took 2x the
    out-of-place one)."""
    x.copy_(torch.exp2((x.float() - m) * scale) * k)


def _local_log_sum(
    log_sum: torch.Tensor, row_max: torch.Tensor, m_raw: torch.Tensor, temperature: float
) -> torch.Tensor:
    """log_sum relative to m_raw / tau, the maximum of the rows this call holds (m_raw in the
    logits' units), from the forward's row_max and log_sum, all (rows, 1) fp32. Where row_max is
    m_raw / tau as the forward formed it, the difference is exactly 0 and log_sum comes back
    unchanged; where row_max is the larger maximum of the whole vocabulary (a shard's statistics
    after `sharded.combine_row_stats`), log_sum grows by the gap, so that
    exp((x - m_raw) / tau - result) = exp(x / tau - row_max - log_sum)."""
    local = m_raw if temperature == 1.0 else (m_raw / temperature).clamp_(min=FP32_LOWEST)
    return log_sum + (row_max - local)


def _fused_wanted(logits: torch.Tensor) -> bool:
    return (
        logits.device.type == "cpu"
        and logits.numel() >= CPU_FUSED_MIN_ELEMENTS
        and os.environ.get("FTIS_CPU_FUSED", "1") != "0"
        and not _FUSED.get("broken", False)
        and not torch.compiler.is_compiling()
    )


def _compiled(name: str):
    """The torch.compile'd row function `name`; compiled at its first call, with dynamic shapes
    (one compilation serves most run lengths and vocabularies; `_past_recompile_limit` where
    torch.compile gives up)."""
    if name not in _FUSED:
        fn = {"fwd": _fwd_rows, "bwd": _bwd_rows, "bwd_inplace": _bwd_rows_inplace}[name]
        _FUSED[name] = _past_recompile_limit(
            name, fn, torch.compile(fn, dynamic=True, fullgraph=True)
        )
    return _FUSED[name]


def _past_recompile_limit(name: str, fn, compiled):
    """`compiled`, or `fn` uncompiled once torch.compile has specialised it for as many shapes as
    its recompile limit allows (0/1 sizes, views of bases of other shapes, vocabulary ranges):
    under fullgraph it then raises before running anything. That run and the rest of its call
    take `fn` (the call may have written runs already: the in-place backward over its own input
    cannot start again), and later calls the eager passes, after one warning."""
    import torch._dynamo

    limit_hit = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", ())

    def run(*args):
        try:
            return compiled(*args)
        except limit_hit as err:
            _FUSED["broken"], _FUSED[name] = True, fn
            warnings.warn(
                "ftis_kernels: torch.compile reached its recompile limit on the fused CPU row "
                f"passes ({str(err).splitlines()[0]}); the eager ones run instead",
                RuntimeWarning,
                stacklevel=4,
            )
            return fn(*args)

    return run


def _fwd_rows_fused(x: torch.Tensor, scale: torch.Tensor, with_entropy: bool):
    """`_fwd_rows`, by the C++ row functions (`cpu_rows.py`) where they serve x, else compiled."""
    if cpu_rows.usable("fwd", x):
        m, s, u = cpu_rows.fwd_rows(x, float(scale), with_entropy)
        return (m, s) if u is None else (m, s, u)
    return _compiled("fwd")(x, scale, with_entropy)


def _bwd_rows_fused(x: torch.Tensor, m: torch.Tensor, scale: torch.Tensor, k: torch.Tensor, out):
    """`_bwd_rows`, by the C++ row functions where they serve x and out, else compiled."""
    if cpu_rows.usable("bwd", x, out):
        cpu_rows.bwd_rows(x, m, float(scale), k, out)
    else:
        _compiled("bwd")(x, m, scale, k, out)


def _bwd_rows_inplace_fused(x: torch.Tensor, m: torch.Tensor, scale: torch.Tensor, k: torch.Tensor):
    """`_bwd_rows_inplace`, by the C++ row functions where they serve x, else compiled."""
    if cpu_rows.usable("bwd", x):
        cpu_rows.bwd_rows(x, m, float(scale), k, x)
    else:
        _compiled("bwd_inplace")(x, m, scale, k)


_FUSED_ROWS = {
    "fwd": _fwd_rows_fused,
    "bwd": _bwd_rows_fused,
    "bwd_inplace": _bwd_rows_inplace_fused,
}


def _fused(name: str):
    """The fused row function `name` ("fwd", "bwd", "bwd_inplace")."""
    return _FUSED_ROWS[name]


def _fused_call(fn, *args) -> bool:
    """Runs fn(*args); False (after a warning, once) where inductor cannot compile the row
    functions, e.g. without a C++ compiler: the caller then takes the eager passes."""
    import torch._dynamo

    try:
        fn(*args)
    except torch._dynamo.exc.BackendCompilerFailed as err:
        _FUSED["broken"] = True
        warnings.warn(
            "ftis_kernels: the fused CPU row passes could not be compiled, the eager ones run "
            f"instead ({type(err).__name__}: {str(err).splitlines()[0]})",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def _live_runs(live: Optional[torch.Tensor], T: int) -> list[tuple[int, int]]:
    """[(t0, t1)]: the maximal runs of True in live (T,) bool; [(0, T)] for None."""
    if live is None:
        return [(0, T)]
    edges = torch.diff(
        live.to(torch.int8),
        prepend=live.new_zeros(1, dtype=torch.int8),
        append=live.new_zeros(1, dtype=torch.int8),
    )
    starts = (edges == 1).nonzero()[:, 0].tolist()
    ends = (edges == -1).nonzero()[:, 0].tolist()
    return list(zip(starts, ends))


def _flat_rows(*tensors: torch.Tensor) -> Optional[list[torch.Tensor]]:
    """Each (B, T, V) tensor as a (B * T, V) view, or None where one of them has no such view (a
    sample stride that is not T rows): then the fused passes go one sample at a time."""
    try:
        return [t.view(-1, t.shape[-1]) for t in tensors]
    except RuntimeError:
        return None


class _Rows:
    """The rows r = b * T + t of (B, T, V) tensors in runs [r0, r1): one run per maximal run of
    live rows, across samples where every tensor has a (B * T, V) view (one compiled call for a
    whole batch without dead rows), else within a sample."""

    def __init__(self, live: Optional[torch.Tensor], B: int, T: int, *tensors: torch.Tensor):
        self.T, self.tensors = T, tensors
        self.flat = _flat_rows(*tensors)
        if self.flat is not None:
            self.runs = _live_runs(None if live is None else live.reshape(-1), B * T)
        else:
            self.runs = [
                (b * T + t0, b * T + t1)
                for b in range(B)
                for t0, t1 in _live_runs(None if live is None else live[b], T)
            ]
        self.n = B * T

    def slices(self, r0: int, r1: int) -> list[torch.Tensor]:
        """Rows r0 : r1 of each tensor, (r1 - r0, V); within one sample unless flat."""
        if self.flat is not None:
            return [t[r0:r1] for t in self.flat]
        b, t0 = divmod(r0, self.T)
        return [t[b, t0 : t0 + r1 - r0] for t in self.tensors]

    def gaps(self) -> list[tuple[int, int]]:
        """The runs of rows outside self.runs, each within one sample unless flat."""
        edges = [0] + [r for run in self.runs for r in run] + [self.n]
        out = []
        for g0, g1 in zip(edges[::2], edges[1::2]):
            while g0 < g1:
                end = g1 if self.flat is not None else min(g1, (g0 // self.T + 1) * self.T)
                out.append((g0, end))
                g0 = end
        return out


def _logp_lse_fwd_fused(logits, tokens, mask, temperature, out) -> None:
    """logp_lse_fwd_torch's results into out = (logp, row_max, log_sum, entropy or None), zeros
    at entry, with the element-wise part compiled; rows the mask leaves out are never read."""
    B, T, V = logits.shape
    logp, row_max, log_sum, entropy = (None if o is None else o.view(-1) for o in out)
    tokens = tokens.reshape(-1)
    scale = torch.tensor(_exp2_scale(temperature), dtype=torch.float32)
    rows_fn = _fused("fwd")
    rows = _Rows(None if mask is None else mask.bool(), B, T, logits)
    for r0, r1 in rows.runs:
        (x,) = rows.slices(r0, r1)
        stats = rows_fn(x, scale, entropy is not None)
        m_raw, total = stats[0], stats[1]
        # As the eager passes: the token's logit shifted in the logits' units, then divided.
        x_token = x.gather(-1, tokens[r0:r1, None].long().clamp(0, V - 1)).float()
        shifted_token = x_token.sub_(m_raw)
        m = m_raw
        if temperature != 1.0:
            shifted_token.div_(temperature)
            m = (m_raw / temperature).clamp_(min=FP32_LOWEST)
        chunk_log_sum = total.log()
        row_max[r0:r1] = m[:, 0]
        log_sum[r0:r1] = chunk_log_sum[:, 0]
        logp[r0:r1] = shifted_token.sub_(chunk_log_sum)[:, 0]
        if entropy is not None:
            u = stats[2] if temperature == 1.0 else stats[2] / temperature
            entropy[r0:r1] = (chunk_log_sum - u / total)[:, 0]


def _logits_bwd_fused(logits, tokens, row_max, log_sum, coef, temperature, out) -> None:
    """logits_bwd_torch's result without an entropy term, into out, with the element-wise part
    compiled: runs of rows with coef != 0 are computed, the others written as 0."""
    B, T, V = logits.shape
    tokens, row_max, log_sum, coef = (t.reshape(-1) for t in (tokens, row_max, log_sum, coef))
    scale = torch.tensor(_exp2_scale(temperature), dtype=torch.float32)
    inplace = out.data_ptr() == logits.data_ptr()
    rows_fn = _fused("bwd_inplace" if inplace else "bwd")
    live = coef != 0
    rows = _Rows(None if bool(live.all()) else live.view(B, T), B, T, logits, out)
    for g0, g1 in rows.gaps():
        rows.slices(g0, g1)[1].zero_()
    for r0, r1 in rows.runs:
        x, o = rows.slices(r0, r1)
        c = coef[r0:r1, None]
        ls = log_sum[r0:r1, None]
        token = tokens[r0:r1, None].long()
        owned = (token >= 0) & (token < V)
        tok = token.clamp(0, V - 1)
        # Gathered before o is written: o may be the logits.
        x_token = x.gather(-1, tok).float()
        if temperature == 1.0:
            # The forward's row max is the one a second pass would find (or, for a vocabulary
            # shard, the global one the statistics are relative to): no pass to recompute it.
            m_raw = row_max[r0:r1, None]
        else:
            # The shift is redone in the logits' units (the forward keeps max / tau).
            m_raw = x.amax(dim=-1, keepdim=True).float().clamp_(min=FP32_LOWEST)
            ls = _local_log_sum(ls, row_max[r0:r1, None], m_raw, temperature)
        k = ls.neg().exp_().mul_(c).neg_()
        rows_fn(x, m_raw, scale, k) if inplace else rows_fn(x, m_raw, scale, k, o)
        logp = x_token.sub_(m_raw)
        if temperature != 1.0:
            logp.div_(temperature)
        taken = logp.sub_(ls).expm1_().mul_(c).neg_().to(o.dtype)
        if not bool(owned.all()):
            taken = torch.where(owned, taken, o.gather(-1, tok))
        _put_taken(o, tok, taken)
