"""Sharded text generation: greedy or sampled decoding with a KV cache, under tensor parallelism.

Three sources:

- a local Hugging Face directory (``config.json``, safetensors, tokenizer);
- a shardwise checkpoint of a Hugging Face model (the config and tokenizer from ``--model DIR``
  or from the copy ``shardwise train --model.hf`` keeps in the checkpoint's ``hf/``);
- a checkpoint of the built-in GPT job (``shardwise train``): its shape and character vocabulary
  from the ``gpt/model.json`` the job keeps beside the checkpoints
  (:mod:`shardwise.checkpoint.gpt_files`).

Either way the model is built on the meta device and parallelized before any weight is read, and
each rank reads only its own slices (safetensors slice reads, or DCP's resharding load), so the
model never has to fit on one process.

Decoding (one prompt, batch 1; ``lm`` is the model's adapter, :mod:`shardwise.generate.decoders`)::

    logits, cache = lm(prompt, None, use_cache=True)  # prefill: the K/V of every prompt token
    repeat max_new_tokens times:
        token = choose(logits[:, -1])                 # argmax, or sample from softmax(logits / T)
                                                      # restricted to the top k
        logits, cache = lm(token, cache, use_cache=True)   # one new position

Under TP the attention projections are split by heads, so each rank's KV cache holds its own
heads (``1/tp`` of the cache), and the logits are gathered over the vocabulary. Rank 0 chooses
each token (with a CPU generator seeded by ``seed``) and broadcasts it, so every rank extends the
same sequence. Plans: ``tp`` (with ``dp``/``zero`` degrees, whose ranks decode the same prompt);
pipelines, context parallelism and sequence parallelism are refused: one token at a time leaves a
pipeline's stages idle but one, and neither a KV cache nor a one-token step is split by sequence
here.
"""

from __future__ import annotations

import dataclasses

import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.checkpoint import commit as cm
from shardwise.checkpoint.gpt_files import GPTFiles, gpt_files_in, read_gpt_files
from shardwise.checkpoint.hf_export import HF_DIR
from shardwise.checkpoint.hf_load import Pretrained, allocate, load_parallel
from shardwise.checkpoint.manager import CheckpointManager
from shardwise.data.corpus import CharVocab
from shardwise.errors import ConfigError
from shardwise.layout import Plan
from shardwise.generate.decoders import CausalLM, causal_lm


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
            raise ConfigError(
                f"temperature={self.temperature} must be a non-negative number", hint="0 decodes greedily"
            )
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top_k={self.top_k} must be at least 1")


@dataclass(frozen=True)
class LoadedLM:
    """A parallelized model ready to decode, with what turns text into its ids and back.

    ``vocab_limit``: only ids below it are ever chosen (a vocabulary padded for tensor parallelism
    has ids that stand for no token); ``context``: the most positions the model takes (None: not
    known here)."""

    module: nn.Module
    encode: Callable[[str], list[int]] | None
    decode: Callable[[list[int]], str] | None
    eos_token_id: int | None = None
    vocab_limit: int | None = None
    context: int | None = None


def check_generate_plan(plan: Plan) -> None:
    """Refuse the layouts generation does not run under (module doc), before any weight is read."""
    spread = "use tensor parallelism to spread the model, e.g. --plan tp=2"
    for enabled, name, hint in (
        (plan.pp_enabled, "pipeline", spread),
        (plan.cp_enabled, "context", spread),
        (plan.ep_enabled, "expert", spread),
        (plan.sequence_parallel, "sequence", "drop sp: tp alone splits the model"),
    ):
        if enabled:
            raise ConfigError(f"generate does not run under {name} parallelism (plan {plan})", hint=hint)


def is_checkpoint(path: str) -> bool:
    """A shardwise checkpoint root (holding ``step_*`` directories) or one step directory."""
    if cm.read_marker(path) is not None:
        return True
    return os.path.isdir(path) and any(name.startswith("step_") for name in os.listdir(path))


