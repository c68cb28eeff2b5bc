"""Reading checkpoints without executing their contents, and refusing another model's checkpoint.

Three places could unpickle data from disk; each is restricted:

- DCP's ``.metadata`` index is a pickle: :class:`SafeFileSystemReader` reads it with an
  unpickler that only resolves DCP's own metadata classes and torch's ``Size``/dtype/layout;
- DCP's non-tensor values (optimizer hyper-parameters) go through ``torch.load``:
  :class:`SafeLoadPlanner` calls it with ``weights_only=True``;
- the per-rank files are read with ``torch.load(..., weights_only=True)``.

:func:`check_compatible` compares the checkpoint's tensor names and global shapes with the model
being restored and raises one error listing every mismatch before any state is modified.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any, Mapping

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint._traverse import set_element  # the helper DefaultLoadPlanner itself uses

from shardwise.checkpoint.reshard import source_rank
from shardwise.errors import ConfigError

_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
            ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}
_MAX_LISTED = 20


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (module in _ALLOWED_MODULES or (module, name) in _ALLOWED
                   or (module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))))
        if not allowed:
            raise ConfigError(f"checkpoint metadata refers to {module}.{name}, which a checkpoint index never contains",
                              hint="the file is corrupt or not a shardwise/DCP checkpoint; it was not loaded")
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, with the ``.metadata`` pickle read by a restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _RestrictedUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise ConfigError(f"{path} is not a DCP checkpoint index")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values are read with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


_NDARRAY = "__shardwise_ndarray__"


def encode_for_weights_only(obj: Any) -> Any:
    """Replace NumPy arrays (e.g. in ``np.random.get_state()``) by tagged tensors, recursively, so
    the per-rank file loads with ``weights_only=True`` without allow-listing NumPy's unpickler."""
    if isinstance(obj, np.ndarray):
        return {_NDARRAY: torch.from_numpy(np.ascontiguousarray(obj).view(np.uint8).copy()), "dtype": obj.dtype.str, "shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: encode_for_weights_only(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(encode_for_weights_only(v) for v in obj)
    return obj


def decode_weights_only(obj: Any) -> Any:
    if isinstance(obj, dict):
        if _NDARRAY in obj:
            return obj[_NDARRAY].numpy().view(np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
        return {k: decode_weights_only(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(decode_weights_only(v) for v in obj)
    return obj


def load_rank_file(rank_dir: str, *, rank: int, saved_world: int) -> dict[str, Any]:
    """This rank's small state (see :func:`shardwise.checkpoint.reshard.source_rank`)."""
    path = os.path.join(rank_dir, f"rank_{source_rank(rank, saved_world):05d}.pt")
    try:
        return decode_weights_only(torch.load(path, weights_only=True, map_location="cpu"))
    except FileNotFoundError:
        raise ConfigError(f"checkpoint file {path} is missing") from None


def check_compatible(metadata: Metadata, state: Mapping[str, Any], saved_components: Mapping[str, Any],
                     components: Mapping[str, Any], *, path: str, model_names: set[str] | None = None,
                     saved_param_groups: Any = None) -> None:
    """Raise one ``ConfigError`` listing every name/shape mismatch between checkpoint and model.

    ``model_names``: the model's names over all ranks (pipeline stages hold only their own), used
    to decide which checkpoint tensors are unexpected; defaults to this rank's names."""
    saved = metadata.state_dict_metadata
    problems: list[str] = []
    model_state = state.get("model", {})
    saved_model = {k[len("model."):]: v for k, v in saved.items() if k.startswith("model.")}
    for name, value in model_state.items():
        if not isinstance(value, torch.Tensor):
            continue
        meta = saved_model.get(name)
        if meta is None:
            problems.append(f"missing in checkpoint: {name} {tuple(value.shape)}")
        elif hasattr(meta, "size") and tuple(meta.size) != tuple(value.shape):
            problems.append(f"shape of {name}: checkpoint {tuple(meta.size)}, model {tuple(value.shape)}")
    for name, meta in saved_model.items():
        if name not in (model_names if model_names is not None else model_state):
            problems.append(f"unexpected in checkpoint: {name} {tuple(getattr(meta, 'size', ()))}")
    if "optim" in state and saved_param_groups is None:
        problems.append("the checkpoint has no optimizer state")
    for name in components:
        if name not in saved_components:
            problems.append(f"component {name!r} is not in the checkpoint (it has {sorted(saved_components)})")
    if problems:
        listed = "; ".join(problems[:_MAX_LISTED]) + (f"; ... {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else "")
        raise ConfigError(f"checkpoint {path} does not match this model ({len(problems)} mismatches): {listed}",
                          hint="load a checkpoint of the same model; nothing was modified")
