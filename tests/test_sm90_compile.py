"""Every Triton kernel the ops launch compiles for Hopper (sm_90), at the specialisations Triton
makes at launch, on a machine without a GPU.

The CPU interpreter specialises nothing, so a kernel can pass every CPU test and still fail to
compile at its first launch on a GPU: Triton makes an int argument equal to 1 the compile-time
constant 1 (`.to()` on it is an AttributeError), marks ints divisible by 16 and 16-byte aligned
pointers, and types ints from 2^31 on as i64. Here the public ops run under the interpreter at
shapes whose sizes and strides are 1, divisible by 16 and neither (B, T, V = 1; contiguous, the
causal-LM view `logits[:, :-1]`, a vocabulary stride other than 1; V = 37), every kernel launch is
recorded (the kernel, each argument, the constexprs and num_warps), and a subprocess without the
interpreter compiles each distinct launch for sm_90 with the specialisation Triton's own binder
gives it (`bench/sm90.py`), and each again with its sizes and strides past 2^31. Nothing here
names a kernel: a new kernel, or a new argument of one, is covered as soon as an op launches it.

SM90_PYTHON=/path/to/python compiles with that interpreter's Triton instead (the launches are still
recorded with this one's): a virtual environment with the GPU machine's Triton checks, before a GPU
is at hand, that the kernels compile there too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from bench.sm90 import describe_launch
from ftis_kernels import ftis_linear_loss, ftis_logprobs, ftis_loss
from ftis_kernels.kernels import logp_lse

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    not logp_lse.triton_is_interpreted(),
    reason="records the launches under Triton's CPU interpreter; with a GPU the kernel tests "
    "compile every launch themselves",
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (B, T, V, layout): sizes and strides equal to 1, divisible by 16, and neither.
LOGITS_SHAPES = (
    (1, 1, 1, "contiguous"),  # every size 1, every stride 1
    (2, 16, 32, "contiguous"),  # sizes and strides divisible by 16
    (2, 3, 37, "causal"),  # logits[:, :-1] of (2, 4, 37): strides (148, 37, 1)
    (2, 3, 5, "vocabulary_strided"),  # a (V, B, T) tensor seen as (B, T, V): vocabulary stride 6
    (1, 2, 4099, "contiguous"),  # more than one block of MAX_BLOCK_V (one of the grad kernel's)
)
# (V, H, chunk_size): chunks of logits (c, V) with c and V equal to 1, divisible by 16, neither.
LINEAR_SHAPES = ((1, 1, 1), (32, 16, 16), (37, 5, 7))
B_LINEAR, T_LINEAR = 2, 9


def _logits(B, T, V, layout, dtype, g):
    if layout == "causal":
        return torch.randn(B, T + 1, V, generator=g).to(dtype)[:, :-1]
    if layout == "vocabulary_strided":
        return torch.randn(V, B, T, generator=g).to(dtype).permute(1, 2, 0)
    return torch.randn(B, T, V, generator=g).to(dtype)


def _rows(B, T, V, g, with_mask=True, causal=False):
    # Causal: the next tokens input_ids[:, 1:], 8 bytes past a 16-byte boundary.
    tokens = torch.randint(0, V, (B, T + causal), generator=g)[:, int(causal) :]
    gen = -torch.rand(B, T, generator=g) * 3
    mask = torch.rand(B, T, generator=g) < 0.8 if with_mask else None
    if mask is not None:
        mask[:, 0] = True
    return tokens, gen, torch.randn(B, generator=g), mask


def _run_ftis_loss(g):
    options = (
        {},
        {"entropy_coef": 0.05, "beta": 0.04},
        {"inplace_backward": "force"},
        {"loss_type": "dapo"},  # the gradient-in-forward kernel's batch-wide token count
    )
    for B, T, V, layout in LOGITS_SHAPES:
        for dtype in DTYPES:
            for k, opts in enumerate(options):
                tokens, gen, adv, mask = _rows(B, T, V, g, k != 1, layout == "causal")
                logits = _logits(B, T, V, layout, dtype, g).requires_grad_()
                ref = gen - 0.1 if opts.get("beta") else None
                loss, _ = ftis_loss(logits, tokens, gen, adv, mask, ref_logprobs=ref, **opts)
                loss.backward()


def _run_ftis_linear_loss(g):
    for V, H, chunk_size in LINEAR_SHAPES:
        for dtype in DTYPES:
            for grad_in_forward in (False, True):
                tokens, gen, adv, mask = _rows(B_LINEAR, T_LINEAR, V, g)
                hidden = torch.randn(B_LINEAR, T_LINEAR, H, generator=g).to(dtype)
                weight = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
                leaves = [hidden.requires_grad_(), weight.requires_grad_()]
                loss, _ = ftis_linear_loss(
                    *leaves,
                    tokens,
                    gen,
                    adv,
                    None if grad_in_forward else mask,
                    chunk_size=max(chunk_size, T_LINEAR) if grad_in_forward else chunk_size,
                    grad_in_forward=grad_in_forward,
                    entropy_coef=0.05 if grad_in_forward else 0.0,
                )
                loss.backward()


def _run_ftis_logprobs(g):
    for B, T, V, layout in LOGITS_SHAPES:
        for dtype in DTYPES:
            tokens, _, _, mask = _rows(B, T, V, g, causal=layout == "causal")
            ftis_logprobs(_logits(B, T, V, layout, dtype, g), tokens, mask=mask)
    for V, H, chunk_size in LINEAR_SHAPES:
        tokens, _, _, mask = _rows(B_LINEAR, T_LINEAR, V, g)
        hidden = torch.randn(B_LINEAR, T_LINEAR, H, generator=g)
        ftis_logprobs(hidden, tokens, torch.randn(V, H, generator=g), chunk_size=chunk_size)


def _recorder(monkeypatch) -> list[dict]:
    """A list that receives every launch of an interpreted Triton kernel from now on, as
    `describe_launch` writes it."""
    launches: list[dict] = []
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        launches.append(describe_launch(self.fn, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    return launches


def _sm90(launches: list[dict], tmp_path, *flags: str) -> tuple[subprocess.CompletedProcess, Any]:
    """`python -m bench.sm90` on the launches, without the interpreter: (the process, its JSON
    report)."""
    path, report_path = tmp_path / "launches.json", tmp_path / "report.json"
    path.write_text(json.dumps(launches))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [
            os.environ.get("SM90_PYTHON") or sys.executable,
            *("-m", "bench.sm90", str(path), *flags, "--report", str(report_path)),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    return done, report


def _record_launches(monkeypatch) -> list[dict]:
    """Every launch of an interpreted Triton kernel while the ops run, as `describe_launch`."""
    launches = _recorder(monkeypatch)
    g = torch.Generator().manual_seed(0)
    _run_ftis_loss(g)
    _run_ftis_linear_loss(g)
    _run_ftis_logprobs(g)
    return launches


def test_every_kernel_launch_compiles_for_sm90_at_triton_specialisations(monkeypatch, tmp_path):
    launches = _record_launches(monkeypatch)
    distinct = list({json.dumps(x, sort_keys=True): x for x in launches}.values())
    done, report = _sm90(distinct, tmp_path)
    assert report is not None, done.stdout + done.stderr
    failed = report["failed"]
    total = len(failed) + len(report["compiled"])
    shown = "\n\n".join(f"{row.get('launch')}\n{row['error']}" for row in failed[:3])
    assert not failed, f"{len(failed)} of {total} launches do not compile for sm_90:\n{shown}"
    if os.environ.get("SM90_PYTHON"):  # which Triton compiled them (pytest's warnings summary)
        warnings.warn(f"compiled for sm_90 with Triton {report['triton']}", stacklevel=1)
    assert done.returncode == 0, done.stdout + done.stderr
    # The shapes above must keep reaching every specialisation, and every kernel with an int
    # argument that Triton specialises must see it equal to 1 (the bug class this test is for).
    classes = {kernel: set(seen) for kernel, seen in report["classes"].items()}
    assert len(classes) >= 2, classes
    want = {"int=1", "int%16", "int", "i64", "ptr%16", "ptr", "None"}
    reached = set().union(*classes.values())
    assert want <= reached, f"specialisations never reached: {want - reached}"
    for kernel, seen in classes.items():
        if seen & {"int", "int%16"}:
            assert "int=1" in seen, f"{kernel}: no int argument was ever 1 ({sorted(seen)})"


def test_new_lengths_and_option_values_need_no_new_binary(monkeypatch, tmp_path):
    """Liger's GRPO kernel takes lengths and hyperparameters as constexprs and compiles a binary
    for every new completion length; here lengths and option values are runtime arguments. Over
    39 completion lengths and 5 values of each runtime option, a kernel needs at most the
    binaries its strides' alignment classes make (a stride divisible by 16 or not: 2)."""
    launches = _recorder(monkeypatch)
    g = torch.Generator().manual_seed(1)
    V = 37
    for T in range(2, 41):
        logits = torch.randn(2, T, V, generator=g, requires_grad=True)
        rows = _rows(2, T, V, g)
        i = T % 5
        opts = dict(kl_threshold=1.0 + i, epsilon=0.1 + 0.02 * i, is_cap=1.5 + i, beta=0.0)
        loss, _ = ftis_loss(logits, *rows, **opts)
        loss.backward()
    done, binaries = _sm90(launches, tmp_path, "--binaries")
    assert done.returncode == 0, done.stdout + done.stderr
    # Mask counts, the row pass writing the gradient, per-sample, reduction, the backward's fix-up.
    assert len(binaries) == 5, binaries
    assert all(n <= 2 for n in binaries.values()), binaries