def _root(source: str) -> str:
    """The checkpoint root of ``source`` (itself, or the parent of a step directory)."""
    return os.path.dirname(os.path.abspath(source)) if cm.read_marker(source) is not None else source


def gpt_files_of(source: str) -> GPTFiles | None:
    """The built-in GPT's model files kept with checkpoint ``source`` (None: not a GPT checkpoint)."""
    if not is_checkpoint(source):
        return None
    for directory in (source, _root(source)):
        if gpt_files_in(directory):
            return read_gpt_files(directory)
    return None


def model_files(source: str, model_dir: str | None = None) -> str:
    """The directory with the Hugging Face config and tokenizer for ``source`` (a model directory is its own)."""
    if model_dir is not None:
        return model_dir
    if not is_checkpoint(source):
        return source
    for candidate in (os.path.join(source, HF_DIR), os.path.join(_root(source), HF_DIR)):
        if os.path.isfile(os.path.join(candidate, "config.json")):
            return candidate
    raise ConfigError(
        f"checkpoint {source} keeps no model config (neither the built-in GPT's gpt/model.json nor "
        f"{HF_DIR}/config.json)",
        hint="pass --model DIR, the Hugging Face directory the run started from",
    )


def _load_weights(module: nn.Module, source: str, step: int | None) -> None:
    """This rank's slices of the model's tensors from checkpoint ``source`` (weights only: the
    optimizer and training state stay on disk)."""
    marker = cm.read_marker(source)
    if marker is not None:
        step = marker.step
    if CheckpointManager(_root(source)).load({"model": module}, step=step) is None:
        raise ConfigError(f"no complete checkpoint in {source}", hint="check it with 'shardwise checkpoint inspect'")


def load_gpt(
    source: str, files: GPTFiles, plan: Plan, meshes: Any, *, device: torch.device, step: int | None = None
) -> LoadedLM:
    """The built-in GPT of checkpoint ``source``: built on meta from the kept shape, parallelized,
    this rank's shards allocated (DDP: the whole model, before wrapping) and read from the checkpoint."""
    from shardwise.models.gpt import GPT
    from shardwise.parallel.init import parallelize_on_meta

    check_generate_plan(plan)
    # no initialization: every value is overwritten by the checkpoint's
    pm = parallelize_on_meta(lambda: GPT(files.shape), plan, meshes, device=device, seed=0, init=lambda _module: None)
    _load_weights(pm.module, source, step)
    vocab = files.vocab
    return LoadedLM(pm.module, encode=lambda text: encode_chars(vocab, text), decode=vocab.decode,
                    vocab_limit=len(vocab), context=files.shape.seq_len)


def encode_chars(vocab: CharVocab, text: str) -> list[int]:
    """``text`` as the GPT's character ids; a character it was not trained on is refused."""
    unknown = vocab.unknown(text)
    if unknown:
        raise ConfigError(f"the prompt has characters the model's vocabulary lacks: {unknown!r}",
                          hint="use characters of the training text (the model was trained on Python source)")
    return vocab.encode(text).tolist()


def lora_source(source: str) -> Pretrained | None:
    """The base directory with the LoRA config of a LoRA run's checkpoint (None for other checkpoints);
    a base whose files changed since training is refused with one line."""
    from shardwise.checkpoint.adapters import files_checksum
    from shardwise.checkpoint.consolidate import resolve_step_dir
    from shardwise.checkpoint.peft_export import adapter_record
    from shardwise.models.lora import require_peft

    step_dir = resolve_step_dir(_root(source) if cm.read_marker(source) is None else source)
    try:
        record = adapter_record(step_dir)
    except ConfigError:
        return None
    path = record.get("path")
    if not path or not os.path.isdir(path):
        raise ConfigError(
            f"the base of the adapters in {source} ({path or 'a model built in Python'}) is not a model directory here",
            hint="export the adapters (--format peft) and load them onto your base with peft",
        )
    if record.get("sha256") and files_checksum(path) != record["sha256"]:
        raise ConfigError(f"the base {path} changed since the adapters in {source} were trained (its sha256 differs)",
                          hint="generate with the base model the adapters were trained on")
    config_class = require_peft().LoraConfig
    known = {f.name for f in dataclasses.fields(config_class) if f.init}
    known.discard("base_model_name_or_path")  # peft sets it from the base it wraps (a stale one is warned about)
    config = config_class(**{k: v for k, v in record["lora"].items() if k in known})
    return Pretrained(path, lora=config)


