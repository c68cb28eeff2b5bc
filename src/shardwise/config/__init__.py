"""Typed job configuration: nested frozen dataclasses, a TOML file, ``--section.key=value`` overrides.

Precedence, lowest to highest::

    defaults (the dataclasses below)  <  the TOML file (--config run.toml)  <  the command line

On the command line, ``--section.key=value`` (or ``--section.key value``) sets one key; the
shortcut flags of ``shardwise train`` (``--max-steps``, ``--plan``, ``--nproc``) are the same as
their dotted keys and are applied last. Every value is checked against the field's type, allowed
choices and range; an unknown section or key, or a bad value, raises one
:class:`~shardwise.errors.ConfigError` line that names the key (and suggests the nearest valid one).

A section is a frozen dataclass whose fields carry ``help`` (and optionally ``min``/``max``)
metadata (:mod:`shardwise.config.schema`; the tables of ``shardwise train`` are in
:mod:`shardwise.config.sections`); :func:`describe_keys` turns that into the reference table printed by
``shardwise train --help`` and shown in ``docs/training.md``.
"""

from __future__ import annotations

import difflib
import sys
import typing
from dataclasses import fields
from typing import Any, Literal, Mapping, Sequence, TypeVar

from shardwise.config.schema import check_value
from shardwise.config.paths import check_input_file, check_output_dir, check_output_file
from shardwise.config.sections import (
    MODEL_KEYS,
    CheckpointSection,
    DataSection,
    LogSection,
    LoraSection,
    ModelSection,
    ParallelSection,
    RunSection,
    SampleSection,
    TrainJobConfig,
    TrainSection,
)
from shardwise.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    try:
        import tomli as tomllib
    except ImportError:
        tomllib = None

T = TypeVar("T")


# -- loading -----------------------------------------------------------------------------------
def load_config(cls: type[T] = TrainJobConfig, *, path: str | None = None, overrides: Sequence[str] = (),
                values: Mapping[str, Any] | None = None) -> T:
    """Defaults, then the TOML file at ``path``, then ``overrides`` (``"section.key=value"``), then
    ``values`` (``{"section.key": typed value}``, the command line's shortcut flags)."""
    sections = _sections(cls)
    merged: dict[str, dict[str, Any]] = {name: {} for name in sections}
    if path:
        for section, table in _read_toml(path).items():
            if section not in sections:
                raise _unknown(section, list(sections), f"section [{section}] in {path}")
            if not isinstance(table, dict):
                raise ConfigError(f"config key {section!r} in {path} must be a table [{section}]")
            for key, value in table.items():
                merged[section][key] = (value, path)
    for item in overrides:
        dotted, sep, raw = item.lstrip("-").partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} has no value", hint="write --section.key=value, e.g. --train.lr=1e-3")
        section, key = _split_key(dotted, sections)
        merged[section][key] = (raw, "the command line")
    for dotted, value in (values or {}).items():
        section, key = _split_key(dotted, sections)
        merged[section][key] = (value, "the command line")
    built = {}
    for section, section_cls in sections.items():
        built[section] = _build_section(section, section_cls, merged[section], section_fields(cls, section))
    return cls(**built)


def to_toml(config: Any) -> str:
    """The config as a TOML document that :func:`load_config` reads back to the same value."""
    lines = []
    for section in fields(config):
        lines.append(f"[{section.name}]")
        for f in section_fields(type(config), section.name):
            lines.append(f"{f.name} = {_toml_value(getattr(getattr(config, section.name), f.name))}")
        lines.append("")
    return "\n".join(lines)


def flatten(config: Any) -> dict[str, Any]:
    """``{"section.key": value}`` for every configurable key, in table order (the parameters an
    experiment tracker records for the run)."""
    return {f"{s.name}.{f.name}": getattr(getattr(config, s.name), f.name) for s in fields(config)
            for f in section_fields(type(config), s.name)}


