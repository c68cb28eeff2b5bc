"""Per-step fault tolerance over replica groups, with torchft (``shardwise run --ft-replicas R``).

The job is ``R`` replica groups; each runs the Trainer's plan (dp, ZeRO, TP, PP... inside the
group) on its own processes, with its own rendezvous and restarts. The groups form the outer,
fault-tolerant data-parallel dimension: replica ``r`` trains on data shard ``r`` of every global
batch (data rank ``r * D + d`` of ``R * D``, ``D`` the group's data-parallel ranks), and a step is::

    quorum = manager.start_quorum()          # torchft: the live groups, via the lighthouse;
                                             # a returning group heals here from a live peer
    grads = the group's step (its own plan's reductions: the group's mean gradient g_r)
    c_r = 1 ("samples") or N_r, the group's valid targets ("tokens")
    g = sum_live c_r g_r / sum_live c_r      # manager.allreduce(SUM) of c_r g_r, c_r loss_r and c_r
    if manager.should_commit():  clip, optimizer.step(), scheduler.step(); step, data position += 1
    else:                        drop the gradients; run the same batch again in the next quorum

**Communication**: rank ``g`` of each group all-reduces its local gradient shards with rank ``g``
of every other live group (torchft's reconfigurable Gloo/NCCL process group, rebuilt at each
quorum change), one flat buffer per dtype plus one float64 pair (weighted loss, weight); then one
commit vote inside the group (torchft's ManagerServer).

**Semantics** (docs/multinode.md states them for users):

- a step is committed by every live group or by none; the step counter, learning-rate schedule and
  data position advance only on a committed step;
- a discarded step (a peer died mid-step) is run again on the same batch by the survivors, with
  the new quorum: nothing committed is ever redone;
- gradient, loss, clipping and metrics are over the live groups' tokens (samples): ``c_r`` above;
- **the lost group's data**: while a group is gone its shard of each committed step is skipped
  (as torchft's sampler does), counted as ``samples_skipped`` in the events; every group keeps
  the global position, so a returning group reads on from the survivors' position;
- a returning group heals from a live peer (:mod:`shardwise.train.ft_state`): model, optimizer,
  scheduler, RNG, step and data position become the peer's;
- replica group 0 writes the Trainer's checkpoints (the other groups drop the checkpoint callback
  after its resume): they restart a whole job, never a group.

Group rank 0 appends one JSON line per event (quorum change, discard, heal, commit) to
``$SHARDWISE_FT_DIR/replica<r>.jsonl``; the launcher sums them into ``summary.json``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardwise.callback import Callback
from shardwise.errors import ShardwiseError
from shardwise.runtime import watchdog
from shardwise.runtime.ft_env import FtSettings
from shardwise.runtime.logging import get_logger
from shardwise.data.batch import chunks
from shardwise.train.ft_state import heal_fns

log = get_logger("ft")


def _reachable(url: str, timeout_s: float = 2.0) -> bool:
    """Whether a TCP connection to ``http://HOST:PORT`` opens."""
    host, _, port = url.split("://")[-1].rstrip("/").rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
        return True
    except (OSError, ValueError):
        return False


def replica_index(replica_id: str) -> int:
    """The group index of a torchft replica id (``shardwise_3:<uuid>`` -> 3)."""
    match = re.search(r"(\d+)$", replica_id.split(":")[0])
    return int(match.group(1)) if match else -1


