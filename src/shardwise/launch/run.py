"""Run a resolved launch with torch's elastic agent and explain how it ended.

The agent (the engine behind torchrun) starts ``nproc_per_node`` workers, joins the rendezvous,
watches the workers and restarts the whole local group up to ``max_restarts`` times when one fails.
shardwise adds little process management of its own: it reports failures as readable lines, and
signals as what they are (:class:`~shardwise.errors.StoppedBySignal`, exit ``128 + signal``):

- SIGTERM, SIGINT, SIGHUP, SIGQUIT: the agent sends the signal to every worker, waits up to
  ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (default 30) and SIGKILLs what is left; no restart.
- SIGUSR1 (a time-limit warning): passed on to the workers (:mod:`shardwise.launch.forward`),
  which save and exit 0; the agent keeps supervising until they have.
- The launcher itself killed (SIGKILL, OOM): each worker gets SIGTERM from the kernel
  (:mod:`shardwise.runtime.parent`, armed with ``SHARDWISE_LAUNCHER_PID``), saves and exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from typing import Any, Callable

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import LaunchConfig

from shardwise.errors import LaunchError, StoppedBySignal
from shardwise.launch.agent import launch_agent
from shardwise.launch.forward import Forwarded, forward_signals
from shardwise.launch.options import ResolvedLaunch
from shardwise.launch.worker_errors import ERROR_DIR_VAR, read_records, worker_failure

LAUNCHER_PID_VAR = "SHARDWISE_LAUNCHER_PID"  # read by shardwise.runtime.settings in the workers


def first_failure(err: ChildFailedError, first_recorded: int | None = None) -> tuple[int, ProcessFailure]:
    """The rank that failed first. torch orders failures by whole seconds; within torch's first
    second, a rank the agent stopped (SIGTERM) came after the one whose failure made it stop. Of the
    others, a rank killed by another signal (SIGKILL, a crash in native code) came first: it had no
    chance to write a record, and what its peers recorded then (a read error, a closed connection)
    followed from its death; the agent's own SIGKILL comes only after its shutdown timeout, seconds
    later. Then the rank whose record came first (``first_recorded``:
    :mod:`shardwise.launch.worker_errors`, timed to the microsecond, whose traceback was shown)."""
    rank, failure = err.get_first_failure()
    same_second = {r: f for r, f in err.failures.items() if f.timestamp == failure.timestamp}
    candidates = {r: f for r, f in same_second.items() if f.exitcode != -signal.SIGTERM} or same_second
    killed = {r: f for r, f in candidates.items() if f.exitcode < 0 and f.exitcode != -signal.SIGTERM}
    if not killed and first_recorded in candidates:
        return first_recorded, candidates[first_recorded]
    pick = killed or candidates
    first = rank if rank in pick else min(pick)
    return first, pick[first]


def describe_failures(err: ChildFailedError, max_restarts: int, first_recorded: int | None = None) -> str:
    """One line: the first rank that failed (:func:`first_failure`), how, its last error line, and
    how many others stopped."""
    rank, failure = first_failure(err, first_recorded)
    how = f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
    message = failure.message if isinstance(failure.message, str) else ""
    detail = message.strip().splitlines()[-1] if message and "To enable traceback" not in message else ""
    others = len(err.failures) - 1
    restarts = f" after {max_restarts} restart(s)" if max_restarts else ""
    return (
        f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) failed{restarts}: {how}"
        + (f": {detail}" if detail else "")
        + (f"; {others} other worker(s) were stopped" if others else "")
        + "; its output is above"
    )


class _QuietFailures(logging.Filter):
    """Drops the agent's "failed (exitcode: N) local_rank: ...", "Sending process P closing signal"
    and "Terminating process P via signal" log lines: the launcher's own line (the workers' one-line error, or
    :func:`describe_failures`, which counts the workers stopped) says it once, readably."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(noise in message for noise in ("failed (exitcode", "closing signal", "Terminating process"))


def run_elastic(config: LaunchConfig, entrypoint: str | Callable[..., Any], args: tuple[Any, ...]) -> dict[int, Any]:
    """Start the agent (:class:`shardwise.launch.agent.ShardwiseAgent`: torch's, plus the peer
    watch); return the workers' results by global rank, or raise :class:`LaunchError`."""
    errors = tempfile.mkdtemp(prefix="shardwise-errors-")  # the workers' records (shardwise.launch.worker_errors)
    saved = os.environ.get(ERROR_DIR_VAR)
    os.environ[ERROR_DIR_VAR] = errors  # the agent copies this process's environment to the workers
    quiet = _QuietFailures()
    agent_logs = [
        logging.getLogger(name)
        for name in ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")
    ]
    for agent_log in agent_logs:
        agent_log.addFilter(quiet)
    try:
        return launch_agent(config, entrypoint, args)
    except LaunchError:  # this node was dropped from the job (shardwise.launch.agent): its own line
        raise
    except ChildFailedError as err:
        records = read_records(errors)
        bad_input, first_traceback = worker_failure(records)
        if bad_input is not None:
            raise bad_input from None
        if first_traceback:
            sys.stderr.write(first_traceback)
            sys.stderr.flush()
        raise LaunchError(describe_failures(err, config.max_restarts, records[0].rank if records else None)) from None
    except SignalException as err:  # the agent has already passed the signal on and stopped the workers
        name = signal.Signals(err.sigval).name
        saves = (
            " (a shardwise Trainer saves a checkpoint at its next step and returns)"
            if err.sigval == signal.SIGTERM
            else ""
        )
        raise StoppedBySignal(f"stopped by {name}: the workers were sent {name} and given {config.shutdown_timeout} s "
                              f"to exit{saves}", signum=int(err.sigval)) from None
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as err:  # rendezvous errors: timeout, connection refused, closed
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise LaunchError(
            f"the processes could not meet at {config.rdzv_endpoint} ({config.rdzv_backend} rendezvous): "
            f"{type(err).__name__}: {first}",
            hint="check that node 0 is up, the address is reachable from every node and the port is open",
        ) from None
    finally:
        for agent_log in agent_logs:
            agent_log.removeFilter(quiet)
        if saved is None:
            os.environ.pop(ERROR_DIR_VAR, None)
        else:
            os.environ[ERROR_DIR_VAR] = saved
        shutil.rmtree(errors, ignore_errors=True)


def wait_for_endpoint(endpoint: str, timeout_s: float, *, store_off_nodes: bool = False) -> None:
    """Block until ``host:port`` accepts TCP connections, or fail with one clear line.

    A node other than node 0 checks this before starting the agent, so an unreachable master is
    reported as one sentence after ``--rdzv-timeout`` instead of pages of C++ retry logs.
    """
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(5.0, timeout_s)):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                if store_off_nodes:
                    raise LaunchError(
                        f"the rendezvous store at {endpoint} did not answer within {timeout_s:.0f}s "
                        f"({exc.strerror or exc})",
                        hint="start what hosts it first ('shardwise rendezvous', or the node with is_host=1), and "
                        "check --rdzv-endpoint and firewalls",
                    ) from None
                raise LaunchError(
                    f"node 0 at {endpoint} did not answer within {timeout_s:.0f}s ({exc.strerror or exc})",
                    hint="start node 0 first (or together), and check --master-addr/--master-port and firewalls",
                ) from None
            time.sleep(0.5)


