"""The implementations under test, each configured to the same work (`workload.TIS_OPTIONS`).

`prepare(name, case, inputs, mode)` returns a `Prepared`: `run()` does the measured work once
(the forward with gradients enabled, as in training, or the forward and the backward) and returns
the loss; `restore()`, when not None, must run before each `run()` outside the timed region (the
in-place variants overwrite their input with its gradient).

logits family (input: (B, T, V) logits):
  ref_eager            ref/ `ref_ftis_loss`, eager PyTorch (fp32 log-softmax of the whole tensor)
  ref_compile          the same under torch.compile (dynamic=False, one compile per shape)
  ftis_loss            `ftis_kernels.ftis_loss` (Triton on CUDA, the chunked PyTorch path on CPU)
  ftis_loss_inplace    the same with inplace_backward="force" (fwd+bwd only)
  ftis_loss_filter     the same with the paper's F-TIS filter on (FTIS_OPTIONS)
  ftis_loss_3pass      `ftis_loss` with grad_in_forward=False: the gradient computed in the
                       backward (a read of the logits in each pass), beside the default, which
                       writes it in the forward where the options allow (Triton only)
  trl_eager            TRL's GRPO loss code (`selective_log_softmax`, then the token-level "grpo"
                       formula of `GRPOTrainer._compute_loss`), TIS as its importance_sampling_ratio
  liger_triton         Liger-Kernel `triton_grpo_loss` (CUDA), TIS through `vllm_is_ratio`
  liger_triton_inplace the same with its inplace=True (fwd+bwd only)
linear family (inputs: hidden (B, T, H), lm-head weight (V, H); gradients to both):
  ref_eager            hidden @ weight.T, then `ref_ftis_loss`
  ref_compile          the same under torch.compile
  ftis_loss            hidden @ weight.T, then `ftis_loss` (the unfused use of our kernels)
  ftis_loss_inplace    the same with the gradient written over the logits' buffer (on Triton in
                       the forward: grad_in_forward=True; fwd+bwd only)
  ftis_linear_loss     `ftis_kernels.ftis_linear_loss` (never materialises the logits)
  ftis_linear_loss_wacc
                       the same with grad_weight_accumulation="weight": grad_weight summed in
                       the weight's dtype, as Liger's chunked losses do across their chunks (no
                       fp32 (V, H) accumulator; fwd+bwd only)
  trl_eager            hidden @ weight.T, then TRL's GRPO loss code as in the logits family: the
                       materialised `selective_log_softmax` path (TRL before 1.16)
  trl_fused            TRL 1.16's fused lm-head (`ChunkedLogProbFunction`, what `add_fused_lm_head`
                       and `fused_lm_head=True` run in GRPOTrainer: log-probs and entropy, the
                       logits never whole), then the same GRPO formula
  liger_chunked        Liger-Kernel `LigerFusedLinearGRPOLoss`, TIS through `vllm_is_ratio`
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from bench.workload import FTIS_OPTIONS, TIS_OPTIONS, Case

LOGITS_IMPLS = (
    "ref_eager",
    "ref_compile",
    "ftis_loss",
    "ftis_loss_inplace",
    "ftis_loss_filter",
    "ftis_loss_3pass",
    "trl_eager",
    "liger_triton",
    "liger_triton_inplace",
)
LINEAR_IMPLS = (
    "ref_eager",
    "ref_compile",
    "ftis_loss",
    "ftis_loss_inplace",
    "ftis_linear_loss",
    "ftis_linear_loss_wacc",
    "trl_eager",
    "trl_fused",
    "liger_chunked",
)
IMPLS = {"logits": LOGITS_IMPLS, "linear": LINEAR_IMPLS}
MODES = ("fwd", "fwd+bwd")
# Only meaningful with a backward: they differ from their base implementation there alone.
BACKWARD_ONLY = ("ftis_loss_inplace", "liger_triton_inplace", "ftis_linear_loss_wacc")


@dataclass
class Prepared:
    run: Callable[[], torch.Tensor]
    restore: Optional[Callable[[], None]]
    options: dict
    note: str = ""


def liger_version() -> Optional[str]:
    """Liger-Kernel's version when it imports, else None (it is a bench-only extra)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    try:
        from importlib.metadata import version

        importlib.import_module("liger_kernel.chunked_loss.grpo_loss")
        importlib.import_module("liger_kernel.transformers.grpo_loss")
        return version("liger-kernel")
    except Exception:  # a broken optional install is reported as missing, not raised
        return None


