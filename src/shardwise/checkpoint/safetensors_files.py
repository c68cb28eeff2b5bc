"""The tensors of a Hugging Face model directory, read by region, and the checkpoints
``transformers`` converts on load.

:class:`SafetensorsFiles` maps every key to its file (``model.safetensors`` or the shards named in
``model.safetensors.index.json``) and reads a region of one tensor with
``safe_open(...).get_slice(key)[region]``: only those bytes. :func:`conversions` follows
transformers' own conversion table for a model type (renames; per-expert tensors stacked along
dim 0; pieces concatenated), and :func:`read_merged` reads a region of such a merged tensor from
the per-expert pieces without reading anything outside it. Used by :mod:`shardwise.checkpoint.hf_load`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from shardwise.errors import ConfigError

Region = tuple[slice, ...]


class SafetensorsFiles:
    """The tensors of a model directory, by key, read by region (module doc)."""

    def __init__(self, directory: str) -> None:
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as fh:
                files = {key: os.path.join(directory, name) for key, name in json.load(fh)["weight_map"].items()}
        else:
            names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
            if not names:
                raise ConfigError(
                    f"{directory!r} holds no *.safetensors weights", hint="save the model with save_pretrained(dir)"
                )
            from safetensors import safe_open

            files = {}
            for name in names:
                with safe_open(os.path.join(directory, name), framework="pt") as f:
                    files.update({key: os.path.join(directory, name) for key in f.keys()})
        self.directory, self.files = directory, files
        self._open: dict[str, Any] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> SafetensorsFiles:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle(key).get_slice(key).get_shape())

    def read(self, key: str, region: Region | None = None) -> torch.Tensor:
        part = self._handle(key).get_slice(key)
        return part[region] if region is not None else part[:]

    def _handle(self, key: str) -> Any:
        path = self.files[key]
        if path not in self._open:
            from safetensors import safe_open

            self._open[path] = self._stack.enter_context(safe_open(path, framework="pt"))
        return self._open[path]


@dataclass(frozen=True)
class Merged:
    """A target tensor transformers builds by stacking experts (dim 0) and concatenating pieces."""

    pieces: tuple[tuple[str, ...], ...]  # pieces[i][e]: the checkpoint key of piece i of expert e
    cat_dim: int | None  # the target dim the pieces are concatenated along (None: one piece)


def conversions(model_type: str, keys: Sequence[str]) -> tuple[dict[str, str], dict[str, Merged]]:
    """Module key -> checkpoint key (renamed), and module key -> merged sources, following
    transformers' conversion table for ``model_type`` (renames, expert stacking, concatenation)."""
    from transformers.conversion_mapping import (
        Concatenate,
        MergeModulelist,
        WeightConverter,
        WeightRenaming,
        get_checkpoint_conversion_mapping,
    )

    renamed = {key: key for key in keys}
    merged: dict[str, Merged] = {}
    for rule in get_checkpoint_conversion_mapping(model_type) or []:
        if isinstance(rule, WeightRenaming):
            for src, dst in zip(rule.source_patterns, rule.target_patterns):
                renamed = {re.sub(src, dst, new): old for new, old in renamed.items()}
        elif isinstance(rule, WeightConverter):
            ops = list(rule.operations)
            cat = next((op.dim for op in ops if isinstance(op, Concatenate)), None)
            if (
                not ops
                or not isinstance(ops[0], MergeModulelist)
                or ops[0].dim != 0
                or len(ops) > 1 + (cat is not None)
            ):
                continue  # not a layout we assemble; such a key is reported missing if the model needs it
            found: dict[str, list[dict[int, str]]] = {}
            for i, pattern in enumerate(rule.source_patterns):
                regex = re.compile(re.escape(pattern).replace(r"\*", r"(\d+)") + "$")
                for new, old in renamed.items():
                    m = regex.search(new)
                    if m:
                        target = new[: m.start()] + rule.target_patterns[0]
                        found.setdefault(target, [{} for _ in rule.source_patterns])[i][int(m.group(1))] = old
            for target, pieces in found.items():
                merged[target] = Merged(tuple(tuple(p[e] for e in sorted(p)) for p in pieces), cat)
    return {new: old for new, old in renamed.items()}, merged


def merged_shape(files: SafetensorsFiles, spec: Merged) -> tuple[int, ...]:
    """One expert's shape after concatenating its pieces."""
    shapes = [files.shape(piece[0]) for piece in spec.pieces]
    if spec.cat_dim is None:
        return shapes[0]
    d = spec.cat_dim - 1
    return (*shapes[0][:d], sum(s[d] for s in shapes), *shapes[0][d + 1:])


def read_merged(files: SafetensorsFiles, spec: Merged, region: Region) -> torch.Tensor:
    """``region`` of stack(experts) / cat(pieces) without reading anything outside it."""
    experts = range(*region[0].indices(len(spec.pieces[0])))
    rows = []
    for e in experts:
        parts = []
        offset = 0
        for piece in spec.pieces:
            key = piece[e]
            shape = files.shape(key)
            sub = list(region[1:])
            if spec.cat_dim is not None:
                d = spec.cat_dim - 1  # the dim inside one expert's tensor
                lo, hi, _ = region[spec.cat_dim].indices(10**18)
                lo, hi = max(lo - offset, 0), min(hi - offset, shape[d])
                offset += shape[d]
                if lo >= hi:
                    continue
                sub[d] = slice(lo, hi)
            parts.append(files.read(key, tuple(sub)))
        rows.append(torch.cat(parts, dim=spec.cat_dim - 1) if spec.cat_dim is not None else parts[0])
    return torch.stack(rows)
