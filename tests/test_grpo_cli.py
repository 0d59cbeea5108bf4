"""The command line as a user meets it: which flag or key an error names, the checks of data
files and model folders before torchrun starts, `ftis-grpo export`, and what the terminal shows."""

from __future__ import annotations

import pytest

from ftis_kernels.grpo.config import RESUMABLE, ConfigError, build_config
from ftis_kernels.grpo.launch import check_resume
from tests.test_faults import _fake_run, ftis_grpo

# A value given by a flag is named by the flag, as argparse names it for a value of the wrong
# type; the same value given by --set (or a --config file) is named by its key.
NAMING = [
    (["--rounds", "x"], "--rounds: expected an integer, got 'x'"),
    (["--rounds", "-3"], "--rounds: expected a value >= 1, got -3"),
    (["--set", "rounds=-3"], "rounds: expected a value >= 1, got -3"),
    (["--rounds", "4", "--set", "rounds=-3"], "rounds: expected a value >= 1, got -3"),
    (["--is-cap", "0"], "--is-cap: expected a value > 0"),
    (["--timeout", "-1"], "--timeout: expected a value > 0"),
    (["--kl-threshold", "-1"], "--kl-threshold: expected a value >= 0"),
]


@pytest.mark.parametrize("args, line", NAMING, ids=[" ".join(a) for a, _ in NAMING])
def test_an_error_names_the_flag_the_value_came_from(tmp_path, args, line):
    rc, err = ftis_grpo("--preset", "smoke", *args, out=tmp_path / "run")
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"ftis-grpo: {line}"), err


def test_the_resume_refusal_lists_every_key_a_resume_may_change(tmp_path):
    before = build_config("smoke", overrides={"out": str(tmp_path)})
    _fake_run(tmp_path, before, rounds_done=2)
    now = build_config("smoke", overrides={"out": str(tmp_path), "resume": True, "seed": 5})
    with pytest.raises(ConfigError) as refused:
        check_resume(now)
    (line,) = refused.value.lines
    changeable = line.split("may change only ", 1)[1].removesuffix("), got 5")
    assert changeable.split(", ") == [k for k in RESUMABLE if k not in ("out", "resume")]
    assert "pack, pack_row_tokens" in line
