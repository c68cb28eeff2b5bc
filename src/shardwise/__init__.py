"""shardwise: distributed training for PyTorch that plans itself.

Public API (everything else is an implementation detail):

- :func:`init`, :func:`shutdown`, :func:`barrier`, :func:`main_process_first`, :class:`RuntimeEnv`
- :class:`Trainer`, :func:`prepare`, :mod:`callbacks`: training with any plan; the Trainer's option
  sections :class:`TrainOptions`, :class:`DataOptions`, :class:`PrecisionOptions`,
  :class:`ParallelOptions`, :class:`LoggingOptions`; :class:`CertifyOptions`: how ``plan="auto"``
  certifies its choice (``ParallelOptions(certify=...)``)
- :func:`launch`: run a function on N local processes
- :class:`ShardwiseError`: the exception every user-facing check raises
- :func:`shard`: MindSpore-style tensor-parallel annotation of a Linear/Embedding layer
- :class:`PipelineStages`, :class:`PipelineOptions`: explicit pipeline stages / where to cut the model
- :func:`from_pretrained`, :class:`Pretrained`: a Hugging Face model directory under any plan, each
  rank reading only its slices (``Trainer(Pretrained(dir), ...)``; needs ``shardwise[hf]``)

The names are imported on first use (PEP 562), so ``import shardwise.plan`` and ``shardwise plan``
stay free of torch: the planner is pure Python, and only these entry points need the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shardwise.errors import ShardwiseError
from shardwise.exports import keep_moved_modules
from shardwise.launch.inprocess import launch  # torch-free until called; it also shadows the subpackage's name
from shardwise.version import __version__

# public name -> (module, attribute); attribute None: the module itself
_LAZY: dict[str, tuple[str, str | None]] = {
    "CertifyOptions": ("shardwise.auto.certify", "CertifyOptions"),
    "DataOptions": ("shardwise.train.options", "DataOptions"),
    "LoggingOptions": ("shardwise.train.options", "LoggingOptions"),
    "ParallelOptions": ("shardwise.train.options", "ParallelOptions"),
    "PrecisionOptions": ("shardwise.train.options", "PrecisionOptions"),
    "TrainOptions": ("shardwise.train.options", "TrainOptions"),
    "PipelineOptions": ("shardwise.parallel.pipeline.schedule", "PipelineOptions"),
    "Pretrained": ("shardwise.checkpoint.hf_load", "Pretrained"),
    "from_pretrained": ("shardwise.train.pretrained", "from_pretrained"),
    "PipelineStages": ("shardwise.parallel.pipeline.split", "PipelineStages"),
    "RuntimeEnv": ("shardwise.runtime.detect", "RuntimeEnv"),
    "Trainer": ("shardwise.train.trainer", "Trainer"),
    "barrier": ("shardwise.runtime.env", "barrier"),
    "callbacks": ("shardwise.train.callbacks", None),
    "get_logger": ("shardwise.runtime.logging", "get_logger"),
    "init": ("shardwise.runtime.env", "init"),
    "main_process_first": ("shardwise.runtime.env", "main_process_first"),
    "prepare": ("shardwise.train.prepare", "prepare"),
    "shard": ("shardwise.parallel.annotate", "shard"),
    "shutdown": ("shardwise.runtime.env", "shutdown"),
}

# old module paths that moved: still importable, as the new module, with a DeprecationWarning
_MOVED = {
    **{f"shardwise.parallel.{old}": f"shardwise.parallel.tp.{new}"
       for old, new in (("tp_plan", "styles"), ("tp_layers", "layers"), ("tp_adapters", "adapters"))},
    **{f"shardwise.parallel.pipeline_{old}": f"shardwise.parallel.pipeline.{old}"
       for old in ("split", "stage", "ties", "accumulation")},
    "shardwise.train.generate": "shardwise.generate.decode",
    "shardwise.train.decoders": "shardwise.generate.decoders",
    "shardwise.train.auto": "shardwise.auto.sample",
    "shardwise.train.batch": "shardwise.data.batch",
    "shardwise.models.measure": "shardwise.auto.measure",
    "shardwise.calibrate.machine": "shardwise.auto.machine",
    "shardwise.verify.certify": "shardwise.auto.certify",
}
keep_moved_modules(_MOVED)

__all__ = ["ShardwiseError", "__version__", "launch", *sorted(_LAZY)]

if TYPE_CHECKING:
    from shardwise.auto.certify import CertifyOptions
    from shardwise.checkpoint.hf_load import Pretrained
    from shardwise.parallel.annotate import shard
    from shardwise.parallel.pipeline.schedule import PipelineOptions
    from shardwise.parallel.pipeline.split import PipelineStages
    from shardwise.runtime.detect import RuntimeEnv
    from shardwise.runtime.env import barrier, init, main_process_first, shutdown
    from shardwise.runtime.logging import get_logger
    from shardwise.train import callbacks
    from shardwise.train.prepare import prepare
    from shardwise.train.options import DataOptions, LoggingOptions, ParallelOptions, PrecisionOptions, TrainOptions
    from shardwise.train.pretrained import from_pretrained
    from shardwise.train.trainer import Trainer


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = importlib.import_module(module)
    value = value if attribute is None else getattr(value, attribute)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