class _RecordingClient:
    """torchft's ManagerClient, keeping the last quorum it returned (members, step, heal source)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.last: Any = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self._client._quorum(*args, **kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


@dataclass
class Events:
    """Group rank 0's event lines (module doc) and the counts the log reports."""

    path: str | None
    replica: int
    counts: dict[str, float] = field(default_factory=lambda: {"discarded_steps": 0, "heals": 0, "samples_skipped": 0})

    def write(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        with open(self.path, "a") as fh:
            fh.write(
                json.dumps({"t": time.time(), "event": event, "replica": self.replica, "pid": os.getpid(), **fields})
                + "\n"
            )


def _group_store(env: Any) -> tuple[str, int, Any]:
    """A fresh TCPStore for this launch attempt's Manager (hosted by group rank 0, its port
    broadcast): the agent's store outlives restarts, and a stale manager address there would send
    a restarted rank to its dead predecessor."""
    host, store = env.master_addr, None
    port = [0]
    if env.rank == 0:
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        port = [store.port]
    if env.world_size > 1:
        dist.broadcast_object_list(port, src=0)
    return host, int(port[0]), store


class ReplicaSync:
    """torchft's Manager for one rank of a replica group: quorum, gradient all-reduce, commit vote."""

    def __init__(self, trainer: Any, settings: FtSettings) -> None:
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL  # here: only a fault-tolerant run needs torchft

        # torchft logs each failed collective with its traceback; the discarded step's own line says it once
        logging.getLogger("torchft.manager").setLevel(logging.CRITICAL)

        env, self.settings, self.trainer = trainer.env, settings, trainer
        self.is_reporter = env.rank == 0
        path = (
            os.path.join(settings.events_dir, f"replica{settings.replica}.jsonl")
            if settings.events_dir and self.is_reporter
            else None
        )
        self.events = Events(path, settings.replica)
        state_dict, load_state_dict = heal_fns(trainer.stateful_components, optimizer=trainer.optimizer)
        self.healed = False

        def load(received: dict[str, Any]) -> None:
            load_state_dict(received)
            self.healed = True

        host, port, self._store = _group_store(env)
        timeout = timedelta(seconds=settings.timeout_s)
        pg = (
            ProcessGroupNCCL(timeout)
            if env.device is not None and env.device.type == "cuda"
            else ProcessGroupGloo(timeout=timeout)
        )
        try:
            self.manager = Manager(
                pg=pg,
                load_state_dict=load,
                state_dict=state_dict,
                min_replica_size=settings.min_replicas,
                use_async_quorum=False,
                timeout=timeout,
                quorum_timeout=timedelta(seconds=settings.quorum_timeout_s),
                connect_timeout=timeout,
                rank=env.rank,
                world_size=env.world_size,
                store_addr=host,
                store_port=port,
                lighthouse_addr=settings.lighthouse,
                replica_id=f"shardwise_{settings.replica}",
                init_sync=True,
            )
        except Exception as err:  # noqa: BLE001 - the Rust side raises RuntimeError for a refused connection
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
            raise ShardwiseError(
                f"replica group {settings.replica} cannot reach the lighthouse at {settings.lighthouse} "
                f"within {settings.timeout_s:g} s: {first}",
                hint="start 'shardwise lighthouse --port P' first, and check --lighthouse HOST:PORT",
            ) from None
        self.manager.load_state_dict(
            {"step": trainer.state.step, "batches_committed": 0}
        )  # a resumed checkpoint's step
        self._client = _RecordingClient(self.manager._client)
        self.manager._client = self._client
        self._members: tuple[int, ...] | None = None
        self.samples_per_replica = trainer.global_batch_size // settings.replicas

    def begin(self) -> bool:
        """Join the quorum for the next step (a returning group heals here); True if it healed."""
        self.healed, t0 = False, time.perf_counter()
        try:
            self.manager.start_quorum()
        except Exception as err:  # noqa: BLE001 - torchft raises what the RPC raised
            raise ShardwiseError(self._quorum_failure(err)) from None
        self._report_quorum(time.perf_counter() - t0)
        return self.healed

    def _quorum_failure(self, err: Exception) -> str:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        s = self.settings
        cause = (f"the lighthouse at {s.lighthouse} does not answer" if not _reachable(s.lighthouse)
                 else f"fewer than {s.min_replicas} replica group(s) (--ft-min-replicas) are alive")
        return (
            f"replica group {s.replica}: no quorum for step {self.trainer.state.step + 1} within "
            f"{s.quorum_timeout_s:g} s: {cause} ({type(err).__name__}: {first})"
        )

    def _report_quorum(self, seconds: float) -> None:
        quorum = self._client.last
        if quorum is None:
            return
        members = tuple(sorted(replica_index(rid) for rid in quorum.replica_ids))
        if (
            self.healed and quorum.max_step > 0
        ):  # at step 0 every group but one takes the first one's weights (init sync)
            self.events.counts["heals"] += 1
            self.events.write(
                "healed", step=quorum.max_step, source=quorum.recover_src_replica_rank, heal_s=round(seconds, 3)
            )
        if members == self._members:
            return
        before = set(self._members or ())
        left, joined = sorted(before - set(members)), sorted(set(members) - before)
        if self.is_reporter:
            log.info(f"ft: replica group {self.settings.replica}: quorum {quorum.quorum_id} at step {quorum.max_step}: "
                     f"groups {list(members)} live (left {left}, joined {joined}), formed in {seconds:.2f} s"
                     + (", healed from a peer" if self.healed else ""))
        self.events.write("quorum", step=quorum.max_step, quorum_id=quorum.quorum_id, members=list(members), left=left,
                          joined=joined, quorum_s=round(seconds, 3))
        self._members = members

    def __call__(self, loss_sum: torch.Tensor | None, weights: Any) -> bool:
        """All-reduce the gradients over the live groups (weighted by ``c_r``, module doc) and vote;
        True if the step is committed (every live group then steps)."""
        grads = [p.grad for p in self.trainer.model.parameters() if p.grad is not None]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        share = getattr(weights, "share", None)
        count = (
            float(torch.round(float(self.trainer.meshes.tokens.size()) / share.per_token).item())
            if share is not None
            else 1.0
        )
        loss = float(loss_sum.item()) if loss_sum is not None else 0.0
        meta = torch.tensor([count * loss, count], dtype=torch.float64)
        works, buckets = [self.manager.allreduce(meta, reduce_op=dist.ReduceOp.SUM)], []
        for dtype in sorted({t.dtype for t in local}, key=str):
            members = [t for t in local if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1) for t in members]) * count
            buckets.append((members, flat))
            works.append(self.manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM))
        for work in works:
            work.wait()
        commit = self.manager.should_commit()
        if not commit:
            self.events.counts["discarded_steps"] += 1
            err = self.manager.errored()
            why = str(err.original_exception if err is not None else "").strip().splitlines()
            why = why[0][:200] if why else f"fewer than {self.settings.min_replicas} live group(s)"
            if self.is_reporter:
                log.info(
                    f"ft: replica group {self.settings.replica}: step {self.trainer.state.step + 1} discarded ({why}); "
                    "running it again on the same batch with the next quorum"
                )
            self.events.write("discarded", step=self.trainer.state.step + 1, error=why)
            return False
        total = float(meta[1])
        for members, flat in buckets:
            flat /= total
            offset = 0
            for t in members:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        if loss_sum is not None:
            loss_sum.fill_(float(meta[0]) / total)
        live = self.manager.num_participants()
        skipped = (self.settings.replicas - live) * self.samples_per_replica if live < self.settings.replicas else 0
        self.events.counts["samples_skipped"] += skipped
        self.events.write("commit", step=self.trainer.state.step + 1, live=live, samples_skipped=skipped)
        return True

    def close(self) -> None:
        self.manager.shutdown(wait=False)


