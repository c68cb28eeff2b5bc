"""The built-in GPT's model files beside its checkpoints: what rebuilds the model and its tokenizer.

A checkpoint holds tensors only. To decode from one (``shardwise generate``) the model must be
built again with the shape it was trained with, and text must map to the ids it was trained on.
The built-in job (``shardwise train``) therefore keeps, when training starts,
``<checkpoints>/gpt/model.json``::

    {"format": "shardwise-gpt", "version": 1,
     "shape": {"layers": 4, "hidden": 128, "heads": 4, "vocab_size": 104, "seq_len": 128, ...},
     "vocab": "\\n !\\"#..."}

``shape`` is the resolved :class:`~shardwise.shape.TransformerShape` the GPT was built from (the
vocabulary already padded to a multiple of 8 for tensor parallelism), ``vocab`` the corpus's
characters (id ``i`` is ``vocab[i]``; the padded ids stand for no character). The file is written
atomically (a temporary file, fsync, rename), so a reader sees all of it or none; it is the
counterpart of the ``hf/`` copy a Hugging Face fine-tuning run keeps
(:func:`shardwise.checkpoint.hf_export.keep_model_files`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from shardwise.checkpoint.commit import atomic_write_text
from shardwise.data.corpus import CharVocab
from shardwise.errors import ConfigError
from shardwise.shape import TransformerShape

GPT_DIR = "gpt"  # inside a checkpoint directory, beside the step_* directories
MODEL_FILE = "model.json"
FORMAT = "shardwise-gpt"
VERSION = 1


@dataclass(frozen=True)
class GPTFiles:
    """The built-in GPT's shape and its character vocabulary."""

    shape: TransformerShape
    vocab: CharVocab

    def __post_init__(self) -> None:
        if not len(self.vocab) or len(self.vocab) > self.shape.vocab_size:
            raise ConfigError(
                f"a vocabulary of {len(self.vocab)} characters does not fit the model's "
                f"vocab_size={self.shape.vocab_size}"
            )


def keep_gpt_files(checkpoint_dir: str, files: GPTFiles) -> str:
    """Write ``checkpoint_dir/gpt/model.json`` atomically (module doc); returns its path."""
    target = os.path.join(checkpoint_dir, GPT_DIR)
    os.makedirs(target, exist_ok=True)
    payload = {"format": FORMAT, "version": VERSION, "shape": files.shape.to_dict(), "vocab": files.vocab.chars}
    path = os.path.join(target, MODEL_FILE)
    atomic_write_text(path, json.dumps(payload, indent=1, ensure_ascii=True) + "\n")
    return path


def gpt_files_in(directory: str) -> bool:
    """Whether ``directory`` (a checkpoint root or step directory) has the GPT's model file."""
    return os.path.isfile(os.path.join(directory, GPT_DIR, MODEL_FILE))


def read_gpt_files(directory: str) -> GPTFiles:
    """The :class:`GPTFiles` kept in ``directory/gpt/``, or one line naming what is wrong."""
    path = os.path.join(directory, GPT_DIR, MODEL_FILE)
    bad = f"{path} is not a shardwise GPT model file"
    hint = "it is written by 'shardwise train' when training starts; restore it from the run, or retrain"
    try:
        with open(path, encoding="utf-8") as fh:
            payload = json.load(fh)
    except FileNotFoundError:
        raise ConfigError(
            f"checkpoint {directory} keeps no GPT model file ({GPT_DIR}/{MODEL_FILE})", hint=hint
        ) from None
    except OSError as err:
        raise ConfigError(f"{path} cannot be read: {err.strerror or err}", hint="check its permissions") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"{bad} (not JSON)", hint=hint) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ConfigError(f"{bad} (no \"format\": \"{FORMAT}\")", hint=hint)
    if payload.get("version") != VERSION:
        raise ConfigError(
            f"{path} has format version {payload.get('version')!r}; this shardwise reads version {VERSION}",
            hint="generate with the shardwise version that trained the model",
        )
    shape, vocab = payload.get("shape"), payload.get("vocab")
    if not isinstance(shape, dict) or not isinstance(vocab, str):
        raise ConfigError(f"{bad} (it needs a \"shape\" object and a \"vocab\" string)", hint=hint)
    try:
        return GPTFiles(shape=TransformerShape.from_dict(shape), vocab=CharVocab(vocab))
    except (ConfigError, TypeError) as err:
        raise ConfigError(f"{bad}: {getattr(err, 'message', err)}", hint=hint) from None
