"""Timing, peak memory, the two roofline ceilings, the roofline model and the run's metadata.

Time: CUDA events around each repetition (the work is asynchronous: a host clock without a
synchronisation times the launches only), with a 256 MiB buffer written before each repetition
so that no input is served from L2; on CPU, a host clock (the work is synchronous).

Peak memory, as extra bytes over what was allocated before the call (inputs, saved copies):
- CUDA: the caching allocator's peak (`torch.cuda.max_memory_allocated`) after a reset.
- CPU: the process's resident-set high-water mark (VmHWM in /proc/self/status), reset through
  /proc/self/clear_refs just before the measured call, minus the resident set at that moment.
  It counts every byte the call touched, whoever allocated it (torch, oneDNN, inductor's C++).
  It is only honest in a fresh process whose allocator returns freed memory to the system, which
  `bench.run` arranges: one subprocess per measurement, and `mmap_large_blocks()` just before the
  peak call, so that glibc serves every block of 64 KiB or more by mmap and unmaps it on free
  (with its default dynamic threshold a block freed earlier would be reused unseen).
  Only that call: the timed calls run with the default allocator, as a user's would. A fixed
  64 KiB threshold makes every scratch chunk a fresh mmap with its page faults, which doubled
  some CPU times. The gradient buffer ftis_kernels keeps for reuse on the CPU is
  released before the peak call, which therefore counts the gradient's allocation.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch

REPO = Path(__file__).resolve().parent.parent
_L2_FLUSH_BYTES = 256 << 20


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def quantiles(samples_ms: list[float]) -> dict:
    """median, 20th/80th percentiles, min, max and count of a list of times in ms."""
    s = sorted(samples_ms)
    n = len(s)

    def q(p: float) -> float:
        i = p * (n - 1)
        lo, hi = int(i), min(int(i) + 1, n - 1)
        return s[lo] + (s[hi] - s[lo]) * (i - lo)

    return {
        "median": statistics.median(s),
        "p20": q(0.2),
        "p80": q(0.8),
        "min": s[0],
        "max": s[-1],
        "n": n,
    }


def time_fn(
    fn: Callable[[], object],
    device: torch.device,
    restore: Optional[Callable[[], None]] = None,
    *,
    min_reps: int = 5,
    max_reps: int = 50,
    min_time_s: float = 1.0,
) -> dict:
    """Quantiles of the time of fn() in ms: at least min_reps repetitions, more (up to max_reps)
    until min_time_s of measured time has passed. restore() runs before each, untimed."""
    samples: list[float] = []
    flush = (
        torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
        if device.type == "cuda"
        else None
    )
    total = 0.0
    while len(samples) < min_reps or (total < min_time_s and len(samples) < max_reps):
        if restore is not None:
            restore()
        if device.type == "cuda":
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        samples.append(ms)
        total += ms / 1e3
    return quantiles(samples)


def _proc_status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def cpu_rss_supported() -> bool:
    """True where the RSS high-water mark can be read and reset (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _proc_status_kib("VmHWM") > 0
    except OSError:
        return False


def mmap_large_blocks() -> None:
    """glibc only: from now on serve blocks >= 64 KiB by mmap (unmapped on free) and give the
    heap's free pages back, so that the resident set follows the live allocations. The same as
    starting the process with MALLOC_MMAP_THRESHOLD_=65536, but after the timed calls."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_mmap_threshold = -3  # malloc.h
    libc.mallopt(m_mmap_threshold, 1 << 16)
    libc.malloc_trim(0)


def peak_extra_bytes(fn: Callable[[], object], device: torch.device, restore=None) -> int:
    """Peak bytes fn() holds beyond what was allocated before it (see the module docstring)."""
    import gc

    if restore is not None:
        restore()
    # The CPU backward's reused gradient buffer (ftis_kernels/grad_buffer.py) is dropped, so that
    # the call allocates its gradient as the first step of a run does; bench.compare runs this
    # file against older revisions, some of which have no such buffer.
    try:
        from ftis_kernels.grad_buffer import release_cpu_grad_buffer
    except ImportError:
        pass
    else:
        release_cpu_grad_buffer()
    gc.collect()
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = fn()
        sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del out
        return int(peak)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS
    base = _proc_status_kib("VmRSS")
    out = fn()
    peak = _proc_status_kib("VmHWM") - base
    del out
    return int(peak) * 1024


def copy_bandwidth(device: torch.device, nbytes: Optional[int] = None) -> dict:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written per second)."""
    nbytes = nbytes or (4 << 30 if device.type == "cuda" else 512 << 20)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = time_fn(lambda: dst.copy_(src), device, min_reps=10, max_reps=30, min_time_s=0.5)
    return {"GBps": 2 * nbytes / (t["median"] * 1e-3) / 1e9, "bytes": nbytes, "time_ms": t}


def matmul_rate(device: torch.device, dtype: torch.dtype, n: Optional[int] = None) -> dict:
    """n x n x n matmul rate in TFLOP/s on random data (zeros run faster and would flatter it)."""
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    t = time_fn(lambda: a @ b, device, min_reps=5, max_reps=20, min_time_s=0.5)
    return {"TFLOPs": 2 * n**3 / (t["median"] * 1e-3) / 1e12, "n": n, "time_ms": t}


def work_model(case, mode: str) -> dict:
    """The least an implementation of `case` must do: bytes through memory and matmul FLOPs.

    logits family: read the logits once in the forward; read them again and write their gradient
    in the backward (3 passes over B*T*V elements), plus the (B, T) inputs and outputs.
    linear family: the forward matmul (2*N*H*V FLOPs) and, with the backward, grad_hidden and
    grad_weight (4*N*H*V more); bytes: hidden and weight read, their gradients written.
    """
    N, V, H = case.tokens, case.V, case.H
    s = torch.empty((), dtype=case.torch_dtype).element_size()
    row_bytes = N * (8 + 4 + 4 + 1 + 4)  # tokens, gen_logprobs, is weight/logp out, mask, lse
    bwd = mode == "fwd+bwd"
    if case.family == "logits":
        return {"bytes": (3 if bwd else 1) * N * V * s + row_bytes, "flops": 0}
    io = (N * H + V * H) * s
    return {"bytes": (2 * io if bwd else io) + row_bytes, "flops": (6 if bwd else 2) * N * H * V}


def roofline_ms(work: dict, bw_GBps: float, tflops: Optional[float]) -> float:
    t_mem = work["bytes"] / (bw_GBps * 1e9) * 1e3
    t_math = work["flops"] / (tflops * 1e12) * 1e3 if (work["flops"] and tflops) else 0.0
    return max(t_mem, t_math)


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def metadata(device: torch.device) -> dict:
    """What every record carries: device, versions, commit, date."""
    import triton

    from bench.impls import liger_version

    commit = _git("rev-parse", "HEAD")
    # Dirty = the code the benchmark runs differs from the commit (not the driver, docs or tests).
    dirty = bool(
        _git(
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--",
            ":(glob)ftis_kernels/*.py",
            "ftis_kernels/kernels",
            "ref",
            ":(glob)bench/*.py",
        )
    )
    return {
        "device": device.type,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "liger_kernel": liger_version(),
        "python": platform.python_version(),
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "commit": commit[:12] + ("-dirty" if dirty else "") if commit else "unknown",
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
        # Other work on the machine slows a CPU run down: its load at the start is part of the record.  # noqa: E501
        "loadavg_1min": os.getloadavg()[0],
    }
