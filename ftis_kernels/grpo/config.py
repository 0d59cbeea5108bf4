"""Run configuration: presets, YAML/TOML files and `key=value` overrides over the schema
(`schema.RunConfig`), and the schema described for people (`--list-keys`, `--print-config`).

Layers, later wins: the dataclass defaults, `--preset`, `--config FILE`, then the command-line
flags (`--rounds 8`, `--set nodes.1.hostile=random_tokens`, ...). The schema's names are
importable from here too (`__all__`): `from ftis_kernels.grpo.config import RunConfig`.
"""

from __future__ import annotations

import copy
import difflib
import re
import textwrap
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

import yaml
from pydantic import TypeAdapter, ValidationError

from ftis_kernels.grpo.errors import ConfigError, Verbatim, show
from ftis_kernels.grpo.schema import (
    ARCHS,
    COLLABS,
    LOSSES,
    REPEAT_SEED_STRIDE,
    RESUMABLE,
    RUN_LOSS_OPTIONS,
    TRANSPORTS,
    NodeSpec,
    RunConfig,
    resume_changes,
    to_dict,
)

__all__ = [
    "ARCHS",
    "COLLABS",
    "LOSSES",
    "PRESETS",
    "PRESET_HELP",
    "RESUMABLE",
    "RUN_LOSS_OPTIONS",
    "TRANSPORTS",
    "ConfigError",
    "NodeSpec",
    "RunConfig",
    "apply_set",
    "build_config",
    "describe_keys",
    "from_dict",
    "load_file",
    "render_config",
    "render_keys",
    "resume_changes",
    "show",
    "to_dict",
]


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 floats: `3e-4` and `1E5` are numbers, not strings
    (YAML 1.1, which PyYAML follows, demands a dot and a signed exponent: `3.0e-4`), and without
    aliases (`*name`): a config needs none, and a few hundred bytes of nested aliases expand to
    gigabytes."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None,
                None,
                "aliases (*name) are not allowed in a config",
                self.peek_event().start_mark,
            )
        return super().compose_node(parent, index)


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                 |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                 |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                 |[-+]?\.(?:inf|Inf|INF)
                 |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_YamlLoader)


# One line each for `ftis-grpo --help`.
PRESET_HELP = {
    "smoke": "2 tiny nodes (full fine-tune and LoRA), 4 rounds: the driver end to end in ~20 s",
    "demo": "3 heterogeneous nodes (tiny, small, LoRA), 80 rounds: the README's main job",
}
PRESETS: dict[str, dict[str, Any]] = {
    # End to end in well under 2 minutes on 2 CPU cores.
    "smoke": dict(
        rounds=4,
        prompts_per_node=2,
        group_size=4,
        max_new_tokens=24,
        eval_size=16,
        eval_max_new_tokens=24,
        ckpt_every=2,
        micro_batch=16,
        nodes=[
            dict(
                name="tiny-full",
                arch="tiny",
                init_seed=0,
                warmup_steps=100,
                warmup_format=0.5,
                lr=3e-4,
            ),
            dict(
                name="tiny-lora",
                arch="tiny",
                init_seed=1,
                warmup_steps=80,
                warmup_format=0.5,
                lora=True,
                lr=1e-3,
            ),
        ],
    ),
    # The README's main job: three heterogeneous nodes, a few minutes on CPU. Their warm-ups
    # differ in length, operations and how often they use GSM8K's '#### x' answer format.
    "demo": dict(
        rounds=80,
        prompts_per_node=8,
        group_size=8,
        max_new_tokens=28,
        eval_size=64,
        eval_every=5,
        ckpt_every=10,
        micro_batch=64,
        temperature=0.8,
        nodes=[
            dict(
                name="tiny-add",
                arch="tiny",
                init_seed=0,
                warmup_steps=500,
                warmup_ops=["add"],
                warmup_format=0.4,
                lr=3e-4,
            ),
            dict(
                name="small",
                arch="small",
                init_seed=1,
                warmup_steps=300,
                warmup_format=0.3,
                lr=2e-4,
            ),
            dict(
                name="tiny-lora",
                arch="tiny",
                init_seed=2,
                warmup_steps=500,
                warmup_format=0.5,
                lora=True,
                lr=1e-3,
            ),
        ],
    ),
}


def from_dict(d: dict[str, Any]) -> RunConfig:
    """The config dict `d` (every key, as `to_dict` writes one) as a RunConfig; ConfigError
    naming the key of every value the schema refuses."""
    try:
        return _ADAPTER.validate_python(d)
    except ValidationError as exc:
        raise ConfigError(*(_problem(e) for e in exc.errors())) from None


