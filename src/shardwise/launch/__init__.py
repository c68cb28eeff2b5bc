"""Starting processes: ``shardwise run`` (scripts) and :func:`launch` (functions), both on torch's elastic agent."""

from shardwise.launch.inprocess import launch
from shardwise.launch.options import ResolvedLaunch, RunOptions, resolve
from shardwise.launch.run import run_launch

__all__ = ["ResolvedLaunch", "RunOptions", "launch", "resolve", "run_launch"]