def _ftis_linear_loss():
    try:
        from ftis_kernels.ftis_linear_loss import ftis_linear_loss
    except ImportError:
        return None
    return ftis_linear_loss


def unavailable(name: str, family: str, mode: str, device: torch.device) -> Optional[str]:
    """Why `name` cannot run here (a short reason), or None when it can."""
    if name not in IMPLS[family]:
        return f"not an implementation of the {family} family"
    if mode == "fwd" and name in BACKWARD_ONLY:
        return "a variant that differs only in the backward"
    if name.startswith("liger"):
        if liger_version() is None:
            return "liger-kernel not installed (pip install liger-kernel)"
        if name.startswith("liger_triton") and device.type != "cuda":
            from ftis_kernels.kernels.logp_lse import triton_is_interpreted

            if not triton_is_interpreted():
                return "Liger's Triton kernels need CUDA (or TRITON_INTERPRET=1)"
    if name.startswith("trl") and importlib.util.find_spec("trl") is None:
        return "trl not installed (pip install trl)"
    if name == "trl_fused" and trl_fused_lm_head() is None:
        return "trl without its fused lm-head (trl >= 1.16)"
    if name.startswith("ftis_linear_loss") and _ftis_linear_loss() is None:
        return "ftis_kernels.ftis_linear_loss not importable"
    return None


def _grad_targets(case: Case, inputs: dict, mode: str) -> list[torch.Tensor]:
    """Leaf tensors the loss is differentiated against (requires_grad set on them)."""
    names = ("logits",) if case.family == "logits" else ("hidden", "weight")
    leaves = [inputs[n].detach().requires_grad_(True) for n in names]
    return leaves


def _finish(loss: torch.Tensor, leaves: list[torch.Tensor], mode: str) -> torch.Tensor:
    if mode == "fwd+bwd":
        # autograd.grad, not .backward(): nothing accumulates into .grad across repetitions.
        torch.autograd.grad(loss, leaves)
    return loss.detach()


_COMPILED: dict = {}


def _compiled_ref(case: Case) -> Callable:
    """torch.compile of the reference (logits family) or of matmul + reference (linear), one per
    case: a new case drops the previous one's graphs, so that no cache limit silently sends a
    later shape back to eager."""
    import torch._dynamo

    from ref import ref_ftis_loss

    if _COMPILED.get("case") != case:
        torch._dynamo.reset()
        if case.family == "logits":
            fn = ref_ftis_loss
        else:

            def fn(hidden, weight, *args, **kwargs):
                return ref_ftis_loss(hidden @ weight.t(), *args, **kwargs)

        _COMPILED.update(case=case, fn=torch.compile(fn, dynamic=False))
    return _COMPILED["fn"]


def trl_fused_lm_head() -> Optional[Callable]:
    """TRL's fused lm-head log-prob function (`trl.kernels.ChunkedLogProbFunction.apply`, trl >=
    1.16), or None where this trl has none."""
    try:
        from trl.kernels import ChunkedLogProbFunction
    except ImportError:
        return None
    return ChunkedLogProbFunction.apply


