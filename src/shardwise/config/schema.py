"""What one config key is, and how one value is checked against it.

A key is a field of a frozen dataclass (a *section*, one TOML table) made with :func:`opt`: its
default, one line of help and an optional inclusive range. :func:`check_value` turns a
command-line string into the field's type (bool, int, float, str or a ``Literal`` of choices) or
checks a TOML/code value as it is, then checks the range; a bad value is one
:class:`~shardwise.errors.ConfigError` line naming the key and where the value came from.
"""

from __future__ import annotations

import typing
from dataclasses import field, fields
from typing import Any, ClassVar, Literal, Mapping

from shardwise.errors import ConfigError


def opt(default: Any, help: str, *, min: float | None = None, max: float | None = None) -> Any:  # noqa: A002
    """A config field: default, one line of help, optional inclusive range."""
    return field(default=default, metadata={"help": help, "min": min, "max": max})


class Section:
    """Base of a config table: code-built values get the same checks as TOML and the command line."""

    section: ClassVar[str] = ""

    def __post_init__(self) -> None:
        validate_section(self)


def check_value(
    key: str, value: Any, annotation: Any, meta: Mapping[str, Any], source: str, *, coerce: bool = True
) -> Any:
    """Coerce a command-line string or check a TOML value against the field's type and range."""
    where = f"config key '{key}' (from {source})"
    if typing.get_origin(annotation) is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, choices))}")
        return value
    from_cli = coerce and isinstance(value, str) and annotation is not str
    try:
        if annotation is bool:
            if from_cli:
                low = value.lower()
                if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError
                value = low in ("1", "true", "yes", "on")
            elif not isinstance(value, bool):
                raise ValueError
        elif annotation is int:
            if from_cli:
                value = int(value.replace("_", ""))
            elif isinstance(value, bool) or not isinstance(value, int):
                raise ValueError
        elif annotation is float:
            if from_cli:
                value = float(value)
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError
            value = float(value)
        elif annotation is str:
            if not isinstance(value, str):
                raise ValueError
    except ValueError:
        kind = {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}[annotation]
        raise ConfigError(f"{where}: {value!r} is not {kind}") from None
    low, high = meta.get("min"), meta.get("max")
    if low is not None and value < low:
        raise ConfigError(f"{where}: {value!r} is below the minimum {low}")
    if high is not None and value > high:
        raise ConfigError(f"{where}: {value!r} is above the maximum {high}")
    return value


def validate_section(section: Any) -> None:
    hints = typing.get_type_hints(type(section))
    for f in fields(section):
        check_value(
            f"{section.section}.{f.name}", getattr(section, f.name), hints[f.name], f.metadata, "the code", coerce=False
        )
