"""What is in a checkpoint directory: steps, complete or not (and why), plan, tensors and sizes."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from shardwise.checkpoint import commit as cm
from shardwise.checkpoint.safe_io import SafeFileSystemReader
from shardwise.errors import ConfigError


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    chunks: int  # how many shards it was saved as


def tensors(step_path: str) -> list[TensorEntry]:
    """The tensors of one step directory, from DCP's index (no tensor data is read)."""
    out = []
    for name, meta in SafeFileSystemReader(step_path).read_metadata().state_dict_metadata.items():
        if not hasattr(meta, "size"):
            continue
        dtype = meta.properties.dtype
        nbytes = torch.Size(meta.size).numel() * torch.empty((), dtype=dtype).element_size()
        out.append(TensorEntry(name, tuple(meta.size), str(dtype).replace("torch.", ""), nbytes, len(meta.chunks)))
    return out


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


def _pointer(directory: str) -> str:
    """What the ``latest`` file names ("-" when absent, "?" when it is not a readable text file):
    only a convenience, so a damaged one must not stop the listing."""
    path = os.path.join(directory, cm.LATEST)
    if not os.path.exists(path):
        return "-"
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read(200).strip() or "?"
    except (OSError, UnicodeDecodeError):
        return "?"


def report(
    directory: str, *, step: int | None = None, show_tensors: bool = True, verify: cm.Verify = "checksum"
) -> str:
    """A human-readable listing of ``directory`` (the text ``shardwise checkpoint inspect`` prints)."""
    if not os.path.isdir(directory):
        raise ConfigError(
            f"{directory} is not a directory", hint="pass the checkpoint directory (the one holding step_* directories)"
        )
    infos = cm.list_checkpoints(directory, level=verify)
    if not infos:
        raise ConfigError(f"no checkpoints in {directory} (no step_* directories)",
                          hint="pass the checkpoint directory, e.g. runs/NAME/checkpoints")
    if step is not None and step not in {c.step for c in infos}:
        raise ConfigError(f"no step {step} in {directory} (steps: {', '.join(str(c.step) for c in infos)})")
    lines = [f"{directory}  (latest -> {_pointer(directory)})",
             f"{'step':>10}  {'status':<10} {'world':>5} {'dp':>3}  {'size':>10}  plan / metrics"]
    for c in infos:
        if c.complete:
            m = c.marker
            size = sum(f["size"] for f in m.files.values())
            metrics = " ".join(f"{k}={v:.4g}" for k, v in sorted(m.metrics.items()))
            lines.append(
                (
                    f"{c.step:>10}  {'complete':<10} {m.world_size:>5} {m.dp_size:>3}  "
                    f"{_size(size):>10}  {m.plan or '-'} {metrics}"
                ).rstrip()
            )
        else:
            lines.append(f"{c.step:>10}  {'INCOMPLETE':<10} {'':>5} {'':>3}  {'':>10}  {c.reason}")
    complete = [c for c in infos if c.complete]
    chosen = next(c for c in infos if c.step == step) if step is not None else (complete[-1] if complete else None)
    if show_tensors and step is not None and not chosen.complete:
        raise ConfigError(
            f"step {step} in {directory} is not complete: {chosen.reason}",
            hint="its tensors cannot be listed; omit --step",
        )
    if show_tensors and chosen is not None and chosen.complete:
        entries = tensors(chosen.path)
        lines.append(f"\ntensors of step {chosen.step} ({len(entries)}, {_size(sum(e.nbytes for e in entries))}):")
        width = max(len(e.name) for e in entries) if entries else 10
        for e in entries:
            lines.append(
                f"  {e.name:<{width}}  {str(list(e.shape)):<16} {e.dtype:<9} {_size(e.nbytes):>10}  {e.chunks} shard(s)"
            )
    return "\n".join(lines)
