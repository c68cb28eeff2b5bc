"""The ``shardwise`` command.

Each subcommand lives in its own module under :mod:`shardwise.commands` and exposes
``register(subparsers)``, which adds its parser and sets ``func(args) -> int``. This file only
dispatches, and turns a :class:`~shardwise.errors.ShardwiseError` into one line on stderr and a
non-zero exit code (never a traceback).

Dependencies' import-time warnings and log lines are kept off the terminal
(:mod:`shardwise.runtime.quiet`) unless ``--verbose`` (before the command or among its options) or
``SHARDWISE_LOG_LEVEL=debug`` asks for them; ``--verbose`` sets that variable, so the workers a
command starts show them too.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from shardwise.errors import ShardwiseError, StoppedBySignal
from shardwise.runtime.quiet import LOG_LEVEL_VAR, quiet_dependencies

# Order here is the order in `shardwise --help`.
COMMANDS = (
    "shardwise.commands.train",
    "shardwise.commands.run",
    "shardwise.commands.rendezvous",
    "shardwise.commands.lighthouse",
    "shardwise.commands.slurm",
    "shardwise.commands.doctor",
    "shardwise.commands.verify",
    "shardwise.commands.plan",
    "shardwise.commands.calibrate",
    "shardwise.commands.checkpoint",
    "shardwise.commands.generate",
)

EPILOG = """examples:
  shardwise doctor --nproc 2                      check the install and the collectives
  shardwise run --nproc-per-node 4 train.py       start 4 processes of your script
  shardwise slurm --nodes 2 --gpus-per-node 8 -- train.py   write an sbatch script
"""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the problem (exit code 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="shardwise",
        description="Distributed training for PyTorch that plans itself.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"shardwise {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    _add_verbose(parser, default=False)
    return parser


def _add_verbose(parser: argparse.ArgumentParser, *, default: object) -> None:
    """``--verbose`` on ``parser`` and every subcommand's parser below it (theirs leave the
    top-level value alone when not given)."""
    parser.add_argument("--verbose", action="store_true", default=default,
                        help="also show the dependencies' warnings and log lines (= SHARDWISE_LOG_LEVEL=debug)")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                _add_verbose(child, default=argparse.SUPPRESS)


def _version() -> str:
    from shardwise.version import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verbose:
        os.environ[LOG_LEVEL_VAR] = "debug"  # this process and (inherited) the workers it starts
    quiet_dependencies(os.environ)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except StoppedBySignal as err:  # pre-empted or interrupted: say what happened, exit 128 + signal
        print(f"shardwise {args.command}: {err}", file=sys.stderr)
        return err.exit_code
    except ShardwiseError as err:
        print(f"shardwise {args.command}: error: {err}", file=sys.stderr)
        return 2 if not isinstance(err, _launch_error()) else 1
    except KeyboardInterrupt:
        print(f"shardwise {args.command}: interrupted", file=sys.stderr)
        return 130


def _launch_error() -> type:
    from shardwise.errors import LaunchError

    return LaunchError


if __name__ == "__main__":
    raise SystemExit(main())
