"""shardwise: distributed training for PyTorch that plans itself.

Public API (everything else is an implementation detail):

- :func:`init`, :func:`shutdown`, :func:`barrier`, :func:`main_process_first`, :class:`RuntimeEnv`
- :func:`launch`: run a function on N local processes
- :class:`ShardwiseError`: the exception every user-facing check raises
- :func:`shard`: MindSpore-style tensor-parallel annotation of a Linear/Embedding layer
- :class:`PipelineStages`, :class:`PipelineOptions`: explicit pipeline stages / where to cut the model
"""

from shardwise.errors import ShardwiseError
from shardwise.launch.inprocess import launch
from shardwise.parallel.annotate import shard
from shardwise.parallel.pipeline import PipelineOptions
from shardwise.parallel.pipeline_split import PipelineStages
from shardwise.runtime import RuntimeEnv, barrier, get_logger, init, main_process_first, shutdown
from shardwise.train import Trainer, callbacks, prepare

__version__ = "0.1.0"

__all__ = [
    "PipelineOptions",
    "PipelineStages",
    "RuntimeEnv",
    "ShardwiseError",
    "__version__",
    "Trainer",
    "barrier",
    "callbacks",
    "get_logger",
    "init",
    "launch",
    "main_process_first",
    "prepare",
    "shard",
    "shutdown",
]
