"""Sharded text generation: greedy or sampled decoding with a KV cache, under tensor parallelism.

The model comes from a local Hugging Face directory (``config.json``, safetensors, tokenizer) or
from a shardwise checkpoint of a Hugging Face model (the config and tokenizer from ``--model DIR``
or from the copy ``shardwise train --model.hf`` keeps in the checkpoint's ``hf/``). Either way it
is built on the meta device and parallelized before any weight is read, and each rank reads only
its own slices (safetensors slice reads, or DCP's resharding load), so the model never has to fit
on one process.

Decoding (one prompt, batch 1)::

    out = model(prompt, use_cache=True)               # prefill: the K/V of every prompt token
    repeat max_new_tokens times:
        token = choose(out.logits[:, -1])             # argmax, or sample from softmax(logits / T)
                                                      # restricted to the top k
        out = model(token, past_key_values=out.past_key_values, use_cache=True)   # one new position

Under TP the attention projections are split by heads, so each rank's KV cache holds its own
heads (``1/tp`` of the cache), and the logits are gathered over the vocabulary. Rank 0 chooses
each token (with a CPU generator seeded by ``seed``) and broadcasts it, so every rank extends the
same sequence. Plans: ``tp`` (with ``dp``/``zero`` degrees, whose ranks decode the same prompt);
pipelines and context parallelism are refused: one token at a time leaves a pipeline's stages
idle but one, and a KV cache is not split by sequence here.
"""

from __future__ import annotations

import inspect
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.checkpoint import commit as cm
from shardwise.checkpoint.hf_export import HF_DIR
from shardwise.checkpoint.hf_load import Pretrained, allocate, load_parallel
from shardwise.checkpoint.manager import CheckpointManager
from shardwise.errors import ConfigError
from shardwise.layout import Plan
from shardwise.models.hf import logits_of


@dataclass(frozen=True)
class Sampling:
    """``temperature=0``: greedy (argmax); otherwise sample from ``softmax(logits / temperature)``
    over the ``top_k`` most likely tokens (all when None), drawn with a generator seeded by ``seed``."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0
    use_cache: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens} must be at least 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"temperature={self.temperature} must be a non-negative number", hint="0 decodes greedily")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top_k={self.top_k} must be at least 1")


def check_generate_plan(plan: Plan) -> None:
    """Refuse the layouts generation does not run under (module doc), before any weight is read."""
    for enabled, name in ((plan.pp_enabled, "pipeline"), (plan.cp_enabled, "context"), (plan.ep_enabled, "expert")):
        if enabled:
            raise ConfigError(f"generate does not run under {name} parallelism (plan {plan})",
                              hint="use tensor parallelism to spread the model, e.g. --plan tp=2")


def is_checkpoint(path: str) -> bool:
    """A shardwise checkpoint root (holding ``step_*`` directories) or one step directory."""
    if cm.read_marker(path) is not None:
        return True
    return os.path.isdir(path) and any(name.startswith("step_") for name in os.listdir(path))


def model_files(source: str, model_dir: str | None = None) -> str:
    """The directory with the config and tokenizer for ``source`` (a model directory is its own)."""
    if model_dir is not None:
        return model_dir
    if not is_checkpoint(source):
        return source
    root = os.path.dirname(os.path.abspath(source)) if cm.read_marker(source) is not None else source
    for candidate in (os.path.join(source, HF_DIR), os.path.join(root, HF_DIR)):
        if os.path.isfile(os.path.join(candidate, "config.json")):
            return candidate
    raise ConfigError(f"checkpoint {source} keeps no model config (no {HF_DIR}/config.json)",
                      hint="pass --model DIR, the Hugging Face directory the run started from")


def load_model(source: str, plan: Plan, meshes: Any, *, device: torch.device, model_dir: str | None = None,
               step: int | None = None) -> tuple[nn.Module, str]:
    """``(the parallelized model, the directory of its config and tokenizer)`` for ``source``."""
    from shardwise.parallel.parallelize import parallelize

    check_generate_plan(plan)
    files = model_files(source, model_dir)
    if not is_checkpoint(source):
        return load_parallel(Pretrained(source), plan, meshes, device=device).module, files
    model = Pretrained(files).build_meta()
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    module = parallelize(model, plan, meshes).module
    allocate(module, device=device, buffers=buffers)
    root = os.path.dirname(os.path.abspath(source)) if cm.read_marker(source) is not None else source
    if cm.read_marker(source) is not None:
        step = cm.read_marker(source).step
    # weights only: the checkpoint's optimizer and training state stay on disk
    if CheckpointManager(root).load({"model": module}, step=step) is None:
        raise ConfigError(f"no complete checkpoint in {source}", hint="check it with 'shardwise checkpoint inspect'")
    return module, files


def _choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """The next token ``[B, 1]`` from the last position's logits ``[B, V]``."""
    logits = logits.float().cpu()
    if sampling.temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / sampling.temperature
    if sampling.top_k is not None:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)


def _last_logits(output: Any) -> torch.Tensor:
    logits = logits_of(output)
    if isinstance(logits, DTensor):  # vocabulary-sharded under loss parallelism
        logits = logits.full_tensor()
    return logits[:, -1, :]


def _cache_argument(model: nn.Module) -> str:
    """The keyword the model's forward takes its KV cache by: ``cache`` in recent transformers 5
    releases, ``past_key_values`` before (still accepted there, with a deprecation warning)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(output: Any) -> Any:
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


@torch.no_grad()
def generate_ids(model: nn.Module, ids: torch.Tensor, sampling: Sampling, *, eos_token_id: int | None = None) -> torch.Tensor:
    """``ids[B, T]`` followed by up to ``max_new_tokens`` new tokens (stops early after ``eos_token_id``).

    Every rank calls it with the same ``ids``; all return the same tokens. ``use_cache=False``
    recomputes the whole sequence at every step (the reference the KV cache must equal).
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(sampling.seed)
    ids = ids.to(device)
    cache_arg = _cache_argument(model)
    try:
        out = model(input_ids=ids, use_cache=sampling.use_cache)
        for i in range(sampling.max_new_tokens):
            token = _choose(_last_logits(out), sampling, generator).to(device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast(token, src=0)  # rank 0's choice, the same sequence everywhere
            ids = torch.cat([ids, token], dim=1)
            if (eos_token_id is not None and bool((token == eos_token_id).all())) or i == sampling.max_new_tokens - 1:
                break
            if sampling.use_cache:
                out = model(input_ids=token, use_cache=True, **{cache_arg: _cache_of(out)})
            else:
                out = model(input_ids=ids, use_cache=False)
    finally:
        model.train(was_training)
    return ids.cpu()
