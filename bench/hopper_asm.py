"""Compile the row kernels of `ftis_loss` for Hopper (sm_90) without a GPU and read their machine
code: `python -m bench.hopper_asm`.

Triton compiles for a named target on any machine and ships ptxas and cuobjdump, so the SASS of
the kernels as they launch on an H200 in the benchmark (contiguous logits, sizes divisible by 16,
unit vocabulary stride; `bench/sm90.py` gives them Triton's launch-time specialisations) can be
read without device time: registers, shared memory, and per loop iteration the instructions per
logit, the exp units (MUFU), barriers and the width of the loads and stores.

`python -m bench.hopper_asm --kernels [--json PATH] [--compare PATH]` compiles every launch of a
fixed set of switch configurations (`bench/switch_configs.py`) and prints each binary's
instructions, registers and spills; `--compare` a file written by `--json` before a change (with
this or another Triton: run it with that Python) says which binaries differ. At the copy roofline
an H200 moves 4.21 TB/s / 132 SMs / 1.98 GHz = 16.1 B per SM per clock, i.e. 8.1 bf16 logits per
clock in the forward (read only): an SM issues at most 128 thread-instructions per clock, so a
forward loop above ~16 instructions per logit is bound by instruction issue, not memory, in bf16.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from bench import sm90

# NVIDIA H200: the copy bandwidth (read + write) `bench.run` measured on one on 2026-12-04
# (bench/results/h200-2026-12-04/results.json, "ceilings"), its SM count (NVIDIA's H200
# specification: the GH100 die with 132 SMs enabled) and its boost clock (nvidia-smi's
# clocks.max.sm on that machine, bench/results/h200-2026-12-04/env.txt).
H200_COPY_BYTES_PER_S = 4.21e12
H200_SMS = 132
H200_CLOCK_HZ = 1.98e9
ISSUE_PER_SM_CLOCK = 128  # 4 schedulers x 1 warp-instruction x 32 threads
# Hopper's per-SM limits (CUDA's compute capability 9.0 table) and the GH100's L2 as an H100 SXM
# or H200 has it enabled: 50 MB.
MAX_THREADS_PER_SM = 2048
REGS_PER_SM = 65536
SMEM_PER_SM = 228 * 1024
H200_L2_BYTES = 50 * 1024**2


def awaiting_reread_bytes(stats: LoopStats, V: int, itemsize: int) -> int:
    """Bytes the gradient-in-forward kernel has read once and will read again, with every SM
    full: half a row for each resident program (a program is on average halfway through its
    first read or its second)."""
    return stats.programs_per_sm * H200_SMS * V * itemsize // 2


def roofline_bytes_per_logit(kernel: str, itemsize: int) -> int:
    """Bytes the kernel moves through memory per logit at its roofline, whose time its loop (or
    loops) must fit: the forward reads the logits; the backward reads them and writes the
    gradient; the gradient-in-forward kernel does the same (its second read comes from L2), in
    two loops that share that time, so each pass's issue figure is its share and the two add up
    to the kernel's."""
    return itemsize if kernel == "fwd" else 2 * itemsize


