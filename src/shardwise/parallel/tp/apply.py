"""Tensor (and sequence) parallel: the styles are data, ``parallelize_module`` applies them.

A :class:`TPStyles` maps module-name patterns (``fnmatch`` per dotted atom, as
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
adapter_input       (SP only) a LoRA adapter's dropout takes that gathered input as a local tensor
                    (:mod:`shardwise.parallel.tp.adapters`: how adapters follow their base layer)
adapter_sequence    (SP only) the replicated lora_B of a rowwise base, on the local sequence chunk
lm_head             colwise output projection; output all-gathered, or with ``loss_parallel``
                    left sharded over the vocabulary for torch's ``loss_parallel()``
replicate           leave the module replicated (its math is repeated on every TP rank)
colwise_fused2/3    colwise for a projection fused from 2 or 3 equal pieces (gate|up, q|k|v): each
                    rank holds its share of every piece (whole heads of q, k and v)
colwise_grouped     q|k|v fused with fewer key/value heads than query heads (Phi-3's qkv_proj under
                    GQA): each rank computes whole heads of q, k and v; the weight is held whole
                    and its gradient all-reduced over tp (:mod:`shardwise.parallel.tp.layers`)
experts             MoE experts held as 3-D tensors: every expert's MLP split like a dense one
==================  ==============================================================================

``colwise``/``rowwise`` on GPT-2's ``Conv1D`` (transposed weight), the fused styles and ``experts``
are shardwise's own styles (:mod:`shardwise.parallel.tp.layers`); the rest are torch's. Tied
weights (an LM head sharing the token embedding's matrix) stay one parameter: both layers are
split by vocabulary rows (``Shard(0)``), and after sharding the head is given the embedding's
DTensor again. Parameters no style covers are replicated; :func:`tp_share` says how much of the
model each rank keeps and :func:`apply_tp` logs the replicated layers by name.

Per block and step, without SP: 2 all-reduces of the activations forward (after attention's
output projection and the MLP's down projection) and 2 backward. With SP each all-reduce
becomes a reduce-scatter + all-gather pair of the same volume, and norms/dropout run on 1/tp
of the sequence (activation memory / tp).

:func:`derive_tp_styles` finds the standard shapes (q/k/v + output projection, MLP up/down pairs,
token and positional embeddings, LM head, norms) by module names and, failing names, by an
``in_features`` match between two Linear siblings. :func:`validate_tp` checks that tp divides every
sharded dimension and the head counts before any process-group work.

Model contract (torchtitan's): attention code reshapes with ``-1`` for the local width, or keeps
its head count in an attribute named ``n_head``/``n_heads``/``num_heads``/``n_kv_heads``, which
:func:`apply_tp` divides by tp after sharding.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from shardwise.errors import ConfigError
from shardwise.exports import renamed
from shardwise.parallel.chunked_loss import ChunkedHeadParallel, is_chunked_head
from shardwise.parallel.fp8 import float8_tp_style
from shardwise.parallel.tp.layers import (
    ColumnSplit,
    ExpertSplit,
    GroupedColumnSplit,
    RowSplit,
    fused_pieces,
    is_conv1d,
    qkv_widths,
)
from shardwise.parallel.tp.styles import HEAD_ATTRS, TPStyles, tp_share, validate_tp
from shardwise.runtime.logging import get_logger

log = get_logger("parallel")
__getattr__ = renamed(__name__, {"to_torch_plan": "to_torch_styles"})
_WIDTH_ATTRS = ("split_size",)  # widths of a fused projection's pieces, divided by tp like the head counts

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
        weight.register_hook(
            lambda g: (
                g.redistribute(placements=placements) if isinstance(g, DTensor) and g.placements != placements else g
            )
        )
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
        return ColwiseParallel(
            input_layouts=seq if sp else Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if not sp:  # the rest only matter when activations are split along the sequence
        return None
    if style == "pos_embedding":
        return PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(-2), use_local_output=True)
    if style == "sequence_parallel":
        return SequenceParallel()
    if style == "attention_input":
        return _GatherSequence()
    if style == "adapter_sequence":
        return SequenceParallel(use_local_output=True)
    if style == "adapter_input":
        return PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    return None


def _module_style(module: nn.Module, style: str, *, sp: bool, loss_parallel: bool) -> ParallelStyle | None:
    """torch's style for ``style`` (:func:`_style`), except for a head that ``chunked_loss``
    prepared (its own colwise style, whose output is the replicated hidden states while the head
    passes them through) and an FP8 layer that takes torchao's float8 counterpart with the same
    layouts (:func:`shardwise.parallel.fp8.float8_tp_style`)."""
    if style == "lm_head" and is_chunked_head(module):
        return ChunkedHeadParallel(sequence_parallel=sp, loss_parallel=loss_parallel)
    base = _style(style, sp=sp, loss_parallel=loss_parallel)
    if isinstance(base, (ColwiseParallel, RowwiseParallel)):
        fp8 = float8_tp_style(module, style, input_layouts=base.input_layouts[0], output_layouts=base.output_layouts[0])
        if fp8 is not None:
            return fp8
    return base


def to_torch_styles(styles: TPStyles, *, sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan (torch's name) for ``styles``: torch's styles, for nn.Linear/nn.Embedding."""
    out: dict[str, ParallelStyle] = {}
    for pattern, name in styles.entries:
        style = _style(name, sp=sequence_parallel, loss_parallel=loss_parallel)
        if style is not None:
            out[pattern] = style
    return out


