"""Tensor (and sequence) parallel: a plan is data, ``parallelize_module`` applies it.

A :class:`TPPlan` maps module-name patterns (``fnmatch`` per dotted atom, as
``parallelize_module`` reads them) to style names:

==================  ==============================================================================
style               what it does (Megatron-LM, Shoeybi et al. 2019; Korthikanti et al. 2022 for SP)
==================  ==============================================================================
colwise             Linear weight split by output features; input replicated, output stays
                    sharded on the last dim (feeds its rowwise partner, no communication)
rowwise             Linear weight split by input features; input sharded on the last dim,
                    partial outputs all-reduced (SP: reduce-scattered along the sequence)
colwise_rep         colwise without a partner: output all-gathered to replicated
rowwise_rep         rowwise without a partner: replicated input sliced locally, output all-reduced
vocab_embedding     Embedding split by vocabulary rows; out-of-range ids give zeros, all-reduce
embedding_colwise   Embedding split by embedding dim; output all-gathered
pos_embedding       (SP only) positional embedding output sliced to the local sequence chunk
sequence_parallel   (SP only) norm/dropout region computed on the local sequence chunk
attention_input     (SP only) all-gather the sequence before a colwise group (attention, MLP)
lm_head             colwise output projection; output all-gathered, or with ``loss_parallel``
                    left sharded over the vocabulary for torch's ``loss_parallel()``
replicate           leave the module replicated (its math is repeated on every TP rank)
==================  ==============================================================================

Per block and step, without SP: 2 all-reduces of the activations forward (after attention's
output projection and the MLP's down projection) and 2 backward. With SP each all-reduce
becomes a reduce-scatter + all-gather pair of the same volume, and norms/dropout run on 1/tp
of the sequence (activation memory / tp).

:func:`derive_tp_plan` finds the standard shapes (q/k/v + output projection, MLP up/down pairs,
token and positional embeddings, LM head, norms) by module names and, failing names, by an
``in_features`` match between two Linear siblings. :func:`validate_tp` checks that tp divides every
sharded dimension and the head counts before any process-group work.

Model contract (torchtitan's): attention code reshapes with ``-1`` for the local width, or keeps
its head count in an attribute named ``n_head``/``n_heads``/``num_heads``/``n_kv_heads``, which
:func:`apply_tp` divides by tp after sharding.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any, Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from shardwise.errors import ConfigError

STYLES = (
    "colwise", "rowwise", "colwise_rep", "rowwise_rep", "vocab_embedding", "embedding_colwise",
    "pos_embedding", "sequence_parallel", "attention_input", "lm_head", "replicate",
)
HEAD_ATTRS = ("n_head", "n_heads", "num_heads", "n_kv_heads", "num_kv_heads", "num_key_value_heads")

_COL = {"q", "k", "v", "wq", "wk", "wv", "q_proj", "k_proj", "v_proj", "qkv", "c_attn", "query", "key", "value",
        "w1", "w3", "fc1", "c_fc", "up", "up_proj", "gate", "gate_proj", "fc_in", "w_in", "in_proj"}
_ROW = {"o", "wo", "o_proj", "out_proj", "proj", "c_proj", "out", "dense", "w2", "fc2", "down", "down_proj",
        "fc_out", "w_out"}
_HEAD = {"lm_head", "head", "output", "out_head", "unembed", "logits"}
_POS = {"wpe", "pos", "pos_emb", "pos_embedding", "position_embeddings", "pos_embed"}
_NORMS = (nn.LayerNorm, nn.RMSNorm)
_UNSHARDABLE = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.RNNBase)


@dataclass(frozen=True)
class TPOptions:
    """``plan``: explicit pattern -> style mapping (else annotations, else derived);
    ``loss_parallel``: keep the LM head's logits vocabulary-sharded (the loss must then be
    computed inside ``ParallelModel.step_context()``)."""

    plan: Mapping[str, str] | None = None
    loss_parallel: bool = False


@dataclass(frozen=True)
class TPPlan:
    """Ordered (pattern, style) pairs; module paths are dotted names as in ``named_modules``."""

    entries: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, mapping: Mapping[str, str]) -> TPPlan:
        for pattern, style in mapping.items():
            if style not in STYLES:
                raise ConfigError(f"TP plan style {style!r} for {pattern!r} is unknown", hint=f"use one of {', '.join(STYLES)}")
        return cls(tuple(mapping.items()))

    def as_dict(self) -> dict[str, str]:
        return dict(self.entries)

    def matches(self, model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
        """Module path -> (module, style) for every module a pattern names."""
        out: dict[str, tuple[nn.Module, str]] = {}
        for name, module in model.named_modules():
            for pattern, style in self.entries:
                if name and _match(name, pattern):
                    out[name] = (module, style)
        return out


def _match(name: str, pattern: str) -> bool:
    atoms, pats = name.split("."), pattern.split(".")
    return len(atoms) == len(pats) and all(fnmatch.fnmatchcase(a, p) for a, p in zip(atoms, pats))


# -- derivation --------------------------------------------------------------------------------
def derive_tp_plan(model: nn.Module, *, tp: int) -> TPPlan:
    """The standard plan for a transformer-like model (module doc); raises ConfigError for a
    layer type TP cannot shard, or when nothing shardable is found."""
    for name, module in model.named_modules():
        if isinstance(module, _UNSHARDABLE):
            raise ConfigError(
                f"tp={tp} cannot shard {name or 'the model'} ({type(module).__module__}.{type(module).__name__}: "
                "its projections are fused inside one module)",
                hint="build the layer from separate nn.Linear projections (as shardwise's GPT does), or use dp/zero/pp instead of tp",
            )
    plan: dict[str, str] = {}
    paired: set[str] = set()
    for parent_name, parent in model.named_modules():
        linears = [(n, m) for n, m in parent.named_children() if isinstance(m, nn.Linear)]
        cols = [n for n, _ in linears if n in _COL]
        rows = [n for n, _ in linears if n in _ROW]
        if not (cols and rows):
            # Structural fallback: exactly two Linear siblings where the first feeds the second.
            if len(linears) == 2 and linears[0][1].out_features == linears[1][1].in_features and not (
                {linears[0][0], linears[1][0]} & _HEAD
            ):
                cols, rows = [linears[0][0]], [linears[1][0]]
            else:
                continue
        prefix = f"{parent_name}." if parent_name else ""
        for n in cols:
            plan[prefix + n] = "colwise"
        for n in rows:
            plan[prefix + n] = "rowwise"
        paired.update(prefix + n for n in cols + rows)
        if parent_name:
            plan[parent_name] = "attention_input"
    if not paired:
        raise ConfigError(
            f"tp={tp} found no colwise/rowwise Linear pair in {type(model).__name__}",
            hint="annotate layers with shardwise.shard(layer, 'colwise'/'rowwise') or pass a TP plan; or use dp/zero instead of tp",
        )
    head = _find_head(model, paired)
    vocab = head[1].out_features if head else None
    if head:
        plan[head[0]] = "lm_head"
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Embedding):
            if leaf in _POS:
                plan[name] = "pos_embedding"
            elif vocab is None or module.num_embeddings == vocab:
                plan[name] = "vocab_embedding"
        elif isinstance(module, _NORMS):
            plan[name] = "sequence_parallel"
    return TPPlan.of(_generalize(plan))


_BLOCK_INDEX = re.compile(r"\.\d+\.")  # a block index between two names


def _generalize(plan: dict[str, str]) -> dict[str, str]:
    """``blocks.0.attn.q``, ``blocks.1.attn.q`` -> ``blocks.*.attn.q`` when every block agrees."""
    groups: dict[str, set[str]] = {}
    for name, style in plan.items():
        groups.setdefault(_BLOCK_INDEX.sub(".*.", name), set()).add(style)
    out: dict[str, str] = {}
    for name, style in plan.items():
        key = _BLOCK_INDEX.sub(".*.", name)
        out[key if len(groups[key]) == 1 else name] = style
    return out


def _find_head(model: nn.Module, paired: set[str]) -> tuple[str, nn.Linear] | None:
    candidates = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in paired]
    named = [(n, m) for n, m in candidates if n.rsplit(".", 1)[-1] in _HEAD]
    if named:
        return named[-1]
    embeddings = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    by_vocab = [(n, m) for n, m in candidates if m.out_features in embeddings]
    return by_vocab[-1] if by_vocab else None


# -- validation ---------------------------------------------------------------------------------
def _sharded_sizes(module: nn.Module, style: str) -> dict[str, int]:
    if isinstance(module, nn.Linear):
        if style in ("colwise", "colwise_rep", "lm_head"):
            return {"out_features": module.out_features}
        if style in ("rowwise", "rowwise_rep"):
            return {"in_features": module.in_features}
    if isinstance(module, nn.Embedding):
        if style == "vocab_embedding":
            return {"num_embeddings": module.num_embeddings}
        if style == "embedding_colwise":
            return {"embedding_dim": module.embedding_dim}
    if style == "attention_input":
        heads = {a: getattr(module, a) for a in HEAD_ATTRS if isinstance(getattr(module, a, None), int)}
        head_dim = getattr(module, "head_dim", None)
        if not heads and isinstance(head_dim, int) and head_dim > 0:
            # Heads implied by the width: q's output features / head_dim (``view(B, T, -1, head_dim)``).
            first = next((m for m in module.children() if isinstance(m, nn.Linear)), None)
            if first is not None and first.out_features % head_dim == 0:
                heads = {"heads": first.out_features // head_dim}
        return heads
    return {}


def validate_tp(model: nn.Module, plan: TPPlan, *, tp: int) -> None:
    """Raise ConfigError unless tp divides every dimension the plan shards (and the head counts)."""
    sizes: list[tuple[str, int]] = []
    for name, (module, style) in plan.matches(model).items():
        if style in ("colwise", "rowwise", "colwise_rep", "rowwise_rep", "lm_head") and not isinstance(module, nn.Linear):
            raise ConfigError(f"TP style {style!r} on {name} needs an nn.Linear, not {type(module).__name__}",
                              hint="shard nn.Linear/nn.Embedding layers only, or mark this module 'replicate'")
        if style in ("vocab_embedding", "embedding_colwise", "pos_embedding") and not isinstance(module, nn.Embedding):
            raise ConfigError(f"TP style {style!r} on {name} needs an nn.Embedding, not {type(module).__name__}",
                              hint="shard nn.Linear/nn.Embedding layers only, or mark this module 'replicate'")
        sizes += [(f"{name}.{attr}", size) for attr, size in _sharded_sizes(module, style).items()]
    bad = [(what, size) for what, size in sizes if size % tp]
    if bad:
        what, size = bad[0]
        good = [d for d in range(2, 65) if all(s % d == 0 for _, s in sizes)][:4]
        raise ConfigError(f"tp={tp} does not divide {what}={size}",
                          hint=f"use tp={' or tp='.join(map(str, good))}" if good else "this model cannot be split by tp; use dp/zero instead")


# -- application --------------------------------------------------------------------------------
class _GatherSequence(ParallelStyle):
    """Before a colwise group under SP: all-gather the first input's sequence shards (Shard(1) ->
    Replicate), as a DTensor the colwise layers consume; other arguments pass through."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def pre_hook(_mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            if not args:
                return args
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
            return (x.redistribute(device_mesh, (Replicate(),)), *args[1:])

        module.register_forward_pre_hook(pre_hook)
        return module


