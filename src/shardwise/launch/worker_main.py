"""What every worker of ``shardwise run`` runs first: line-buffered output, then the user's target.

``python -m shardwise.launch.worker_main [-m] TARGET [ARGS...]`` makes the worker's ``sys.stdout``
and ``sys.stderr`` line-buffered, then runs ``TARGET`` as ``python TARGET ARGS`` (or
``python -m TARGET ARGS``) would: as ``__main__``, with ``sys.argv = [TARGET, *ARGS]`` and, for a
file, its directory first on ``sys.path``.

Why: the workers share the launcher's stdout. Python writes a ``print(a, b)`` as several writes
(``a``, ``" "``, ``b``, ``"\\n"``); unbuffered (``PYTHONUNBUFFERED=1``, ``python -u``, common in
containers) each reaches the shared file on its own, and lines of different ranks interleave
mid-line; block-buffered (the default when stdout is not a terminal), output arrives in 8 KB
chunks, minutes late, cut anywhere. Line-buffered, each line leaves the process in one ``write``
of the whole line, which the kernel keeps whole on a pipe (up to 4 KB), a terminal or a file
shared by the ranks, whatever ``PYTHONUNBUFFERED`` says. Nothing multiplexes the workers' output:
it goes straight to the launcher's stdout, or, with ``--log-dir`` / ``--log-prefix``, to torch's
elastic agent, which keeps each rank's file and copies whole lines to the console behind the
prefix. Before the target runs, the dependencies' import-time noise is silenced as in the
``shardwise`` command (:mod:`shardwise.runtime.quiet`; ``SHARDWISE_LOG_LEVEL=debug`` keeps it).
Imports nothing but the standard library and that module, so a worker starts as fast as
``python TARGET``.

An exception that ends the target is recorded for the launcher, which prints it once
(:mod:`shardwise.launch.worker_errors`: one line and exit code 2 for bad input).
"""

from __future__ import annotations

import io
import os
import runpy
import sys
from typing import TextIO

from shardwise.runtime.quiet import quiet_dependencies


def line_buffered(stream: TextIO) -> TextIO:
    """``stream`` writing whole lines: reconfigured in place when it has a buffer below it, else (an
    unbuffered stream over the raw file) a line-buffered stream on the same file descriptor."""
    if isinstance(stream, io.TextIOWrapper) and isinstance(stream.buffer, io.BufferedWriter):
        stream.reconfigure(line_buffering=True, write_through=False)
        return stream
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a test's capture): leave it
        return stream
    return open(fd, "w", buffering=1, encoding=stream.encoding, errors=stream.errors, closefd=False)  # noqa: SIM115


def line_buffered_output() -> None:
    """Make this process's ``sys.stdout`` and ``sys.stderr`` line-buffered (module doc)."""
    sys.stdout.flush()
    sys.stderr.flush()
    sys.stdout = line_buffered(sys.stdout)
    sys.stderr = line_buffered(sys.stderr)


def run_as_main(target: str, *, module: bool) -> None:
    """Run ``target`` as ``python -m target`` (``module``) or ``python target`` would, with
    ``sys.argv`` already set. A module: the current directory stays first on ``sys.path`` (it is
    already), and it runs as ``__main__`` only, even where a fork server imported it already
    (:mod:`shardwise.launch.forkserver`; runpy would warn of that copy on stderr). A file: its
    directory first on ``sys.path``, not the current directory."""
    if module:
        sys.modules.pop(target, None)
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    module = bool(argv) and argv[0] == "-m"
    if module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m shardwise.launch.worker_main [-m] TARGET [ARGS...]")
    line_buffered_output()
    quiet_dependencies(os.environ)
    target = argv[0]
    sys.argv = [target, *argv[1:]]
    try:
        run_as_main(target, module=module)
    except Exception as exc:  # noqa: BLE001 - reported once by the launcher (shardwise.launch.worker_errors)
        from shardwise.launch.worker_errors import exit_for_launcher

        exit_for_launcher(exc)
        raise


if __name__ == "__main__":
    main()
