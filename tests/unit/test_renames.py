"""Moved modules and renamed names keep working for one release, each with a DeprecationWarning
that names the new spelling (shardwise/exports.py)."""

from __future__ import annotations

import importlib
import sys

import pytest

MOVED = {
    "shardwise.parallel.tp_plan": "shardwise.parallel.tp.styles",
    "shardwise.parallel.tp_layers": "shardwise.parallel.tp.layers",
    "shardwise.parallel.tp_adapters": "shardwise.parallel.tp.adapters",
    "shardwise.parallel.pipeline_split": "shardwise.parallel.pipeline.split",
    "shardwise.parallel.pipeline_stage": "shardwise.parallel.pipeline.stage",
    "shardwise.parallel.pipeline_ties": "shardwise.parallel.pipeline.ties",
    "shardwise.parallel.pipeline_accumulation": "shardwise.parallel.pipeline.accumulation",
    "shardwise.train.generate": "shardwise.generate.decode",
    "shardwise.train.decoders": "shardwise.generate.decoders",
    "shardwise.train.auto": "shardwise.auto.sample",
    "shardwise.train.batch": "shardwise.data.batch",
    "shardwise.models.measure": "shardwise.auto.measure",
    "shardwise.calibrate.machine": "shardwise.auto.machine",
    "shardwise.verify.certify": "shardwise.auto.certify",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_imports_the_moved_module(old: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old]) and module.__spec__.name == MOVED[old]


@pytest.mark.parametrize("module, old, new", [
    ("shardwise.parallel.tp", "TPPlan", "TPStyles"),
    ("shardwise.parallel.tp", "derive_tp_plan", "derive_tp_styles"),
    ("shardwise.parallel.tp", "to_torch_plan", "to_torch_styles"),
    ("shardwise.parallel.tp.styles", "TPPlan", "TPStyles"),
    ("shardwise.parallel.tp.adapters", "adapter_plan", "adapter_styles"),
    ("shardwise.parallel.annotate", "annotated_plan", "annotated_styles"),
    ("shardwise.plan", "AutoPlan", "AutoChoice"),
    ("shardwise.plan.planner", "AutoPlan", "AutoChoice"),
])
def test_an_old_name_warns_and_is_the_new_one(module: str, old: str, new: str) -> None:
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=f"use {module}.{new}"):
        value = getattr(mod, old)
    assert value is getattr(mod, new)


def test_the_packages_serve_their_public_names() -> None:
    for name in ("shardwise.parallel.tp", "shardwise.parallel.pipeline", "shardwise.generate"):
        package = importlib.import_module(name)
        assert all(getattr(package, n) is not None for n in package.__all__)
    with pytest.raises(AttributeError):
        importlib.import_module("shardwise.parallel.tp").no_such_name  # noqa: B018


def test_tp_options_take_styles_and_the_old_keyword() -> None:
    from shardwise.parallel.tp import TPOptions

    assert TPOptions({"fc": "colwise"}) == TPOptions(styles={"fc": "colwise"})
    with pytest.warns(DeprecationWarning, match="TPOptions\\(styles=...\\)"):
        old = TPOptions(plan={"fc": "colwise"}, loss_parallel=True)
    assert old.styles == {"fc": "colwise"} and old.loss_parallel
