"""The elastic agent of ``shardwise run``: torch's ``LocalElasticAgent`` that also notices a silent node.

torch's agent re-forms the world when a node's workers *fail*. A node that is frozen (SIGSTOP,
a paused VM, a kernel stall) or cut off by a dead link fails nothing: its sockets stay open, the
other nodes' workers wait in a collective until a timeout (the hang watchdog's 300 s, Gloo's or
NCCL's 30 minutes), and every GPU idles. The agents already exchange a heartbeat, though: each
one writes its keep-alive time into the dynamic rendezvous' shared state every
``keep_alive_interval`` (c10d or etcd-v2 rendezvous; torch's default 5 s), and the rendezvous
drops a node whose heartbeat is ``keep_alive_interval x keep_alive_max_attempt`` old (15 s).

This agent reads that state on every monitor tick (one cached get of the rendezvous state per
second, the same read the agent already does to see nodes waiting to join) and acts on it:

- **a peer is silent** (its heartbeat value has not changed for the rendezvous' own expiry time,
  counted on this node's clock, so clock skew does not matter): it prints one line naming the
  node, SIGKILLs this node's workers (their collectives can never finish without the peer, and
  the newest complete checkpoint is what the next world resumes) and lets torch restart the
  group, which re-forms the world without the silent node (one of ``--max-restarts``, like a
  node whose processes died);
- **this node was dropped** (it is no longer a participant of the round it joined: the others
  found *it* silent, e.g. it was frozen and has just been thawed): it SIGKILLs its workers at
  once, before they write anything, does not close the rendezvous (that would end the others'
  job) and exits with one line (:class:`NodeDropped`).

It also makes a restart, and the stop of the other workers when one fails, honour the shutdown
timeout (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, default 30 s) like a stop by signal does; torch's own
paths there always wait 30 s.

The rendezvous state is read through ``DynamicRendezvousHandler`` internals (``_state_holder``,
``_this_node``, ``_heartbeat_lock``, ``_settings``) of the pinned torch; any other handler (the
static rendezvous, a fixed world) simply gets no peer watch. tests/unit/test_agent.py pins them.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, TextIO

from torch.distributed.elastic import events, metrics
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.launcher.api import LaunchConfig, _get_addr_and_port, _get_entrypoint_name

from shardwise.errors import LaunchError

REAP_S = 10.0  # how long a SIGKILLed worker may take to be reported dead


class NodeDropped(LaunchError):
    """This node was dropped from the rendezvous while it ran (the others found it silent)."""


@dataclass(frozen=True)
class Silent:
    """A participant of this node's round whose heartbeat stopped."""

    node: Hashable  # torch's _NodeDesc (addr, pid, local_id)
    node_rank: int
    silent_s: float

    def describe(self) -> str:
        addr, pid = getattr(self.node, "addr", str(self.node)), getattr(self.node, "pid", "?")
        return f"node {self.node_rank} ({addr}, agent pid {pid}) sent no heartbeat for {self.silent_s:.0f} s"


@dataclass(frozen=True)
class Verdict:
    dropped: bool = False
    silent: tuple[Silent, ...] = ()


class PeerWatch:
    """Which peers of this node's round went silent, and whether this node was dropped (pure: it
    is fed snapshots of the rendezvous state and the time, so it is unit-tested without torch).

    A peer is silent when the heartbeat value it last published has not changed for
    ``expiry_s`` seconds of *this* node's monotonic clock. A value that vanishes (torch's own
    expiry removes dead nodes from the state it reads) does not reset the count."""

    def __init__(self, *, me: Hashable, expiry_s: float) -> None:
        self.me, self.expiry_s = me, expiry_s
        self.round: int | None = None
        self.members: dict[Hashable, int] = {}
        self._seen: dict[Hashable, tuple[Any, float]] = {}  # node -> (heartbeat value, first seen at)

    def joined(self, *, round: int, participants: Mapping[Hashable, int], now: float) -> None:
        """This node joined round ``round`` with these participants (node -> node rank)."""
        self.round, self.members = round, dict(participants)
        self._seen = {node: (None, now) for node in self.members if node != self.me}

    def check(self, *, round: int, participants: Mapping[Hashable, int], heartbeats: Mapping[Hashable, Any],
              now: float) -> Verdict:
        if self.round is None:
            return Verdict()
        if round != self.round or self.me not in participants:
            return Verdict(dropped=True)
        silent = []
        for node, (value, since) in list(self._seen.items()):
            beat = heartbeats.get(node)
            if beat is not None and beat != value:
                self._seen[node] = (beat, now)
            elif now - since >= self.expiry_s:
                silent.append(Silent(node, self.members[node], now - since))
        return Verdict(silent=tuple(sorted(silent, key=lambda s: s.node_rank)))


def _rendezvous_view(handler: Any) -> tuple[int, dict[Hashable, int], dict[Hashable, Any]] | None:
    """(round, participants, heartbeats) of a dynamic rendezvous handler, or None for another kind."""
    holder, lock = getattr(handler, "_state_holder", None), getattr(handler, "_heartbeat_lock", None)
    if holder is None or lock is None:
        return None
    with lock:
        holder.sync()  # served from a 1 s cache, like num_nodes_waiting's
        state = holder.state
        return state.round, dict(state.participants), dict(state.last_heartbeats)


