"""Compile Triton kernels for Hopper (sm_90) on a machine without a GPU, with the specialisations
Triton makes when it launches them.

Triton compiles one binary per launch signature. At launch, `JITFunction.run` turns every argument
into a type and a specialisation (`native_specialize_impl`, the same rules in Triton 3.6 and 3.9):
an int equal to 1 becomes the compile-time constant 1; an int divisible by 16, and a pointer
aligned to 16 bytes, carry `tt.divisibility = 16`; an int is i32 below 2^31, i64 from there, u64
from 2^63; None is the constant None; a float is fp32 and a bool u1, neither specialised.
`specialise` asks Triton's own binder for these, for the target sm_90, the way `run` does before
it compiles; `compile_sm90` compiles the result. The CPU interpreter (TRITON_INTERPRET=1)
specialises nothing, so only such a compile shows a kernel that breaks under one of them (`.to()`
on a stride that Triton made the constant 1 is an AttributeError at compile time).

    python -m bench.sm90 LAUNCHES.json

compiles every distinct launch a JSON file lists (`tests/test_sm90_compile.py` records them while
the ops run under the interpreter, `describe_launch` writes one) and exits 1 if any fails; with
--binaries it only counts the binaries each kernel would need (`tests/test_sm90_compile.py` holds
that a new completion length or option value needs none). Run it without TRITON_INTERPRET: the
kernels must be decorated as `JITFunction`s.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from ftis_kernels.kernels import tl_utils

TARGET = GPUTarget("cuda", 90, 32)
ALIGN = 16  # bytes: a pointer aligned to this carries tt.divisibility 16


def jit_function(kernel) -> JITFunction:
    """The `JITFunction` under `triton.heuristics` / `triton.autotune` wrappers."""
    while not isinstance(kernel, JITFunction):
        if not hasattr(kernel, "fn"):
            raise TypeError(f"not a Triton kernel (run without TRITON_INTERPRET?): {kernel!r}")
        kernel = kernel.fn
    return kernel


def through_heuristics(kernel, kwargs: dict) -> tuple[JITFunction, dict]:
    """(the `JITFunction`, kwargs with the values of the `triton.heuristics` around it), as a
    launch kernel[grid](**kwargs) computes them (`tl_utils.through_heuristics`)."""
    fn, kwargs = tl_utils.through_heuristics(kernel, (), dict(kwargs))
    return jit_function(fn), kwargs


def pointer(dtype: torch.dtype, misalign: int = 0) -> torch.Tensor:
    """A CPU tensor standing in for a pointer argument: Triton reads only its dtype and the
    address modulo 16 (CPU allocations, like CUDA's, start 64-byte aligned)."""
    size = torch.empty((), dtype=dtype).element_size()
    if misalign % size:
        raise ValueError(f"a {dtype} pointer cannot be {misalign} bytes off alignment")
    t = torch.empty(ALIGN, dtype=dtype)[misalign // size :]
    assert t.data_ptr() % ALIGN == misalign, "the CPU allocator did not align to 16 bytes"
    return t


def specialise(fn: JITFunction, args: tuple, kwargs: dict) -> tuple[Any, dict, dict, dict]:
    """(options, signature, constexprs, attrs) of a launch fn[grid](*args, **kwargs) on sm_90,
    from Triton's own binder, as `JITFunction.run` computes them before compiling. kwargs hold
    the constexprs and options (num_warps, ...) after any `triton.heuristics`."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    return fn._pack_args(backend, kwargs, bound_args, specialization, options)


def compile_sm90(fn: JITFunction, args: tuple, kwargs: dict):
    """triton.compile of the launch fn[grid](*args, **kwargs) for sm_90 (`specialise`)."""
    options, signature, constexprs, attrs = specialise(fn, args, kwargs)
    src = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=TARGET, options=options.__dict__)


# --- launches as JSON --------------------------------------------------------------------------


def describe_value(value: object) -> object:
    """A launch argument as JSON: a tensor as its dtype and misalignment, a scalar as itself."""
    if isinstance(value, torch.Tensor):
        return {
            "tensor": str(value.dtype).removeprefix("torch."),
            "misalign": value.data_ptr() % ALIGN,
        }
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a launch argument of type {type(value).__name__} cannot be described")


def describe_launch(fn, args: tuple, kwargs: dict) -> dict:
    """A launch of the Python function fn (the body of a Triton kernel) as JSON."""
    return {
        "kernel": f"{fn.__module__}:{fn.__qualname__}",
        "args": [describe_value(a) for a in args],
        "kwargs": {k: describe_value(v) for k, v in kwargs.items()},
    }


def _value(described: object) -> object:
    if isinstance(described, dict):
        return pointer(getattr(torch, described["tensor"]), described["misalign"])
    return described


def _kernel(name: str) -> JITFunction:
    module, qualname = name.split(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return jit_function(obj)


def beyond_int32(fn: JITFunction, args: list, kwargs: dict) -> tuple[list, dict]:
    """The launch with each runtime int argument other than 1 moved past 2^31 (+ 2^32: the same
    residue modulo 16), as sizes and strides of more than 2^31 elements make it: Triton types them
    i64."""
    runtime = {p.name for p in fn.params if not p.is_constexpr}
    names = [p.name for p in fn.params]

    def moved(name: str, a: object) -> object:
        return a + 2**32 if type(a) is int and a != 1 and name in runtime else a

    return (
        [moved(name, a) for name, a in zip(names, args)],
        {k: moved(k, v) for k, v in kwargs.items()},
    )


def compile_launches(launches: list[dict]) -> dict:
    """Compile each distinct specialisation of the launches, and each again with its int
    arguments past 2^31 (`beyond_int32`). Returns {"compiled": [...], "failed": [...],
    "classes": {kernel: sorted specialisation classes seen}, "triton": the compiler's version}."""
    seen: set = set()
    report: dict = {"compiled": [], "failed": [], "classes": {}, "triton": triton.__version__}
    for launch in launches:
        fn = _kernel(launch["kernel"])
        args = [_value(a) for a in launch["args"]]
        kwargs = {k: _value(v) for k, v in launch["kwargs"].items()}
        for v_args, v_kwargs in ((args, kwargs), beyond_int32(fn, args, kwargs)):
            try:
                options, signature, constexprs, attrs = specialise(fn, tuple(v_args), v_kwargs)
            except Exception:  # noqa: BLE001 - reported with the launch that caused it
                report["failed"].append({**launch, "error": traceback.format_exc()})
                continue
            key = repr((launch["kernel"], options, sorted(signature.items()), constexprs, attrs))
            if key in seen:
                continue
            seen.add(key)
            classes = report["classes"].setdefault(launch["kernel"], set())
            classes.update(_classes(fn, signature, constexprs, attrs))
            what = _summary(fn, signature, constexprs, attrs, options)
            t0 = time.perf_counter()
            try:
                src = ASTSource(fn, signature, constexprs, attrs)
                triton.compile(src, target=TARGET, options=options.__dict__)
            except Exception as err:  # noqa: BLE001 - the point: every failure, with its launch
                report["failed"].append({"launch": what, "error": f"{type(err).__name__}: {err}"})
                continue
            report["compiled"].append({"launch": what, "seconds": time.perf_counter() - t0})
    report["classes"] = {k: sorted(v) for k, v in report["classes"].items()}
    return report


def binaries(launches: list[dict]) -> dict[str, int]:
    """How many binaries Triton would compile for each kernel over these launches: the distinct
    (options, signature, constexprs, attrs) its binder gives them. Nothing is compiled."""
    keys: dict[str, set] = {}
    for launch in launches:
        fn = _kernel(launch["kernel"])
        args = tuple(_value(a) for a in launch["args"])
        kwargs = {k: _value(v) for k, v in launch["kwargs"].items()}
        options, signature, constexprs, attrs = specialise(fn, args, kwargs)
        key = repr((options, sorted(signature.items()), constexprs, attrs))
        keys.setdefault(launch["kernel"], set()).add(key)
    return {kernel: len(k) for kernel, k in keys.items()}


def _classes(fn: JITFunction, signature: dict, constexprs: dict, attrs: dict) -> set[str]:
    """Which of Triton's specialisations of runtime arguments this launch has: "int=1",
    "int%16", "int" (an int Triton may specialise, with none applying), "int unspecialised" (one
    under `do_not_specialize`), "i64", "ptr%16", "ptr", "None"."""
    out = set()
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            continue
        ty, const = signature[p.name], constexprs.get((i,), "absent")
        divisible = bool(attrs.get((i,)))  # [] when none applies
        if ty == "constexpr":
            out.add("None" if const is None else f"int={const}")
        elif ty.startswith("*"):
            out.add("ptr%16" if divisible else "ptr")
        elif ty == "i64":
            out.add("i64")
        elif ty == "i32":
            out.add(
                "int unspecialised" if p.do_not_specialize else ("int%16" if divisible else "int")
            )
    return out


def _summary(fn, signature, constexprs, attrs, options) -> str:
    names = [p.name for p in fn.params]
    parts = []
    for i, name in enumerate(names):
        ty = signature[name]
        if ty == "constexpr":
            parts.append(f"{name}={constexprs[(i,)]!r}")
        else:
            parts.append(f"{name}:{ty}" + ("/16" if attrs.get((i,)) else ""))
    return f"{fn.__name__}[num_warps={options.num_warps}]({', '.join(parts)})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sm90", description=__doc__.splitlines()[0])
    ap.add_argument("launches", help="JSON list of launches (describe_launch)")
    ap.add_argument("--report", help="write the report as JSON here")
    ap.add_argument(
        "--binaries",
        action="store_true",
        help="count the binaries each kernel would need (`binaries`) instead of compiling",
    )
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        ap.error("run without TRITON_INTERPRET: the interpreter's kernels do not compile")
    with open(args.launches) as f:
        launches = json.load(f)
    if args.binaries:
        counts = binaries(launches)
        print(json.dumps(counts, indent=1))
        if args.report:
            with open(args.report, "w") as f:
                json.dump(counts, f)
        return 0
    report = compile_launches(launches)
    for row in report["compiled"]:
        print(f"ok   {row['seconds']:5.2f} s  {row['launch']}")
    for row in report["failed"]:
        print(f"FAIL {row.get('launch', row.get('kernel'))}\n{row['error']}")
    print(
        f"sm_90 (Triton {triton.__version__}): {len(report['compiled'])} distinct launches "
        f"compiled, {len(report['failed'])} failed"
    )
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
