"""The data side of tensor parallelism: :class:`TPStyles` (module-name patterns -> style names,
what torch calls a ``parallelize_plan``), their automatic derivation for common transformer shapes,
their validation, and how much of a model they shard. The styles themselves are applied by
:mod:`shardwise.parallel.tp` (see its doc for the
table of styles and their communication).

:func:`derive_tp_styles` finds q/k/v (or fused q|k|v) + output projections and MLP up/gate/down pairs
by module names (``q_proj``, ``c_attn``, ``fc1``, ``down_proj`` ...) or by shape (two Linear or
Conv1D siblings where the first feeds the second), MoE experts held as 3-D tensors, the token and
positional embeddings, the LM head and the norms. :func:`validate_tp` checks that tp divides every
sharded dimension and the head counts before any process-group work, naming the layer.
"""

from __future__ import annotations

import fnmatch
import re
import warnings
from dataclasses import dataclass
from typing import Mapping

from torch import nn

from shardwise.errors import ConfigError
from shardwise.exports import renamed
from shardwise.models.lora import see_through
from shardwise.parallel.tp.layers import expert_weights, in_out, inner_sizes, is_conv1d, qkv_widths

__getattr__ = renamed(
    __name__, {"TPPlan": "TPStyles", "derive_tp_plan": "derive_tp_styles"}
)  # the old names, deprecated

STYLES = (
    "colwise",
    "rowwise",
    "colwise_rep",
    "rowwise_rep",
    "vocab_embedding",
    "embedding_colwise",
    "pos_embedding",
    "sequence_parallel",
    "attention_input",
    "lm_head",
    "replicate",
    "colwise_fused2",
    "colwise_fused3",
    "colwise_grouped",
    "experts",
    "adapter_input",
    "adapter_sequence",
)
_OWN = ("colwise_fused2", "colwise_fused3", "colwise_grouped", "experts")  # always shardwise's styles (tp/layers.py)
HEAD_ATTRS = ("n_head", "n_heads", "num_heads", "n_kv_heads", "num_kv_heads", "num_key_value_heads")

_COL = {
    "q",
    "k",
    "v",
    "wq",
    "wk",
    "wv",
    "q_proj",
    "k_proj",
    "v_proj",
    "qkv",
    "c_attn",
    "query",
    "key",
    "value",
    "w1",
    "w3",
    "fc1",
    "c_fc",
    "up",
    "up_proj",
    "gate",
    "gate_proj",
    "fc_in",
    "w_in",
    "in_proj",
    "qkv_proj",
    "query_key_value",
    "Wqkv",
    "gate_up_proj",
}
_ROW = {"o", "wo", "o_proj", "out_proj", "proj", "c_proj", "out", "dense", "w2", "fc2", "down", "down_proj",
        "fc_out", "w_out"}
_HEAD = {"lm_head", "head", "output", "out_head", "unembed", "logits"}
_POS = {"wpe", "pos", "pos_emb", "pos_embedding", "position_embeddings", "pos_embed"}
_NORMS = (nn.LayerNorm, nn.RMSNorm)
_UNSHARDABLE = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.RNNBase)


@dataclass(frozen=True, init=False)
class TPOptions:
    """``styles``: explicit pattern -> style mapping (else annotations, else derived);
    ``loss_parallel``: keep the LM head's logits vocabulary-sharded (the loss must then be
    computed inside ``ParallelModel.step_context()``). ``plan=`` is the deprecated name of ``styles``."""

    styles: Mapping[str, str] | None = None
    loss_parallel: bool = False

    def __init__(self, styles: Mapping[str, str] | None = None, loss_parallel: bool = False, *,
                 plan: Mapping[str, str] | None = None) -> None:
        if plan is not None:
            warnings.warn(
                "TPOptions(plan=...) is deprecated: use TPOptions(styles=...)", DeprecationWarning, stacklevel=2
            )
            styles = plan if styles is None else styles
        object.__setattr__(self, "styles", styles)
        object.__setattr__(self, "loss_parallel", loss_parallel)

    @property
    def plan(self) -> Mapping[str, str] | None:
        """Deprecated: :attr:`styles`."""
        warnings.warn("TPOptions.plan is deprecated: use TPOptions.styles", DeprecationWarning, stacklevel=2)
        return self.styles