def _own_style(module: nn.Module, style: str, parent: nn.Module | None = None) -> ParallelStyle | None:
    """shardwise's style for a Conv1D, a fused projection or MoE experts (None: torch's); ``parent``
    (the attention module) gives a grouped q|k|v its widths."""
    if style == "experts":
        return ExpertSplit()
    if style == "colwise_grouped":
        widths = qkv_widths(parent) if parent is not None else None
        if widths is None or sum(widths) != getattr(module, "out_features", -1):
            raise ConfigError(
                f"TP style 'colwise_grouped' on {type(module).__name__} needs its attention module's head counts "
                "and head_dim to split q|k|v",
                hint="mark it 'replicate' (and its partner), or use dp/zero/pp instead of tp",
            )
        return GroupedColumnSplit(widths)
    if style.startswith("colwise_fused"):
        return ColumnSplit(fused_pieces(style))
    if is_conv1d(module):
        return ColumnSplit() if style == "colwise" else RowSplit() if style == "rowwise" else None
    return None


def _ties(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module name, parameter name) that hold one shared parameter."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for name, module in model.named_modules():
        for pname, p in module._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((name, pname))
    return [group for group in holders.values() if len(group) > 1]


def _retie(model: nn.Module, groups: list[list[tuple[str, str]]]) -> None:
    """Give every holder of a tied weight the first holder's (sharded) parameter again."""
    for group in groups:
        first_module, first_name = group[0]
        keep = model.get_submodule(first_module)._parameters[first_name]
        for module_name, pname in group[1:]:
            module = model.get_submodule(module_name)
            other = module._parameters[pname]
            if other is keep:
                continue
            if isinstance(keep, DTensor) != isinstance(other, DTensor) or (
                    isinstance(keep, DTensor) and tuple(keep.placements) != tuple(other.placements)):
                where = lambda m, n: f"{m}.{n}" if m else n  # noqa: E731
                raise ConfigError(
                    f"tied weight {where(first_module, first_name)} and {where(module_name, pname)} "
                    "get different TP layouts "
                    f"({getattr(keep, 'placements', 'replicated')} vs {getattr(other, 'placements', 'replicated')})",
                    hint="give both the vocabulary split ('vocab_embedding' and 'lm_head'), or untie them",
                )
            module.register_parameter(pname, keep)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, styles: TPStyles | None = None, sequence_parallel: bool = False,
             loss_parallel: bool = False, plan: TPStyles | None = None) -> nn.Module:
    """Shard ``model`` over ``tp_mesh`` by ``styles`` in place (module doc); then divide head-count
    attributes of each attention module by tp so its reshapes see the local head count, give tied
    weights one parameter again, and log the matrices left replicated. (``plan=``: the deprecated
    name of ``styles``.)"""
    if plan is not None:
        warnings.warn("apply_tp(plan=...) is deprecated: use apply_tp(styles=...)", DeprecationWarning, stacklevel=2)
    styles = styles or plan
    if styles is None:
        raise TypeError("apply_tp() needs styles=")
    tp = tp_mesh.size()
    validate_tp(model, styles, tp=tp)
    matched = styles.matches(model)
    own = {name: _own_style(module, style, model.get_submodule(name.rpartition(".")[0]) if "." in name else model)
           for name, (module, style) in matched.items()}
    own = {name: style for name, style in own.items() if style is not None}
    if own and sequence_parallel:
        first = next(iter(own))
        raise ConfigError(f"sequence parallel is not available with {first} ({type(matched[first][0]).__name__}, style "
                          f"{matched[first][1]!r})", hint="drop sp from the plan")
    share, replicated = tp_share(model, styles, tp=tp)
    ties = _ties(model)
    torch_plan = {
        name: style
        for name, (module, style_name) in matched.items()
        if name not in own
        for style in [_module_style(module, style_name, sp=sequence_parallel, loss_parallel=loss_parallel)]
        if style is not None
    }
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    parallelize_module(model, tp_mesh, {**torch_plan, **own})
    # torch's SequenceParallel re-registers norm parameters as trainable: a frozen base stays frozen
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    _retie(model, ties)
    for module, style in matched.values():
        if style == "vocab_embedding":
            module.register_forward_pre_hook(_GradLikeWeight())
        if style == "attention_input":
            fused = any(s.startswith("colwise_fused") or s == "colwise_grouped"
                        for n, (_, s) in matched.items() if n.startswith(_name_of(model, module) + "."))
            for attr in HEAD_ATTRS + (_WIDTH_ATTRS if fused else ()):
                if isinstance(getattr(module, attr, None), int):
                    setattr(module, attr, getattr(module, attr) // tp)
            if fused:
                _local_config(module, tp)
    big = [(n, c) for n, c in replicated if c >= 0.01 * sum(p.numel() for p in model.parameters())]
    if big and tp_mesh.get_local_rank() == 0:
        names = ", ".join(f"{n or type(model).__name__} ({c:,})" for n, c in big[:4]) + (
            f" and {len(big) - 4} more" if len(big) > 4 else ""
        )
        log.warning("tp=%d keeps %.1f%% of the parameters on every rank; replicated (no TP style covers them): %s",
                    tp, 100 * share, names)
    return model


def _local_config(module: nn.Module, tp: int) -> None:
    """An attention module that slices its fused q|k|v by the head counts of its (shared) model
    config (Phi-3: ``qkv[..., :config.num_attention_heads * head_dim]``) gets a copy of the config
    with the local head counts; the model's own config is left as it is."""
    config = getattr(module, "config", None)
    counts = {a: getattr(config, a, None) for a in ("num_attention_heads", "num_key_value_heads")}
    if config is None or not any(isinstance(v, int) for v in counts.values()):
        return
    local = copy.copy(config)
    for attr, value in counts.items():
        if isinstance(value, int):
            setattr(local, attr, value // tp)
    module.config = local


def _name_of(model: nn.Module, target: nn.Module) -> str:
    return next((n for n, m in model.named_modules() if m is target), "")
