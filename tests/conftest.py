"""Shared test setup.

Without a GPU the Triton kernels run under Triton's CPU interpreter: TRITON_INTERPRET must be set
before the first `triton.jit` decoration, so it is set here, before any test module imports the
library. On a machine with CUDA the compiled kernels are tested instead. torch.compile's cache
lives in the checkout's .pytest_cache.
"""

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Inductor's cache is keyed on the traced graph, not on our custom ops' code: a cache shared with
# another checkout (the default, /tmp/torchinductor_$USER) can replay a kernel compiled for a
# different version of the op. Each checkout keeps its own.
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "inductor"),
)

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=400,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    """Where the op is tested: the GPU when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_addoption(parser):
    parser.addoption(
        "--error-table",
        action="store_true",
        help="print the largest error against the float64 reference per dtype, path and quantity "
        "(always written to .pytest_cache/d/ftis/error_table.txt)",
    )


def error_table() -> list[str]:
    """The largest error of each (dtype, path, quantity) the property tests saw, one per line."""
    from tests import numerics

    rows = [f"property examples run: {numerics.EXAMPLES['count']}"]
    for (dtype, impl, name), err in sorted(numerics.MAX_ERRORS.items()):
        rows.append(f"{dtype:9s} {impl:7s} {name:18s} {err:.3e}")
    return rows


def pytest_terminal_summary(terminalreporter, config):
    from tests import numerics

    if not numerics.MAX_ERRORS:
        return
    rows = error_table()
    where = ": --error-table prints them"
    cache = getattr(config, "cache", None)  # absent under -p no:cacheprovider
    if cache is not None:
        path = cache.mkdir("ftis") / "error_table.txt"
        path.write_text("\n".join(rows) + "\n")
        where = f" in {path.relative_to(config.rootpath)}; --error-table prints it"
    if config.getoption("error_table"):
        terminalreporter.section("property tests: largest error against the float64 reference")
        for row in rows:
            terminalreporter.write_line(row)
    else:
        terminalreporter.write_line(
            f"property tests: {numerics.EXAMPLES['count']} examples; largest errors against the "
            f"float64 reference{where}"
        )
