"""Triton helpers shared by the kernels of ftis-kernels."""

import functools
import operator
from collections.abc import Callable
from typing import Any

import triton
import triton.language as tl
from triton.runtime.autotuner import Heuristics

# Start value of a running maximum: the lowest finite fp32. Finite on purpose: with -inf, a row
# whose first block is all -inf would compute exp(-inf - -inf) = nan when it rescales its running
# sum. The lowest finite value rather than a round -3e38, so that every finite logit exceeds it.
NEG_BIG = tl.constexpr(-3.4028234663852886e38)


# Below this |x|, e^x - 1 and e^x - 1 - x come from their Taylor series: exp(x) - 1 would lose
# the digits of a small x to cancellation (and a GPU's exp is an approximation with an absolute
# error near 1). At 0.35 the series' first dropped term, x^8 / 8!, is below fp32's epsilon of x.
SERIES_BELOW = tl.constexpr(0.35)


@triton.jit
def expm1(x):
    """e^x - 1, accurate for small |x| (torch.expm1's role)."""
    series = x * (1 + x / 2 * (1 + x / 3 * (1 + x / 4 * (1 + x / 5 * (1 + x / 6 * (1 + x / 7))))))
    return tl.where(tl.abs(x) < SERIES_BELOW, series, tl.exp(x) - 1.0)


@triton.jit
def exp_m1_mx(x):
    """e^x - 1 - x >= 0, accurate for small |x|: the k3 estimator's and the k3 penalty's form."""
    series = x * x / 2 * (1 + x / 3 * (1 + x / 4 * (1 + x / 5 * (1 + x / 6 * (1 + x / 7)))))
    return tl.where(tl.abs(x) < SERIES_BELOW, series, (tl.exp(x) - 1.0) - x)


def through_heuristics(kernel, args: tuple, kwargs: dict) -> tuple[Any, dict]:
    """(the kernel under its `triton.heuristics` wrappers, kwargs with their values added in
    place), the values computed from one dict of the arguments; each sees the ones before it,
    as in Triton's `Heuristics.run`, which builds that dict anew for every value (with our
    kernels' 30-70 arguments, host time at every launch: `python -m bench.host_time`)."""
    named = None
    while isinstance(kernel, Heuristics):
        if named is None:
            named = kwargs if not args else {**dict(zip(kernel.arg_names, args)), **kwargs}
        for name, value in kernel.values.items():
            kwargs[name] = named[name] = value(named)
        kernel = kernel.fn
    return kernel, kwargs


# What a launch takes beside the kernel's parameters.
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


@functools.cache
def _in_order(kernel) -> Callable[[dict], tuple]:
    return operator.itemgetter(*kernel.arg_names)


def launch(kernel, grid: tuple, **kwargs) -> None:
    """kernel[grid](**kwargs). Arguments are named at the call, so that a reordered signature
    cannot swap two of them silently; the values of the `triton.heuristics` around the kernel
    are computed once (`through_heuristics`), and Triton receives the arguments in the kernel's
    order: its launcher binds keywords by name at every launch, about 10 us for a 70-argument
    kernel (`python -m bench.host_time`). Every parameter must be given (a KeyError names a
    missing one)."""
    kernel, kwargs = through_heuristics(kernel, (), kwargs)
    options = {name: kwargs[name] for name in LAUNCH_OPTIONS if name in kwargs}
    kernel[grid](*_in_order(kernel)(kwargs), **options)
