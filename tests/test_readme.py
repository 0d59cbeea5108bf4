"""The Python code of the README and of the docs pages runs as written: every ```python block is
a whole program (a block that needs names it does not define would be a fragment, and the pages
have none). The README stays one screen: what the library is, its commands, the op, the
measurements and the pages; the rest is in docs/."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    (page, code)
    for page in PAGES
    for code in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
]


def _name(page: Path, code: str) -> str:
    """A block's test id: its page and its first import from the library."""
    lines = code.splitlines()
    first = next((line for line in lines if line.startswith("from ftis_kernels")), lines[0])
    return f"{page.relative_to(ROOT)}: {first}"


def test_readme_python_code_is_in_whole_python_blocks():
    readme = [code for page, code in BLOCKS if page == README]
    assert any("ftis_loss(" in code for code in readme), "the README shows the op in a step"
    shown = "".join(code for _, code in BLOCKS)
    for helper in ("ftis_kernels.integrations.hf import", "ftis_kernels.integrations.trl import"):
        assert helper in shown, f"the docs show the Hugging Face helper and TRL: {helper}"
    fragments = [page.name for page in PAGES if re.search(r"```py\n", page.read_text())]
    assert not fragments, f"a ```py fragment in {fragments}: make it a ```python block"


def test_the_readme_is_one_screen_and_names_every_docs_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 80, "the README's first screen grew: move the rest to docs/"
    pages = sorted(p.relative_to(ROOT).as_posix() for p in PAGES if p != README)
    missing = [page for page in pages if f"`{page}`" not in text]
    assert not missing, f"docs pages the README does not name: {missing}"


@pytest.mark.parametrize("page, code", BLOCKS, ids=[_name(p, b) for p, b in BLOCKS])
def test_readme_python_block_runs_as_written(page, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the TRL block writes its output_dir here
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    exec(compile(code, str(page), "exec"), {"__name__": "__readme__"})
