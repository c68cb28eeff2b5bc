"""Who is stuck, and why: the pure diagnosis behind the hang watchdog.

Every rank publishes a :class:`Heartbeat` (its step, how many collectives it has issued on each
process group, the collectives still in flight) to the rendezvous store. When one rank has made
no progress for T seconds, it reads every heartbeat and :func:`diagnose` compares them with the
collective it is stuck in. A peer *arrived* at collective ``#seq`` of group ``g`` when it has
issued at least ``seq`` collectives on ``g`` with the same operation; otherwise it is named:

- ``frozen``: its heartbeat is older than the staleness limit (SIGSTOP, swapping, a C call that
  holds the GIL, a dead host) — its own watchdog cannot speak, so the others speak for it;
- ``behind``: it has issued fewer collectives on ``g`` (slow, stuck in compute, or it skipped one);
- ``mismatch``: it is at the same sequence number in a different operation or shapes (a
  collective issued on some ranks only, in a different order);
- ``finished`` / ``exited``: it left the training loop while the others still wait;
- ``silent``: it never published a heartbeat (started without the watchdog).

Sequence numbers are torch's own (``collective_seq_id`` in the flight recorder, the per-group
counter every backend keeps), so they are comparable across ranks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class InFlight:
    """One collective this rank has issued and that has not completed (a flight-recorder entry)."""

    pg: str
    seq: int
    op: str
    sizes: tuple = ()
    dtypes: tuple = ()
    age_s: float = 0.0

    def describe(self) -> str:
        shapes = ", ".join("x".join(map(str, s)) or "scalar" for s in self.sizes) or "-"
        dt = f" {'/'.join(sorted(set(self.dtypes)))}" if self.dtypes else ""
        return f"{self.op} #{self.seq} on group {self.pg} (shapes [{shapes}]{dt})"


@dataclass(frozen=True)
class Heartbeat:
    """What one rank publishes every interval."""

    rank: int
    host: str
    pid: int
    time: float
    state: str = "running"  # running | finished | exited
    step: int | None = None
    issued: dict = field(default_factory=dict)  # group name -> collectives issued so far
    in_flight: tuple = ()  # InFlight, oldest first

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str | bytes) -> "Heartbeat":
        raw = json.loads(text)
        flights = tuple(InFlight(**{**f, "sizes": tuple(tuple(s) for s in f["sizes"]), "dtypes": tuple(f["dtypes"])})
                        for f in raw.pop("in_flight", ()))
        return Heartbeat(**raw, in_flight=flights)

    def where(self) -> str:
        return f"rank {self.rank} ({self.host}, pid {self.pid})"


@dataclass(frozen=True)
class Stall:
    """What the detecting rank was doing when it stopped making progress."""

    rank: int
    kind: str  # collective | step | finish
    seconds: float
    collective: InFlight | None = None
    group_ranks: tuple = ()  # global ranks of the collective's group (empty: the whole world)
    step: int | None = None

    def describe(self) -> str:
        if self.kind == "collective" and self.collective is not None:
            return f"no progress for {self.seconds:.0f} s in {self.collective.describe()}"
        if self.kind == "finish":
            return f"finished training and waited {self.seconds:.0f} s for the other ranks to finish"
        return f"step {self.step} has made no progress for {self.seconds:.0f} s (not inside a collective)"


@dataclass(frozen=True)
class Culprit:
    rank: int
    reason: str  # frozen | behind | mismatch | finished | exited | silent | self
    detail: str


def diagnose(
    stall: Stall, beats: dict[int, Heartbeat | None], *, now: float, stale_s: float, world_size: int
) -> list[Culprit]:
    """The ranks that did not arrive where ``stall`` is stuck, each with the reason (see module doc)."""
    members = stall.group_ranks or tuple(range(world_size))
    culprits = []
    if stall.kind == "step":
        culprits.append(
            Culprit(
                stall.rank, "self", f"rank {stall.rank} itself is stuck outside any collective at step {stall.step}"
            )
        )
    for r in members:
        if r == stall.rank:
            continue
        beat = beats.get(r)
        if beat is None:
            culprits.append(
                Culprit(
                    r, "silent", f"rank {r} never published a heartbeat (not started, or started without the watchdog)"
                )
            )
            continue
        age = now - beat.time
        at = f" at step {beat.step}" if beat.step is not None else ""
        if beat.state in ("finished", "exited"):
            counts = (
                ", ".join(f"{n} collectives on group {g}" for g, n in sorted(beat.issued.items())) or "no collectives"
            )
            culprits.append(Culprit(r, beat.state, f"{beat.where()} has {beat.state}{at} after issuing {counts}"))
            continue
        if age > stale_s:
            culprits.append(
                Culprit(
                    r,
                    "frozen",
                    f"{beat.where()} has sent no heartbeat for {age:.0f} s{at}: the process is "
                    "frozen (stopped, swapping, or stuck in a call that holds the GIL) or its host is down",
                )
            )
            continue
        if stall.kind == "finish":
            _add_finish_culprit(stall, beats, r, beat, at, culprits)
            continue
        culprit = _collective_culprit(stall, r, beat, at)
        if culprit is not None:
            culprits.append(culprit)
    return culprits


def _add_finish_culprit(
    stall: Stall, beats: dict[int, Heartbeat | None], r: int, beat: Heartbeat, at: str, culprits: list[Culprit]
) -> None:
    """A ``finish`` stall, seen from the running rank ``r``: if ``r`` waits in a collective the
    finished rank never issued, that rank skipped it (put first, once); else ``r`` is behind."""
    mine = beats.get(stall.rank)
    waiting = next((f for f in beat.in_flight if mine is not None and f.seq > mine.issued.get(f.pg, 0)), None)
    if waiting is not None and mine is not None:
        # The peer waits in a collective this rank never issued: this rank is the one missing.
        if not any(c.rank == stall.rank for c in culprits):
            culprits.insert(
                0,
                Culprit(
                    stall.rank,
                    "finished",
                    f"{mine.where()} has finished after issuing "
                    f"{mine.issued.get(waiting.pg, 0)} collectives on group {waiting.pg}, "
                    f"but other ranks wait in {waiting.describe()}: it skipped a collective",
                ),
            )
        return
    culprits.append(Culprit(r, "behind", f"{beat.where()} is still running{at}{_doing(beat)}"))


def _collective_culprit(stall: Stall, r: int, beat: Heartbeat, at: str) -> Culprit | None:
    """A ``collective`` stall, seen from rank ``r``: behind when it has not issued that collective
    yet, a mismatch when it is in a different one at the same place; else None."""
    if stall.kind != "collective" or stall.collective is None:
        return None
    want = stall.collective
    issued = beat.issued.get(want.pg, 0)
    if issued < want.seq:
        return Culprit(
            r,
            "behind",
            f"{beat.where()} did not arrive at {want.op} #{want.seq}: it has issued only "
            f"{issued} collectives on group {want.pg}{at}{_doing(beat)}",
        )
    twin = next((f for f in beat.in_flight if f.pg == want.pg and f.seq == want.seq), None)
    if twin is not None and (twin.op != want.op or tuple(twin.sizes) != tuple(want.sizes)):
        return Culprit(
            r,
            "mismatch",
            f"{beat.where()} is in {twin.describe()} while rank {stall.rank} is in "
            f"{want.describe()}: the ranks issued different collectives",
        )
    return None


def _doing(beat: Heartbeat) -> str:
    if beat.in_flight:
        return f"; it is waiting in {beat.in_flight[0].describe()} for {beat.in_flight[0].age_s:.0f} s"
    return "; it is not inside any collective (computing, loading data, or sleeping)"


def verdict(stall: Stall, culprits: list[Culprit]) -> str:
    """One paragraph for the log: what was stuck, and who did not arrive."""
    head = f"HANG: rank {stall.rank} {stall.describe()}."
    if not culprits:
        return head + (" Every rank of the group reached it, so the transport itself is stuck "
                       "(network, NCCL, or a peer blocked inside the backend).")
    names = sorted({c.rank for c in culprits})
    lines = [head, f"Stuck rank(s): {', '.join(map(str, names))}."]
    lines += [f"  - {c.detail}" for c in culprits]
    return "\n".join(lines)
