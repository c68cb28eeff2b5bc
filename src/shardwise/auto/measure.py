"""Measure: statistics of any ``nn.Module`` for the planner, measured on the ``meta`` device.

:func:`model_stats` is what ``plan="auto"`` calls: a Hugging Face directory's ``config.json``, else
the model measured on the first training sample (:func:`sample_stats`), else on ``meta`` alone
(:func:`module_stats`).

Nothing is allocated: the model is built (or copied) on ``meta``, parameters are counted per
module, FLOPs come from ``torch.utils.flop_counter.FlopCounterMode`` and the saved-for-backward
bytes from ``torch.autograd.graph.saved_tensors_hooks`` during one meta forward of one sample. The
repeated blocks are the longest ``nn.ModuleList``/``nn.Sequential`` whose children all share one
type; the parameters before them count as the embedding part, those after as the head.

A model that carries its :class:`~shardwise.shape.TransformerShape` as ``model.config`` (the
built-in GPT), or a Hugging Face config (read by :func:`shardwise.models.hf.shape_of`), gets the
planner's closed forms instead (:func:`shardwise.plan.stats.transformer_stats`).

**When the meta forward fails** (a user's forward with a data-dependent op, ``.item()`` or a mask
built from values, which the meta device cannot run), :func:`sample_stats` falls back, in order,
and logs which one sized the model:

1. a Hugging Face ``config`` found anywhere in the module tree (a user's wrapper around an HF
   model): the closed forms of :func:`shardwise.models.hf.stats_of_config`;
2. one real forward and backward on the CPU of a copy with at most 2 of the repeated blocks, on the
   first sample cut to at most :data:`SHORT_SEQ` tokens: parameters are counted on the whole model;
   the saved-for-backward bytes, FLOPs, block input and logits measured per block at the short
   length are scaled linearly to the real one (``x seq / short``; the ``s^2`` attention scores of
   eager attention are under-counted by the same factor, a stated approximation);
3. a parameter-count estimate, when no such copy can run (the model's values are on ``meta``):
   ``2 P_block`` FLOPs per token and block forward, and activations of ``34 h`` bytes per token and
   block (Korthikanti et al. 2022, 16-bit, no recomputation, the attention-score term left out), with
   ``h`` the widest Linear input in a block.

Only a model whose forward cannot run at all (the real forward fails too) is refused, with that
error.
"""

from __future__ import annotations

import copy
import os
import runpy
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from shardwise.auto.forward_stats import measure_module
from shardwise.errors import ConfigError
from shardwise.models.blocks import block_modules, find_blocks
from shardwise.plan.stats import ModelStats, TransformerShape, transformer_stats
from shardwise.runtime.logging import get_logger

log = get_logger("plan")


def model_stats(model: Any, *, tokens_per_sample: int | None, inputs: Any = None) -> ModelStats:
    """The planner's statistics of ``model`` (an ``nn.Module`` or a Hugging Face ``Pretrained``
    directory): closed forms for a model carrying its shape as ``model.config`` (the built-in GPT, a
    Hugging Face model) or a directory (its ``config.json``), else measured on the meta device.
    ``inputs``: the first training sample (a batch of one), which sets the sequence length and is
    what the meta forward runs on; ``tokens_per_sample`` overrides the length."""
    from shardwise.checkpoint.hf_load import Pretrained

    if isinstance(model, Pretrained):
        from shardwise.models.hf import read_config, stats_of_config

        seq = tokens_per_sample or (sample_seq(inputs) if inputs is not None else None)
        stats = stats_of_config(read_config(model.path), seq=seq)
        if model.lora is not None and hasattr(model.lora, "base"):  # a frozen (4-bit) base with adapters
            from shardwise.plan.adapters import with_lora

            stats = with_lora(stats, r=model.lora.r, base=model.lora.base)
        return stats
    if inputs is not None:
        return sample_stats(model, inputs, tokens_per_sample=tokens_per_sample)
    return module_stats(model, seq=tokens_per_sample)