_ADAPTER = TypeAdapter(RunConfig)
_KNOWN = {f.name for f in fields(RunConfig)} | {f.name for f in fields(NodeSpec)}
# What the schema expected, by pydantic error type, where its own message is not the clearest.
_EXPECTED = {
    "int_parsing": "an integer",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "int_parsing_size": "an integer in range (ftis-grpo --list-keys gives the bounds)",
    "float_parsing": "a number",
    "float_type": "a number",
    "finite_number": "a finite number",
    "bool_parsing": "true or false",
    "bool_type": "true or false",
    "string_type": "a string",
    "dict_type": "a mapping",
    "list_type": "a list",
    "dataclass_type": "a mapping of node keys",
}


def _problem(err: dict[str, Any]) -> tuple[str, str, Any]:
    """(key, expected, got) of one pydantic error."""
    loc = [str(p) for p in err["loc"] if p != "[key]"]
    key, kind, ctx = ".".join(loc), err["type"], err.get("ctx") or {}
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        close = difflib.get_close_matches(loc[-1], sorted(_KNOWN), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        return (
            key,
            f"a known key ({hint}ftis-grpo --list-keys lists them)",
            Verbatim(f"{key}={show(err['input'])}"),
        )
    if kind in _EXPECTED:
        return key, _EXPECTED[kind], err["input"]
    bounds = {
        "greater_than": "> {gt}",
        "greater_than_equal": ">= {ge}",
        "less_than": "< {lt}",
        "less_than_equal": "<= {le}",
    }
    if kind in bounds:
        return key, "a value " + bounds[kind].format(**ctx), err["input"]
    if kind == "literal_error":
        return key, "one of " + ctx["expected"], err["input"]
    if kind == "too_short":
        return key, f"at least {ctx['min_length']} item(s)", err["input"]
    msg = err["msg"].removeprefix("Input should be ").removeprefix("Value error, ")
    return key, msg, err["input"]


def load_file(path: str) -> dict[str, Any]:
    """A YAML (.yaml/.yml) or TOML (.toml) config file as a dict; ConfigError naming the file if it
    cannot be read or parsed, or holds anything but a mapping of config keys."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            (
                "--config",
                "a readable YAML or TOML file",
                Verbatim(f"{path!r} ({getattr(exc, 'strerror', None) or exc})"),
            )
        ) from None
    try:
        if path.endswith(".toml"):
            try:
                import tomllib
            except ImportError:  # Python 3.10
                import tomli as tomllib

            content = tomllib.loads(text)
        else:
            content = _yaml(text)
    except Exception as exc:  # yaml.YAMLError, tomllib.TOMLDecodeError
        where = " ".join(str(exc).split())
        raise ConfigError(
            ("--config", "valid YAML or TOML", Verbatim(f"{path}: {where}"))
        ) from None
    if content is None:
        return {}
    if not isinstance(content, dict):
        raise ConfigError(
            (f"--config {path}", "a mapping of config keys (key: value lines)", content)
        )
    return content


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if key == "nodes":
            # A node list replaces the preset's; per-node edits go through --set nodes.i.key=...
            out[key] = copy.deepcopy(value)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_set(d: dict[str, Any], assignment: str) -> None:
    """Apply one 'a.b.c=value' override (value parsed as YAML) to the dict `d` in place."""
    if "=" not in assignment:
        raise ConfigError(("--set", "KEY=VALUE", assignment))
    key, raw = assignment.split("=", 1)
    try:
        value = _yaml(raw)
    except yaml.YAMLError:
        raise ConfigError((key, "a YAML value", raw)) from None
    parts = key.split(".")
    target: Any = d
    for depth, part in enumerate(parts):
        here = ".".join(parts[: depth + 1])
        last = depth == len(parts) - 1
        if isinstance(target, list):
            if not (part.isdigit() and int(part) < len(target)):
                within = f"{len(target)} items of {'.'.join(parts[:depth])}"
                raise ConfigError(
                    (
                        here,
                        f"an index from 0 to {len(target) - 1} into the {within}",
                        Verbatim(part),
                    )
                )
            if last:
                target[int(part)] = value
            else:
                target = target[int(part)]
        elif isinstance(target, dict):
            if last:
                target[part] = value
            else:
                target = target.setdefault(part, {})
        else:
            raise ConfigError(
                (
                    here,
                    f"a key inside a mapping, but {'.'.join(parts[:depth])} is a single value",
                    Verbatim(assignment),
                )
            )


def build_config(
    preset: Optional[str] = None,
    config_file: Optional[str] = None,
    overrides: Optional[dict[str, Any]] = None,
    sets: tuple[str, ...] = (),
    n_nodes: Optional[int] = None,
) -> RunConfig:
    """Defaults < preset < config file < flags (`overrides`, then each `--set`); ConfigError
    naming the key of every value the schema refuses."""
    d: dict[str, Any] = to_dict(RunConfig())
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(("--preset", f"one of {', '.join(PRESETS)}", preset))
        d = _merge(d, PRESETS[preset])
    if config_file is not None:
        d = _merge(d, load_file(config_file))
    d = _merge(d, {k: v for k, v in (overrides or {}).items() if v is not None})
    if n_nodes is not None:
        if n_nodes < 1:
            raise ConfigError(("--nodes", "a number of nodes >= 1", n_nodes))
        base = d["nodes"]
        if isinstance(base, list) and base and all(isinstance(n, dict) for n in base):
            d["nodes"] = [dict(base[i % len(base)]) for i in range(n_nodes)]
            if n_nodes > len(base):
                for i, n in enumerate(d["nodes"]):
                    n["name"] = f"{n.get('name', 'node')}-{i}"
                    n["init_seed"] = n.get("init_seed", 0) + REPEAT_SEED_STRIDE * (i // len(base))
    for assignment in sets:
        apply_set(d, assignment)
    return from_dict(d)


# -- the schema, described for people (`--list-keys`, `--print-config`) ---------------------------
def _allowed(annotation: Any, metadata: list[Any] = ()) -> str:
    """What a field accepts, in words: 'integer >= 1', "'vertical' | 'horizontal'", ..."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _allowed(args[0], list(args[1:]) + list(metadata))
    if origin is Literal:
        text = " | ".join(show(a) for a in args)
    elif origin is Union:
        text = " | ".join(_allowed(a) for a in args)
    elif origin is list:
        text = f"list of ({_allowed(args[0])})"
    elif origin is dict:
        text = f"mapping ({_allowed(args[0])}) -> ({_allowed(args[1])})"
    else:
        text = {
            bool: "true | false",
            int: "integer",
            float: "number",
            str: "string",
            type(None): "null",
        }.get(annotation, getattr(annotation, "__name__", "mapping"))
    bounds = []
    for m in metadata:
        for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                bounds.append(f"{op} {getattr(m, attr)}")
        for item in getattr(m, "metadata", ()):  # a FieldInfo inside Annotated
            for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
                if getattr(item, attr, None) is not None:
                    bounds.append(f"{op} {getattr(item, attr)}")
    return " ".join([text] + [", ".join(bounds)] if bounds else [text])


def describe_keys() -> list[tuple[str, str, str, str]]:
    """(key, allowed values, default, meaning) of every config key; node keys as nodes.<i>.KEY."""
    rows = []
    for cls, prefix in ((RunConfig, ""), (NodeSpec, "nodes.<i>.")):
        defaults = to_dict(cls())
        for name, info in cls.__pydantic_fields__.items():
            if cls is RunConfig and name == "nodes":
                allowed, default = "list of node mappings (the nodes.<i>.* keys)", "[one node]"
            else:
                allowed = _allowed(info.annotation, info.metadata)
                default = (
                    yaml.safe_dump(defaults[name], default_flow_style=True, width=1 << 30)
                    .strip()
                    .removesuffix("\n...")
                )
            rows.append((prefix + name, allowed, default, info.description or ""))
    return rows


LIST_WIDTH = 100  # columns of `--list-keys`


def render_keys(width: int = LIST_WIDTH) -> str:
    """`--list-keys`: every config key with its allowed values and default, then its meaning
    indented below, in lines of at most `width` columns (a longer word keeps its line)."""
    wrap = dict(width=width, break_long_words=False, break_on_hyphens=False)
    blocks = []
    for key, allowed, default, meaning in describe_keys():
        head = textwrap.wrap(
            f"{key}: {allowed}; default {default}", subsequent_indent="      ", **wrap
        )
        body = textwrap.wrap(meaning, initial_indent="    ", subsequent_indent="    ", **wrap)
        blocks.append("\n".join(head + body))
    return "\n".join(blocks)


def render_config(cfg: RunConfig, layers: str) -> str:
    """`--print-config`: the effective configuration as YAML (a valid `--config` file), each key
    commented with its allowed values and meaning."""
    described = {key: (allowed, meaning) for key, allowed, _, meaning in describe_keys()}
    lines = [f"# the effective configuration: {layers}", "# key: value  # allowed values: meaning"]

    def line(indent: str, key: str, value: Any, described_as: Optional[str]) -> str:
        text = f"{indent}{key}: " + yaml.safe_dump(
            value, default_flow_style=True, width=1 << 30
        ).strip().removesuffix("\n...")
        if described_as is None:
            return text
        allowed, meaning = described[described_as]
        return f"{text:<40}  # {allowed}: {meaning}"

    d = to_dict(cfg)
    for key, value in d.items():
        if key != "nodes":
            lines.append(line("", key, value, key))
    lines.append(f"nodes:{'':<33}  # {described['nodes'][1]}")
    for i, node in enumerate(d["nodes"]):
        for j, (key, value) in enumerate(node.items()):
            lines.append(
                line("- " if j == 0 else "  ", key, value, f"nodes.<i>.{key}" if i == 0 else None)
            )
    return "\n".join(lines)
