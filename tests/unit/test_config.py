"""Typed job configuration: precedence (defaults < TOML < command line), round trip, errors naming the key."""

from __future__ import annotations

import pytest

from dataclasses import fields

from shardwise.config import (
    TrainJobConfig,
    TrainSection,
    describe_keys,
    load_config,
    override_keys,
    replace,
    section_fields,
    to_toml,
)
from shardwise.errors import ConfigError


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def test_defaults_without_file_or_overrides() -> None:
    assert load_config() == TrainJobConfig()


def test_precedence_defaults_then_toml_then_command_line(tmp_path) -> None:
    path = _write(tmp_path, "[train]\nlr = 0.01\nmax_steps = 7\n[model]\nlayers = 2\n")
    cfg = load_config(path=path, overrides=["train.lr=0.02"], values={"train.max_steps": "9"})
    assert cfg.train.lr == 0.02  # command line beats the file
    assert cfg.train.max_steps == 9  # shortcut flags are applied last
    assert cfg.model.layers == 2  # the file beats the default
    assert cfg.model.hidden == TrainJobConfig().model.hidden  # untouched default


def test_toml_round_trip(tmp_path) -> None:
    cfg = load_config(overrides=["sample.prompt=a \"quoted\"\\ line", "train.precision=bf16", "model.dropout=0.1"])
    again = load_config(path=_write(tmp_path, to_toml(cfg)))
    assert again == cfg


def test_types_are_coerced_and_checked(tmp_path) -> None:
    cfg = load_config(overrides=["train.lr=1e-3", "model.layers=3", "data.max_chars=10_000"])
    assert isinstance(cfg.train.lr, float) and cfg.train.lr == 1e-3
    assert cfg.model.layers == 3 and cfg.data.max_chars == 10000
    # TOML integers are accepted for floats, but not the other way round, and not bools for ints
    assert load_config(path=_write(tmp_path, "[train]\nlr = 1\n")).train.lr == 1.0
    with pytest.raises(ConfigError, match="'model.layers'.*not an integer"):
        load_config(path=_write(tmp_path, "[model]\nlayers = 2.5\n"))
    with pytest.raises(ConfigError, match="'model.layers'.*not an integer"):
        load_config(path=_write(tmp_path, "[model]\nlayers = true\n"))


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("train.lrr=1", r"unknown config key 'train.lrr'.*did you mean 'train.lr'"),
        ("trian.lr=1", r"unknown config section 'trian'.*did you mean 'train'"),
        ("train.lr=fast", r"config key 'train.lr' \(from the command line\): 'fast' is not a number"),
        ("train.precision=fp64", r"'train.precision'.*'fp64' is not one of fp32, bf16, fp16, fp8"),
        ("model.layers=0", r"'model.layers'.*0 is below the minimum 1"),
        ("data.val_fraction=0.9", r"'data.val_fraction'.*above the maximum"),
        ("lr=1", r"override key 'lr' is not section.key"),
        ("train.lr", r"has no value"),
    ],
)
def test_bad_override_is_one_line_naming_the_key(override: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern) as info:
        load_config(overrides=[override])
    assert "\n" not in str(info.value)


def test_bad_file_names_the_file_and_key(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"unknown config section \[optim\] in .*run.toml"):
        load_config(path=_write(tmp_path, "[optim]\nlr = 1\n"))
    with pytest.raises(ConfigError, match=r"'train.warmup_steps' \(from .*run.toml\)"):
        load_config(path=_write(tmp_path, "[train]\nwarmup_steps = -1\n"))
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(path=_write(tmp_path, "[train\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(path=str(tmp_path / "missing.toml"))


def test_sections_built_in_code_are_checked_too() -> None:
    with pytest.raises(ConfigError, match="'train.lr' \\(from the code\\)"):
        TrainSection(lr=-1.0)
    with pytest.raises(ConfigError, match="'train.scale_lr'"):
        TrainSection(scale_lr="cubic")  # type: ignore[arg-type]


def test_replace_checks_values() -> None:
    cfg = replace(TrainJobConfig(), train={"max_steps": 5})
    assert cfg.train.max_steps == 5 and cfg.model == TrainJobConfig().model
    with pytest.raises(ConfigError, match="'train.max_steps'"):
        replace(cfg, train={"max_steps": -2})


def test_override_keys_splits_the_command_line() -> None:
    overrides, rest = override_keys(["--config", "a.toml", "--train.lr=1e-3", "--model.layers", "2", "--nproc", "2"])
    assert overrides == ["train.lr=1e-3", "model.layers=2"]
    assert rest == ["--config", "a.toml", "--nproc", "2"]
    with pytest.raises(ConfigError, match="has no value"):
        override_keys(["--train.lr"])


def test_describe_keys_lists_every_key_with_its_default() -> None:
    text = describe_keys()
    assert "train.lr = 0.003" in text and "train.precision = \"fp32\"" in text and "(fp32|bf16|fp16|fp8)" in text
    assert len(text.splitlines()) == sum(len(section_fields(TrainJobConfig, f.name)) for f in fields(TrainJobConfig))
    assert "model.seq_len = 128" in text and "model.vocab_size" not in text  # the job sets the vocabulary


def test_docs_list_the_current_keys() -> None:
    import pathlib

    docs = pathlib.Path(__file__).resolve().parents[2] / "docs" / "training.md"
    assert describe_keys() in docs.read_text(), "regenerate the key table in docs/training.md from describe_keys()"