def module_stats(model: nn.Module, *, seq: int | None = None) -> ModelStats:
    """Planner statistics of a live module (it is copied to ``meta``, never run).

    ``seq``: the input length per sample (1 for non-sequence inputs); needed unless the model
    carries its shape as ``model.config``."""
    config = getattr(model, "config", None)
    if isinstance(config, TransformerShape):
        return transformer_stats(config, seq=seq)
    if hasattr(config, "model_type") and callable(getattr(config, "to_dict", None)):
        # A Hugging Face model: its config.json says the shape (no meta forward through its masks)
        from shardwise.models.hf import stats_of_config

        return stats_of_config(config, seq=seq)
    if seq is None:
        raise ConfigError(f"planning a {type(model).__name__} needs its input length per sample",
                          hint="pass the length of one sample (1 for non-sequence inputs)")
    meta = copy.deepcopy(model).to("meta")
    first = next(meta.parameters(), None)
    is_tokens = isinstance(getattr(meta, "tok_emb", None) or first, nn.Embedding)

    def example(device: str) -> torch.Tensor:
        if is_tokens:
            return torch.zeros(1, seq, dtype=torch.long, device=device)
        in_features = getattr(first, "shape", (1, 1))[-1]
        return torch.zeros(1, in_features, device=device)

    return measure_module(lambda: meta, example, seq=seq, name=type(model).__name__)


def sample_stats(model: nn.Module, inputs: Any, *, tokens_per_sample: int | None = None) -> ModelStats:
    """Planner statistics of ``model`` for one sample of the training data, ``inputs`` (a collated
    batch of one: what ``model(inputs)`` takes), measured on ``meta``.

    The sequence length is the sample's own: dimension 1 of integer inputs (token ids), 1 for
    anything else (images, feature vectors), unless ``tokens_per_sample`` says otherwise. A model
    carrying its shape as ``model.config`` (the built-in GPT, a Hugging Face model) gets the closed
    forms at that length; any other model runs one meta forward of the sample."""
    seq = tokens_per_sample or sample_seq(inputs)
    config = getattr(model, "config", None)
    if isinstance(config, TransformerShape) or (
        hasattr(config, "model_type") and callable(getattr(config, "to_dict", None))
    ):
        return module_stats(model, seq=seq)
    meta = copy.deepcopy(model).to("meta")
    example = inputs
    if tokens_per_sample and isinstance(inputs, torch.Tensor) and not inputs.is_floating_point() and inputs.dim() >= 2:
        example = torch.zeros((1, tokens_per_sample) + tuple(inputs.shape[2:]), dtype=inputs.dtype)
    name = type(model).__name__
    try:
        return measure_module(lambda: meta, lambda device: _to_device(example, device), seq=seq, name=name)
    except ConfigError:
        raise
    except Exception as exc:  # the user's forward on meta (a data-dependent op): the fallbacks of the module doc
        meta_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    hf_config = next((c for m in model.modules() for c in [getattr(m, "config", None)]
                      if hasattr(c, "model_type") and callable(getattr(c, "to_dict", None))), None)
    if hf_config is not None:
        from shardwise.models.hf import stats_of_config

        log.info("plan=auto: sized %s from the Hugging Face config inside it (%s); its meta forward failed (%s)",
                 name, hf_config.model_type, meta_error)
        return replace(stats_of_config(hf_config, seq=seq), name=name)
    small = _small_copy(model, blocks=2)
    if small is None:
        stats = parameter_stats(model, seq=seq, name=name)
        log.info(
            "plan=auto: sized %s from its parameter count (%d blocks of %s parameters, activations 34 h bytes per "
            "token and block, h=%d); its meta forward failed (%s) and its values are on meta",
            name,
            stats.blocks,
            f"{stats.params_per_block:,}",
            stats.hidden,
            meta_error,
        )
        return stats
    short = min(seq, SHORT_SEQ)
    real = inputs
    if isinstance(inputs, torch.Tensor) and not inputs.is_floating_point() and inputs.dim() >= 2:
        real = (inputs if inputs.shape[1] >= short else example)[:, :short]
        if real.shape[1] < short:  # tokens_per_sample longer than the sample: zeros, as on meta
            real = torch.zeros((1, short) + tuple(inputs.shape[2:]), dtype=inputs.dtype)
    else:
        short = seq  # not a sequence: the sample as it is
    try:
        measured = measure_module(
            lambda: small, lambda device: _to_device(real, device), seq=short, name=name, device="cpu", backward=True
        )
    except ConfigError:
        raise
    except Exception as exc:  # it cannot run at all: refused, with the reason
        raise ConfigError(
            f"{name} cannot run its first training sample ({_describe(inputs)}): on the meta device {meta_error}; "
            f"on the CPU {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}",
            hint="check that the dataset's inputs are what the model's forward takes, or pass an explicit plan",
        ) from None
    stats = _scaled(measured, model, seq=seq, short=short)
    log.info(
        "plan=auto: sized %s by one forward and backward on the CPU (%d of its blocks, %d of %d tokens, "
        "scaled linearly to %d); its meta forward failed (%s)",
        name,
        min(2, stats.blocks),
        short,
        seq,
        seq,
        meta_error,
    )
    return stats


