"""The README's code runs as written (```python blocks; ```py marks fragments)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "the README has a Python example"
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})
