"""What an elastic job says when its world changed: who was lost (or joined), the old and the new
plan, and the steps redone.

Under ``shardwise run --nnodes MIN:MAX`` torch's elastic agent re-forms the world when a node
dies (the survivors' workers fail on the broken collective and are restarted) or comes back (its
agent waits in the rendezvous and the running workers are stopped with SIGTERM, which the
checkpoint callback turns into a save at the next step boundary). Each new world starts the
script again: the Trainer re-plans for the new world size (:func:`shardwise.resolve.replan`) and
resumes the newest complete checkpoint, resharded, with the exact data position. This callback
only explains it:

    elastic: lost 1 node after step 14: host-b (ranks 2-3); 2 processes remain on 1 node
    elastic: plan dp=2,tp=2 (4 processes) -> dp=1,tp=2 (2 processes); global batch 8 kept
        (2 -> 4 samples per data-parallel rank)
    elastic: resumed from the checkpoint of step 10; steps 11-14 are redone

To know the world before, rank 0 keeps a small record, ``elastic.json`` in the checkpoint
directory (shared storage, like the checkpoints): the run id, the nodes (host, agent pid, ranks),
the plan and the last step reached, rewritten after every step. A record of another run id is
ignored. Communication: one ``all_gather_object`` of (host, agent pid) at the start of ``fit``.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch.distributed as dist

from shardwise.callback import Callback
from shardwise.errors import ConfigError
from shardwise.resolve import resolve_plan
from shardwise.runtime.logging import get_logger

log = get_logger("train")

RECORD = "elastic.json"


@dataclass(frozen=True)
class Node:
    """One node of a world: the machine, its elastic agent (a node that comes back gets a new
    agent, so a returning host counts as joined) and the global ranks it runs."""

    host: str
    agent_pid: int
    ranks: tuple[int, ...]

    @property
    def key(self) -> tuple[str, int]:
        return (self.host, self.agent_pid)


@dataclass(frozen=True)
class WorldRecord:
    """The world of one launch attempt, as rank 0 last wrote it."""

    run_id: str
    world_size: int
    plan: str
    dp_size: int
    step: int
    nodes: tuple[Node, ...]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorldRecord:
        data = json.loads(text)
        nodes = tuple(Node(n["host"], int(n["agent_pid"]), tuple(n["ranks"])) for n in data.pop("nodes"))
        return cls(nodes=nodes, **data)


def nodes_of(members: list[tuple[str, int]]) -> tuple[Node, ...]:
    """Group the (host, agent pid) of every global rank (list index = rank) into nodes."""
    by_key: dict[tuple[str, int], list[int]] = {}
    for rank, key in enumerate(members):
        by_key.setdefault(tuple(key), []).append(rank)  # type: ignore[arg-type]
    return tuple(
        Node(host, pid, tuple(ranks)) for (host, pid), ranks in sorted(by_key.items(), key=lambda kv: kv[1][0])
    )


def _ranks(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 1 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def _names(nodes: tuple[Node, ...], everyone: tuple[Node, ...]) -> str:
    """``host (ranks 2-3)``; with the agent's pid where two nodes share a host (loopback tests)."""
    shared = {n.host for n in everyone if sum(m.host == n.host for m in everyone) > 1}
    return ", ".join(
        f"{n.host} ({'agent pid %d, ' % n.agent_pid if n.host in shared else ''}{_ranks(n.ranks)})" for n in nodes
    )


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith('s') else 's'}"


