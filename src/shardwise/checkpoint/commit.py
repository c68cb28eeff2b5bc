"""Atomic commit of a checkpoint directory: a checkpoint is either complete and valid, or ignored.

On-disk layout under the checkpoint root::

    root/
      step_00000040/            one directory per saved step (DCP shards + per-rank files)
        .metadata               DCP's global index (written by the coordinator, last of DCP's files)
        __0_0.distcp ...        each rank's tensor shards (written by that rank)
        ranks/rank_00000.pt     each rank's small state (counters, data position, RNG)
        COMMITTED.json          the commit marker, written LAST: step, plan, world size, metrics
                                and the size + sha256 of every other file in the directory
      latest                    name of the newest committed step directory (advanced after commit)

Protocol (the order is what makes it crash-safe):

1. every rank writes its files into ``step_N/`` and fsyncs them (DCP's ``sync_files``);
2. after DCP's coordinator has gathered every rank's write result, rank 0 hashes the files and
   writes the marker to a temporary name, fsyncs it, renames it to ``COMMITTED.json`` (an atomic
   ``rename(2)``) and fsyncs the directory;
3. only then ``latest`` is replaced (temp file + rename) and old checkpoints are pruned.

A crash before step 2 completes leaves a directory without a valid marker, which every reader
skips; the previous committed checkpoint is untouched because nothing is deleted before the new
one is committed. Deletion removes the marker first, so a half-deleted directory is invalid too.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Literal

MARKER = "COMMITTED.json"
LATEST = "latest"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d{8,})$")

Verify = Literal["none", "size", "checksum"]


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so a reader sees the old content or the new one, never a mix."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(os.path.dirname(os.path.abspath(path)))


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _payload_files(step_path: str) -> list[str]:
    """Relative paths of every file of a step directory except the marker and temporaries."""
    out = []
    for base, _dirs, files in os.walk(step_path):
        for name in files:
            rel = os.path.relpath(os.path.join(base, name), step_path)
            if rel == MARKER or ".tmp." in name:
                continue
            out.append(rel)
    return sorted(out)


def _is_count(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


@dataclass(frozen=True)
class Marker:
    """The content of ``COMMITTED.json``."""

    step: int
    world_size: int
    dp_size: int
    plan: str | None
    files: dict[str, dict[str, Any]]  # relative path -> {"size": int, "sha256": str}
    metrics: dict[str, float] = field(default_factory=dict)
    created: float = 0.0
    version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Marker":
        """Parse a marker; ``ValueError`` if it is not one (a hand-edited or damaged file must read
        as "no valid marker", not crash a reader later on a wrong type)."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("a commit marker is a JSON object")
        names = {f for f in cls.__dataclass_fields__}
        marker = cls(**{k: v for k, v in data.items() if k in names})
        if not (_is_count(marker.step, 0) and _is_count(marker.world_size, 1) and _is_count(marker.dp_size, 1)):
            raise ValueError("a commit marker has a step and positive world_size and dp_size")
        if (
            not isinstance(marker.files, dict)
            or not isinstance(marker.metrics, dict)
            or not isinstance(marker.plan, (str, type(None)))
        ):
            raise ValueError("a commit marker has a files table, a metrics table and a plan")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in marker.metrics.values()):
            raise ValueError("the metrics of a commit marker are numbers")
        for info in marker.files.values():
            if (
                not isinstance(info, dict)
                or not isinstance(info.get("size"), int)
                or not isinstance(info.get("sha256"), str)
            ):
                raise ValueError("each file of a commit marker has an integer size and a sha256")
        return marker


def commit(
    step_path: str, *, step: int, world_size: int, dp_size: int, plan: str | None, metrics: dict[str, float]
) -> Marker:
    """Seal ``step_path``: fsync its files, then write the marker (with checksums) last, atomically."""
    files = {}
    for rel in _payload_files(step_path):
        full = os.path.join(step_path, rel)
        _fsync_path(full)  # cheap when DCP already synced; required for our own files
        files[rel] = {"size": os.path.getsize(full), "sha256": _sha256(full)}
    for base, _dirs, _files in os.walk(step_path):
        _fsync_path(base)
    marker = Marker(step=step, world_size=world_size, dp_size=dp_size, plan=plan, files=files,
                    metrics={k: float(v) for k, v in metrics.items()}, created=time.time())
    atomic_write_text(os.path.join(step_path, MARKER), marker.to_json())
    return marker


