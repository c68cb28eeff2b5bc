"""Consolidate a sharded checkpoint's model weights into one safetensors file, streaming.

For each tensor of the model, DCP reads just the chunks that make up that tensor (from all ranks'
shard files) into one full tensor, which is written to the output and dropped before the next
one is read: peak memory is the largest single tensor, not the model, and no process group is
needed. The names are the plain single-device FQNs (``get_state_dict`` already removed DDP/FSDP
wrapper prefixes), so the file loads into the unwrapped model with ``load_state_dict``.

The output is the standard safetensors layout (little-endian u64 header size, JSON header of
``{name: {dtype, shape, data_offsets}}`` padded to 8 bytes, then the raw tensor bytes in header
order); it is written with the header computed up front from DCP's index so tensors can be
appended one by one, which the safetensors library's ``save_file`` (all tensors in memory) cannot.
"""

from __future__ import annotations

import json
import os
import struct

import torch
import torch.distributed.checkpoint as dcp

from shardwise.checkpoint import commit as cm
from shardwise.checkpoint.safe_io import SafeFileSystemReader, SafeLoadPlanner
from shardwise.errors import ConfigError

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64", torch.int64: "I64",
           torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def resolve_step_dir(directory: str, step: int | None = None) -> str:
    """A complete step directory: ``directory`` itself if it is one, else its newest (or ``step``)."""
    if cm.read_marker(directory) is not None:
        return directory
    if step is not None:
        path = os.path.join(directory, cm.step_dirname(step))
        marker, reason = cm.verify(path)
        if marker is None:
            raise ConfigError(f"checkpoint {path} cannot be used: {reason}")
        return path
    info = cm.latest_complete(directory)
    if info is None:
        raise ConfigError(f"no complete checkpoint in {directory}", hint="check the path with 'shardwise checkpoint inspect'")
    return info.path


def consolidate(directory: str, out_path: str, *, step: int | None = None, prefix: str = "model.") -> dict[str, tuple[int, ...]]:
    """Write the model weights of a checkpoint to ``out_path``; returns ``{name: shape}``."""
    path = resolve_step_dir(directory, step)
    reader = SafeFileSystemReader(path)
    metadata = reader.read_metadata()
    entries = [(key, meta) for key, meta in metadata.state_dict_metadata.items() if key.startswith(prefix) and hasattr(meta, "size")]
    if not entries:
        raise ConfigError(f"checkpoint {path} holds no model tensors")
    header: dict[str, object] = {"__metadata__": {"format": "pt", "source": os.path.basename(path)}}
    offset = 0
    for key, meta in entries:
        dtype = meta.properties.dtype
        if dtype not in _DTYPES:
            raise ConfigError(f"tensor {key} has dtype {dtype}, which safetensors cannot store")
        nbytes = torch.Size(meta.size).numel() * torch.empty((), dtype=dtype).element_size()
        header[key[len(prefix):]] = {"dtype": _DTYPES[dtype], "shape": list(meta.size), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = f"{out_path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for key, meta in entries:
            tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
            dcp.load({key: tensor}, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=True)
            f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            del tensor
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out_path)  # a reader never sees a half-written file
    return {key[len(prefix):]: tuple(meta.size) for key, meta in entries}
