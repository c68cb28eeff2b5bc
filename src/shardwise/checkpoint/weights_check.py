"""A Hugging Face model directory's weights checked before anything reads them: one line per problem.

What is checked, reading only the files' headers (the first ``8 + N`` bytes of each, never a tensor):

- **the files**: ``model.safetensors``, or every shard ``model.safetensors.index.json`` names, exists;
- **each file is whole**: a safetensors file is an 8-byte little-endian header length ``N``, ``N``
  bytes of JSON (each tensor's ``dtype``, ``shape`` and ``data_offsets`` ``[begin, end)`` into the
  data that follows), then the data. A whole file has exactly ``8 + N + max(end)`` bytes, and each
  tensor's ``end - begin`` is ``prod(shape) * itemsize(dtype)``. A truncated copy, an interrupted
  download, or a file that is not safetensors at all fails here, naming the file (and the tensor);
- **the index**: every tensor it maps to a file is in that file's header;
- **the shapes** (given the model built on meta from ``config.json``): every parameter stored under
  its own name (or a name transformers renames it from) has the shape the config gives it, and
  every parameter has weights somewhere (a tied head may borrow the embedding's).

Used by ``shardwise train --model.hf`` (so also by a resumed run), ``generate`` and ``checkpoint
export`` before any process starts, and by :func:`~shardwise.checkpoint.hf_load.load_parallel`
(``Pretrained(DIR)``) before it allocates anything.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

from shardwise.errors import ConfigError

INDEX = "model.safetensors.index.json"
ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}  # sub-byte dtypes: no size check
_RESAVE = "download or save it again (save_pretrained), or restore it from a good copy"


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors header."""

    file: str
    dtype: str
    shape: tuple[int, ...]


def read_header(path: str) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file, after checking that the file is whole (module doc)."""
    name = os.path.basename(path)
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if n is None or 8 + n > size:
            raise ConfigError(
                f"{path} is truncated or not a safetensors file ({size} bytes, too few for its header)", hint=_RESAVE
            )
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict):
        raise ConfigError(f"{path} is corrupt: its header is not a JSON object", hint=_RESAVE)
    tensors, end = {}, 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, stop) = str(info["dtype"]), tuple(int(d) for d in info["shape"]), info["data_offsets"]
            begin, stop = int(begin), int(stop)
        except (KeyError, TypeError, ValueError):
            raise ConfigError(
                f"{path} is corrupt: the header entry of tensor {key!r} is not dtype, shape and data_offsets",
                hint=_RESAVE,
            ) from None
        expected = math.prod(shape) * ITEMSIZE[dtype] if dtype in ITEMSIZE else None
        if begin < 0 or stop < begin or (expected is not None and stop - begin != expected):
            raise ConfigError(
                f"{path} is corrupt: tensor {key!r} ({dtype}, shape {list(shape)}) has data_offsets [{begin}, {stop}]",
                hint=_RESAVE,
            )
        tensors[key], end = StoredTensor(name, dtype, shape), max(end, stop)
    if size != 8 + n + end:
        how = "truncated" if size < 8 + n + end else "longer than its header describes"
        raise ConfigError(f"{path} is {how}: it has {size} bytes, its header describes {8 + n + end}", hint=_RESAVE)
    return tensors


def stored_tensors(directory: str) -> dict[str, StoredTensor]:
    """Every tensor of the directory's weights, by key, each file checked (module doc)."""
    index = os.path.join(directory, INDEX)
    if not os.path.exists(index):
        names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
        if not names:
            raise ConfigError(
                f"{directory!r} holds no *.safetensors weights", hint="save the model with save_pretrained(dir)"
            )
        return {key: t for name in names for key, t in read_header(os.path.join(directory, name)).items()}
    try:
        with open(index) as fh:
            weight_map = json.load(fh)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise ConfigError(
            f"{index} is not a safetensors index (a JSON object with a \"weight_map\")", hint=_RESAVE
        ) from None
    by_file: dict[str, list[str]] = {}
    for key, name in weight_map.items():
        by_file.setdefault(str(name), []).append(key)
    tensors: dict[str, StoredTensor] = {}
    for name, keys in by_file.items():
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise ConfigError(f"{path} is missing: {INDEX} names it for {len(keys)} tensor(s), e.g. {keys[0]!r}",
                              hint="copy every shard the index names into the directory (an interrupted download?)")
        header = read_header(path)
        absent = [k for k in keys if k not in header]
        if absent:
            raise ConfigError(f"{path} lacks tensor {absent[0]!r}, which {INDEX} places there", hint=_RESAVE)
        tensors.update({k: header[k] for k in keys})
    return tensors


def check_weights(directory: str, model: Any = None) -> dict[str, StoredTensor]:
    """Check the directory's weights (module doc); with ``model`` (built on meta from the directory's
    config, LoRA adapters allowed) also the shapes. Returns the stored tensors by key."""
    tensors = stored_tensors(directory)
    if model is not None:
        check_shapes(directory, tensors, model)
    return tensors


def check_shapes(directory: str, tensors: dict[str, StoredTensor], model: Any) -> None:
    """Each parameter of ``model`` against the stored tensor it is read from (module doc)."""
    from shardwise.checkpoint.safetensors_files import conversions
    from shardwise.models.lora import base_key

    model_type = str(getattr(getattr(model, "config", None), "model_type", "") or "")
    keys, merged = conversions(model_type, list(tensors)) if model_type else ({k: k for k in tensors}, {})
    aliases = tied_aliases(model)
    missing = []
    for name, param in model.named_parameters():
        if not param.is_meta:  # LoRA adapters: made, not read
            continue
        candidates = [base_key(c) for c in (name, *aliases.get(name, ()))]
        key = next((keys[c] for c in candidates if c in keys), None)
        if key is None:
            if not any(c in merged for c in candidates):
                missing.append(name)
            continue
        stored = tensors[key]
        if stored.shape != tuple(param.shape):
            raise ConfigError(
                f"{os.path.join(directory, stored.file)}: tensor {key!r} has shape {list(stored.shape)}, but the model "
                f"that config.json describes needs {list(param.shape)}",
                hint="the weights and config.json are of different models; keep the config.json saved with the weights",
            )
    if missing:
        raise ConfigError(
            f"{directory} has no weights for {len(missing)} parameter(s) of the model, e.g. {missing[0]!r}",
            hint="load a checkpoint of the same model class and config (save_pretrained writes one)",
        )


def tied_aliases(model: Any) -> dict[str, tuple[str, ...]]:
    """For each parameter name, its other names (a head tied to the token embedding)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return {name: tuple(n for n in names if n != name) for names in groups.values() if len(names) > 1 for name in names}
