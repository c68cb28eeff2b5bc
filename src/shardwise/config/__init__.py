"""Typed job configuration: nested frozen dataclasses, a TOML file, ``--section.key=value`` overrides.

Precedence, lowest to highest::

    defaults (the dataclasses below)  <  the TOML file (--config run.toml)  <  the command line

On the command line, ``--section.key=value`` (or ``--section.key value``) sets one key; the
shortcut flags of ``shardwise train`` (``--max-steps``, ``--plan``, ``--nproc``) are the same as
their dotted keys and are applied last. Every value is checked against the field's type, allowed
choices and range; an unknown section or key, or a bad value, raises one
:class:`~shardwise.errors.ConfigError` line that names the key (and suggests the nearest valid one).

A section is a frozen dataclass whose fields carry ``help`` (and optionally ``min``/``max``)
metadata; :func:`describe_keys` turns that into the reference table printed by
``shardwise train --help`` and shown in ``docs/training.md``.
"""

from __future__ import annotations

import difflib
import sys
import typing
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal, Mapping, Sequence, TypeVar

from shardwise.config.paths import check_input_file, check_output_dir, check_output_file
from shardwise.errors import ConfigError
from shardwise.shape import TransformerShape

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    try:
        import tomli as tomllib
    except ImportError:
        tomllib = None

T = TypeVar("T")


def opt(default: Any, help: str, *, min: float | None = None, max: float | None = None) -> Any:  # noqa: A002
    """A config field: default, one line of help, optional inclusive range."""
    return field(default=default, metadata={"help": help, "min": min, "max": max})


class _Section:
    """Base of a config table: code-built values get the same checks as TOML and the command line."""

    section: ClassVar[str] = ""

    def __post_init__(self) -> None:
        _validate(self)


# -- the sections of `shardwise train` -------------------------------------------------------
# The [model] table is the one transformer shape (shardwise.shape), limited to the keys the
# built-in GPT implements and the job does not set itself, plus `hf`: a Hugging Face model
# directory to fine-tune instead (its config.json gives the shape; seq_len is the window length).
MODEL_KEYS = ("hf", "layers", "hidden", "heads", "ffn", "seq_len", "dropout", "experts", "top_k", "expert_ffn", "aux_loss")


@dataclass(frozen=True)
class ModelSection(TransformerShape):
    """The ``[model]`` table: the built-in GPT's shape, or ``hf``: a Hugging Face model directory."""

    hf: str = opt("", "a Hugging Face model directory (config.json, safetensors, tokenizer) to fine-tune instead of the built-in GPT")

    def shape(self) -> TransformerShape:
        """The shape without the ``hf`` key."""
        return TransformerShape(**{k: v for k, v in self.to_dict().items() if k != "hf"})


@dataclass(frozen=True)
class RunSection(_Section):
    section: ClassVar[str] = "run"
    name: str = opt("", "run name: logs go to <runs_dir>/<name>/ (empty: gpt-stdlib-<date>-<time>)")
    runs_dir: str = opt("runs", "parent directory of the run directories")
    seed: int = opt(0, "seed of the model initialization, the data order and the sample", min=0)


@dataclass(frozen=True)
class DataSection(_Section):
    section: ClassVar[str] = "data"
    files: str = opt("", "text, JSONL or parquet files to train on: comma-separated globs, e.g. 'data/**/*.txt' (needs model.hf; "
                         "empty: the standard library's source)")
    text_key: str = opt("text", "the field of each JSONL line (or the parquet column) that holds the text")
    max_chars: int = opt(1_000_000, "characters of standard-library source to read", min=1000)
    val_fraction: float = opt(0.1, "last fraction of the text kept for validation", min=0.001, max=0.49)
    num_workers: int = opt(0, "DataLoader worker processes per rank", min=0)
    streaming: bool = opt(False, "read data.files as a stream: packed as read, sharded over ranks and workers, resumed exactly "
                                 "(needs model.hf and train.max_steps; validation from data.val_files)")
    val_files: str = opt("", "with data.streaming: files loaded whole as the validation split (empty: no validation)")
    shuffle_windows: int = opt(0, "with data.streaming: shuffle the windows within blocks of this many (0: in order)", min=0)