def load_model(source: str, plan: Plan, meshes: Any, *, device: torch.device, model_dir: str | None = None,
               step: int | None = None, need_tokenizer: bool = True) -> LoadedLM:
    """The parallelized model of ``source`` (module doc) with its tokenizer (a Hugging Face
    model's only when ``need_tokenizer`` or it has a ``tokenizer.json``)."""
    from shardwise.models.hf import load_tokenizer
    from shardwise.parallel.parallelize import parallelize

    check_generate_plan(plan)
    files = gpt_files_of(source) if model_dir is None else None
    if files is not None:
        return load_gpt(source, files, plan, meshes, device=device, step=step)
    adapters = lora_source(source) if is_checkpoint(source) else None
    if adapters is not None:  # a LoRA run: its base (checked against the checkpoint), then the trained adapters
        config_dir = model_dir or adapters.path
        module = load_parallel(adapters, plan, meshes, device=device).module
        _load_weights(module, source, step)
        tokenizer = (
            load_tokenizer(config_dir)
            if need_tokenizer or os.path.exists(os.path.join(config_dir, "tokenizer.json"))
            else None
        )
        eos = getattr(getattr(module, "config", None), "eos_token_id", None)
        return LoadedLM(
            module,
            encode=tokenizer.encode if tokenizer is not None else None,
            decode=tokenizer.decode if tokenizer is not None else None,
            eos_token_id=eos if isinstance(eos, int) else None,
        )
    config_dir = model_files(source, model_dir)
    if not is_checkpoint(source):
        module = load_parallel(Pretrained(source), plan, meshes, device=device).module
    else:
        model = Pretrained(config_dir).build_meta()
        buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        module = parallelize(model, plan, meshes).module
        allocate(module, device=device, buffers=buffers)
        _load_weights(module, source, step)
    has_tokenizer = need_tokenizer or os.path.exists(os.path.join(config_dir, "tokenizer.json"))
    tokenizer = load_tokenizer(config_dir) if has_tokenizer else None
    eos = getattr(getattr(module, "config", None), "eos_token_id", None)
    return LoadedLM(
        module,
        encode=tokenizer.encode if tokenizer is not None else None,
        decode=tokenizer.decode if tokenizer is not None else None,
        eos_token_id=eos if isinstance(eos, int) else None,
    )


def check_context(prompt_len: int, sampling: Sampling, context: int | None) -> None:
    """Decoding feeds at most ``prompt_len + max_new_tokens - 1`` positions (the last token chosen
    is never fed back); a model with learned positions takes no more than its ``context``."""
    needed = prompt_len + sampling.max_new_tokens - 1
    if context is not None and needed > context:
        raise ConfigError(
            f"decoding {prompt_len} prompt + {sampling.max_new_tokens} new tokens needs {needed} positions; "
            f"the model's context is {context}",
            hint="shorten the prompt or generate fewer tokens",
        )


