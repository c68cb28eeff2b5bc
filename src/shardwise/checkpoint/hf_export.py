"""Weights out: a sharded checkpoint as a Hugging Face model directory.

``shardwise checkpoint export --format hf CKPT OUT`` writes ``OUT/config.json`` (and the
tokenizer and generation files, when the run kept them) plus the model's tensors as safetensors
shards (``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json`` past ``max_shard_bytes``), which ``transformers``'
``AutoModelForCausalLM.from_pretrained(OUT)`` loads.

The tensors are read with DCP from every rank's shard files, one output shard at a time, so peak
memory is one output shard (default at most 2 GiB), never the model; no process group is needed.
Names are the model's own (``model.layers.0.self_attn.q_proj.weight``: DCP's ``model.`` prefix is
removed), in the layout the module holds them (transformers 5 loads its fused expert tensors as
they are); a weight that tensor parallelism held in a split view (a fused q|k|v as (in, 3, H)) is
written in the model's own shape, read off the config's model built on meta. A weight held under two names (a tied
head a pipeline stage kept as ``lm_head.weight``)
is written once, under the name ``transformers`` ties the other to.

Where the config comes from: ``--model DIR`` (the directory the run started from), or the copy
:func:`keep_model_files` left in ``CKPT/hf/`` when training began.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from shardwise.checkpoint.consolidate import resolve_step_dir
from shardwise.checkpoint.safe_io import SafeFileSystemReader, SafeLoadPlanner
from shardwise.errors import ConfigError

HF_DIR = "hf"  # inside a checkpoint directory: the config and tokenizer of the model trained
_KEEP = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def keep_model_files(model_dir: str, checkpoint_dir: str) -> None:
    """Copy the config and tokenizer files of ``model_dir`` into ``checkpoint_dir/hf/`` (what
    the export needs besides the tensors). Rank 0 calls it once when training starts."""
    target = os.path.join(checkpoint_dir, HF_DIR)
    os.makedirs(target, exist_ok=True)
    for name in _KEEP:
        source = os.path.join(model_dir, name)
        if os.path.exists(source):
            shutil.copyfile(source, os.path.join(target, name))


def _config_dir(checkpoint_dir: str, model_dir: str | None) -> str:
    for candidate in ([model_dir] if model_dir else []) + [
        os.path.join(checkpoint_dir, HF_DIR),
        os.path.join(os.path.dirname(os.path.abspath(checkpoint_dir)), HF_DIR),
    ]:
        if candidate and os.path.exists(os.path.join(candidate, "config.json")):
            return candidate
    raise ConfigError(f"no Hugging Face config.json for checkpoint {checkpoint_dir}",
                      hint="pass --model DIR (the model directory the run started from)")


def _tied_duplicates(config: dict[str, Any], names: set[str]) -> set[str]:
    """Names not to write: ``lm_head.weight`` when the config ties it to the embedding that is written."""
    tied = config.get("tie_word_embeddings", config.get("model_type") == "gpt2")
    if not tied:
        return set()
    return (
        {n for n in names if n.endswith("lm_head.weight")} if any("embed" in n or "wte" in n for n in names) else set()
    )


def export_hf(checkpoint_dir: str, out_dir: str, *, step: int | None = None, model_dir: str | None = None,
              max_shard_bytes: int = 2 * 1024**3) -> dict[str, tuple[int, ...]]:
    """Write the model of a checkpoint to ``out_dir`` in the Hugging Face layout; returns ``{name: shape}``."""
    from safetensors.torch import save_file

    path = resolve_step_dir(checkpoint_dir, step)
    source = _config_dir(checkpoint_dir, model_dir)
    with open(os.path.join(source, "config.json")) as fh:
        config = json.load(fh)
    metadata = SafeFileSystemReader(path).read_metadata()
    prefix = "model."
    entries = {key[len(prefix):]: (key, meta) for key, meta in metadata.state_dict_metadata.items()
               if key.startswith(prefix) and hasattr(meta, "size")}
    if not entries:
        raise ConfigError(f"checkpoint {path} holds no model tensors")
    for name in _tied_duplicates(config, set(entries)):
        del entries[name]
    shapes = _model_shapes(source)
    shards: list[list[str]] = [[]]
    size = 0
    for name, (_, meta) in entries.items():
        nbytes = torch.Size(meta.size).numel() * torch.empty((), dtype=meta.properties.dtype).element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    os.makedirs(out_dir, exist_ok=True)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    total = 0
    for names, file in zip(shards, files):
        state = {
            entries[n][0]: torch.empty(tuple(entries[n][1].size), dtype=entries[n][1].properties.dtype) for n in names
        }
        dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=True)
        tensors = {n: _as(state[entries[n][0]], shapes.get(n)).contiguous() for n in names}
        tmp = os.path.join(out_dir, f".{file}.tmp")
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(out_dir, file))  # a reader never sees a half-written shard
        weight_map.update({n: file for n in names})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del state, tensors
    if len(files) > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
    for name in _KEEP:
        if os.path.exists(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(out_dir, name))
    return {name: tuple(shapes.get(name, entries[name][1].size)) for name in entries}


def _model_shapes(config_dir: str) -> dict[str, tuple[int, ...]]:
    """The parameter shapes of the config's model, built on meta (no memory)."""
    from shardwise.models.hf import require_transformers

    tf = require_transformers()
    config = tf.AutoConfig.from_pretrained(config_dir, local_files_only=True)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _as(tensor: torch.Tensor, shape: tuple[int, ...] | None) -> torch.Tensor:
    if shape is None or tuple(tensor.shape) == shape:
        return tensor
    if tensor.numel() != torch.Size(shape).numel():
        raise ConfigError(f"a checkpoint tensor of shape {list(tensor.shape)} does not fit the config's {list(shape)}",
                          hint="pass --model DIR of the model this run trained")
    return tensor.reshape(shape)