@dataclass(frozen=True)
class TrainSection(_Section):
    section: ClassVar[str] = "train"
    max_steps: int = opt(400, "optimizer steps (0: no step limit, use max_epochs)", min=0)
    max_epochs: int = opt(0, "epochs over the training windows (0: no epoch limit)", min=0)
    global_batch_size: int = opt(64, "sequences per optimizer step over all ranks and micro-steps", min=1)
    grad_accum_steps: int = opt(1, "micro-steps per optimizer step (gradient accumulation)", min=1)
    lr: float = opt(3e-3, "peak learning rate (for the reference world size, see scale_lr)", min=0.0)
    scale_lr: Literal["none", "linear", "sqrt"] = opt("none", "scale lr with the data-parallel size (Goyal et al. 2017)")
    warmup_steps: int = opt(50, "linear warmup steps, then cosine decay", min=0)
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of the peak", min=0.0, max=1.0)
    weight_decay: float = opt(0.1, "AdamW weight decay", min=0.0)
    clip_grad_norm: float = opt(1.0, "clip the global gradient norm to this (0: off)", min=0.0)
    precision: Literal["fp32", "bf16", "fp16"] = opt("fp32", "compute precision (bf16/fp16 autocast)")
    eval_every: int = opt(100, "evaluate every N steps (0: only at the end)", min=0)
    eval_windows: int = opt(0, "validation windows per evaluation (0: the whole split)", min=0)
    log_every: int = opt(10, "log metrics every N steps", min=1)


@dataclass(frozen=True)
class ParallelSection(_Section):
    section: ClassVar[str] = "parallel"
    plan: str = opt("dp", "parallel plan: 'dp' (all ranks data parallel), 'auto' (the planner picks) or e.g. 'dp=2,tp=2'")
    nproc: str = opt("auto", "local processes: a number, or 'auto' (one per GPU, else one per core up to 4)")


@dataclass(frozen=True)
class SampleSection(_Section):
    section: ClassVar[str] = "sample"
    chars: int = opt(200, "characters to generate at the end (0: none)", min=0)
    prompt: str = opt("def ", "text the sample starts from")
    temperature: float = opt(0.8, "sampling temperature", min=0.01)
    top_k: int = opt(0, "sample among the k most likely characters (0: all)", min=0)


@dataclass(frozen=True)
class CheckpointSection(_Section):
    section: ClassVar[str] = "checkpoint"
    every_n_steps: int = opt(0, "save every N steps into <run dir>/checkpoints (0: only at the end)", min=0)
    keep_last_n: int = opt(3, "complete checkpoints kept", min=1)
    async_save: bool = opt(False, "write checkpoints in the background while training continues")
    resume: Literal["never", "auto"] = opt("never", "'auto': continue from the newest complete checkpoint of run.name")


@dataclass(frozen=True)
class LogSection(_Section):
    section: ClassVar[str] = "log"
    tracker: Literal["none", "mlflow", "wandb"] = opt("none", "experiment tracker that also gets the metrics, this configuration and the plan")
    experiment: str = opt("shardwise", "the MLflow experiment or the W&B project the run is logged under")
    tracking_uri: str = opt("", "MLflow's store: file:///abs/mlruns, sqlite:///mlflow.db, http://host:5000 (empty: MLFLOW_TRACKING_URI "
                                "or MLflow's default)")
    wandb_mode: Literal["auto", "online", "offline"] = opt("auto", "W&B's mode ('offline': only files under <run dir>/wandb; "
                                                           "'auto': WANDB_MODE, else online)")


@dataclass(frozen=True)
class TrainJobConfig:
    """Everything ``shardwise train`` needs; one attribute per TOML table."""

    run: RunSection = field(default_factory=RunSection)
    # The built-in GPT's shape; the job fills in the vocabulary from the corpus.
    model: ModelSection = field(default_factory=ModelSection, metadata={"keys": MODEL_KEYS})
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    sample: SampleSection = field(default_factory=SampleSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)


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
        raise ConfigError(f"config file {path!r} is a directory", hint="give the path of a TOML file to --config") from None
    except OSError as exc:
        raise ConfigError(f"config file {path!r} cannot be read: {exc.strerror or exc}", hint="check its permissions") from None
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
            raise _unknown(f"{section}.{key}", [f"{section}.{k}" for k in known], f"key '{section}.{key}' (from {source})")
        out[key] = _check(f"{section}.{key}", value, hints[key], known[key].metadata, source)
    return cls(**out)


def _check(key: str, value: Any, annotation: Any, meta: Mapping[str, Any], source: str, *, coerce: bool = True) -> Any:
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


def _validate(section: Any) -> None:
    hints = typing.get_type_hints(type(section))
    for f in fields(section):
        _check(f"{section.section}.{f.name}", getattr(section, f.name), hints[f.name], f.metadata, "the code", coerce=False)


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
    "ConfigError",
    "DataSection",
    "LogSection",
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
