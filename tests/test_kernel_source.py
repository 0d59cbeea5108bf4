"""The kernels read as their phases, read from their source: no Triton function too long to hold
in mind, compile-time switches compared with names (never a bare number), the loss types'
surrogate names spelled in one definition and one implementation, and kernels launched by
keyword (reordering a signature cannot silently swap two arguments)."""

import ast
from pathlib import Path

import pytest

from ftis_kernels import options
from ftis_kernels.kernels import switches

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ftis_kernels"
# Above this many lines a Triton function is split into named phases (Triton inlines them: the
# split costs no instruction, `python -m bench.hopper_asm --kernels --compare` shows it).
MAX_JIT_LINES = 200


def _trees():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _is_jit(node: ast.FunctionDef) -> bool:
    return any("triton.jit" in ast.unparse(d) for d in node.decorator_list)


def _jit_functions():
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and _is_jit(node):
                yield path, node


def test_no_triton_function_is_longer_than_the_limit():
    long = [
        f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path, node in _jit_functions()
        if node.end_lineno - node.lineno + 1 > MAX_JIT_LINES
    ]
    assert not long, long


def test_compile_time_switches_are_compared_with_names_not_numbers():
    bare = []
    for path, node in _jit_functions():
        constexprs = {
            a.arg
            for a in node.args.args
            if a.annotation and "constexpr" in ast.unparse(a.annotation)
        }
        for cmp in ast.walk(node):
            if not isinstance(cmp, ast.Compare):
                continue
            sides = [cmp.left, *cmp.comparators]
            named = any(isinstance(s, ast.Name) and s.id in constexprs for s in sides)
            number = any(isinstance(s, ast.Constant) and type(s.value) is int for s in sides)
            if named and number:
                bare.append(f"{path.relative_to(ROOT)}:{cmp.lineno}: {ast.unparse(cmp)}")
    assert not bare, bare


def test_surrogate_names_are_spelled_in_at_most_two_files():
    names = set(options.SURROGATES)
    files = set()
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names:
                files.add(str(path.relative_to(ROOT)))
    assert "ftis_kernels/options.py" in files
    assert len(files) <= 2, sorted(files)


def test_kernels_are_launched_by_keyword():
    positional = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name) and func.id == "launch":
                extra = node.args[2:]  # launch(kernel, grid, ...)
            elif isinstance(func, ast.Subscript) and ast.unparse(func.value).endswith("_kernel"):
                extra = node.args  # kernel[grid](...)
            else:
                continue
            if extra:
                positional.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not positional, positional


@pytest.mark.parametrize(
    ("values", "codes"),
    [
        (options.SURROGATES, (switches.CLIPPED, switches.CISPO, switches.SAPO, switches.VESPO)),
        (options.IS_MODES, (switches.IS_NONE, switches.IS_VIS, switches.IS_TIS, switches.IS_MASK)),
        (options.FILTERS, (switches.NO_FILTER, switches.NEGATIVE_OFFPOLICY,
                           switches.NEGATIVE_OR_OFFPOLICY, switches.NEGATIVE, switches.OFFPOLICY)),
    ],
)  # fmt: skip
def test_every_option_value_has_its_own_code(values, codes):
    assert sorted(c.value for c in codes) == list(range(len(values)))


def test_a_code_table_that_misses_a_value_is_refused():
    with pytest.raises(AssertionError, match="must name each"):
        switches._codes(("a", "b", "c"), ("a", "b"))