def run_launch(launch: ResolvedLaunch, *, forwarded: Forwarded | None = None) -> dict[int, Any]:
    """Start the workers of a resolved ``shardwise run`` with the extra worker environment.

    SIGUSR1 is passed on to the workers while they run (``forwarded``: the command's own
    :func:`~shardwise.launch.forward.forward_for_this_process`, else one for the launch only); a
    launch that received it ends with :class:`~shardwise.errors.StoppedBySignal`."""
    config = launch.config
    client_only = str(config.rdzv_configs.get("is_host", "")).lower() in ("0", "false", "no")
    if (config.rdzv_backend == "static" and config.rdzv_configs.get("rank", 0) != 0) or (
        config.rdzv_backend == "c10d" and client_only
    ):
        # a node that does not host the store (or a store off the nodes, 'shardwise rendezvous'): one line if nobody
        # answers
        wait_for_endpoint(
            config.rdzv_endpoint, float(config.rdzv_configs.get("timeout", 300)), store_off_nodes=client_only
        )
    worker_env = {**launch.worker_env, LAUNCHER_PID_VAR: str(os.getpid())}
    saved = {k: os.environ.get(k) for k in worker_env}
    os.environ.update(worker_env)  # the agent copies this process's environment to workers
    try:
        with contextlib.nullcontext(forwarded) if forwarded is not None else forward_signals() as forwarded:
            if forwarded.received is not None:  # warned before anything started: do not start it
                name = signal.Signals(forwarded.received).name
                raise StoppedBySignal(f"stopped by {name} before the workers were started", signum=forwarded.received)
            try:
                results = run_elastic(launch.config, launch.entrypoint, launch.args)
            except LaunchError as err:
                if forwarded.received is None:
                    raise
                # e.g. a worker still starting up had no handler yet and died of it: still a stop from outside
                name = signal.Signals(forwarded.received).name
                raise StoppedBySignal(
                    f"stopped by {name}: it was passed to the workers, which did not all exit cleanly ({err.message})",
                    signum=forwarded.received,
                ) from None
        if forwarded.received is not None:
            name = signal.Signals(forwarded.received).name
            raise StoppedBySignal(f"stopped by {name}: it was passed to the workers, which exited cleanly"
                                  " (a shardwise Trainer saves a checkpoint at its next step and returns)",
                                  signum=forwarded.received)
        return results
    finally:
        if launch.temp_log_dir is not None:
            shutil.rmtree(launch.temp_log_dir, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
