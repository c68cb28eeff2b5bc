"""LoRA adapters under tensor parallel: each adapter follows its base layer's style.

A LoRA layer computes ``y = W x + s B (A x)``. Split so that ``B A x`` has the layout of ``W x``
with no communication beyond the base layer's own:

==================  =========================  ======================  =====================
base style          ``base_layer``             ``lora_A`` (r x in)     ``lora_B`` (out x r)
==================  =========================  ======================  =====================
colwise (+ _rep,    split by output features   replicated: ``A x`` is  split like the base's
fused pieces)                                  the whole r-vector      output (same style)
rowwise (+ _rep)    split by input features    split like the base's   replicated: ``B`` maps
                                               input (same style:      the reduced r-vector
                                               the partial r-vectors   to the whole output
                                               are all-reduced, or
                                               reduce-scattered over
                                               the sequence under SP)
==================  =========================  ======================  =====================

Communication added per adapter and step: none for a column-wise base (the gradient of ``A x``
is all-reduced by ``lora_B``'s input, as the base's input gradient is); for a row-wise base one
all-reduce (SP: reduce-scatter) of the ``r``-wide partial products forward and none backward,
``r / out`` of the base's own. The replicated halves compute the same values on every TP rank, so
their gradients agree there without reduction (the clipping norm counts them once).

Under sequence parallelism the input of a column-wise group arrives as a replicated DTensor
(:mod:`shardwise.parallel.tp`'s ``attention_input``); the adapter's dropout takes it as the local
(whole) tensor (style ``adapter_input``), which is what the replicated ``lora_A`` multiplies. A
row-wise base's output is sequence-sharded there, so its ``lora_B`` sees only this rank's tokens:
it is a sequence-parallel region like a norm (style ``adapter_sequence``: replicated DTensor
weights whose partial gradients are summed over tp, output kept local).

:func:`adapter_styles` rewrites TP styles whose entries name peft LoRA layers (``...q_proj``, as
derived styles or a user's name them) into entries for their pieces, with PEFT's own module
names: ``...q_proj.base_layer``, ``...q_proj.lora_A.*``, ``...q_proj.lora_B.*``,
``...q_proj.lora_dropout.*``. Entries that already name the pieces are kept. An adapter on a
layer TP cannot pair (an embedding, the LM head, MoE experts) is refused with one line.
"""

from __future__ import annotations

from torch import nn

from shardwise.errors import ConfigError
from shardwise.exports import renamed
from shardwise.models.lora import is_adapter_module, is_lora_layer
from shardwise.parallel.tp.styles import TPStyles, _match

__getattr__ = renamed(__name__, {"adapter_plan": "adapter_styles"})  # the old names, deprecated

_COLUMN = ("colwise", "colwise_rep", "colwise_fused2", "colwise_fused3")
_ROW = ("rowwise", "rowwise_rep")


def _pieces(prefix: str, style: str) -> list[tuple[str, str]]:
    if style in _COLUMN:
        return [(f"{prefix}.base_layer", style), (f"{prefix}.lora_A.*", "replicate"), (f"{prefix}.lora_B.*", style),
                (f"{prefix}.lora_dropout.*", "adapter_input")]
    # under SP the row-wise output is sequence-sharded: B then sees only this rank's tokens, so it is
    # a sequence-parallel region like a norm (replicated DTensor weights whose gradients are summed)
    return [(f"{prefix}.base_layer", style), (f"{prefix}.lora_A.*", style), (f"{prefix}.lora_B.*", "adapter_sequence")]


def adapter_styles(model: nn.Module, styles: TPStyles) -> TPStyles:
    """``styles`` with every entry naming a LoRA layer expanded into its pieces (module doc); entries
    that name pieces themselves come last, so they win over the expansion."""
    layers = [name for name, module in model.named_modules() if is_lora_layer(module)]
    if not layers:
        return styles
    out: list[tuple[str, str]] = []
    own: list[tuple[str, str]] = []  # the styles' own entries for adapter pieces
    for pattern, style in styles.entries:
        if is_adapter_module(pattern):
            own.append((pattern, style))
            continue
        hits = [name for name in layers if _match(name, pattern)]
        base_hits = [name for name in layers if _match(f"{name}.base_layer", pattern)]
        if not (hits or base_hits) or style == "replicate":
            out.append((pattern, style))
            continue
        if style not in _COLUMN + _ROW:
            raise ConfigError(
                f"tp cannot split the LoRA adapter of {(hits or base_hits)[0]}: its base layer's TP style is {style!r}",
                hint="adapt only the attention and MLP projections (drop it from lora targets), or mark it 'replicate'",
            )
        out += _pieces(pattern if hits else pattern.removesuffix(".base_layer"), style)
    return TPStyles(tuple(dict.fromkeys(out + own)))
