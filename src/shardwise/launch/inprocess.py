"""``shardwise.launch(fn, nprocs=N)``: run a function on N local processes.

The reference guides' ``mp.spawn`` pattern, for notebooks and quick experiments, but started by
the same elastic agent as ``shardwise run``: each worker gets the same environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...), calls :func:`shardwise.init`, runs ``fn(*args)`` and
leaves cleanly. Results come back as a list ordered by rank.

``fn`` must be importable by a fresh interpreter (defined at module level in a file, not in
``__main__`` of a notebook cell), which is the ``spawn`` start method's rule: each worker is a
``python -m shardwise.launch.call_worker`` command that prepares itself as a ``spawn`` child does
and returns its result through a file (:mod:`shardwise.launch.call_worker`), so it starts as the
workers of ``shardwise run`` do, forked from a fork server when ``SHARDWISE_FORKSERVER`` names one.
"""

from __future__ import annotations

import multiprocessing.spawn
import os
import pickle
import shutil
import sys
import tempfile
import uuid
from typing import Any, Callable, Sequence

from shardwise.errors import LaunchError
from shardwise.launch.options import free_port


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    backend: str | None = None,
    timeout_s: float = 300.0,
    max_restarts: int = 0,
    log_dir: str | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` local processes with an initialized process group."""
    # torch's elastic agent is imported here, so that ``import shardwise`` stays light
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    from shardwise.launch.call_worker import result_path  # run with -m: not imported with the package
    from shardwise.launch.forkserver import worker_command
    from shardwise.launch.run import run_elastic

    if nprocs < 1:
        raise LaunchError(f"nprocs={nprocs} must be at least 1", hint="launch(fn, nprocs=2)")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=str(uuid.uuid4()),
        role="shardwise",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_backend="c10d",
        rdzv_configs={"timeout": int(timeout_s), "join_timeout": int(timeout_s)},
        max_restarts=max_restarts,
        start_method="spawn",
        local_addr="127.0.0.1",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )
    folder = tempfile.mkdtemp(prefix="shardwise-call-")
    try:
        _write_call(folder, fn, backend, timeout_s, tuple(args))
        command = worker_command(["-m", "shardwise.launch.call_worker", folder], os.environ)
        run_elastic(config, sys.executable, tuple(command))
        results = []
        for rank in range(nprocs):
            with open(result_path(folder, rank), "rb") as fh:
                results.append(pickle.load(fh))
        return results
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _write_call(folder: str, fn: Callable[..., Any], backend: str | None, timeout_s: float, args: tuple) -> None:
    """``prepare.pkl`` (what a ``spawn`` child needs to unpickle ``fn``) and ``call.pkl``."""
    with open(os.path.join(folder, "prepare.pkl"), "wb") as fh:
        preparation = multiprocessing.spawn.get_preparation_data("shardwise-worker")
        preparation.pop("authkey", None)  # this process's multiprocessing secret: the workers need none
        pickle.dump(preparation, fh)
    try:
        with open(os.path.join(folder, "call.pkl"), "wb") as fh:
            pickle.dump((fn, backend, timeout_s, args), fh)
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        raise LaunchError(
            f"launch() cannot send {getattr(fn, '__qualname__', fn)!r} and its arguments to the workers: {err}",
            hint="define the function at module level in a file (not a lambda, a nested function or a notebook cell)",
        ) from None
