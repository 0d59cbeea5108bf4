"""Compile the row kernels of `ftis_loss` for Hopper (sm_90) without a GPU and read their machine
code: `python -m bench.hopper_asm`.

METHOD.md: "read what costs no device time". Triton compiles for a named target on any machine
and ships ptxas and cuobjdump, so the SASS of the kernels as they would launch on an H200
(contiguous logits, sizes divisible by 16, unit vocabulary stride) can be inspected here: registers,
shared memory, and per loop iteration the instructions per logit, the exp units (MUFU), barriers
and the width of the loads and stores. At the copy roofline an H200 moves 4.3 TB/s / 132 SMs /
1.98 GHz = 16.5 B per SM per clock, i.e. 8.2 bf16 logits per clock in the forward (read only):
an SM issues at most 128 thread-instructions per clock, so a forward loop above ~15
instructions per logit is bound by instruction issue, not memory, in bf16.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# H200 (KINDS.md / H200.md): copy bandwidth measured here, SM count, boost clock.
H200_COPY_BYTES_PER_S = 4.3e12
H200_SMS = 132
H200_CLOCK_HZ = 1.98e9
ISSUE_PER_SM_CLOCK = 128  # 4 schedulers x 1 warp-instruction x 32 threads


@dataclass
class LoopStats:
    kernel: str
    dtype: str
    block_v: int
    num_warps: int
    registers: int
    shared_bytes: int
    loop_instructions: int
    elements_per_thread: int
    mufu: int
    barriers: int
    ldg128: int
    stg128: int

    @property
    def per_element(self) -> float:
        return self.loop_instructions / self.elements_per_thread

    def issue_bound_fraction(self, bytes_per_element: float) -> float:
        """Fraction of issue capacity the loop needs to keep up with the copy roofline."""
        elems_per_clock = H200_COPY_BYTES_PER_S / H200_SMS / H200_CLOCK_HZ / bytes_per_element
        return elems_per_clock * self.per_element / ISSUE_PER_SM_CLOCK


def _tools() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_sm90(fn, types: dict, constexprs: dict, divisible16: list, num_warps: int):
    """triton.compile for sm_90 with the given signature and launch-time specialisations."""
    names = fn.arg_names
    sig = {n: ("constexpr" if n in constexprs else types[n]) for n in names}
    src = ASTSource(
        fn=fn,
        signature=sig,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible16},
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


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


def _hot_loop(lines: list[str]) -> list[str]:
    """The body of the longest backward branch (the vocabulary loop)."""
    addr = [int(re.search(r"/\*([0-9a-f]{4})\*/", ln).group(1), 16) for ln in lines]
    best: list[str] = []
    for i, ln in enumerate(lines):
        m = re.search(r"BRA (0x[0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < addr[i]:
            j = addr.index(int(m.group(1), 16))
            if i + 1 - j > len(best):
                best = lines[j : i + 1]
    return best


def loop_stats(kernel: str, dtype: str, block_v: int, num_warps: int) -> LoopStats:
    from ftis_kernels.kernels import logp_lse as K

    ty = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}[dtype]
    if kernel == "fwd":
        fn = K._logp_lse_fwd_kernel.fn  # under triton.heuristics
        types = dict(
            logits_ptr=f"*{ty}",
            tokens_ptr="*i64",
            mask_ptr="*i1",
            logp_ptr="*fp32",
            row_max_ptr="*fp32",
            log_sum_ptr="*fp32",
            entropy_ptr="*fp32",
            temperature="fp32",
            T="i32",
            V="i32",
            stride_lb="i32",
            stride_lt="i32",
            stride_lv="i32",
            stride_tb="i32",
            stride_tt="i32",
            stride_mb="i32",
            stride_mt="i32",
        )
        consts = dict(
            HAS_MASK=True, WITH_ENTROPY=True, BLOCK_V=block_v, stride_lv=1, stride_tt=1, stride_mt=1
        )
        div16 = [
            "logits_ptr",
            "tokens_ptr",
            "mask_ptr",
            "logp_ptr",
            "row_max_ptr",
            "log_sum_ptr",
            "entropy_ptr",
            "V",
            "stride_lb",
            "stride_lt",
            "stride_tb",
            "stride_mb",
        ]
    else:
        fn = K._logits_bwd_kernel.fn  # under triton.heuristics
        types = dict(
            logits_ptr=f"*{ty}",
            dlogits_ptr=f"*{ty}",
            tokens_ptr="*i64",
            row_max_ptr="*fp32",
            log_sum_ptr="*fp32",
            coef_ptr="*fp32",
            entropy_ptr="*fp32",
            entropy_coef_ptr="*fp32",
            scales_ptr="*fp32",
            grad_ptr="*fp32",
            temperature="fp32",
            T="i32",
            V="i32",
            stride_lb="i32",
            stride_lt="i32",
            stride_lv="i32",
            stride_db="i32",
            stride_dt="i32",
            stride_dv="i32",
            stride_tb="i32",
            stride_tt="i32",
        )
        consts = dict(
            HAS_ENTROPY_GRAD=False,
            HAS_SCALES=True,
            HAS_GRAD=True,
            BLOCK_V=block_v,
            stride_lv=1,
            stride_dv=1,
            stride_tt=1,
        )
        div16 = [
            "logits_ptr",
            "dlogits_ptr",
            "tokens_ptr",
            "row_max_ptr",
            "log_sum_ptr",
            "coef_ptr",
            "V",
            "stride_lb",
            "stride_lt",
            "stride_db",
            "stride_dt",
            "stride_tb",
        ]
    compiled = compile_sm90(fn, types, consts, div16, num_warps)
    lines, usage = _sass(compiled)
    body = _hot_loop(lines)
    reg = re.search(r"REG:(\d+)", usage)
    shared = re.search(r"SHARED:(\d+)", usage)
    return LoopStats(
        kernel=kernel,
        dtype=dtype,
        block_v=block_v,
        num_warps=num_warps,
        registers=int(reg.group(1)) if reg else -1,
        shared_bytes=int(shared.group(1)) if shared else -1,
        loop_instructions=len(body),
        elements_per_thread=block_v // (32 * num_warps),
        mufu=sum("MUFU" in ln for ln in body),
        barriers=sum("BAR.SYNC" in ln for ln in body),
        ldg128=sum("LDG.E.128" in ln for ln in body),
        stg128=sum("STG.E.128" in ln for ln in body),
    )


def main(argv=None) -> None:
    from ftis_kernels.kernels.logp_lse import MAX_BLOCK_V, _block_v, _num_warps

    ap = argparse.ArgumentParser(
        prog="python -m bench.hopper_asm", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--V", type=int, default=151936)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    args = ap.parse_args(argv)
    bv = _block_v(args.V)
    print(
        f"launch config for V={args.V}: BLOCK_V={bv} (MAX_BLOCK_V={MAX_BLOCK_V}), num_warps={_num_warps(bv)}"  # noqa: E501
    )
    print(
        "| kernel | dtype | regs | smem B | loop instr / logit | MUFU / logit | barriers / iter | 16 B loads / iter "  # noqa: E501
        "| 16 B stores / iter | issue needed at roofline |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kernel in ("fwd", "bwd"):
        for dtype in args.dtypes.split(","):
            s = loop_stats(kernel, dtype, bv, _num_warps(bv))
            size = 2 if dtype == "bfloat16" else 4
            bpe = size if kernel == "fwd" else 2 * size
            print(
                f"| {kernel} | {dtype} | {s.registers} | {s.shared_bytes} | {s.per_element:.1f} "
                f"| {s.mufu / s.elements_per_thread:.2f} | {s.barriers} | {s.ldg128} | {s.stg128} "
                f"| {100 * s.issue_bound_fraction(bpe):.0f}% |"
            )


if __name__ == "__main__":
    main()
