"""shardwise: distributed training for PyTorch that plans itself.

Public API (everything else is an implementation detail):

- :func:`init`, :func:`shutdown`, :func:`barrier`, :func:`main_process_first`, :class:`RuntimeEnv`
- :func:`launch`: run a function on N local processes
- :class:`ShardwiseError`: the exception every user-facing check raises
"""

from shardwise.errors import ShardwiseError
from shardwise.launch.inprocess import launch
from shardwise.runtime import RuntimeEnv, barrier, get_logger, init, main_process_first, shutdown
from shardwise.train import Trainer, callbacks, prepare

__version__ = "0.1.0"

__all__ = [
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
    "shutdown",
]