def describe_keys(cls: type = TrainJobConfig) -> str:
    """One line per key: ``section.key = default   help``."""
    rows = []
    for section, section_cls in _sections(cls).items():
        hints = typing.get_type_hints(section_cls)
        for f in section_fields(cls, section):
            choices = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is Literal else ()
            extra = f" ({'|'.join(choices)})" if choices else ""
            rows.append((f"{section}.{f.name} = {_toml_value(f.default)}", f.metadata.get("help", "") + extra))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {h}" for k, h in rows)


def override_keys(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split a command line into ``("section.key=value", ...)`` overrides and the other arguments.

    ``--section.key=value`` and ``--section.key value`` are both accepted; an option is an
    override when its name contains a dot.
    """
    overrides, rest = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if "." in name:
            if "=" in arg:
                overrides.append(arg[2:])
            elif i + 1 < len(argv):
                overrides.append(f"{name}={argv[i + 1]}")
                i += 1
            else:
                raise ConfigError(f"override {arg!r} has no value", hint=f"write {arg}=VALUE")
        else:
            rest.append(arg)
        i += 1
    return overrides, rest


# -- helpers -------------------------------------------------------------------------------------
def _sections(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def section_fields(config_cls: type, section: str) -> list[Any]:
    """The configurable fields of one table: all of its dataclass's fields, or the ``keys`` that
    the config class's field metadata names (the ``[model]`` table exposes part of a shape)."""
    outer = {f.name: f for f in fields(config_cls)}[section]
    keys = outer.metadata.get("keys")
    inner = fields(_sections(config_cls)[section])
    return [f for f in inner if keys is None or f.name in keys]


def _read_toml(path: str) -> dict[str, Any]:
    if tomllib is None:  # pragma: no cover - Python 3.10 without tomli
        raise ConfigError("reading TOML needs Python 3.11 or the 'tomli' package", hint="pip install tomli")
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist", hint="check the path given to --config") from None
    except IsADirectoryError:
        raise ConfigError(
            f"config file {path!r} is a directory", hint="give the path of a TOML file to --config"
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"config file {path!r} cannot be read: {exc.strerror or exc}", hint="check its permissions"
        ) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:  # tomllib decodes the bytes as UTF-8 first
        raise ConfigError(f"config file {path!r} is not valid TOML: {exc}") from None


def _split_key(dotted: str, sections: Mapping[str, type]) -> tuple[str, str]:
    section, dot, key = dotted.partition(".")
    if not dot or not key:
        raise ConfigError(f"override key {dotted!r} is not section.key", hint="for example --train.lr=1e-3")
    if section not in sections:
        raise _unknown(section, list(sections), f"section {section!r} (in --{dotted})")
    return section, key


def _unknown(name: str, valid: list[str], what: str) -> ConfigError:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ConfigError(f"unknown config {what}", hint=f"{hint}valid: {', '.join(valid)}")


def _build_section(section: str, cls: type, values: Mapping[str, tuple[Any, str]], allowed: Sequence[Any]) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in allowed}
    out = {}
    for key, (value, source) in values.items():
        if key not in known:
            raise _unknown(
                f"{section}.{key}", [f"{section}.{k}" for k in known], f"key '{section}.{key}' (from {source})"
            )
        out[key] = check_value(f"{section}.{key}", value, hints[key], known[key].metadata, source)
    return cls(**out)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{text}"'


def replace(config: T, **section_values: Mapping[str, Any]) -> T:
    """``replace(cfg, train={"max_steps": 5})``: a copy with some keys changed (checked like overrides)."""
    values = {f"{section}.{k}": v for section, kv in section_values.items() for k, v in kv.items()}
    return load_config(type(config), values={**flatten(config), **values})


__all__ = [
    "CheckpointSection",
    "ConfigError",
    "DataSection",
    "LogSection",
    "LoraSection",
    "MODEL_KEYS",
    "ModelSection",
    "ParallelSection",
    "RunSection",
    "SampleSection",
    "TrainJobConfig",
    "TrainSection",
    "check_input_file",
    "check_output_dir",
    "check_output_file",
    "describe_keys",
    "flatten",
    "load_config",
    "override_keys",
    "replace",
    "to_toml",
]
