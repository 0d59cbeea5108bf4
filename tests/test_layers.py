"""The package's layers, read from the code's own `import` statements (function-level ones too):
no module imports itself back through others, the core (the ops) never imports the driver or
the integrations, no module is too long to hold in mind, and the driver's and the integrations'
packages name each of their modules."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ftis_kernels"
# Above this many lines a module is split along a seam of its own (schema and loading, setup and
# the loop), not read as one.
MAX_LINES = 650
# The layers above the ops: the core imports neither.
UPPER = ("ftis_kernels.grpo", "ftis_kernels.integrations")
# The driver's layers, from the top: the command line, the launcher, one process of a swarm (a
# node under torchrun or a peer), the round; every other module of the driver is below them all.
DRIVER_LAYERS = (("__main__", "cli"), ("launch",), ("worker", "peer"), ("node",))


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, not `__init__`)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports, anywhere in its body. `from a import b` names the
    module `a.b` when there is one, else `a`; the parent packages Python runs on the way are not
    counted (every module would import `ftis_kernels/__init__.py`, which imports the ops)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {t for t in targets if t in modules and t != name}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _is_upper(name: str) -> bool:
    return any(name == u or name.startswith(u + ".") for u in UPPER)


def test_the_graph_reads_the_imports_it_should():
    graph = import_graph()
    assert "ftis_kernels.options" in graph["ftis_kernels.ftis_loss"]
    assert "ftis_kernels.grpo.cli" in graph["ftis_kernels.grpo.__main__"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_itself_back_through_others():
    cycles = _cycles(import_graph())
    assert not cycles, "modules that import one another in a circle:\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_core_imports_neither_the_driver_nor_the_integrations():
    graph = import_graph()
    upward = [
        f"{name} -> {target}"
        for name, targets in sorted(graph.items())
        if not _is_upper(name)
        for target in sorted(targets)
        if _is_upper(target)
    ]
    assert not upward, f"the core imports a layer above it: {upward}"


def test_the_driver_imports_nothing_of_a_layer_above():
    layer = {f"ftis_kernels.grpo.{m}": i for i, names in enumerate(DRIVER_LAYERS) for m in names}
    below = len(DRIVER_LAYERS)
    upward = [
        f"{name} -> {target}"
        for name, targets in sorted(import_graph().items())
        if name.startswith("ftis_kernels.grpo.")
        for target in sorted(targets)
        if layer.get(target, below) < layer.get(name, below)
    ]
    assert not upward, f"imports of a layer above: {upward}"


def test_no_module_is_longer_than_a_reader_holds_in_mind():
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _modules().values()}
    long = {path: n for path, n in lines.items() if n > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_driver_and_integration_packages_name_each_of_their_modules():
    inits = [
        PACKAGE / "grpo" / "__init__.py",
        *sorted((PACKAGE / "integrations").rglob("__init__.py")),
    ]
    unnamed = {}
    for init in inits:
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        named = set(re.findall(r"`(?:[\w.]+\.)?(\w+)`", doc))
        modules = {p.stem for p in init.parent.glob("*.py")} - {"__init__"}
        modules |= {p.parent.name for p in init.parent.glob("*/__init__.py")}
        if modules - named:
            unnamed[str(init.parent.relative_to(ROOT))] = sorted(modules - named)
    assert not unnamed, f"modules their package's docstring does not name: {unnamed}"