@dataclass
class LoopStats:
    kernel: str
    dtype: str
    block_v: int
    num_warps: int
    registers: int
    shared_bytes: int
    stack_bytes: int  # a thread's local-memory stack: registers spilled (0 when none are)
    spills: int  # local loads and stores (LDL, STL) in the whole kernel
    loop_instructions: int
    elements_per_thread: int
    mufu: int
    barriers: int
    ldg128: int
    stg128: int
    evict_first: int  # loads and stores marked to leave L2 first (.EF)

    @property
    def per_element(self) -> float:
        return self.loop_instructions / self.elements_per_thread

    @property
    def programs_per_sm(self) -> int:
        """Programs an SM holds at once: threads, registers (allocated 8 a thread, 256 a warp),
        shared memory (1 KB more a program) and Hopper's 32 programs an SM."""
        threads = 32 * self.num_warps
        regs = -(-max(self.registers, 1) // 8) * 8 * threads
        smem = self.shared_bytes + 1024
        return min(MAX_THREADS_PER_SM // threads, REGS_PER_SM // regs, SMEM_PER_SM // smem, 32)

    def issue_bound_fraction(self, bytes_per_element: float) -> float:
        """Fraction of issue capacity the loop needs to keep up with the copy roofline."""
        elems_per_clock = H200_COPY_BYTES_PER_S / H200_SMS / H200_CLOCK_HZ / bytes_per_element
        return elems_per_clock * self.per_element / ISSUE_PER_SM_CLOCK


def _tools() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _sass(compiled) -> tuple[list[str], str]:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        run = lambda *a: (  # noqa: E731
            subprocess.run(
                [os.path.join(_tools(), "cuobjdump"), *a, path],  # noqa: E731
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        sass, usage = run("--dump-sass"), run("--dump-resource-usage")
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
    return lines, usage


def _loops(lines: list[str]) -> list[list[str]]:
    """The bodies of the backward branches (the vocabulary loops), longest first."""
    addr = [int(re.search(r"/\*([0-9a-f]{4})\*/", ln).group(1), 16) for ln in lines]
    loops = []
    for i, ln in enumerate(lines):
        m = re.search(r"BRA (0x[0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < addr[i]:
            j = addr.index(int(m.group(1), 16))
            loops.append(lines[j : i + 1])
    return sorted(loops, key=len, reverse=True)


def _hot_loop(lines: list[str], rank: int = 0, count: int = 1) -> list[str]:
    """The body of the longest backward branch (the vocabulary loop); with count > 1, of the
    rank-th in address order among the `count` longest (a kernel with two vocabulary loops)."""
    loops = _loops(lines)[:count]
    loops.sort(key=lambda body: lines.index(body[0]))
    return loops[rank] if rank < len(loops) else []


def _h200_launch(kernel: str, dtype: str, V: int, width: Optional[int] = None) -> tuple:
    """(the kernel, its arguments by name, before its `triton.heuristics`) as `logp_lse.py`
    launches it in the benchmark's workload: contiguous (16, 1024, V) logits (with `width`, the
    first V logits of rows `width` wide: a vocabulary sliced to the tokenizer's size), int64
    tokens, a mask, the entropy in the forward and no entropy bonus in the backward. Pointers
    are CPU stand-ins: Triton reads only their dtype and alignment."""
    from ftis_kernels.kernels import logp_lse as K

    T = 1024
    W = V if width is None else width
    x, f32 = sm90.pointer(getattr(torch, dtype)), sm90.pointer(torch.float32)
    tokens = sm90.pointer(torch.int64)
    block_v = K._block_v(V)
    common = dict(
        logits_ptr=x,
        tokens_ptr=tokens,
        temperature=1.0,
        T=T,
        V=V,
        stride_lb=T * W,
        stride_lt=W,
        stride_lv=1,
        stride_tb=T,
        stride_tt=1,
        BLOCK_V=block_v,
        num_warps=K._num_warps(block_v),
    )
    outputs = dict(logp_ptr=f32, row_max_ptr=f32, log_sum_ptr=f32, entropy_ptr=f32)
    mask = dict(mask_ptr=sm90.pointer(torch.bool), stride_mb=T, stride_mt=1)
    if kernel == "fwd":
        return K._logp_lse_fwd_kernel, {**common, **outputs, **mask, **K.fwd_meta(block_v)}
    if kernel.startswith("grad_fwd"):
        from ftis_kernels.kernels import logp_grad as G

        # The default F-TIS work of the benchmark: TIS, the grpo reduction, no old log-probs.
        rows = dict(gen_ptr=f32, old_ptr=None, ref_ptr=None, adv_ptr=f32, counts_ptr=f32)
        rows.update(dlogits_ptr=x, coef_ptr=f32, stride_db=T * W, stride_dt=W, stride_dv=1)
        rows.update(stride_gb=T, stride_gt=1, stride_ob=0, stride_ot=0, stride_rb=0, stride_rt=0)
        rows.update(stride_adv=1, n_samples=16, length=T)
        scalars = dict(is_cap=2.0, is_cap_min=0.0, lo=0.8, hi=1.2, clip_high=0.2, delta=1e30)
        scalars.update(tau_pos=1.0, tau_neg=1.05, beta=0.0, grad_scale=1.0)
        from ftis_kernels.kernels.switches import token_switches
        from ftis_kernels.options import FTISOptions

        codes = dict(token_switches(FTISOptions(), has_old=False), BIAS_KL=False)
        meta = G.grad_meta(V, getattr(torch, dtype).itemsize)
        args = {**common, **outputs, **mask, **rows, **scalars, **codes, **meta}
        return G._logp_grad_fwd_kernel, args
    rows = dict(row_max_ptr=f32, log_sum_ptr=f32, coef_ptr=f32, entropy_ptr=None)
    rows.update(scales_ptr=f32, grad_ptr=f32, rows_ptr=None, rows_out_ptr=None, H=0)
    rows.update(stride_hr=0, stride_hh=0)
    grad = dict(dlogits_ptr=x, entropy_coef_ptr=None, stride_db=T * W, stride_dt=W, stride_dv=1)
    return K._logits_bwd_kernel, {**common, **rows, **grad, **K.bwd_meta(block_v)}


def loop_stats(kernel: str, dtype: str, V: int, width: Optional[int] = None) -> LoopStats:
    """Compile one kernel for sm_90 as the H200 benchmark launches it, with the specialisations
    Triton makes at that launch (`bench/sm90.py`), and read its vocabulary loop."""
    fn, kwargs = sm90.through_heuristics(*_h200_launch(kernel, dtype, V, width))
    block_v, num_warps = kwargs["BLOCK_V"], kwargs["num_warps"]
    compiled = sm90.compile_sm90(fn, (), kwargs)
    lines, usage = _sass(compiled)
    # The gradient-in-forward kernel has two vocabulary loops: pass 1 (statistics), pass 2 (the
    # gradient), in that order.
    body = _hot_loop(lines, 1, 2) if kernel == "grad_fwd_pass2" else _hot_loop(lines, 0, 2)
    if not kernel.startswith("grad_fwd"):
        body = _hot_loop(lines)
    reg = re.search(r"REG:(\d+)", usage)
    shared = re.search(r"SHARED:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return LoopStats(
        kernel=kernel,
        dtype=dtype,
        block_v=block_v,
        num_warps=num_warps,
        registers=int(reg.group(1)) if reg else -1,
        shared_bytes=int(shared.group(1)) if shared else -1,
        stack_bytes=int(stack.group(1)) if stack else -1,
        spills=sum(bool(re.search(r"\b(LDL|STL)\b", ln)) for ln in lines),
        loop_instructions=len(body),
        elements_per_thread=block_v // (32 * num_warps),
        mufu=sum("MUFU" in ln for ln in body),
        barriers=sum("BAR.SYNC" in ln for ln in body),
        ldg128=sum(bool(re.search(r"LDG\.E(\.\w+)*\.128", ln)) for ln in body),
        stg128=sum(bool(re.search(r"STG\.E(\.\w+)*\.128", ln)) for ln in body),
        evict_first=sum(bool(re.search(r"[LS][DT]G\.E\.EF", ln)) for ln in body),
    )


def binary_counts(compiled) -> dict:
    """A compiled kernel's size: instructions in its SASS, registers a thread, local-memory loads
    and stores (spills), and its stack bytes."""
    lines, usage = _sass(compiled)
    reg, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return dict(
        instructions=len(lines),
        registers=int(reg.group(1)) if reg else -1,
        spills=sum(bool(re.search(r"\b(LDL|STL)\b", ln)) for ln in lines),
        stack=int(stack.group(1)) if stack else -1,
    )


def switch_config_counts(
    record_with: Optional[str] = None, configs: Optional[str] = None
) -> list[dict]:
    """`binary_counts` of every launch `bench.switch_configs` records, keyed by its configuration,
    its kernel and its rank among that kernel's launches in the configuration. The recording runs
    under the interpreter in a subprocess of `record_with` (a Python; this one by default: another
    Triton's interpreter may not run every kernel), the compiles here, with this Triton; configs:
    a comma-separated list of their labels (default: all)."""
    import json
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "launches.json")
        python = record_with or sys.executable
        command = [python, "-m", "bench.switch_configs", path, *([configs] if configs else [])]
        subprocess.run(command, env=env, check=True)
        with open(path) as f:
            launches = json.load(f)
    rows, rank, cache = [], {}, {}
    for launch in launches:
        key = (launch["config"], launch["kernel"])
        rank[key] = rank.get(key, -1) + 1
        fn = sm90._kernel(launch["kernel"])
        args = tuple(sm90._value(a) for a in launch["args"])
        kwargs = {k: sm90._value(v) for k, v in launch["kwargs"].items()}
        options, signature, constexprs, attrs = sm90.specialise(fn, args, kwargs)
        spec = repr((launch["kernel"], options, sorted(signature.items()), constexprs, attrs))
        if spec not in cache:
            src = sm90.ASTSource(fn, signature, constexprs, attrs)
            compiled = triton.compile(src, target=sm90.TARGET, options=options.__dict__)
            cache[spec] = binary_counts(compiled)
        kernel = launch["kernel"].split(":")[1]
        rows.append(dict(config=key[0], kernel=kernel, rank=rank[key], **cache[spec]))
    return rows


def _kernels_main(json_path, compare, record_with, configs) -> int:
    import json

    rows = switch_config_counts(record_with, configs)
    before = {}
    if compare:
        with open(compare) as f:
            before = {(r["config"], r["kernel"], r["rank"]): r for r in json.load(f)["rows"]}
    print(f"sm_90, Triton {triton.__version__}: the launches of bench/switch_configs.py")
    print(
        "| config | kernel | # | instructions | registers | spills | stack B |"
        + (" before |" if compare else "")
    )
    print("|---" * (7 + bool(compare)) + "|")
    differ = 0
    for r in rows:
        line = (
            f"| {r['config']} | {r['kernel']} | {r['rank']} | {r['instructions']} "
            f"| {r['registers']} | {r['spills']} | {r['stack']} |"
        )
        if compare:
            old = before.get((r["config"], r["kernel"], r["rank"]))
            fields = ("instructions", "registers", "spills", "stack")
            if old is None:
                line += " absent |"
                differ += 1
            elif all(old[k] == r[k] for k in fields):
                line += " same |"
            else:
                line += " " + "/".join(str(old[k]) for k in fields) + " |"
                differ += 1
        print(line)
    if compare:
        missing = set(before) - {(r["config"], r["kernel"], r["rank"]) for r in rows}
        print(
            f"{len(rows) - differ} of {len(rows)} binaries with the same instructions, registers,"
            f" spills and stack as {compare}; {differ} differ; {len(missing)} no longer launched"
        )
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"triton": triton.__version__, "rows": rows}, f, indent=1)
    return 0


def main(argv=None) -> None:
    from ftis_kernels.kernels.logp_lse import MAX_BLOCK_V

    ap = argparse.ArgumentParser(
        prog="python -m bench.hopper_asm", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--V", type=int, default=151936)
    ap.add_argument(
        "--width",
        type=int,
        default=None,
        help="rows this many logits wide, of which the first V are read (a sliced vocabulary)",
    )
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument(
        "--kernels",
        action="store_true",
        help="instead: instructions, registers and spills of every binary the switch "
        "configurations of bench/switch_configs.py launch",
    )
    ap.add_argument("--json", help="with --kernels: write the counts here")
    ap.add_argument("--compare", help="with --kernels: a file --json wrote, to compare with")
    ap.add_argument(
        "--record-with",
        help="with --kernels: the Python whose Triton interpreter records the launches (default: "
        "this one); e.g. this machine's, when compiling with another Triton",
    )
    ap.add_argument("--configs", help="with --kernels: only these labels (comma-separated)")
    args = ap.parse_args(argv)
    if args.kernels:
        _kernels_main(args.json, args.compare, args.record_with, args.configs)
        return
    rows = f" of rows {args.width} wide" if args.width else ""
    print(
        f"V={args.V}{rows}; each kernel's BLOCK_V and warps as it launches "
        f"(MAX_BLOCK_V={MAX_BLOCK_V})"
    )
    print(
        "| kernel | dtype | BLOCK_V | warps | regs | smem B | stack B | spills | programs / SM "
        "| loop instr / logit "
        "| MUFU / logit | barriers / iter | 16 B loads / iter | 16 B stores / iter "
        "| evict-first / iter | issue needed at roofline "
        f"| awaiting re-read (L2 {H200_L2_BYTES // 2**20} MB) |"
    )
    print("|---" * 17 + "|")
    for kernel in ("fwd", "bwd", "grad_fwd_pass1", "grad_fwd_pass2"):
        for dtype in args.dtypes.split(","):
            s = loop_stats(kernel, dtype, args.V, args.width)
            size = getattr(torch, dtype).itemsize
            bpe = roofline_bytes_per_logit(kernel, size)
            held = (
                f"{awaiting_reread_bytes(s, args.V, size) / 2**20:.0f} MB"
                if kernel.startswith("grad_fwd")
                else "-"
            )
            print(
                f"| {kernel} | {dtype} | {s.block_v} | {s.num_warps} | {s.registers} "
                f"| {s.shared_bytes} | {s.stack_bytes} | {s.spills} | {s.programs_per_sm} "
                f"| {s.per_element:.1f} "
                f"| {s.mufu / s.elements_per_thread:.2f} | {s.barriers} | {s.ldg128} | {s.stg128} "
                f"| {s.evict_first} | {100 * s.issue_bound_fraction(bpe):.0f}% | {held} |"
            )


if __name__ == "__main__":
    main()
