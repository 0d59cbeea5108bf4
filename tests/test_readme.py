"""The README's Python code runs as written: every ```python block is a whole program (a block
that needs names it does not define would be a fragment, and the README has none)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
TEXT = README.read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, re.S)


def _name(code: str) -> str:
    """A block's test id: its first import from the library."""
    lines = code.splitlines()
    return next((line for line in lines if line.startswith("from ftis_kernels")), lines[0])


def test_readme_python_code_is_in_whole_python_blocks():
    assert len(BLOCKS) >= 3, "the README shows the op, the Hugging Face helper and TRL"
    fragments = re.findall(r"```py\n", TEXT)
    assert not fragments, "a ```py fragment: make it a ```python block that runs as written"


@pytest.mark.parametrize("code", BLOCKS, ids=[_name(b) for b in BLOCKS])
def test_readme_python_block_runs_as_written(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the TRL block writes its output_dir here
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
