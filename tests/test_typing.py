"""The public API's types as a user's type checker reads them: `OptionKeywords` (the option
keywords' static types) agrees with `FTISOptions`, and mypy reads the ops' real signatures."""

import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from ftis_kernels.options import OPTION_FIELDS, FTISOptions, OptionKeywords

ROOT = Path(__file__).resolve().parents[1]


def test_option_keywords_type_every_option_as_its_field():
    static = typing.get_type_hints(OptionKeywords)
    fields = typing.get_type_hints(FTISOptions)
    assert list(static) == list(OPTION_FIELDS), "OptionKeywords: the options, in their order"
    for name, f in OPTION_FIELDS.items():
        choices = f.metadata["choices"]
        if choices is None:
            assert static[name] == fields[name], name
        else:
            assert typing.get_origin(static[name]) is typing.Literal, name
            assert set(typing.get_args(static[name])) == set(choices), name


WRONG = """
import torch
from ftis_kernels import ftis_loss
x = torch.zeros(1, 2, 3)
ftis_loss(x, x, x, x, is_mod="tis")
ftis_loss(x, x, x, x, filter="negatve")
"""


@pytest.mark.skipif(shutil.which("mypy") is None, reason="mypy is not installed (the test extra)")
def test_mypy_reads_the_public_signatures_and_refuses_a_wrong_keyword(tmp_path):
    # pyproject's files (the package's entry, tests/typecheck/public_api.py) plus a user's mistakes.
    wrong = tmp_path / "wrong.py"
    wrong.write_text(WRONG)
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "ftis_kernels/__init__.py", "tests/typecheck/public_api.py"]
        + [str(wrong), "--no-error-summary", "--hide-error-context"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    errors = [line for line in run.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 2 and all(line.startswith(str(wrong)) for line in errors), run.stdout
    assert (
        'Unexpected keyword argument "is_mod" for "ftis_loss"; did you mean "is_mode"?'
        in (errors[0])
    )
    assert 'Argument "filter" to "ftis_loss" has incompatible type' in errors[1]