class _GradLikeWeight:
    """Forward pre-hook for a vocabulary-sharded embedding. torch's embedding backward yields a
    Replicate (whole-table) gradient for a row-sharded table; a gradient hook slices it back to the
    weight's layout (local, no communication), so gradient and optimizer state are 1/tp like the
    weight (FSDP does the same when it reduces). The hook is (re)attached at forward time because
    ``to_empty`` (meta-device init) replaces the parameter object and its hooks."""

    def __init__(self) -> None:
        self.hooked: nn.Parameter | None = None

    def __call__(self, module: nn.Module, args: Any) -> None:
        weight = module.weight
        if weight is self.hooked or not isinstance(weight, DTensor) or not weight.requires_grad:
            return
        placements = weight.placements
        weight.register_hook(lambda g: g.redistribute(placements=placements) if isinstance(g, DTensor) and g.placements != placements else g)
        self.hooked = weight


def _style(style: str, *, sp: bool, loss_parallel: bool) -> ParallelStyle | None:
    seq = Shard(1)
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel(output_layouts=seq if sp else Replicate())
    if style == "colwise_rep":
        return ColwiseParallel(output_layouts=Replicate())
    if style == "rowwise_rep":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq if sp else Replicate())
    if style == "vocab_embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq if sp else Replicate())
    if style == "embedding_colwise":
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=seq if sp else Replicate())
    if style == "lm_head":
        return ColwiseParallel(input_layouts=seq if sp else Replicate(), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                               use_local_output=not loss_parallel)
    if not sp:  # the rest only matter when activations are split along the sequence
        return None
    if style == "pos_embedding":
        return PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(-2), use_local_output=True)
    if style == "sequence_parallel":
        return SequenceParallel()
    if style == "attention_input":
        return _GatherSequence()
    return None


def to_torch_plan(plan: TPPlan, *, sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan for ``plan``."""
    out: dict[str, ParallelStyle] = {}
    for pattern, name in plan.entries:
        style = _style(name, sp=sequence_parallel, loss_parallel=loss_parallel)
        if style is not None:
            out[pattern] = style
    return out


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, plan: TPPlan, sequence_parallel: bool = False,
             loss_parallel: bool = False) -> nn.Module:
    """Shard ``model`` over ``tp_mesh`` in place (module doc); then divide head-count attributes
    of each attention module by tp so its reshapes see the local head count."""
    tp = tp_mesh.size()
    validate_tp(model, plan, tp=tp)
    matched = plan.matches(model)
    parallelize_module(model, tp_mesh, to_torch_plan(plan, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel))
    for module, style in matched.values():
        if style == "vocab_embedding":
            module.register_forward_pre_hook(_GradLikeWeight())
        if style == "attention_input":
            for attr in HEAD_ATTRS:
                if isinstance(getattr(module, attr, None), int):
                    setattr(module, attr, getattr(module, attr) // tp)
    return model