def trl_fused_logprobs(hidden: torch.Tensor, weight: torch.Tensor, inputs: dict) -> torch.Tensor:
    """(B, T) log-probs of the tokens from TRL 1.16's fused lm-head, called as its patched
    forward calls it in GRPOTrainer (`add_fused_lm_head(..., outputs=("log_probs", "entropy"))`,
    its vocabulary tile, temperature 1): on a Triton device only the completion positions are
    scored (`hidden[mask]`), elsewhere every position; the rest are 0."""
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    fused = trl_fused_lm_head()
    mask, tokens = inputs["mask"].bool(), inputs["tokens"]
    compact = hidden.device.type == "cuda"
    rows = hidden[mask] if compact else hidden.reshape(-1, hidden.shape[-1])
    targets = tokens[mask] if compact else tokens.reshape(-1)
    logps = fused(
        rows,
        weight,
        None,
        targets,
        1.0,
        _CHUNKED_LOGPROB_CHUNK_SIZE,
        None,
        1.0,
        ("log_probs", "entropy"),
    )[0]
    if compact:
        return logps.new_zeros(mask.shape).masked_scatter(mask, logps)
    return logps.view(mask.shape).masked_fill(~mask, 0.0)


def _trl_grpo_loss(logits: torch.Tensor, inputs: dict) -> torch.Tensor:
    """TRL's GRPO loss on (B, T, V) logits through `selective_log_softmax` (`_trl_grpo_formula`).
    TRL's entropy (a logging-only pass over the logits) is left out."""
    from trl.trainer.utils import selective_log_softmax

    return _trl_grpo_formula(selective_log_softmax(logits, inputs["tokens"]), inputs)