@dataclass(frozen=True)
class TPStyles:
    """Ordered (pattern, style) pairs; module paths are dotted names as in ``named_modules``."""

    entries: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, mapping: Mapping[str, str]) -> TPStyles:
        for pattern, style in mapping.items():
            if style not in STYLES:
                raise ConfigError(
                    f"TP plan style {style!r} for {pattern!r} is unknown", hint=f"use one of {', '.join(STYLES)}"
                )
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
def derive_tp_styles(model: nn.Module, *, tp: int) -> TPStyles:
    """The standard styles for a transformer-like model (module doc); raises ConfigError for a
    layer type TP cannot shard, or when nothing shardable is found."""
    for name, module in model.named_modules():
        if isinstance(module, _UNSHARDABLE):
            raise ConfigError(
                f"tp={tp} cannot shard {name or 'the model'} ({type(module).__module__}.{type(module).__name__}: "
                "its projections are fused inside one module)",
                hint="build the layer from separate nn.Linear projections (as shardwise's GPT does), "
                "or use dp/zero/pp instead of tp",
            )
    styles: dict[str, str] = {}
    paired: set[str] = set()
    for parent_name, parent in model.named_modules():
        # a peft LoRA layer is derived as the layer it wraps (shardwise.parallel.tp.adapters splits its pieces)
        linears = [(n, see_through(m)) for n, m in parent.named_children() if in_out(see_through(m)) is not None]
        cols = [n for n, _ in linears if n in _COL]
        rows = [n for n, _ in linears if n in _ROW]
        if not (cols and rows):
            # Structural fallback: exactly two Linear siblings where the first feeds the second.
            if len(linears) == 2 and in_out(linears[0][1])[1] == in_out(linears[1][1])[0] and not (  # type: ignore[index]
                {linears[0][0], linears[1][0]} & _HEAD
            ):
                cols, rows = [linears[0][0]], [linears[1][0]]
            else:
                continue
        prefix = f"{parent_name}." if parent_name else ""
        sizes = dict(linears)
        fused = _fused_pieces(sizes, cols, rows, prefix, tp=tp, parent=parent)
        for n in cols:
            styles[prefix + n] = "colwise_grouped" if fused < 0 else f"colwise_fused{fused}" if fused > 1 else "colwise"
        for n in rows:
            styles[prefix + n] = "rowwise"
        paired.update(prefix + n for n in cols + rows)
        if parent_name:
            styles[parent_name] = "attention_input"
    for name, module in model.named_modules():
        if expert_weights(module) is not None:
            styles[name] = "experts"
            paired.add(name)
    if not paired:
        raise ConfigError(
            f"tp={tp} found no colwise/rowwise Linear pair in {type(model).__name__}",
            hint="annotate layers with shardwise.shard(layer, 'colwise'/'rowwise') or pass TP styles "
            "(TPOptions(styles=...)); or use dp/zero instead of tp",
        )
    head = _find_head(model, paired)
    vocab = head[1].out_features if head else None
    if head:
        styles[head[0]] = "lm_head"
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Embedding):
            if leaf in _POS:
                styles[name] = "pos_embedding"
            elif vocab is None or module.num_embeddings == vocab:
                styles[name] = "vocab_embedding"
        elif isinstance(module, _NORMS):
            styles[name] = "sequence_parallel"
    return TPStyles.of(_generalize(styles))


_FUSED_QKV = ("qkv", "c_attn", "query_key_value", "wqkv")


def _fused_pieces(sizes: dict[str, nn.Module], cols: list[str], rows: list[str], prefix: str, *, tp: int,
                  parent: nn.Module | None = None) -> int:
    """How many equal projections one column layer fuses (1: none; -1: q|k|v of unequal widths): a
    lone column layer whose width differs from its row partner's input is q|k|v (named like
    ``c_attn``/``qkv_proj``: 3 equal pieces, or grouped-query q|k|v whose widths the attention
    module's head counts and ``head_dim`` give, ``colwise_grouped``) or gate|up (``gate_up_proj``:
    2 equal pieces); anything else cannot be split head-aligned and is named in the error."""
    if len(cols) != 1 or len(rows) != 1:
        return 1
    out, inner = in_out(sizes[cols[0]])[1], in_out(sizes[rows[0]])[0]  # type: ignore[index]
    if out == inner:
        return 1
    name = cols[0].lower()
    pieces = 3 if any(k in name for k in _FUSED_QKV) else 2 if "gate_up" in name else 0
    if pieces and out == pieces * inner:
        return pieces
    widths = qkv_widths(parent) if pieces == 3 and parent is not None else None
    if widths is not None and sum(widths) == out and widths[0] == inner:
        return -1
    raise ConfigError(
        f"tp={tp} cannot shard {prefix}{cols[0]}: it fuses projections of unequal widths ({out} outputs "
        f"feed {prefix}{rows[0]}'s {inner} inputs)",
        hint="pass TP styles that mark it 'replicate' (and its partner 'replicate'), or use dp/zero/pp instead of tp",
    )


