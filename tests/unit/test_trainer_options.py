"""The Trainer's option sections (``shardwise.train.options``): the constructor's signature, the
one table that maps every earlier flat keyword to its field (with a DeprecationWarning naming the
new spelling, at the caller's line), the refusal of a keyword given twice, and bad sections. All
before any process group: ``runtime.init`` fails if reached."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch.nn.functional as F
from torch import nn

from shardwise.errors import ConfigError
from shardwise.parallel.ddp import DDPOptions
from shardwise.train import DataOptions, LoggingOptions, ParallelOptions, PrecisionOptions, Trainer, TrainOptions
from shardwise.train.options import OLD_KEYWORDS, SECTIONS, sections_with

# The Trainer's flat keywords before the sections, with their defaults then.
OLD_DEFAULTS = {
    "grad_accum_steps": 1,
    "clip_grad_norm": None,
    "lr_scheduler": None,
    "scale_lr": "none",
    "seed": 0,
    "max_steps": None,
    "max_epochs": None,
    "eval_every": None,
    "eval_batch_size": None,
    "loss_reduction": "samples",
    "ignore_index": -100,
    "num_workers": 0,
    "pin_memory": False,
    "persistent_workers": False,
    "worker_start_method": None,
    "collate_fn": None,
    "shuffle": True,
    "fp8": None,
    "loss_scaler": None,
    "ddp": DDPOptions(),
    "tp": None,
    "fsdp": None,
    "pipeline": None,
    "cluster": None,
    "certify": None,
    "sync_batchnorm": False,
    "loggers": (),
    "log_every": 10,
    "metrics": None,
    "run_dir": None,
    "progress_bar": True,
    "flops_per_sample": None,
    "tokens_per_sample": None,
    "peak_flops_per_device": None,
}


@pytest.fixture
def no_process_group(monkeypatch):
    def no_init(*args, **kwargs):
        raise AssertionError("the process group must not be touched")

    monkeypatch.setattr("shardwise.runtime.env.init", no_init)


def _field(sections: dict, path: str):
    section, *names = path.split(".")
    value = sections.get(section) or SECTIONS[section]()
    for name in names:
        value = getattr(value, name)
    return value


def test_the_constructor_takes_a_dozen_arguments() -> None:
    params = inspect.signature(Trainer).parameters
    assert list(params) == [
        "model",
        "loss_fn",
        "global_batch_size",
        "optimizer",
        "plan",
        "precision",
        "train",
        "data",
        "parallel",
        "logging",
        "callbacks",
        "checkpoint",
    ]


def test_every_old_keyword_has_one_field_with_its_old_default() -> None:
    assert set(OLD_KEYWORDS) == set(OLD_DEFAULTS)
    for name, path in OLD_KEYWORDS.items():
        assert path.rsplit(".", 1)[-1] == name
        assert _field({}, path) == OLD_DEFAULTS[name], path


def test_every_old_keyword_lands_in_its_field_with_a_warning_naming_the_new_spelling() -> None:
    for name, path in OLD_KEYWORDS.items():
        value = object()
        with pytest.warns(DeprecationWarning) as caught:
            sections = sections_with({}, {name: value})
        section = path.split(".")[0]
        assert f"Trainer({name}=...) is deprecated: use {section}={type(sections[section]).__name__}(" in str(
            caught[0].message
        )
        assert _field(sections, path) is value
    with pytest.warns(DeprecationWarning, match=r"use train=TrainOptions\(max_steps=5\)"):
        assert sections_with({}, {"max_steps": 5}) == {"train": TrainOptions(max_steps=5)}
    with pytest.warns(DeprecationWarning) as caught:
        both = sections_with(
            {"parallel": ParallelOptions(tp=None)}, {"sync_batchnorm": True, "ddp": DDPOptions(bucket_cap_mb=5)}
        )
    assert str(caught[1].message).endswith("use parallel=ParallelOptions(ddp=DDPOptions(sync_batchnorm=True))")
    assert both["parallel"].ddp == DDPOptions(bucket_cap_mb=5, sync_batchnorm=True)
    with pytest.warns(DeprecationWarning):  # a precision string is kept beside the fp8 options
        assert sections_with({"precision": "fp8"}, {"loss_scaler": None})["precision"] == PrecisionOptions("fp8")


def test_old_keywords_still_reach_the_trainer_and_warn_at_the_callers_line(no_process_group) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(
            ConfigError, match="max_steps=-5 must be a positive integer"
        ):  # the value reached TrainOptions' check
            Trainer(
                nn.Linear(2, 2),
                loss_fn=F.mse_loss,
                global_batch_size=4,
                max_steps=-5,
                num_workers=1,
                progress_bar=False,
            )
    messages = sorted(str(w.message) for w in caught if w.category is DeprecationWarning)
    assert messages == ["Trainer(max_steps=...) is deprecated: use train=TrainOptions(max_steps=-5)",
                        "Trainer(num_workers=...) is deprecated: use data=DataOptions(num_workers=1)",
                        "Trainer(progress_bar=...) is deprecated: use logging=LoggingOptions(progress_bar=False)"]
    assert {w.filename for w in caught} == {__file__}


def test_an_old_keyword_beside_its_section_field_is_refused_in_one_line(no_process_group) -> None:
    with pytest.raises(ConfigError) as err, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        Trainer(nn.Linear(2, 2), loss_fn=F.mse_loss, global_batch_size=4, train=TrainOptions(max_steps=2), max_steps=3)
    assert (
        str(err.value)
        == "Trainer got max_steps=3 and TrainOptions(max_steps=2) both; pass max_steps once, in TrainOptions"
    )
    with pytest.raises(ConfigError, match="sync_batchnorm=True and DDPOptions"), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        Trainer(nn.Linear(2, 2), loss_fn=F.mse_loss, global_batch_size=4,
                parallel=ParallelOptions(ddp=DDPOptions(sync_batchnorm=True)), sync_batchnorm=True)


def test_unknown_keywords_and_wrong_sections_are_refused(no_process_group) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_step'"):
        Trainer(nn.Linear(2, 2), loss_fn=F.mse_loss, global_batch_size=4, max_step=3)
    with pytest.raises(
        ConfigError, match=r"Trainer\(train=\{'max_steps': 3\}\) is not a TrainOptions; pass train=TrainOptions"
    ):
        Trainer(nn.Linear(2, 2), loss_fn=F.mse_loss, global_batch_size=4, train={"max_steps": 3})
    with pytest.raises(ConfigError, match="is not a DataOptions"):
        Trainer(nn.Linear(2, 2), loss_fn=F.mse_loss, global_batch_size=4, data=LoggingOptions())
    with pytest.raises(ConfigError, match="precision=16"):
        Trainer(nn.Linear(2, 2), loss_fn=F.mse_loss, global_batch_size=4, precision=16)
    assert DataOptions(num_workers=2, pin_memory=True).loader().num_workers == 2


def test_the_sections_are_public() -> None:
    import shardwise
    import shardwise.train as train

    for cls in (TrainOptions, DataOptions, PrecisionOptions, ParallelOptions, LoggingOptions):
        assert getattr(shardwise, cls.__name__) is cls and getattr(train, cls.__name__) is cls
        assert cls.__name__ in shardwise.__all__ and cls.__dataclass_params__.frozen