def check_request(source: str, plan: Plan, *, model_dir: str | None, prompt: str | None, prompt_ids: list[int] | None,
                  sampling: Sampling) -> None:
    """What the command checks before any process starts (each a one-line ConfigError): the plan,
    a run directory given for its checkpoints, a checkpoint that keeps no model config, and, for
    the built-in GPT, the plan against the model's shape (on meta), the prompt's characters and ids
    and its length against the context; for a Hugging Face model, the weights it reads
    (:func:`check_hf_model`)."""
    check_generate_plan(plan)
    inside = os.path.join(source, "checkpoints")
    if not is_checkpoint(source) and is_checkpoint(inside):
        raise ConfigError(
            f"--checkpoint {source} is a run directory, not a checkpoint", hint=f"pass --checkpoint {inside}"
        )
    files = gpt_files_of(source) if model_dir is None else None
    if files is None:
        check_hf_model(source, plan, model_dir=model_dir)
        return
    from shardwise.models.gpt import GPT
    from shardwise.parallel.init import build_on_meta
    from shardwise.parallel.parallelize import validate

    validate(build_on_meta(lambda: GPT(files.shape)), plan)
    ids = encode_chars(files.vocab, prompt) if prompt is not None else list(prompt_ids or ())
    if ids and max(ids) >= files.shape.vocab_size:
        raise ConfigError(f"prompt id {max(ids)} is outside the model's vocabulary of {files.shape.vocab_size}",
                          hint=f"use ids below {len(files.vocab)} (the model's characters)")
    check_context(len(ids), sampling, files.shape.seq_len)


def check_hf_model(source: str, plan: Plan, *, model_dir: str | None) -> None:
    """A Hugging Face model's checks before any process starts: built on meta (a LoRA run's base
    with its adapters), the plan against it (:func:`~shardwise.parallel.parallelize.validate`: a tp
    that does not divide a layer), and the safetensors weights it reads, headers only
    (:mod:`shardwise.checkpoint.weights_check`): a directory's own, or a LoRA run's base (a
    checkpoint's own tensors are checked as the checkpoint is read)."""
    from shardwise.checkpoint.weights_check import check_weights
    from shardwise.parallel.parallelize import validate

    config_dir = model_files(source, model_dir)
    adapters = lora_source(source) if is_checkpoint(source) else None
    model = (adapters or Pretrained(config_dir)).build_meta()
    if adapters is not None or not is_checkpoint(source):
        check_weights(adapters.path if adapters is not None else source, model)
    validate(model, plan)


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


def _last_logits(logits: torch.Tensor, vocab_limit: int | None) -> torch.Tensor:
    if isinstance(logits, DTensor):  # vocabulary-sharded under loss parallelism
        logits = logits.full_tensor()
    last = logits[:, -1, :]
    return last if vocab_limit is None else last[:, :vocab_limit]


@torch.no_grad()
def generate_ids(model: nn.Module | CausalLM, ids: torch.Tensor, sampling: Sampling, *, eos_token_id: int | None = None,
                 vocab_limit: int | None = None) -> torch.Tensor:
    """``ids[B, T]`` followed by up to ``max_new_tokens`` new tokens (stops early after ``eos_token_id``).

    ``model``: a parallelized module (its adapter is :func:`~shardwise.generate.decoders.causal_lm`'s)
    or an adapter. Every rank calls it with the same ``ids``; all return the same tokens.
    ``use_cache=False`` recomputes the whole sequence at every step (the reference the KV cache
    must equal). ``vocab_limit``: choose only ids below it.
    """
    lm = causal_lm(model) if isinstance(model, nn.Module) else model
    module = lm.module
    was_training = module.training
    module.eval()
    device = next(module.parameters()).device
    generator = torch.Generator().manual_seed(sampling.seed)
    ids = ids.to(device)
    try:
        logits, cache = lm(ids, None, use_cache=sampling.use_cache)
        for i in range(sampling.max_new_tokens):
            token = _choose(_last_logits(logits, vocab_limit), sampling, generator).to(device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast(token, src=0)  # rank 0's choice, the same sequence everywhere
            ids = torch.cat([ids, token], dim=1)
            if (eos_token_id is not None and bool((token == eos_token_id).all())) or i == sampling.max_new_tokens - 1:
                break
            if sampling.use_cache:
                logits, cache = lm(token, cache, use_cache=True)
            else:
                logits, _ = lm(ids, None, use_cache=False)
    finally:
        module.train(was_training)
    return ids.cpu()