def _trl_grpo_formula(logps: torch.Tensor, inputs: dict) -> torch.Tensor:
    """TRL's GRPO loss on (B, T) log-probs, as `GRPOTrainer._compute_loss` (trl 1.16) computes it
    for this work: token-level ratio with old = current (detached), two-sided clip, the truncated
    IS weight multiplied in as vLLM's `importance_sampling_ratio`, "grpo" reduction."""
    mask = inputs["mask"].float()
    coef_1 = torch.exp(logps - logps.detach())
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.2)
    adv = inputs["advantages"][:, None]
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv) * inputs["is_weight"]
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def prepare(name: str, case: Case, inputs: dict, mode: str) -> Prepared:
    """Build implementation `name` on `inputs` (from `workload.make_inputs(case)`) for `mode`."""
    from ftis_kernels import ftis_loss
    from ref import ref_ftis_loss

    tok, gen, adv, mask = (
        inputs["tokens"],
        inputs["gen_logprobs"],
        inputs["advantages"],
        inputs["mask"],
    )
    leaves = _grad_targets(case, inputs, mode)
    opts = FTIS_OPTIONS if name == "ftis_loss_filter" else TIS_OPTIONS

    if case.family == "logits":
        (x,) = leaves
        if name == "ref_eager":
            return Prepared(
                lambda: _finish(ref_ftis_loss(x, tok, gen, adv, mask, **opts)[0], leaves, mode),
                None,
                opts,
            )
        if name == "ref_compile":
            fn = _compiled_ref(case)
            return Prepared(
                lambda: _finish(fn(x, tok, gen, adv, mask, **opts)[0], leaves, mode), None, opts
            )
        if name in ("ftis_loss", "ftis_loss_filter", "ftis_loss_inplace", "ftis_loss_3pass"):
            # "force": the in-place backward into a leaf is what is measured (restored each time).
            inplace = "force" if name == "ftis_loss_inplace" else False
            switch = {"grad_in_forward": False} if name == "ftis_loss_3pass" else {}
            switch["inplace_backward"] = inplace
            restore = None
            if inplace:
                # Its own storage: the backward overwrites it, and the shared inputs must survive.
                x = inputs["logits"].detach().clone().requires_grad_(True)
                leaves = [x]
                restore = lambda: x.data.copy_(inputs["logits"])  # noqa: E731
            return Prepared(
                lambda: _finish(
                    ftis_loss(x, tok, gen, adv, mask, **opts, **switch)[0],
                    leaves,
                    mode,
                ),
                restore,
                opts,
            )
        if name == "trl_eager":
            return Prepared(
                lambda: _finish(_trl_grpo_loss(x, inputs), leaves, mode),
                None,
                opts,
                note="TIS weight passed in as importance_sampling_ratio",
            )
        if name in ("liger_triton", "liger_triton_inplace"):
            from liger_kernel.transformers.grpo_loss import triton_grpo_loss

            # Liger's kernel takes (B, T + 1, V) logits, the last position unused: the same
            # logits plus one row, so that it reads and scores exactly the rows we do.
            B, T, V = x.shape
            lx = torch.zeros(B, T + 1, V, dtype=x.dtype, device=x.device)
            lx[:, :T] = inputs["logits"]
            lx.requires_grad_(True)
            inplace = name == "liger_triton_inplace"
            restore = None
            if inplace:
                restore = lambda: (lx.data[:, :T].copy_(inputs["logits"]), lx.data[:, T].zero_())  # noqa: E731
            w = inputs["is_weight"]

            def run():
                loss = triton_grpo_loss(
                    lx,
                    None,
                    None,
                    tok,
                    adv,
                    mask,
                    temperature=1.0,
                    beta=0.0,
                    eps_low=0.2,
                    eps_high=0.2,
                    inplace=inplace,
                    loss_type="grpo",
                    reduce=True,
                    vllm_is_ratio=w,
                )[0]
                return _finish(loss, [lx], mode)

            return Prepared(run, restore, opts, note="TIS weight passed in as vllm_is_ratio")
    else:
        h, wt = leaves
        if name == "ref_eager":
            return Prepared(
                lambda: _finish(
                    ref_ftis_loss(h @ wt.t(), tok, gen, adv, mask, **opts)[0], leaves, mode
                ),
                None,
                opts,
            )
        if name == "ref_compile":
            fn = _compiled_ref(case)
            return Prepared(
                lambda: _finish(fn(h, wt, tok, gen, adv, mask, **opts)[0], leaves, mode), None, opts
            )
        if name in ("ftis_loss", "ftis_loss_inplace"):
            switch = {}
            if name == "ftis_loss_inplace":
                # The logits' buffer receives their gradient: in the forward on Triton (the
                # lm-head's output is no leaf), in the backward on the CPU path.
                switch = dict(inplace_backward=True, grad_in_forward=h.is_cuda or None)
            return Prepared(
                lambda: _finish(
                    ftis_loss(h @ wt.t(), tok, gen, adv, mask, **opts, **switch)[0], leaves, mode
                ),
                None,
                opts,
            )
        if name in ("ftis_linear_loss", "ftis_linear_loss_wacc"):
            fll = _ftis_linear_loss()
            acc = "weight" if name == "ftis_linear_loss_wacc" else "fp32"
            return Prepared(
                lambda: _finish(
                    fll(h, wt, tok, gen, adv, mask, grad_weight_accumulation=acc, **opts)[0],
                    leaves,
                    mode,
                ),
                None,
                opts,
            )
        if name == "trl_eager":
            return Prepared(
                lambda: _finish(_trl_grpo_loss(h @ wt.t(), inputs), leaves, mode),
                None,
                opts,
                note="TIS weight passed in as importance_sampling_ratio",
            )
        if name == "trl_fused":
            return Prepared(
                lambda: _finish(
                    _trl_grpo_formula(trl_fused_logprobs(h, wt, inputs), inputs), leaves, mode
                ),
                None,
                opts,
                note="TRL 1.16's fused lm-head (log-probs and entropy); TIS weight passed in as "
                "importance_sampling_ratio",
            )
        if name == "liger_chunked":
            from liger_kernel.chunked_loss.grpo_loss import LigerFusedLinearGRPOLoss

            module = LigerFusedLinearGRPOLoss(
                beta=0.0,
                use_ref_model=False,
                epsilon_low=0.2,
                epsilon_high=0.2,
                loss_type="grpo",
                temperature=1.0,
            )
            w, fmask = inputs["is_weight"], mask.float()
            return Prepared(
                lambda: _finish(module(h, wt, tok, fmask, adv, vllm_is_ratio=w)[0], leaves, mode),
                None,
                opts,
                note="TIS weight passed in as vllm_is_ratio; its forward also computes the gradients",  # noqa: E501
            )
    raise ValueError(f"unknown implementation {name!r} for the {case.family} family")
