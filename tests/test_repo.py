"""The repository stands alone: the method and the contract are in docs/, every reference to
them resolves, and the license, changelog and type marker that the package promises exist."""

import ast
import re
import subprocess
from pathlib import Path

import ftis_kernels

ROOT = Path(__file__).resolve().parents[1]
METHOD = ROOT / "docs" / "method.md"


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    files = [ROOT / n for n in names if n.endswith((".py", ".md", ".toml", ".yaml", ".sh"))]
    return [f for f in files if f.is_file()]


def test_nothing_points_outside_the_repository():
    # Written in pieces, so that this line does not match itself.
    outside = re.compile("FTIS_" + "SPEC|" + "\\.\\./" + "shared|project's " + "shared folder")
    hits = [
        f"{f.relative_to(ROOT)}:{i}"
        for f in _tracked_text_files()
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if outside.search(line)
    ]
    assert not hits, f"references to files a clone does not have: {hits}"


def test_nothing_cites_a_tracker_the_repository_does_not_have():
    # Users have no issue tracker or work log: a comment or document says what happened instead
    # of citing an issue, a work period or a stop by number. The changelog and stored results are
    # history.
    cited = re.compile(r"\b(issue|stop|sess" + r"ion)s?[ -][0-9]+(\.[0-9]+)?\b", re.I)
    hits = [
        f"{f.relative_to(ROOT)}:{i}"
        for f in _tracked_text_files()
        if f.name != "CHANGELOG.md" and "results" not in f.relative_to(ROOT).parts
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if cited.search(line)
    ]
    assert not hits, f"lines that cite an issue, a work period or a stop by number: {hits}"


def test_no_line_speaks_the_words_of_the_machines_that_built_it():
    # A user has none of the workplace's notes and was at none of its work periods: a line says
    # what can be checked (a date, a machine, a measurement), not which note or period it came
    # from, nor how a GPU came to it. A process's own session (start_new_session) is fine.
    # Written in pieces, so that these lines do not match themselves.
    notes = r"\b(METHOD|KINDS|H200|HOPPER)\." + "md\\b"
    period = r"(?<!own )\bsess" + r"ions?\b(?! of its own)"
    words = re.compile(f"{notes}|(?i:{period})|(?i:\\ble" + "nt\\b)")
    hits = [
        f"{f.relative_to(ROOT)}:{i}: {line.strip()[:80]}"
        for f in _tracked_text_files()
        if f.name != "CHANGELOG.md" and "results" not in f.relative_to(ROOT).parts
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if words.search(line)
    ]
    assert not hits, "lines that only the people who wrote them can check:\n" + "\n".join(hits)


def test_every_method_section_reference_resolves():
    sections = set(re.findall(r"^## (\d+)\. ", METHOD.read_text(), re.M))
    refs = [
        (f.relative_to(ROOT), n)
        for f in _tracked_text_files()
        for n in re.findall(r"docs/method\.md §(\d+)", f.read_text())
    ]
    assert refs, "the code cites the contract"
    assert all(n in sections for _, n in refs), (sorted(sections), refs)


def test_every_relative_link_of_the_markdown_files_resolves():
    broken = [
        f"{f.relative_to(ROOT)}: {target}"
        for f in _tracked_text_files()
        if f.suffix == ".md"
        for target in re.findall(r"\]\(([^)\s#]+)[^)]*\)", f.read_text())
        if not re.match(r"[a-z]+:", target) and not (f.parent / target).exists()
    ]
    assert not broken, f"links to nothing, from the folder of the file that holds them: {broken}"


def test_license_changelog_and_type_marker_exist():
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert f"## [{ftis_kernels.__version__}]" in (ROOT / "CHANGELOG.md").read_text()
    assert (ROOT / "ftis_kernels" / "py.typed").is_file()


def test_torch_compile_cache_belongs_to_this_checkout():
    import torch._inductor.runtime.cache_dir_utils as inductor_cache

    assert Path(inductor_cache.cache_dir()).is_relative_to(ROOT)


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_version_has_one_source():
    # pyproject reads it from the package (setuptools' attr, parsed without importing).
    project = _pyproject()
    assert "version" not in project and "version" in project["dynamic"]
    config = (ROOT / "pyproject.toml").read_text()
    assert 'version = { attr = "ftis_kernels.__version__" }' in config
    assert re.fullmatch(r"\d+\.\d+\.\d+", ftis_kernels.__version__)


def test_the_long_description_reads_off_the_repository():
    # The README is the wheel's long description: a relative link breaks on an index page.
    project = _pyproject()
    assert project["readme"] == "README.md"
    links = re.findall(r"\]\(([^)]+)\)", (ROOT / "README.md").read_text())
    relative = [link for link in links if not re.match(r"[a-z]+://|#", link)]
    assert not relative, f"relative links in README.md: {relative}"
    assert not re.findall(r'(?:src|href)="(?![a-z]+://)', (ROOT / "README.md").read_text())
    assert project["authors"] and project["keywords"] and project["classifiers"]


def test_the_public_ops_stand_side_by_side_and_the_front_door_holds_the_ops():
    # Each op imports the shared modules (custom_op, chunks, kernels), never another op.
    ops = ("ftis_loss", "ftis_linear_loss", "ftis_logprobs")
    for op in ops:
        tree = ast.parse((ROOT / "ftis_kernels" / f"{op}.py").read_text())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
        others = {f"ftis_kernels.{o}" for o in ops if o != op}
        assert not imported & others, (op, imported & others)
    assert set(ftis_kernels.__all__) == {"FTISOptions", "raise_on_bad_values", *ops}


# Top-level names that our dependencies import when they find them (optional backends), beside
# the standard library's and every installed distribution's: transformers probes `kernels`.
OPTIONAL_IMPORTS = {
    "kernels",
    "flash_attn",
    "liger_kernel",
    "deepspeed",
    "apex",
    "bitsandbytes",
    "vllm",
    "triton_kernels",
    "accelerate",
    "datasets",
    "typing",
}


def test_no_test_folder_or_module_shadows_a_package_a_dependency_imports():
    # A script run as `python tests/x.py` puts tests/ first on sys.path: a folder or module there
    # named like a package (tests/kernels against transformers' `import kernels`) is imported in
    # its place. The suite runs its scripts as modules (`-m tests.x`), and no name may clash.
    import importlib.metadata
    import sys

    taken = set(sys.stdlib_module_names) | OPTIONAL_IMPORTS
    taken |= set(importlib.metadata.packages_distributions())
    for folder in ("tests", "bench", "experiments", "examples"):
        names = {
            p.stem if p.suffix == ".py" else p.name
            for p in (ROOT / folder).iterdir()
            if (p.suffix == ".py" or (p / "__init__.py").is_file() or p.is_dir())
            and not p.name.startswith((".", "__"))
        }
        clashes = sorted(names & taken)
        assert not clashes, f"{folder}/ holds names a dependency may import instead: {clashes}"


def test_the_layout_page_names_every_module_of_the_package():
    layout = (ROOT / "docs" / "layout.md").read_text()
    modules = sorted((ROOT / "ftis_kernels").rglob("*.py"))
    unnamed = [
        str(p.relative_to(ROOT))
        for p in modules
        if p.name != "__init__.py" and f"`{p.name}`" not in layout
    ]
    assert not unnamed, f"docs/layout.md does not name: {unnamed}"
