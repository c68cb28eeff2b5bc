"""Reading checkpoints without executing their contents, and refusing another model's checkpoint.

Three places could unpickle data from disk; each is restricted:

- DCP's ``.metadata`` index is a pickle: :class:`SafeFileSystemReader` reads it with an
  unpickler that only resolves DCP's own metadata classes and torch's ``Size``/dtype/layout;
- DCP's non-tensor values (optimizer hyper-parameters) go through ``torch.load``:
  :class:`SafeLoadPlanner` calls it with ``weights_only=True``;
- the per-rank files are read with ``torch.load(..., weights_only=True)``;
- DCP's tensor shards (``__<rank>_0.distcp``) are read by DCP with ``weights_only=True`` too;
  :class:`SafeFileSystemReader` turns a refusal into one line naming the file.

A file that passes its checksum can still have been replaced (the marker rewritten to match), so a
refusal is reported as a bad file, never with torch's advice to retry with ``weights_only=False``.

:func:`check_compatible` compares the checkpoint's tensor names and global shapes with the model
being restored and raises one error listing every mismatch before any state is modified.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import re
import warnings
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future
from torch.distributed.checkpoint._traverse import set_element  # the helper DefaultLoadPlanner itself uses

from shardwise.checkpoint.reshard import source_rank
from shardwise.errors import ConfigError, ShardwiseError

_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
            ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}
_MAX_LISTED = 20


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module in _ALLOWED_MODULES
            or (module, name) in _ALLOWED
            or (
                module == "torch"
                and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))
            )
        )
        if not allowed:
            raise ConfigError(f"checkpoint metadata refers to {module}.{name}, which a checkpoint index never contains",
                              hint="the file is corrupt or not a shardwise/DCP checkpoint; it was not loaded")
        return super().find_class(module, name)


@contextmanager
def _untrusted_load() -> Iterator[None]:
    """Silence torch's warning about an unusual pickle protocol: it is printed for exactly the
    files about to be refused, as extra lines before the one-line error."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
        yield


def refused_file(path: str, err: BaseException, *, kind: str = "tensor file") -> ConfigError:
    """The one-line error for a checkpoint file that cannot be read or parsed safely (replaced,
    truncated or random bytes). torch's own message for a refused pickle is several paragraphs
    that suggest ``weights_only=False``, which would run whatever code the file carries."""
    if isinstance(err, OSError):
        return ConfigError(f"checkpoint file {path} cannot be read: {err.strerror or err}",
                           hint="check the path and its permissions")
    found = re.search(r"GLOBAL ([\w.]+)", str(err))
    what = f"refers to {found.group(1)}, which no checkpoint contains" if found else f"is not a readable {kind}"
    return ConfigError(f"checkpoint file {path} {what}; it was not loaded",
                       hint="the file is corrupt or was replaced: restore it, or load another step")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, with the ``.metadata`` pickle read by a restricted unpickler and a shard
    that is not plain tensor data refused in one line naming the file."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _RestrictedUnpickler(f).load()
        except ShardwiseError:
            raise
        except Exception as err:  # noqa: BLE001 - truncated or random bytes: a bad file
            raise refused_file(str(path), err, kind="checkpoint index") from None
        if not isinstance(metadata, Metadata):
            raise ConfigError(f"{path} is not a DCP checkpoint index",
                              hint="the file is corrupt or was replaced: restore it, or load another step")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's read, one shard file at a time, so a refused file is named in the error."""
        by_file: dict[str, list[Any]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in by_file.items():
            try:
                with _untrusted_load():
                    super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except ShardwiseError:
                raise
            except Exception as err:  # noqa: BLE001 - any failure to parse a shard means a bad file
                raise refused_file(os.path.join(str(self.path), relative_path), err) from None
        done: Future[None] = Future()
        done.set_result(None)
        return done


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values are read with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_load(state: dict[str, Any], reader: SafeFileSystemReader, *, process_group: Any = None, no_dist: bool) -> None:
    """``dcp.load`` with :class:`SafeLoadPlanner`, and its errors as the user should see them.

    DCP wraps every rank's exception in a ``CheckpointException`` (even in one process), whose
    text is each rank's traceback: a :class:`ShardwiseError` among them (a refused file) is raised
    as itself. One process also skips DCP's warning that it assumes one process, which is the
    intent here."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(
                state, storage_reader=reader, planner=SafeLoadPlanner(), process_group=process_group, no_dist=no_dist
            )
    except CheckpointException as err:
        found = next((exc for exc, _trace in err.failures.values() if isinstance(exc, ShardwiseError)), None)
        if found is None:
            raise
        raise found from None


_NDARRAY = "__shardwise_ndarray__"


def encode_for_weights_only(obj: Any) -> Any:
    """Replace NumPy arrays (e.g. in ``np.random.get_state()``) by tagged tensors, recursively, so
    the per-rank file loads with ``weights_only=True`` without allow-listing NumPy's unpickler."""
    if isinstance(obj, np.ndarray):
        return {
            _NDARRAY: torch.from_numpy(np.ascontiguousarray(obj).view(np.uint8).copy()),
            "dtype": obj.dtype.str,
            "shape": list(obj.shape),
        }
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
        with _untrusted_load():
            payload = torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise ConfigError(f"checkpoint file {path} is missing") from None
    except Exception as err:  # noqa: BLE001 - any failure to parse the file means a bad file
        raise refused_file(path, err) from None
    if not isinstance(payload, dict) or not isinstance(payload.get("components"), dict):
        raise refused_file(path, ValueError("not a per-rank state file"))
    return decode_weights_only(payload)


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
        listed = "; ".join(problems[:_MAX_LISTED]) + (
            f"; ... {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        )
        raise ConfigError(f"checkpoint {path} does not match this model ({len(problems)} mismatches): {listed}",
                          hint="load a checkpoint of the same model; nothing was modified")
