"""Adapters out: a LoRA run's checkpoint as a PEFT adapter directory, or merged into its base.

``shardwise checkpoint export --format peft CKPT OUT`` writes what ``peft`` itself saves:

- ``OUT/adapter_config.json``: the run's ``LoraConfig`` (kept in every rank's small file of the
  checkpoint by :class:`~shardwise.checkpoint.adapters.BaseReference`), with
  ``base_model_name_or_path`` set to the base the adapters were trained on;
- ``OUT/adapter_model.safetensors``: every adapter tensor read with DCP from all ranks' shards (no
  process group), under PEFT's names (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``:
  the adapter name ``default`` dropped), in the layer's own shape (a fused split view is reshaped).

so ``PeftModel.from_pretrained(base, OUT)`` gives the trained model. ``--format hf --merge``
exports the adapters that way to a temporary directory, loads the base (``--model DIR`` or the
path the checkpoint references) with ``transformers``, and lets ``peft`` merge them
(``merge_and_unload``: ``W + (alpha / r) B A``) before ``save_pretrained(OUT)``: plain
``transformers`` then loads ``OUT``. The merge holds the whole model in memory once, on one
process. A QLoRA run's adapters are merged into the base at its stored precision, not into the
4-bit values they were trained against (the usual QLoRA merge; its logits differ from the trained
model's by the quantization error).

Files are written under temporary names and renamed, so a reader never sees a half-written one.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import shutil
import tempfile
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp

from shardwise.checkpoint import commit as cm
from shardwise.checkpoint.consolidate import resolve_step_dir
from shardwise.checkpoint.safe_io import SafeFileSystemReader, SafeLoadPlanner, load_rank_file
from shardwise.errors import ConfigError

_TOKENIZER = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


def adapter_record(step_dir: str) -> dict[str, Any]:
    """The base reference and LoRA config a LoRA run saved in ``step_dir`` (one line if none)."""
    marker = cm.read_marker(step_dir)
    payload = load_rank_file(os.path.join(step_dir, "ranks"), rank=0, saved_world=marker.world_size if marker else 1)
    record = payload["components"].get("lora_base")
    if not isinstance(record, dict):
        raise ConfigError(f"checkpoint {step_dir} holds no LoRA adapters (it is not a LoRA run's)",
                          hint="export it with --format hf (the full model)")
    return {**record, "lora": json.loads(record.get("lora") or "{}")}


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, enum.Enum):
        return value.value
    return str(value)


def peft_name(name: str) -> str:
    """A parameter name as ``peft`` saves it: the adapter name after ``lora_A``/``lora_B`` dropped."""
    atoms = name.split(".")
    return ".".join(
        a for i, a in enumerate(atoms) if not (i > 0 and atoms[i - 1].startswith("lora_") and a == "default")
    )


def export_peft(checkpoint_dir: str, out_dir: str, *, step: int | None = None) -> dict[str, tuple[int, ...]]:
    """Write the adapters of a LoRA checkpoint as a PEFT adapter directory (module doc); returns ``{name: shape}``."""
    from safetensors.torch import save_file

    path = resolve_step_dir(checkpoint_dir, step)
    record = adapter_record(path)
    metadata = SafeFileSystemReader(path).read_metadata()
    entries = {key[len("model."):]: (key, meta) for key, meta in metadata.state_dict_metadata.items()
               if key.startswith("model.") and hasattr(meta, "size") and ".lora_" in key}
    if not entries:
        raise ConfigError(f"checkpoint {path} holds no adapter tensors", hint="export it with --format hf")
    state = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype) for key, meta in entries.values()}
    dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=True)
    tensors = {}
    for name, (key, _) in entries.items():
        t = state[key]
        if t.dim() > 2:  # a fused split view (pieces, width, r) of the layer's (pieces * width, r)
            t = t.reshape(-1, t.shape[-1]) if ".lora_B." in name else t.reshape(t.shape[0], -1)
        tensors[peft_name(name)] = t.contiguous()
    config = dict(record["lora"])
    config["base_model_name_or_path"] = record.get("path")
    config["inference_mode"] = True
    os.makedirs(out_dir, exist_ok=True)
    _write(
        os.path.join(out_dir, "adapter_model.safetensors"),
        lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}),
    )
    text = json.dumps(config, indent=2, sort_keys=True, default=_jsonable)
    _write(os.path.join(out_dir, "adapter_config.json"), lambda tmp: _write_text(tmp, text))
    return {name: tuple(t.shape) for name, t in tensors.items()}


def export_merged(checkpoint_dir: str, out_dir: str, *, step: int | None = None, model_dir: str | None = None) -> str:
    """Merge a LoRA checkpoint's adapters into its base and write a plain ``transformers`` model
    directory (module doc); returns the base directory used."""
    from shardwise.models.hf import require_transformers
    from shardwise.models.lora import require_peft

    path = resolve_step_dir(checkpoint_dir, step)
    record = adapter_record(path)
    base_dir = model_dir or record.get("path")
    if not base_dir or not os.path.exists(os.path.join(base_dir, "config.json")):
        raise ConfigError(
            f"the base model of checkpoint {path} ({base_dir or 'a model built in Python'}) is not a model directory",
            hint="pass --model DIR (the Hugging Face directory the adapters were trained on)",
        )
    tf, peft = require_transformers(), require_peft()
    from shardwise.checkpoint.hf_load import Pretrained
    from shardwise.checkpoint.weights_check import check_weights

    check_weights(
        base_dir, Pretrained(base_dir).build_meta()
    )  # one line for a truncated file, a missing shard, a wrong shape
    with tempfile.TemporaryDirectory(prefix="shardwise-adapter-") as tmp, _no_progress_bars(tf):
        export_peft(path, tmp)
        base = tf.AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True, dtype=torch.float32)
        merged = peft.PeftModel.from_pretrained(base, tmp).merge_and_unload()
        staging = tempfile.mkdtemp(prefix=".merged-", dir=os.path.dirname(os.path.abspath(out_dir)) or ".")
        merged.save_pretrained(staging)
    for name in _TOKENIZER:
        if os.path.exists(os.path.join(base_dir, name)):
            shutil.copyfile(os.path.join(base_dir, name), os.path.join(staging, name))
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(staging):  # each file appears whole
        os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
    os.rmdir(staging)
    return base_dir


@contextlib.contextmanager
def _no_progress_bars(tf: Any) -> Iterator[None]:
    """Without transformers' "Loading weights" and "Writing model shards" bars (the command prints
    its own line when the export is written)."""
    logs = tf.utils.logging
    shown = logs.is_progress_bar_enabled()
    logs.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            logs.enable_progress_bar()


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


def _write(target: str, write: Any) -> None:
    tmp = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.tmp")
    write(tmp)
    os.replace(tmp, target)
