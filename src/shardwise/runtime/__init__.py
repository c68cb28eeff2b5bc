"""Where this process sits in the distributed world: launcher detection, process groups, logging."""

from shardwise.runtime.detect import ProcessInfo, detect_process
from shardwise.runtime.env import RuntimeEnv, barrier, init, main_process_first, shutdown
from shardwise.runtime.logging import get_logger, setup_logging

__all__ = [
    "ProcessInfo",
    "RuntimeEnv",
    "barrier",
    "detect_process",
    "get_logger",
    "init",
    "main_process_first",
    "setup_logging",
    "shutdown",
]