def read_marker(step_path: str) -> Marker | None:
    try:
        with open(os.path.join(step_path, MARKER), encoding="utf-8") as f:
            return Marker.from_json(f.read())
    except (OSError, ValueError, TypeError):
        return None


def verify(step_path: str, *, level: Verify = "checksum") -> tuple[Marker | None, str]:
    """``(marker, "")`` when ``step_path`` is a complete checkpoint, else ``(None, reason)``."""
    marker = read_marker(step_path)
    if marker is None:
        return None, "no valid commit marker (incomplete or interrupted save)"
    if level == "none":
        return marker, ""
    for rel, info in marker.files.items():
        full = os.path.join(step_path, rel)
        try:
            size = os.path.getsize(full)
        except OSError:
            return None, f"file {rel} is missing"
        if size != info["size"]:
            return None, f"file {rel} has {size} bytes, the marker says {info['size']}"
        try:
            if level == "checksum" and _sha256(full) != info["sha256"]:
                return None, f"file {rel} does not match its checksum"
        except OSError as err:
            return None, f"file {rel} cannot be read ({err.strerror or err})"
    return marker, ""


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str
    marker: Marker | None
    reason: str  # why it is not complete ("" when complete)

    @property
    def complete(self) -> bool:
        return self.marker is not None


def list_checkpoints(root: str, *, level: Verify = "size") -> list[CheckpointInfo]:
    """Every step directory under ``root``, oldest first, with whether it is complete."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        match = _STEP_RE.match(name)
        if not match or not os.path.isdir(os.path.join(root, name)):
            continue
        path = os.path.join(root, name)
        marker, reason = verify(path, level=level)
        out.append(CheckpointInfo(step=int(match.group(1)), path=path, marker=marker, reason=reason))
    return sorted(out, key=lambda c: c.step)


def latest_complete(root: str, *, level: Verify = "checksum") -> CheckpointInfo | None:
    """The newest checkpoint that verifies at ``level``.

    The ``latest`` pointer is a convenience for humans and tools; the truth is the markers, so a
    pointer left behind by a crash between commit and pointer update can never mislead a resume.
    """
    for info in reversed(list_checkpoints(root, level="none")):
        marker, reason = verify(info.path, level=level)
        if marker is not None:
            return CheckpointInfo(step=info.step, path=info.path, marker=marker, reason="")
    return None


def update_latest(root: str, step: int) -> None:
    atomic_write_text(os.path.join(root, LATEST), step_dirname(step) + "\n")


def remove_checkpoint(path: str) -> None:
    """Delete a step directory, marker first, so an interrupted deletion leaves it invalid."""
    try:
        os.remove(os.path.join(path, MARKER))
        _fsync_path(path)
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def retain(root: str, *, keep_last_n: int | None, keep_best: tuple[str, str] | None) -> list[int]:
    """Prune old checkpoints after a commit; return the deleted steps.

    Kept: the newest complete checkpoint (always), the ``keep_last_n`` newest complete ones, and the
    best complete one by ``keep_best = (metric, "min" | "max")``. Incomplete directories older than
    the newest complete checkpoint are leftovers of crashed saves and are removed; newer incomplete
    ones may be a save in flight and are left alone.
    """
    infos = list_checkpoints(root, level="none")
    complete = [c for c in infos if c.complete]
    if not complete:
        return []
    newest = complete[-1].step
    keep = {newest}
    if keep_last_n is None:
        keep |= {c.step for c in complete}
    else:
        keep |= {c.step for c in complete[-max(1, keep_last_n):]}
    if keep_best is not None:
        metric, mode = keep_best
        scored = [c for c in complete if metric in c.marker.metrics]
        if scored:
            pick = min if mode == "min" else max
            keep.add(pick(scored, key=lambda c: c.marker.metrics[metric]).step)
    deleted = []
    for c in infos:
        if c.step in keep or (not c.complete and c.step > newest):
            continue
        remove_checkpoint(c.path)
        deleted.append(c.step)
    return deleted