SHORT_SEQ = 64  # the longest sample the CPU fallback of sample_stats runs


def _small_copy(model: nn.Module, *, blocks: int) -> nn.Module | None:
    """A CPU copy of ``model`` with at most ``blocks`` of its repeated blocks (Hugging Face configs
    inside it say the new number of layers), in train mode; None when its values are on meta."""
    if any(p.is_meta for p in model.parameters()):
        return None
    holder = find_blocks(model)
    if holder is None or len(holder.modules) <= blocks:
        small = copy.deepcopy(model)
    else:
        name, container, found = holder.name, holder.container, holder.modules
        short = (
            type(container)(found[:blocks]) if isinstance(container, nn.ModuleList) else nn.Sequential(*found[:blocks])
        )
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        attr = name.rpartition(".")[2]
        if not name:
            small = copy.deepcopy(short)
        else:
            setattr(parent, attr, short)
            try:
                small = copy.deepcopy(model)
            finally:
                setattr(parent, attr, container)
        for module in small.modules():
            config = getattr(module, "config", None)
            if isinstance(getattr(config, "num_hidden_layers", None), int) and callable(
                getattr(config, "to_dict", None)
            ):
                config.num_hidden_layers = min(config.num_hidden_layers, blocks)
    return small.to("cpu").train()


def _scaled(measured: ModelStats, model: nn.Module, *, seq: int, short: int) -> ModelStats:
    """``measured`` (a small copy at ``short`` tokens) for the whole ``model`` at ``seq`` tokens."""
    full = parameter_stats(model, seq=seq, name=measured.name)
    k = seq / max(1, short)
    return replace(
        measured,
        blocks=full.blocks,
        params_per_block=full.params_per_block,
        params_embed=full.params_embed,
        params_head=full.params_head,
        flops_per_block=measured.flops_per_block * k,
        flops_head=measured.flops_head * k,
        act_bytes_per_block=measured.act_bytes_per_block * k,
        boundary_bytes=measured.boundary_bytes * k,
        logits_bytes=measured.logits_bytes * k,
        seq=seq,
        hidden=measured.hidden or full.hidden,
    )


def parameter_stats(model: nn.Module, *, seq: int, name: str) -> ModelStats:
    """Statistics from parameter counts alone (module doc, fallback 3): works on ``meta``."""
    blocks = block_modules(model) or [model]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    params = list(model.parameters())
    per_block = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    first = next((i for i, p in enumerate(params) if id(p) in in_blocks), len(params))
    embed = sum(p.numel() for i, p in enumerate(params) if id(p) not in in_blocks and i < first)
    head = sum(p.numel() for i, p in enumerate(params) if id(p) not in in_blocks and i >= first)
    hidden = max((m.in_features for m in blocks[0].modules() if isinstance(m, nn.Linear)), default=0)
    hidden = hidden or max((p.shape[-1] for p in params if p.dim() >= 2), default=1)
    return ModelStats(
        name=name, blocks=len(blocks), params_per_block=per_block, params_embed=embed, params_head=head,
        flops_per_block=2.0 * per_block * seq, flops_head=2.0 * head * seq, attn_flops_per_block=0.0,
        act_bytes_per_block=34.0 * hidden * seq, attn_act_bytes_per_block=0.0, boundary_bytes=2.0 * hidden * seq,
        logits_bytes=0.0, seq=seq, hidden=hidden,
    )


