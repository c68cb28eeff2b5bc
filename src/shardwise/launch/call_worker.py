"""What each worker of :func:`shardwise.launch` runs: ``python -m shardwise.launch.call_worker FOLDER``.

The launcher pickles two files into ``FOLDER`` (:func:`shardwise.launch.inprocess.launch`):
``prepare.pkl``, multiprocessing's own preparation data for a ``spawn`` child (the launcher's
``sys.path``, working directory and main module), and ``call.pkl``, the call itself. A worker
prepares itself exactly as a ``spawn`` child does (the launcher's main script imported as
``__mp_main__``, so a function defined there unpickles), runs the call under an initialized
process group (:func:`run_call`) and pickles what it returned to
``FOLDER/result-<rank>.pkl`` for the launcher. Being a plain ``python -m`` command, it is started
like every other worker: fresh, or forked from a fork server (:mod:`shardwise.launch.forkserver`).
"""

from __future__ import annotations

import multiprocessing.spawn
import os
import pickle
import sys
from typing import Any, Callable


def result_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"result-{rank}.pkl")


def run_call(fn: Callable[..., Any], backend: str | None, timeout_s: float, *args: Any) -> Any:
    """In a worker: ``fn(*args)`` between :func:`shardwise.init` and :func:`shardwise.shutdown`."""
    from shardwise.launch.worker_main import line_buffered_output
    from shardwise.runtime.env import init, shutdown
    from shardwise.runtime.quiet import quiet_dependencies

    line_buffered_output()  # each printed line whole, as in shardwise run's workers
    quiet_dependencies(os.environ)  # as in shardwise run's workers (shardwise.runtime.quiet)
    try:
        init(backend=backend, timeout_s=timeout_s)
        try:
            return fn(*args)
        finally:
            shutdown()
    except Exception as exc:  # noqa: BLE001 - reported once by the launcher (shardwise.launch.worker_errors)
        from shardwise.launch.worker_errors import exit_for_launcher

        exit_for_launcher(exc)
        raise


def main(argv: list[str] | None = None) -> None:
    folder = (sys.argv[1:] if argv is None else argv)[0]
    with open(os.path.join(folder, "prepare.pkl"), "rb") as fh:
        multiprocessing.spawn.prepare(pickle.load(fh))
    with open(os.path.join(folder, "call.pkl"), "rb") as fh:
        fn, backend, timeout_s, args = pickle.load(fh)
    result = run_call(fn, backend, timeout_s, *args)
    path = result_path(folder, int(os.environ["RANK"]))
    with open(path + ".tmp", "wb") as fh:
        pickle.dump(result, fh)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
