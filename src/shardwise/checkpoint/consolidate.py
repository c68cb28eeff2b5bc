"""Consolidate a sharded checkpoint's model weights into one safetensors file, streaming.

For each tensor of the model, DCP reads just the chunks that make up that tensor (from all ranks'
shard files) into one full tensor, which is written to the output and dropped before the next
one is read: peak memory is the largest single tensor, not the model, and no process group is
needed. The names are the plain single-device FQNs (``get_state_dict`` already removed DDP/FSDP
wrapper prefixes), so the file loads into the unwrapped model with ``load_state_dict``. Tensors are
written in name order (numbers compared as numbers), so the same weights give the same bytes
whichever layout (DP, ZeRO, TP, any pipeline) wrote the checkpoint.

The output is the standard safetensors layout (little-endian u64 header size, JSON header of
``{name: {dtype, shape, data_offsets}}`` padded to 8 bytes, then the raw tensor bytes in header
order); it is written with the header computed up front from DCP's index so tensors can be
appended one by one, which the safetensors library's ``save_file`` (all tensors in memory) cannot.
"""

from __future__ import annotations

import json
import os
import re
import struct
from typing import Any

import torch

from shardwise.checkpoint import commit as cm
from shardwise.checkpoint.safe_io import SafeFileSystemReader, safe_load
from shardwise.config import check_output_file
from shardwise.errors import ConfigError

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64", torch.int64: "I64",
           torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def resolve_step_dir(directory: str, step: int | None = None) -> str:
    """A complete, verified step directory: ``directory`` itself if it is one, else its newest (or ``step``).

    A step directory given directly is checked like one found under the root (sizes and
    checksums against its marker): a truncated shard must fail here, in one line, not inside DCP.
    """
    marker = cm.read_marker(directory)
    if marker is not None:
        if step is not None and step != marker.step:
            raise ConfigError(f"{directory} is the checkpoint of step {marker.step}, not --step {step}",
                              hint="pass the checkpoint root with --step, or omit --step")
        return _verified(directory)
    if step is not None:
        return _verified(os.path.join(directory, cm.step_dirname(step)))
    info = cm.latest_complete(directory)
    if info is None:
        raise ConfigError(
            f"no complete checkpoint in {directory}", hint="check the path with 'shardwise checkpoint inspect'"
        )
    return info.path


def _verified(path: str) -> str:
    marker, reason = cm.verify(path)
    if marker is None:
        raise ConfigError(
            f"checkpoint {path} cannot be used: {reason}", hint="check it with 'shardwise checkpoint inspect'"
        )
    return path


def check_output(out_path: str, step_path: str) -> None:
    """Refuse an output that cannot be written, or that would overwrite checkpoint files, before
    any tensor is read (a late failure would waste the work and could leave a partial file)."""
    check_output_file(out_path, option="output")
    real = os.path.realpath(out_path)
    inside = _enclosing_checkpoint(os.path.dirname(real))
    if inside is not None or real == os.path.realpath(os.path.join(os.path.dirname(step_path), cm.LATEST)):
        raise ConfigError(f"output {out_path} lies inside the checkpoint {inside or os.path.dirname(step_path)}",
                          hint="write the consolidated file outside every step directory")


def _enclosing_checkpoint(directory: str) -> str | None:
    """The nearest directory at or above ``directory`` that holds a commit marker (a step directory)."""
    while True:
        if os.path.exists(os.path.join(directory, cm.MARKER)):
            return directory
        parent = os.path.dirname(directory)
        if parent == directory:
            return None
        directory = parent


def consolidate(
    directory: str, out_path: str, *, step: int | None = None, prefix: str = "model."
) -> dict[str, tuple[int, ...]]:
    """Write the model weights of a checkpoint to ``out_path``; returns ``{name: shape}``."""
    path = resolve_step_dir(directory, step)
    check_output(out_path, path)
    metadata = SafeFileSystemReader(path).read_metadata()
    # DCP's index lists tensors in the order the ranks' save plans arrived, which depends on the
    # layout that wrote the checkpoint; a fixed order makes the file the same whichever one did.
    entries = sorted(((key, meta) for key, meta in metadata.state_dict_metadata.items()
                      if key.startswith(prefix) and hasattr(meta, "size")), key=lambda entry: natural_key(entry[0]))
    if not entries:
        raise ConfigError(f"checkpoint {path} holds no model tensors")
    blob = _header(entries, prefix, source=os.path.basename(path))
    tmp = f"{out_path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for key, meta in entries:
                tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
                safe_load({key: tensor}, SafeFileSystemReader(path), no_dist=True)
                f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
                del tensor
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out_path)  # a reader never sees a half-written file
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)  # a failed or interrupted export leaves nothing behind
        raise
    return {key[len(prefix):]: tuple(meta.size) for key, meta in entries}


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key of a dotted name with numbers compared as numbers (``blocks.2`` before ``blocks.10``)."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part)


def _header(entries: list[tuple[str, Any]], prefix: str, *, source: str) -> bytes:
    """The safetensors JSON header (padded to 8 bytes), computed from DCP's index alone."""
    header: dict[str, object] = {"__metadata__": {"format": "pt", "source": source}}
    offset = 0
    for key, meta in entries:
        dtype = meta.properties.dtype
        if dtype not in _DTYPES:
            raise ConfigError(f"tensor {key} has dtype {dtype}, which safetensors cannot store")
        nbytes = torch.Size(meta.size).numel() * torch.empty((), dtype=dtype).element_size()
        header[key[len(prefix) :]] = {
            "dtype": _DTYPES[dtype],
            "shape": list(meta.size),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    return blob + b" " * (-len(blob) % 8)