class FaultTolerantStep:
    """The Trainer's optimizer step under a quorum: run again on the same batch until a quorum
    commits it; after a heal, on the batch at the peer's data position (module doc)."""

    def __init__(self, inner: Any, sync: ReplicaSync, loader: Any, grad_accum_steps: int) -> None:
        self.inner, self.sync, self.loader, self.k = inner, sync, loader, grad_accum_steps
        self.inner.replicas = sync  # the step's hook between backward and the optimizer (train/step.py)
        self.reload_data = False  # True after a heal: the Trainer restarts its loader at the healed position

    def __call__(self, micro_batches: list[Any]) -> dict[str, Any]:
        self.reload_data = False
        dog = watchdog.current()
        while True:
            with (
                dog.pause() if dog is not None else contextlib.nullcontext()
            ):  # torchft's own timeouts bound the quorum
                if self.sync.begin():
                    micro_batches = next(chunks(self.loader, self.k))  # the healed position's batch
                    self.reload_data = True
            metrics = self.inner(micro_batches)
            if not metrics.pop("discarded", False):
                return metrics


class _CloseAtFitEnd(Callback):
    """Leaves the quorum when ``fit`` ends and logs the run's fault-tolerance counts."""

    def __init__(self, sync: ReplicaSync) -> None:
        self.sync = sync

    def on_fit_end(self, trainer: Any) -> None:
        counts = self.sync.events.counts
        if self.sync.is_reporter:
            log.info(
                f"ft: replica group {self.sync.settings.replica}: {int(counts['discarded_steps'])} step(s) discarded, "
                f"{int(counts['heals'])} heal(s), {int(counts['samples_skipped'])} sample(s) of lost groups skipped"
            )
        self.sync.events.write("end", step=trainer.state.step, **counts)
        self.sync.close()


def fault_tolerant(train_step: Any, trainer: Any, loader: Any) -> Any:
    """``train_step`` itself when this process is not in a replica group, else its
    :class:`FaultTolerantStep` (torchft is imported only then)."""
    settings = trainer.env.settings.ft
    if settings is None:
        return train_step
    sync = ReplicaSync(trainer, settings)
    trainer.callbacks.append(_CloseAtFitEnd(sync))
    checkpoint = trainer.checkpoint
    if checkpoint is not None and settings.replica != 0 and checkpoint in trainer.callbacks:
        # Replica group 0 writes the checkpoints (the groups hold the same state after every commit);
        # the others have resumed like it (on_fit_start ran), and a returning group heals from a peer.
        trainer.callbacks.remove(checkpoint)
        if checkpoint._installed:
            checkpoint.signal.uninstall()
            checkpoint._installed = False
    return FaultTolerantStep(train_step, sync, loader, trainer.grad_accum_steps)