def describe_change(before: WorldRecord | None, now: WorldRecord, *, requested_plan: str, resumed_step: int | None,
                    global_batch: int) -> list[str]:
    """The few lines rank 0 prints at the start of ``fit`` in an elastic job (see the module doc)."""
    hosts = _names(now.nodes, now.nodes)
    if before is None:
        replanned = (
            f" (re-planned from {requested_plan})" if _replanned(requested_plan, now.plan, now.world_size) else ""
        )
        return [
            f"elastic: {_count(now.world_size, 'process')} on {_count(len(now.nodes), 'node')} [{hosts}], plan "
            f"{now.plan}{replanned}"
        ]
    old = {n.key for n in before.nodes}
    new = {n.key for n in now.nodes}
    lost = tuple(n for n in before.nodes if n.key not in new)
    joined = tuple(n for n in now.nodes if n.key not in old)
    everyone = before.nodes + joined
    lines = []
    if lost:
        lines.append(f"elastic: lost {_count(len(lost), 'node')} after step {before.step}: {_names(lost, everyone)}; "
                     f"{_count(now.world_size, 'process')} remain on {_count(len(now.nodes), 'node')}")
    if joined:
        lines.append(
            f"elastic: {_count(len(joined), 'node')} joined after step {before.step}: {_names(joined, everyone)}; "
            f"{_count(now.world_size, 'process')} on {_count(len(now.nodes), 'node')}"
        )
    if not lost and not joined:
        lines.append(f"elastic: restarted on the same {_count(len(now.nodes), 'node')} after step {before.step}")
    if before.plan != now.plan or before.world_size != now.world_size:
        per_rank = (
            f" ({global_batch // max(before.dp_size, 1)} -> {global_batch // max(now.dp_size, 1)} samples per "
            "data-parallel rank)"
            if before.dp_size != now.dp_size
            else ""
        )
        lines.append(f"elastic: plan {before.plan} ({_count(before.world_size, 'process')}) -> {now.plan} "
                     f"({_count(now.world_size, 'process')}); global batch {global_batch} kept{per_rank}")
    start = resumed_step or 0
    where = (
        f"resumed from the checkpoint of step {start}"
        if resumed_step is not None
        else "no checkpoint to resume: starting again from step 0"
    )
    redone = f"steps {start + 1}-{before.step} are redone" if before.step > start + 1 else (
        f"step {before.step} is redone" if before.step == start + 1 else "no steps are redone")
    lines.append(f"elastic: {where}; {redone}")
    return lines


def _replanned(requested: str, plan: str, world_size: int) -> bool:
    """Whether ``plan`` differs from what ``requested`` means in this world without re-planning
    (``"dp"`` -> ``dp=4`` or ``"zero=3"`` -> ``shard=4`` is filling in, not re-planning)."""
    if not requested or requested.strip().lower() == "auto":
        return False
    try:
        return str(resolve_plan(requested, world_size)) != plan
    except ConfigError:
        return True


def read_record(directory: str, run_id: str) -> WorldRecord | None:
    """The record of run ``run_id`` in ``directory``, or None (missing, unreadable, another run)."""
    try:
        with open(os.path.join(directory, RECORD)) as fh:
            record = WorldRecord.from_json(fh.read())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if record.run_id == run_id else None


def write_record(directory: str, record: WorldRecord) -> None:
    """Atomically (write, then rename): a node lost mid-write never leaves half a record."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, RECORD)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        fh.write(record.to_json())
    os.replace(tmp, path)


class ElasticReport(Callback):
    """Added by the Trainer in an elastic job with checkpoints: prints :func:`describe_change` on
    rank 0 after the checkpoint was restored, and keeps the record up to date."""

    def __init__(self, directory: str, *, requested_plan: str) -> None:
        self.directory = directory
        self.requested_plan = requested_plan
        self.record: WorldRecord | None = None

    def on_fit_start(self, trainer: Any) -> None:
        env = trainer.env
        # this node's elastic agent: the `shardwise run` launcher that runs it (its workers may be
        # children of a fork server, SHARDWISE_FORKSERVER), else, under torchrun, the worker's parent
        agent = env.settings.launcher_pid if env.settings.launcher_pid is not None else os.getppid()
        me = (socket.gethostname(), agent)
        members: list[Any] = [me]
        if dist.is_initialized() and env.world_size > 1:
            members = [None] * env.world_size
            dist.all_gather_object(members, me)
        if not env.is_main:
            return
        run_id = env.settings.run_id
        self.record = WorldRecord(
            run_id=run_id,
            world_size=env.world_size,
            plan=str(trainer.plan),
            dp_size=trainer.dp_size,
            step=trainer.step,
            nodes=nodes_of(members),
        )
        loaded = getattr(trainer.checkpoint, "loaded", None)
        lines = describe_change(
            read_record(self.directory, run_id),
            self.record,
            requested_plan=self.requested_plan,
            resumed_step=loaded.step if loaded is not None else None,
            global_batch=trainer.global_batch_size,
        )
        print("\n".join(lines), flush=True)
        write_record(self.directory, self.record)

    def on_step_end(self, trainer: Any, metrics: dict[str, Any]) -> None:
        if self.record is not None:
            self.record = replace(self.record, step=trainer.step)
            write_record(self.directory, self.record)


def elastic_callbacks(checkpoint: Any, *, requested_plan: str, is_main: bool) -> list[Callback]:
    """What the Trainer adds in an elastic job: with checkpoints, resume by default (a re-formed
    world must continue, not start over) and the report; without, a warning on rank 0."""
    if checkpoint is None:
        if is_main:
            log.warning(
                "elastic job without Trainer(checkpoint=...): a lost or regained node restarts training from step 0"
            )
        return []
    if checkpoint.resume is None:
        checkpoint.resume = "auto"
    return [ElasticReport(checkpoint.manager.directory, requested_plan=requested_plan)]
