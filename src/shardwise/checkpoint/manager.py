"""``CheckpointManager``: save and load every Stateful of a run together, sharded, atomically.

What goes where (one step directory, see :mod:`shardwise.checkpoint.commit` for the layout):

- **model and optimizer** through ``torch.distributed.checkpoint`` (DCP). Their state dicts come
  from ``get_state_dict`` so DDP/FSDP/TP parameters appear under their plain FQNs as local tensors
  or DTensors; every rank writes only the shards it owns (``__<rank>_0.distcp``), in parallel, and
  the coordinator writes the global index ``.metadata``. No tensor is gathered to rank 0.
- **everything else** (LR scheduler, grad scaler, counters, data position, RNG states, user extra
  state) is small and may differ per rank: each rank writes its own ``ranks/rank_<r>.pt``.
- a model with LoRA adapters saves and loads its trainable parameters only (the frozen base is
  referenced, not written: :mod:`shardwise.checkpoint.adapters`); a component with a ``check``
  method (that base reference) may refuse the checkpoint before any tensor is read.

Communication: a save is one broadcast (agree on the step directory) plus DCP's own plan
gather/scatter and final gather; a load is one broadcast (agree on the checkpoint) plus DCP's
load planning. Checkpoint collectives run on a dedicated Gloo group, so an async save's background
thread never interleaves with the training collectives on the default group.

Async saves (``async_save=True``) stage a CPU copy synchronously (the only time training is
blocked), then write in a background thread; at most one save is in flight (the next one waits),
which bounds staging memory to one copy of the local shards.

Decisions that lead into a collective are taken from values every rank holds identically
(:attr:`CheckpointManager.last_saved`, set by the training thread when all ranks entered a save)
or agreed with :meth:`CheckpointManager.agree`; never from :attr:`~CheckpointManager.last_committed`,
which the writer thread sets at a different moment on each rank.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict

from shardwise.checkpoint import commit as cm
from shardwise.checkpoint.adapters import state_options
from shardwise.checkpoint.components import merge_param_groups, split_components, sync_loaded
from shardwise.checkpoint.faults import Fault
from shardwise.checkpoint.options import CheckpointOptions, Loaded
from shardwise.checkpoint.stage_names import StageNames
from shardwise.checkpoint.safe_io import (
    SafeFileSystemReader,
    check_compatible,
    encode_for_weights_only,
    load_rank_file,
    safe_load,
)
from shardwise.errors import ConfigError

RANK_DIR = "ranks"


class CheckpointManager:
    """Sharded, atomic, optionally asynchronous checkpoints of a dict of Stateful objects.

    ``CheckpointManager(dir, keep_last_n=3, keep_best=("val_loss", "min"), every_n_steps=100,
    every_n_minutes=30, on_epoch_end=True, async_save=True)``. Call :meth:`save` (or let the
    trainer callback do it by policy) and :meth:`load` with the same component names.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep_last_n: int | None = 3,
        keep_best: tuple[str, str] | None = None,
        every_n_steps: int | None = None,
        every_n_minutes: float | None = None,
        on_epoch_end: bool = False,
        async_save: bool = False,
        verify: cm.Verify = "checksum",
        plan: Any = None,
        dp_size: int | None = None,
        dp_rank: int | None = None,
        fault: Fault | None = None,
    ) -> None:
        self.directory = os.path.abspath(os.fspath(directory))
        self.options = CheckpointOptions(keep_last_n=keep_last_n, keep_best=keep_best, every_n_steps=every_n_steps,
                                         every_n_minutes=every_n_minutes, on_epoch_end=on_epoch_end,
                                         async_save=async_save, verify=verify)
        self.plan = plan
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.dp_size = dp_size or (plan.dp * plan.shard if plan is not None else self.world_size)
        self.dp_rank = self.rank % self.dp_size if dp_rank is None else dp_rank
        self.fault = fault
        self._group: Any = None  # DCP's collectives (also run from the async writer thread)
        self._control: Any = None  # small collectives of the training thread (agree, broadcast)
        self._pending: threading.Event | None = None  # set when the save in flight is committed (or failed)
        self._pending_error: BaseException | None = None
        self._lock = threading.Lock()
        # Set by whichever thread commits (the writer thread of an async save), at a different
        # moment on each rank: for reports only, never for a decision that leads into a collective.
        self.last_committed: int | None = None
        # The newest step every rank entered save() for (or loaded), set by the training thread
        # after the ranks agreed on it: the same value on every rank at every step boundary.
        self.last_saved: int | None = None
        self._last_save_time = time.monotonic()
        self.blocked_s = 0.0  # time save() held the caller, summed (the benchmark reads it)

    def bind_layout(self, *, plan: Any = None, dp_size: int | None = None, dp_rank: int | None = None) -> None:
        """Record the run's plan and data-parallel position (the Trainer's callback calls this)
        where the manager was built before the layout was known."""
        if plan is not None and self.plan is None:
            self.plan = plan
        if dp_size is not None:
            self.dp_size = dp_size
            self.dp_rank = self.rank % dp_size if dp_rank is None else dp_rank

    # -- process group -----------------------------------------------------------------------
    def _pg(self) -> Any:
        """A Gloo group of all ranks for DCP (created on first use, by all ranks in the same order)."""
        self._make_groups()
        return self._group

    def _make_groups(self) -> None:
        """Two groups: an async save's writer thread runs DCP collectives on one while the training
        thread keeps calling ``agree``/``_broadcast`` on the other; sharing one group between two
        threads would interleave their collectives differently on different ranks and hang."""
        if self.distributed and self._group is None:
            self._group = dist.new_group(backend="gloo")
            self._control = dist.new_group(backend="gloo")

    def _broadcast(self, value: Any) -> Any:
        if not self.distributed:
            return value
        self._make_groups()
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._control)
        return box[0]

    def _all_gather(self, value: Any) -> list[Any]:
        if not self.distributed:
            return [value]
        self._make_groups()
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self._control)
        return out

    # -- policy -------------------------------------------------------------------------------
    def due(self, step: int, *, epoch_end: bool = False) -> bool:
        """Whether the policy asks for a save after ``step`` (same answer on every rank)."""
        o = self.options
        if epoch_end:
            return o.on_epoch_end
        by_steps = o.every_n_steps is not None and step % o.every_n_steps == 0
        if o.every_n_minutes is None:
            return by_steps
        local = (time.monotonic() - self._last_save_time) >= o.every_n_minutes * 60.0
        return by_steps or self.agree(local)

    def agree(self, flag: bool) -> bool:
        """True on every rank if it is true on any rank (one tiny all-reduce): clocks and signals
        differ between ranks, and a save that only some ranks enter would hang the others."""
        return bool(self.agree_max(1 if flag else 0))

    def agree_max(self, value: int) -> int:
        """The largest of every rank's ``value`` (one tiny all-reduce on the control group), e.g. the
        number of a pre-emption signal that only some ranks received yet (0 where none)."""
        if not self.distributed:
            return value
        self._make_groups()
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._control)
        return int(t.item())

    # -- save ---------------------------------------------------------------------------------
    def save(self, components: Mapping[str, Any], *, step: int, metrics: Mapping[str, float] | None = None,
             block: bool | None = None) -> bool:
        """Save all ``components`` as step ``step``; returns False if that step is already committed.

        Every rank must call it. With ``async_save`` (and ``block`` not True) it returns once the
        state is staged; the files are written and committed in the background.
        """
        started = time.perf_counter()
        self.wait()
        path = os.path.join(self.directory, cm.step_dirname(step))
        if self.rank == 0:
            os.makedirs(self.directory, exist_ok=True)
            done = cm.read_marker(path) is not None
            if not done and os.path.exists(path):
                cm.remove_checkpoint(path)  # leftovers of a crashed save of the same step
            decision = "skip" if done else "go"
        else:
            decision = None
        decision = self._broadcast(decision)
        self.last_saved = step  # every rank got here, with the same step: the collectives below are joined by all
        if decision == "skip":
            self.blocked_s += time.perf_counter() - started
            return False
        model, optims, others = split_components(components)
        os.makedirs(os.path.join(path, RANK_DIR), exist_ok=True)
        state, param_groups = self._tensor_state(model, optims)
        self._write_rank_file(path, others, param_groups)
        if self.fault is not None:
            self.fault.maybe_fire(rank=self.rank, step=step, at="save")
        writer = dcp.FileSystemWriter(path, sync_files=True)
        info = dict(step=step, world_size=self.world_size, dp_size=self.dp_size,
                    plan=str(self.plan) if self.plan is not None else None, metrics=dict(metrics or {}))
        asynchronous = self.options.async_save if block is None else not block
        if asynchronous:
            result = dcp.async_save(
                state, storage_writer=writer, process_group=self._pg(), no_dist=not self.distributed
            )
            future = getattr(result, "upload_completion", result)
            self._pending = done = threading.Event()
            future.add_done_callback(lambda f: self._finish(f, path, info, done))
        else:
            dcp.save(state, storage_writer=writer, process_group=self._pg(), no_dist=not self.distributed)
            self._commit(path, info)
        self._last_save_time = time.monotonic()
        self.blocked_s += time.perf_counter() - started
        return True

    def _tensor_state(self, model: nn.Module | None,
                      optims: list[torch.optim.Optimizer]) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
        """``(what DCP saves or loads, the optimizers' param groups for the per-rank file)``.

        Without a model there are no tensors to shard: ``({}, None)``, and a checkpoint of only
        small Statefuls (counters, a data position) still saves and loads.
        """
        if model is None:
            if optims:
                raise ConfigError(
                    "an optimizer is checkpointed without its model", hint="add the model to the components"
                )
            return {}, None
        msd, osd = get_state_dict(model, optims, options=state_options(model))  # LoRA: the adapters only
        names = StageNames(model, msd)  # several local pipeline stages: their original names
        msd, osd = names.model_out(msd), names.optim_out(osd)
        if not optims:
            return {"model": msd}, None
        # Tensors (moments, step counts; sharded like their parameters) go through DCP. The param
        # groups (hyper-parameters and the names of this rank's parameters) are small and, under
        # pipeline parallelism, differ per rank while sharing one key, which DCP would deduplicate
        # to a single rank's copy: they go to the per-rank file.
        return {"model": msd, "optim": {"state": osd["state"]}}, osd["param_groups"]

    @staticmethod
    def _plain_model_state(model: nn.Module) -> dict[str, Any]:
        msd = get_model_state_dict(model, options=state_options(model))
        return StageNames(model, msd).model_out(msd)

    def _write_rank_file(self, path: str, others: Mapping[str, Any], param_groups: Any) -> None:
        payload = {
            "param_groups": param_groups,
            "rank": self.rank, "world_size": self.world_size, "dp_rank": self.dp_rank, "dp_size": self.dp_size,
            "components": {name: obj.state_dict() for name, obj in others.items()},
        }
        target = os.path.join(path, RANK_DIR, f"rank_{self.rank:05d}.pt")
        with open(target, "wb") as f:
            torch.save(encode_for_weights_only(payload), f)
            f.flush()
            os.fsync(f.fileno())

    def _finish(self, future: Future, path: str, info: dict[str, Any], done: threading.Event) -> None:
        """Runs in DCP's writer thread when the async save's files are all written."""
        try:
            future.result()
            self._commit(path, info)
        except BaseException as err:  # noqa: BLE001 - surfaced on the next wait()/save()
            self._pending_error = err
        finally:
            done.set()

    def _commit(self, path: str, info: dict[str, Any]) -> None:
        """Rank 0 seals the step. DCP's coordinator returns only after every rank reported its
        writes done, so all shards and per-rank files are on disk when this runs."""
        if self.rank == 0:
            with self._lock:
                cm.commit(path, **info)
                cm.update_latest(self.directory, info["step"])
                cm.retain(self.directory, keep_last_n=self.options.keep_last_n, keep_best=self.options.keep_best)
        self.last_committed = info["step"]

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and committed; re-raise its error."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.wait()
        if self._pending_error is not None:
            err, self._pending_error = self._pending_error, None
            raise err

    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.is_set()

    def close(self) -> None:
        self.wait()

    # -- load ---------------------------------------------------------------------------------
    def find(self, step: int | None = None) -> cm.CheckpointInfo | None:
        """The newest complete checkpoint (or the given step if complete), decided on rank 0."""
        choice = None
        if self.rank == 0:
            if step is None:
                choice = cm.latest_complete(self.directory, level=self.options.verify)
            else:
                path = os.path.join(self.directory, cm.step_dirname(step))
                marker, reason = cm.verify(path, level=self.options.verify)
                choice = cm.CheckpointInfo(step=step, path=path, marker=marker, reason=reason)
        return self._broadcast(choice)

    def load(self, components: Mapping[str, Any], *, step: int | None = None) -> Loaded | None:
        """Restore ``components`` from the newest complete checkpoint (or ``step``); None if none.

        Works under another plan or world size (see :mod:`shardwise.checkpoint.reshard`). A
        checkpoint of another model raises a ``ConfigError`` listing the mismatches, before anything
        is modified.
        """
        self.wait()
        info = self.find(step)
        if info is None:
            return None
        if not info.complete:
            raise ConfigError(
                f"checkpoint {info.path} is not complete: {info.reason}", hint="load another step or omit step="
            )
        marker = info.marker
        model, optims, others = split_components(components)
        reader = SafeFileSystemReader(info.path)
        rank_payload = load_rank_file(os.path.join(info.path, RANK_DIR), rank=self.rank, saved_world=marker.world_size)
        for name, obj in others.items():  # a LoRA run's base reference: refused before anything is read
            if callable(getattr(obj, "check", None)):
                obj.check(rank_payload["components"].get(name), where=info.path)
        # Checked before the optimizer's state dict is built: torch initializes an empty optimizer's
        # state (a zero-lr step) in get_state_dict, and a refused checkpoint must change nothing.
        probe = {"model": self._plain_model_state(model)} if model is not None else {}
        if optims:
            probe["optim"] = None
        # with pipeline stages each rank holds only some names; "unexpected" is judged on the union
        everyone = self._all_gather(sorted(probe.get("model", {})))
        check_compatible(reader.read_metadata(), probe, rank_payload["components"], others, path=info.path,
                         model_names={name for names in everyone for name in names},
                         saved_param_groups=rank_payload.get("param_groups"))
        state, groups_now = self._tensor_state(model, optims)
        if state:
            safe_load(state, reader, process_group=self._pg(), no_dist=not self.distributed)
            osd = {}
            if groups_now is not None:
                osd = {
                    "state": state["optim"]["state"],
                    "param_groups": merge_param_groups(groups_now, rank_payload["param_groups"], info.path),
                }
            names = StageNames(model, get_model_state_dict(model, options=state_options(model)))
            set_state_dict(
                model,
                optims,
                model_state_dict=names.model_in(state["model"]),
                optim_state_dict=names.optim_in(osd) if osd else osd,
                options=state_options(model, loading=True),
            )
            sync_loaded(components)
        resharded = marker.world_size != self.world_size or marker.dp_size != self.dp_size
        # The data position is a count of global samples (ShardedSampler), the same under any
        # data-parallel size: it loads unchanged (see shardwise.checkpoint.reshard).
        for name, obj in others.items():
            obj.load_state_dict(rank_payload["components"][name])
        self.last_committed = self.last_saved = marker.step
        return Loaded(step=marker.step, path=info.path, marker=marker, resharded=resharded)