_BLOCK_INDEX = re.compile(r"\.\d+\.")  # a block index between two names


def _generalize(styles: dict[str, str]) -> dict[str, str]:
    """``blocks.0.attn.q``, ``blocks.1.attn.q`` -> ``blocks.*.attn.q`` when every block agrees."""
    groups: dict[str, set[str]] = {}
    for name, style in styles.items():
        groups.setdefault(_BLOCK_INDEX.sub(".*.", name), set()).add(style)
    out: dict[str, str] = {}
    for name, style in styles.items():
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
    if is_conv1d(module) or style in _OWN:
        return inner_sizes(module, style)
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


def validate_tp(model: nn.Module, styles: TPStyles, *, tp: int) -> None:
    """Raise ConfigError unless tp divides every dimension the styles shard (and the head counts)."""
    sizes: list[tuple[str, int]] = []
    for name, (module, style) in styles.matches(model).items():
        linear_like = isinstance(module, nn.Linear) or (is_conv1d(module) and style in ("colwise", "rowwise"))
        if style == "colwise_grouped" and not isinstance(module, nn.Linear):
            raise ConfigError(f"TP style 'colwise_grouped' on {name} needs an nn.Linear, not {type(module).__name__}",
                              hint="mark this module 'replicate'")
        if style in (
            "colwise",
            "rowwise",
            "colwise_rep",
            "rowwise_rep",
            "lm_head",
            "colwise_fused2",
            "colwise_fused3",
        ) and not (linear_like or (style.startswith("colwise_fused") and in_out(module))):
            raise ConfigError(
                f"TP style {style!r} on {name} needs an nn.Linear, not {type(module).__name__} (or GPT-2's Conv1D)",
                hint="shard nn.Linear/Conv1D/nn.Embedding layers only, or mark this module 'replicate'",
            )
        if style == "experts" and expert_weights(module) is None:
            raise ConfigError(
                f"TP style 'experts' on {name} needs 3-D expert tensors "
                "(gate_up/down, applied with F.linear per expert)",
                hint="mark this module 'replicate'",
            )
        if style in ("vocab_embedding", "embedding_colwise", "pos_embedding") and not isinstance(module, nn.Embedding):
            raise ConfigError(f"TP style {style!r} on {name} needs an nn.Embedding, not {type(module).__name__}",
                              hint="shard nn.Linear/nn.Embedding layers only, or mark this module 'replicate'")
        sizes += [(f"{name}.{attr}", size) for attr, size in _sharded_sizes(module, style).items()]
    bad = [(what, size) for what, size in sizes if size % tp]
    if bad:
        what, size = bad[0]
        good = [d for d in range(2, 65) if all(s % d == 0 for _, s in sizes)][:4]
        raise ConfigError(
            f"tp={tp} does not divide {what}={size}",
            hint=f"use tp={' or tp='.join(map(str, good))}"
            if good
            else "this model cannot be split by tp; use dp/zero instead",
        )


def tp_share(model: nn.Module, styles: TPStyles, *, tp: int) -> tuple[float, list[tuple[str, int]]]:
    """The fraction of the model's parameters each TP rank keeps, and the matrices that no entry
    of the styles names at all (``(module name, parameters)``, largest first): layers replicated
    without anyone having asked for it (a norm, a positional embedding or a 'replicate' entry is
    replicated on purpose and not listed)."""
    sharding = {
        "colwise",
        "rowwise",
        "colwise_rep",
        "rowwise_rep",
        "vocab_embedding",
        "embedding_colwise",
        "lm_head",
        *_OWN,
    } - {"colwise_grouped"}  # computed split, held whole (layers.GroupedColumnSplit)
    matched = styles.matches(model)
    covered = {
        id(p)
        for _, (m, style) in matched.items()
        if style in sharding
        for p in m.parameters(recurse=False)
        if not (is_conv1d(m) and style == "rowwise" and p.dim() == 1) and not (style == "experts" and p.dim() < 3)
    }
    named = {id(p) for _, (m, _) in matched.items() for p in m.parameters(recurse=False)}
    total = kept = 0.0
    replicated: dict[str, int] = {}
    seen: set[int] = set()
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel()
            kept += p.numel() / tp if id(p) in covered else p.numel()
            if id(p) not in named and p.dim() >= 2:
                replicated[name] = replicated.get(name, 0) + p.numel()
    return (kept / total if total else 1.0), sorted(replicated.items(), key=lambda kv: -kv[1])
