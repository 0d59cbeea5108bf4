"""A fixed set of switch configurations of the ops, and every Triton launch they make, recorded
under the CPU interpreter: `python -m bench.switch_configs OUT.json`.

Each configuration is an op call with options chosen to reach the kernels' compile-time switches
(every loss type's surrogate and reduction, every IS mode and level, both ratio levels, each KL
estimator and reduction, each filter, rejection by mask, the penalty with and without the bias
correction, the entropy bonus, packed batches, float masks, the gradient written in the forward
or in the backward, the lm-head op, the log-probabilities). The shapes are fixed, so a launch's
specialisations (`bench/sm90.py`) depend on the code alone. `python -m bench.hopper_asm
--kernels` compiles every recorded launch for sm_90 and prints each binary's instructions,
registers and spills: run it before and after a change that should leave the machine code alone
(a kernel split into helpers, launches by keyword) and compare (`--compare`).

The launches are recorded by replacing the interpreter's launch with one that writes down its
arguments and then runs it; with TRITON_INTERPRET unset this module refuses to run.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

B, T, V, H = 2, 48, 64, 32

# (label, op, keywords): ops are "loss" (ftis_loss from logits), "linear" (ftis_linear_loss),
# "logprobs" (ftis_logprobs from logits). Keywords "old", "ref", "float_mask", "packed" ask for
# those inputs; the rest are the op's.
CONFIGS: tuple[tuple[str, str, dict], ...] = (
    ("default", "loss", {}),
    ("three_pass", "loss", dict(grad_in_forward=False)),
    ("three_pass_old_k1_max", "loss", dict(grad_in_forward=False, old=True, kl_estimator="k1",
                                           kl_reduction="max", kl_source="old")),
    ("dapo_beta", "loss", dict(loss_type="dapo", beta=0.04, ref=True, filter=None)),
    ("dapo_beta_three_pass", "loss", dict(loss_type="dapo", beta=0.04, ref=True,
                                          grad_in_forward=False)),
    ("bias_kl_dr_grpo", "loss", dict(loss_type="dr_grpo", beta=0.04, ref=True, filter=None,
                                     use_bias_correction_kl=True, old=True)),
    ("cispo_old", "loss", dict(loss_type="cispo", old=True, is_source="old", filter="negative")),
    ("sapo_vis", "loss", dict(loss_type="sapo", is_mode="vis", filter="negative_or_offpolicy")),
    ("vespo", "loss", dict(loss_type="vespo", old=True)),
    ("luspo_none_float_mask", "loss", dict(loss_type="luspo", is_mode="none",
                                           filter="offpolicy", float_mask=True)),
    ("gspo", "loss", dict(preset="gspo", old=True)),
    ("seq_product_mask_k2_mean", "loss", dict(is_level="sequence_product", is_mode="mask",
                                              kl_estimator="k2", kl_reduction="mean")),
    ("reject_mask_entropy", "loss", dict(reject_mode="mask", entropy_coef=0.05, beta=0.04,
                                         ref=True, filter="negative_or_offpolicy")),
    ("packed", "loss", dict(packed=True)),
    ("linear", "linear", {}),
    ("linear_three_pass_old", "linear", dict(grad_in_forward=False, old=True, loss_type="dapo")),
    ("logprobs", "logprobs", {}),
)  # fmt: skip


def _inputs(keywords: dict, g):
    import torch

    tokens = torch.randint(0, V, (B, T), generator=g)
    gen = -torch.rand(B, T, generator=g) * 3
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[:, 0] = True
    if keywords.pop("float_mask", False):
        mask = mask.float()
    old = gen - 0.1 * torch.rand(B, T, generator=g) if keywords.pop("old", False) else None
    ref = gen - 0.2 if keywords.pop("ref", False) else None
    return tokens, gen, adv, mask, old, ref


def _call(op: str, keywords: dict, g) -> None:
    import torch

    from ftis_kernels import FTISOptions, ftis_linear_loss, ftis_logprobs, ftis_loss

    keywords = dict(keywords)
    packed = keywords.pop("packed", False)
    preset = keywords.pop("preset", None)
    if preset is not None:
        keywords["options"] = FTISOptions.preset(preset)
    tokens, gen, adv, mask, old, ref = _inputs(keywords, g)
    if op == "logprobs":
        ftis_logprobs(torch.randn(B, T, V, generator=g).bfloat16(), tokens, mask=mask)
        return
    if op == "linear":
        hidden = torch.randn(B, T, H, generator=g).bfloat16().requires_grad_()
        weight = (torch.randn(V, H, generator=g) / H**0.5).bfloat16().requires_grad_()
        loss, _ = ftis_linear_loss(
            hidden, weight, tokens, gen, adv, mask, old, ref, chunk_size=T, **keywords
        )
        loss.backward()
        return
    logits = torch.randn(B, T, V, generator=g).bfloat16().requires_grad_()
    if packed:
        cu = torch.tensor([0, 20, 31, B * T])
        adv = torch.randn(3, generator=g)
        loss, _ = ftis_loss(
            logits.reshape(B * T, V), tokens.reshape(-1), gen.reshape(-1), adv, cu_seqlens=cu
        )
    else:
        loss, _ = ftis_loss(logits, tokens, gen, adv, mask, old, ref, **keywords)
    loss.backward()


def record(configs=CONFIGS) -> list[dict]:
    """Every launch of an interpreted Triton kernel while each configuration runs, as
    `sm90.describe_launch` writes it, with the configuration's label under "config"."""
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    from bench.sm90 import describe_launch

    launches: list[dict] = []
    label = [""]
    run: Callable = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        launches.append({"config": label[0], **describe_launch(self.fn, args, kwargs)})
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    try:
        for name, op, keywords in configs:
            label[0] = name
            _call(op, keywords, torch.Generator().manual_seed(0))
    finally:
        InterpretedFunction.run = run
    return launches


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2):
        print(
            "usage: TRITON_INTERPRET=1 python -m bench.switch_configs OUT.json [LABEL,...]",
            file=sys.stderr,
        )
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        print("run with TRITON_INTERPRET=1: the launches are recorded by the interpreter")
        return 2
    labels = argv[1].split(",") if len(argv) == 2 else [name for name, _, _ in CONFIGS]
    unknown = set(labels) - {name for name, _, _ in CONFIGS}
    if unknown:
        print(f"unknown configurations: {sorted(unknown)}", file=sys.stderr)
        return 2
    with open(argv[0], "w") as f:
        json.dump(record(tuple(c for c in CONFIGS if c[0] in labels)), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
