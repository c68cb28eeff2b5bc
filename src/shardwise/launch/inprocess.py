"""``shardwise.launch(fn, nprocs=N)``: run a function on N local processes.

The reference guides' ``mp.spawn`` pattern, for notebooks and quick experiments, but started by
the same elastic agent as ``shardwise run``: each worker gets the same environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...), calls :func:`shardwise.init`, runs ``fn(*args)`` and
leaves cleanly. Results come back as a list ordered by rank.

``fn`` must be importable by a fresh interpreter (defined at module level in a file, not in
``__main__`` of a notebook cell), which is the ``spawn`` start method's rule.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable, Sequence

from shardwise.errors import LaunchError
from shardwise.launch.options import free_port


def _worker(fn: Callable[..., Any], backend: str | None, timeout_s: float, *args: Any) -> Any:
    import os

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
    results = run_elastic(config, _worker, (fn, backend, timeout_s, *args))
    return [results[rank] for rank in sorted(results)]