def expiry_s(handler: Any) -> float | None:
    """The rendezvous' own dead-node time (keep_alive_interval x keep_alive_max_attempt), or None."""
    settings = getattr(handler, "_settings", None)
    if settings is None or not hasattr(settings, "keep_alive_interval"):
        return None
    return settings.keep_alive_interval.total_seconds() * settings.keep_alive_max_attempt


class ShardwiseAgent(LocalElasticAgent):
    """``LocalElasticAgent`` with the peer watch (see the module doc)."""

    def __init__(self, *args: Any, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stream, self._clock = stream, clock
        handler = self._worker_group.spec.rdzv_handler
        self._handler = handler
        expiry = expiry_s(handler)
        me = getattr(handler, "_this_node", None)
        self._watch = PeerWatch(me=me, expiry_s=expiry) if expiry is not None and me is not None else None

    def _say(self, text: str) -> None:
        print(text, file=self._stream or sys.stderr, flush=True)

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        if self._watch is not None:
            view = _rendezvous_view(self._handler)
            if view is not None:
                if self._watch.round is not None:  # not the first world: say when the new one formed
                    self._say(f"elastic: the world re-formed with {len(view[1])} node(s) (rendezvous round {view[0]}); "
                              f"starting this node's {len(worker_group.workers)} workers")
                self._watch.joined(round=view[0], participants=view[1], now=self._clock())

    def _verdict(self) -> Verdict:
        if self._watch is None:
            return Verdict()
        try:
            view = _rendezvous_view(self._handler)
        except Exception:  # noqa: BLE001 - the store did not answer this time: torch's own calls will say so
            return Verdict()
        if view is None:
            return Verdict()
        return self._watch.check(round=view[0], participants=view[1], heartbeats=view[2], now=self._clock())

    def _kill_workers(self) -> None:
        """SIGKILL every worker's process group (each leads its own session)."""
        for pid in (self._pcontext.pids().values() if self._pcontext is not None else ()):
            for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
                try:
                    kill()
                    break
                except (ProcessLookupError, PermissionError):
                    continue

    def _check_dropped(self, verdict: Verdict) -> None:
        if verdict.dropped:
            self._kill_workers()
            me = self._watch.me if self._watch is not None else None
            raise NodeDropped(
                f"this node ({getattr(me, 'addr', '?')}, agent pid {os.getpid()}) was dropped from the job while it "
                "ran: the other nodes saw no heartbeat from it for over "
                f"{self._watch.expiry_s if self._watch else 0:.0f} s (it was frozen, suspended or cut off) and "
                "re-formed the world without it; its workers were killed before writing anything",
                hint="nothing was corrupted; start this node's shardwise run again to add it back to the job",
            )

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        verdict = self._verdict()
        self._check_dropped(verdict)
        if verdict.silent:
            for peer in verdict.silent:
                self._say(f"elastic: {peer.describe()}: it is lost (dead, frozen or cut off); stopping this node's "
                          f"{len(worker_group.workers)} workers to re-form the world without it")
            self._kill_workers()
            deadline = time.monotonic() + REAP_S
            while True:
                result = super()._monitor_workers(worker_group)
                if result.state != WorkerState.HEALTHY or time.monotonic() > deadline:
                    return result
                time.sleep(0.05)
        return super()._monitor_workers(worker_group)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        # A node thawed while its workers failed would otherwise join the others' world again.
        self._check_dropped(self._verdict())
        super()._restart_workers(worker_group)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._shutdown(timeout=self._shutdown_timeout)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        ids = super()._start_workers(worker_group)
        pcontext = self._pcontext
        if pcontext is not None:
            # When one worker fails, torch's process context stops the others itself, with a fixed
            # 30 s wait (SubprocessContext._poll calls close()): give it the configured one.
            close, configured = pcontext.close, self._shutdown_timeout

            def close_within(death_sig: signal.Signals | None = None, timeout: int | None = None) -> None:
                close(death_sig, configured if timeout is None else timeout)

            pcontext.close = close_within  # type: ignore[method-assign]
        return ids


def launch_agent(config: LaunchConfig, entrypoint: str | Callable[..., Any], args: tuple[Any, ...], *,
                 stream: TextIO | None = None) -> dict[int, Any]:
    """torch's ``launch_agent`` (what ``elastic_launch`` runs) with :class:`ShardwiseAgent`;
    a dropped node leaves the rendezvous open for the others."""
    rdzv_parameters = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = _get_addr_and_port(rdzv_parameters)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(rdzv_parameters),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        numa_options=config.numa_options,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        virtual_local_rank=config.virtual_local_rank,
    )
    agent = ShardwiseAgent(spec=spec, logs_specs=config.logs_specs, start_method=config.start_method,
                           log_line_prefix_template=config.log_line_prefix_template,
                           shutdown_timeout=config.shutdown_timeout, stream=stream)
    close_rendezvous = True
    try:
        metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))
        result = agent.run()
        events.record(agent.get_event_succeeded(), config.event_log_handler)
        if result is None:
            raise LaunchError("the rendezvous was closed: the job ended on the other nodes")
        if result.is_failed():
            raise ChildFailedError(name=_get_entrypoint_name(entrypoint, list(args)), failures=result.failures)
        return result.return_values
    except (SignalException, NodeDropped):
        # A signal, or a node the others already left behind: closing the rendezvous would end
        # the job for every other node (torch's launcher keeps it open on a signal, too).
        close_rendezvous = False
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    except Exception:
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    finally:
        if close_rendezvous:
            spec.rdzv_handler.shutdown()
