"""The options are defined once (`ftis_kernels.options`): every surface takes its names, defaults
and types from that definition and cannot drift; every enumerated option dispatches through a
table that raises on an unknown value; presets are valid option sets."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
import re
from pathlib import Path

import pytest
import torch

from ftis_kernels import FTISOptions, ftis_linear_loss, ftis_loss, per_sample
from ftis_kernels._extras import MissingExtraError
from ftis_kernels.custom_op import ForwardSignature, option_args, options_from_args
from ftis_kernels.options import (
    OPTION_FIELDS,
    OPTION_NAMES,
    PRESETS,
    option_allowed,
    option_default_text,
    resolve_options,
    with_option_keywords,
)

FORWARD_OPS = ("ftis_loss_fwd", "ftis_linear_loss_fwd")


def _keyword_defaults(func) -> dict:
    return {
        name: p.default
        for name, p in inspect.signature(func).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


@pytest.mark.parametrize("op", [ftis_loss, ftis_linear_loss], ids=lambda f: f.__name__)
def test_public_ops_list_every_option_with_its_default(op):
    keywords = _keyword_defaults(op)
    for name, f in OPTION_FIELDS.items():
        assert name in keywords, f"{op.__name__} lacks the option {name}"
        assert keywords[name] == f.default or (
            isinstance(f.default, float) and math.isnan(f.default)
        ), f"{op.__name__}: {name} defaults to {keywords[name]!r}, the schema to {f.default!r}"


@pytest.mark.parametrize("op", FORWARD_OPS)
def test_custom_op_schemas_carry_every_option_by_name_and_type(op):
    schema = getattr(torch.ops.ftis_kernels, op).default._schema
    arguments = {a.name: str(a.type) for a in schema.arguments}
    for name, f in OPTION_FIELDS.items():
        assert name in arguments, f"{op} lacks the option {name}"
        optional = f.type.startswith("Optional")
        assert arguments[name].startswith("Optional") == optional, (name, arguments[name])


def test_a_new_option_reaches_the_public_signature_and_the_op_schema(monkeypatch):
    # The surfaces are built from OPTION_FIELDS: adding a field there is all it takes. A dummy
    # option added to the definition shows up in a signature and a schema built from it.
    from ftis_kernels import options as options_module

    dummy = dataclasses.field(
        default=0.5, metadata={"help": "a dummy", "choices": None, "check": "finite"}
    )
    dummy.name, dummy.type = "dummy_option", "float"
    monkeypatch.setitem(options_module.OPTION_FIELDS, "dummy_option", dummy)

    def op(x, *, options=None, **option_keywords):
        return x

    assert _keyword_defaults(with_option_keywords(op))["dummy_option"] == 0.5
    assert "float dummy_option" in ForwardSignature(leading=(), trailing=()).schema


def test_trl_config_takes_its_option_fields_from_the_definition():
    trl_module = pytest.importorskip("ftis_kernels.integrations.trl", exc_type=MissingExtraError)
    config_fields = {f.name: f for f in dataclasses.fields(trl_module.FTISGRPOConfig)}
    for name in OPTION_NAMES:
        assert trl_module.TRL_NAMES.get(name, name) in config_fields, name
    for name in trl_module.OWN_OPTIONS:
        f = config_fields[name]
        assert f.default == OPTION_FIELDS[name].default, name
        assert f.metadata["help"] == OPTION_FIELDS[name].metadata["help"], name


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_valid_and_crosses_the_op_boundary_unchanged(name):
    options = FTISOptions.preset(name)
    names = OPTION_NAMES
    assert options_from_args(dict(zip(names, option_args(options)))) == options
    assert PRESETS[name].source


def test_numeric_options_are_floats_as_the_custom_op_carries_them():
    # Eager calls read the options as given, the custom op as its schema's types: 50 is 50.0 on
    # both sides (an int would make the PyTorch path compute in int64).
    options = FTISOptions(kl_threshold=50, is_cap=2, epsilon=0.2, kl_threshold_low=1)
    crossed = options_from_args(dict(zip(OPTION_NAMES, option_args(options))))
    for name in OPTION_NAMES:
        value = getattr(options, name)
        assert type(value) is type(getattr(crossed, name)), name
        if OPTION_FIELDS[name].type in ("float", "Optional[float]") and value is not None:
            assert type(value) is float, name


@pytest.mark.parametrize(
    "module,leading,trailing",
    [
        ("ftis_loss", (torch.zeros(2, 3, 5),), (False, "triton")),
        (
            "ftis_linear_loss",
            (torch.zeros(2, 3, 4), torch.zeros(5, 4), None),
            ([], 64, "triton", True, True, True, False, "fp32"),
        ),
    ],
)
def test_eager_calls_bind_what_the_custom_op_binds(module, leading, trailing):
    import importlib

    from ftis_kernels.validate import Rows

    signature = importlib.import_module(f"ftis_kernels.{module}")._FWD
    rows = Rows(
        torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), torch.zeros(2), None, None, None
    )
    parts = (
        leading,
        rows,
        FTISOptions.preset("gspo"),
        (None, 0, 0, None, "backward", False),
        trailing,
    )
    eager, op = signature.inputs(*parts), signature.bind(signature.flatten(*parts))
    assert eager.rows == op.rows and eager.opt == op.opt
    assert eager.named.keys() == op.named.keys()
    assert all(eager[name] is op[name] for name in op.named)
    with pytest.raises(ValueError):  # a part too short binds nothing
        signature.inputs(*parts[:-1], trailing[:-1])


def test_keywords_over_options_are_judged_with_the_values_they_keep():
    # A combination is checked on the result, not on the keywords alone against the defaults.
    base = FTISOptions(is_cap=5.0, kl_threshold=100.0)
    both = resolve_options(base, {"is_cap_min": 3.0, "kl_threshold_low": 60.0})
    assert (both.is_cap_min, both.kl_threshold_low, both.is_cap) == (3.0, 60.0, 5.0)
    with pytest.raises(ValueError, match=r"^is_cap_min: expected a number <= is_cap = 5\.0, got 6"):
        base.replace(is_cap_min=6.0)
    with pytest.raises(ValueError, match=r"^is_capp: expected a keyword option"):
        base.replace(is_capp=1.0)


def test_presets_take_overrides_and_the_default_is_f_tis():
    assert FTISOptions.preset("f-tis") == FTISOptions()
    assert FTISOptions.preset("GSPO", epsilon=0.1).ratio_level == "sequence"


def test_variant_overrides_refuse_an_unknown_name_as_preset_overrides_do():
    # A misspelt override is a ValueError naming it (docs/method.md, "Errors"), not a TypeError.
    assert FTISOptions.for_variant("tis", is_cap=3.0) == FTISOptions.preset("tis", is_cap=3.0)
    for make in (FTISOptions.for_variant, FTISOptions.preset):
        with pytest.raises(ValueError, match=r"^is_capp: expected a keyword option"):
            make("tis", is_capp=1.0)


ENUMERATED = [name for name, f in OPTION_FIELDS.items() if f.metadata["choices"] is not None]


@pytest.mark.parametrize("name", ENUMERATED)
def test_every_enumerated_option_dispatches_through_a_table_that_raises(name):
    # Bypass the constructor's validation: the per-sample part itself must refuse the value,
    # naming the option, instead of falling through to a default branch.
    options = FTISOptions(beta=0.1)
    object.__setattr__(options, name, "bogus")
    logp = -torch.rand(2, 3)
    args = (logp, logp - 0.1, torch.tensor([1.0, -1.0]), None, logp + 0.05, logp - 0.2, options)
    with pytest.raises(ValueError, match=rf"^{name}: expected one of"):
        per_sample.per_sample_loss(*args)


def test_driver_config_takes_its_loss_options_from_the_definition():
    config = pytest.importorskip("ftis_kernels.grpo.config", exc_type=MissingExtraError)
    fields = {f.name: f for f in dataclasses.fields(config.RunConfig)}
    assert set(config.LOSSES) == {"on-policy", *PRESETS}
    for name in config.RUN_LOSS_OPTIONS:
        assert fields[name].default.description.startswith(OPTION_FIELDS[name].metadata["help"])
    run = config.build_config(
        "smoke", overrides={"loss": "gspo", "epsilon": 0.1, "loss_options": {"entropy_coef": 0.01}}
    )
    want = FTISOptions.preset("gspo", epsilon=0.1, entropy_coef=0.01, temperature=run.temperature)
    assert run.ftis_options() == want
    with pytest.raises(ValueError, match="loss_options"):
        config.build_config("smoke", overrides={"loss_options": {"is_cap_max": 1.0}})


def _option_table(path: str) -> dict[str, tuple[str, str]]:
    """{option: (default cell, allowed cell)} of the option table of a doc (the table whose header
    starts "| option | default |"); a row may name several options."""
    lines = (Path(__file__).resolve().parents[1] / path).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| option | default |"))
    rows: dict[str, tuple[str, str]] = {}
    for line in itertools.takewhile(lambda s: s.startswith("|"), lines[start + 2 :]):
        first, default, allowed = (c.strip() for c in line.strip("|").split(" | ")[:3])
        names = re.findall(r"`(\w+)`", first)
        defaults = default.split(", ")
        for i, name in enumerate(names):
            rows[name] = (defaults[i] if len(defaults) == len(names) else default, allowed)
    return rows


@pytest.mark.parametrize("path", ["docs/options.md", "docs/method.md"])
def test_the_docs_option_tables_give_every_option_its_definitions_default_and_values(path):
    # The allowed cell is the definition's (`option_allowed`), optionally followed by "; " and a
    # combination (e.g. is_cap_min <= is_cap).
    rows = _option_table(path)
    assert set(OPTION_NAMES) <= set(rows), set(OPTION_NAMES) - set(rows)
    for name in OPTION_NAMES:
        default, allowed = rows[name]
        assert default == option_default_text(name), (name, default)
        assert allowed.split("; ")[0] == option_allowed(name), (name, allowed)


def test_the_options_page_says_which_rows_ftis_linear_loss_does_not_take():
    # The page lists the keywords both ops take; a row that one op refuses must say so.
    lines = (Path(__file__).resolve().parents[1] / "docs" / "options.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| option | default |"))
    linear = inspect.signature(ftis_linear_loss).parameters
    for line in itertools.takewhile(lambda s: s.startswith("|"), lines[start + 2 :]):
        first, meaning = line.strip("|").split(" | ")[0], line.strip("|").split(" | ")[3]
        for name in re.findall(r"`(\w+)`", first):
            if name not in linear:
                assert "`ftis_loss` only" in meaning, name


def test_the_options_page_names_every_preset():
    text = (Path(__file__).resolve().parents[1] / "docs" / "options.md").read_text()
    listed = text.split("with `name` one of", 1)[1].split("docs/method.md", 1)[0]
    assert set(re.findall(r"`([\w-]+)`", listed)) == set(PRESETS)


def test_resolved_options_are_reused_and_still_validated_by_type():
    """resolve_options keeps recent results (a training loop passes the same keywords each
    step), keyed by each value's type as well: True == 1 == 1.0, and only the float is valid."""
    from ftis_kernels.options import resolve_options

    first = resolve_options(None, {"is_cap": 1.0, "kl_threshold": 20.0})
    assert resolve_options(None, {"kl_threshold": 20.0, "is_cap": 1.0}) is first
    with pytest.raises(ValueError, match="is_cap"):
        resolve_options(None, {"is_cap": True, "kl_threshold": 20.0})
    base = FTISOptions(is_cap=3.0)
    assert resolve_options(base, {}) is base
    assert resolve_options(base, {"kl_threshold": 5.0}).is_cap == 3.0


@pytest.mark.parametrize(
    "name, lower, upper", [("seq_sum_k1", 0.6, 1.4), ("seq_mean_k1", 0.5, 1.5)]
)
def test_verl_k1_presets_keep_what_verls_lower_upper_band_keeps(name, lower, upper):
    # verl's rollout_rs="seq_*_k1" with threshold "lower_upper" keeps a sequence when the sum
    # (or mean) over its tokens of k1 = log pi_rollout - log pi_old lies in [log lower, log upper]
    # (verl/trainer/ppo/rollout_corr_helper.py in volcengine/verl). One token per sample, so sum
    # and mean agree: 0.9 log(upper) and 0.9 log(lower) are kept, 1.1 log(upper) and 1.1
    # log(lower) are rejected.
    bounds = torch.tensor([math.log(upper), math.log(lower)] * 2)
    d = (bounds * torch.tensor([0.9, 0.9, 1.1, 1.1]))[:, None]
    old = torch.full_like(d, -1.0)
    result = per_sample.per_sample_loss(
        old, old + d, torch.ones(4), None, old, None, FTISOptions.preset(name)
    )
    assert result.metrics["filtered"].tolist() == [False, False, True, True]