def sample_seq(inputs: Any) -> int:
    first = inputs
    while isinstance(first, (list, tuple, dict)) and first:
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    if isinstance(first, torch.Tensor) and not first.is_floating_point() and first.dim() >= 2:
        return int(first.shape[1])
    return 1


def _to_device(inputs: Any, device: str) -> Any:
    if isinstance(inputs, torch.Tensor):
        return inputs.to(device)
    if isinstance(inputs, dict):
        return {k: _to_device(v, device) for k, v in inputs.items()}
    if isinstance(inputs, (list, tuple)):
        return type(inputs)(_to_device(v, device) for v in inputs)
    return inputs


def _describe(inputs: Any) -> str:
    if isinstance(inputs, torch.Tensor):
        return f"a {inputs.dtype} tensor of shape {tuple(inputs.shape)}"
    return f"a {type(inputs).__name__}"


def stats_from_script(path: str, *, seq: int | None = None) -> ModelStats:
    """``shardwise plan --script file.py``: the file defines ``MODEL_SPEC`` (a dict), or
    ``build_model()`` and ``example_input(device)`` (one sample's input), measured on ``meta``."""
    if not os.path.exists(path):
        raise ConfigError(f"--script {path!r} does not exist", hint="give the path of a Python file")
    namespace = runpy.run_path(path, run_name="shardwise_plan")
    if "MODEL_SPEC" in namespace:
        shape = TransformerShape.from_dict(dict(namespace["MODEL_SPEC"]), name=os.path.basename(path))
        return transformer_stats(shape, seq=seq)
    if "build_model" not in namespace or "example_input" not in namespace:
        raise ConfigError(f"--script {path} defines neither MODEL_SPEC nor build_model() + example_input(device)",
                          hint="add MODEL_SPEC = {...} or both functions")
    return measure_module(namespace["build_model"], namespace["example_input"], seq=seq or int(namespace.get("SEQ", 1)),
                          name=os.path.basename(path))


def stats_from_model_script(path: str, *, seq: int | None = None) -> ModelStats:
    """``shardwise plan --model-script file.py``: a ``shardwise verify --script`` file
    (``build_model(seed)`` and ``make_batch(step, size)``; ``example_input(device)`` may stand for
    ``make_batch``). The model is built on ``meta`` and planned as ``Trainer(plan="auto")`` plans it:
    the shape of the first sample (``make_batch(0, 1)``'s inputs), ``seq`` overriding its length."""
    import inspect

    if not os.path.exists(path):
        raise ConfigError(f"--model-script {path!r} does not exist", hint="give the path of a Python file")
    namespace = runpy.run_path(path, run_name="shardwise_plan")
    build = namespace.get("build_model")
    if not callable(build) or not (callable(namespace.get("make_batch")) or callable(namespace.get("example_input"))):
        raise ConfigError(f"--model-script {path} defines no build_model() and make_batch(step, size)",
                          hint="define both, as for shardwise verify --script")
    takes_seed = bool(inspect.signature(build).parameters)
    with torch.device("meta"):  # nothing is allocated, whatever the model's size
        model = build(0) if takes_seed else build()
    if callable(namespace.get("make_batch")):
        inputs = namespace["make_batch"](0, 1)[0]
    else:
        inputs = namespace["example_input"]("cpu")
    stats = sample_stats(model, inputs, tokens_per_sample=seq)
    return stats if stats.name not in ("", "hf", "transformer") else _named(stats, os.path.basename(path))


def _named(stats: ModelStats, name: str) -> ModelStats:
    return replace(stats, name=name)
