"""The driver's usage errors: one line each, `key: expected <what>, got <value>`.

Every configuration or usage error the command line, the launcher, a node or a peer finds is a
`ConfigError`; the command line prints its lines and exits with `process.EXIT_USAGE`.
"""

from __future__ import annotations

import json
from typing import Any

# What an error message echoes of a value at most: a config's value can be megabytes.
MAX_ECHO = 200


class ConfigError(ValueError):
    """Configuration or usage errors, one line each: `key: expected ..., got value`."""

    def __init__(self, *problems: tuple[str, str, Any] | str):
        """Each problem is (key, what was expected, the value got), or a line already written
        in that form (the loss options' own errors)."""
        self.problems = problems
        self.lines = [
            p if isinstance(p, str) else f"{p[0]}: expected {p[1]}, got {_got(p[2])}"
            for p in problems
        ]
        super().__init__("\n".join(self.lines))

    def renamed(self, names: dict[str, str]) -> ConfigError:
        """The same problems, each key found in `names` shown as its value there (the flag that
        set the key on the command line), and each line once."""
        renamed = ConfigError(
            *(p if isinstance(p, str) else (names.get(p[0], p[0]), *p[1:]) for p in self.problems)
        )
        renamed.lines = list(dict.fromkeys(renamed.lines))  # one flag that set several keys
        renamed.args = ("\n".join(renamed.lines),)
        return renamed


def _got(value: Any) -> str:
    """The `got` part of a problem: a `Described` value whole, any other cut by `echo`."""
    return show(value) if isinstance(value, Described) else echo(show(value))


def echo(text: str) -> str:
    """`text` as an error message echoes it: at most `MAX_ECHO` characters."""
    if len(text) <= MAX_ECHO:
        return text
    return f"{text[:MAX_ECHO]}... ({len(text)} characters)"


def show(value: Any) -> str:
    """A value as the user wrote it: strings quoted, None as null, the rest as YAML scalars."""
    if isinstance(value, Verbatim):
        return str(value)
    if isinstance(value, str):
        return repr(value)
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return str(value)


class Verbatim(str):
    """A `got` value shown as is (a description rather than the user's value)."""


class Described(Verbatim):
    """A description whose user values are already cut (`echo`), shown whole: its advice (a
    command to run) must not be cut off."""
