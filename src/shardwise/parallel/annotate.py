"""MindSpore-style sharding annotations: ``shardwise.shard(layer, strategy)``.

``strategy`` is a style name (``"colwise"``, ``"rowwise"``, ``"vocab_embedding"``,
``"embedding_colwise"``, ``"replicate"``, ...; see :mod:`shardwise.parallel.tp`) or a MindSpore
strategy tuple, read with MindSpore's MatMul convention ``x @ W`` with ``W`` of shape (in, out):

==============================  ==============================================================
``nn.Linear`` strategy          meaning
==============================  ==============================================================
``((1, 1), (1, k))``            weight split by output features -> ``colwise``
``((1, k), (k, 1))``            contraction dim split (partial sums all-reduced) -> ``rowwise``
``((k, 1), (1, 1))``            batch split, weight whole -> ``replicate`` (data parallel comes
                                from the plan's dp/shard degrees)
==============================  ==============================================================

For ``nn.Embedding`` the first tuple is the table (vocab, dim): ``((1, k), (1, 1))`` splits the
embedding dim (``embedding_colwise``), ``((k, 1), (1, 1))`` the vocabulary (``vocab_embedding``).
``k`` must equal the plan's tp (``((1, 8), (1, 1))`` in the reference guide's ``LargeModel`` is
written for tp=8).

Partner inference (Megatron's pairing): a ``colwise`` Linear keeps its output sharded when exactly
one later, unannotated Linear sibling consumes its width (``in_features == out_features``); that
sibling becomes ``rowwise``. Likewise an annotated ``rowwise`` layer pulls in exactly one earlier
unannotated sibling as ``colwise``. Without an unambiguous partner the layer gathers its own output
(``colwise_rep``) or slices its replicated input (``rowwise_rep``).

The annotation is stored on the module (``module._shardwise_strategy``), as MindSpore stores a
primitive's strategy on the primitive; nothing global is kept.
"""

from __future__ import annotations

from typing import Any, TypeVar

from torch import nn

from shardwise.errors import ConfigError
from shardwise.exports import renamed
from shardwise.parallel.tp.styles import STYLES, TPStyles

__getattr__ = renamed(__name__, {"annotated_plan": "annotated_styles"})  # the old names, deprecated

ATTR = "_shardwise_strategy"
M = TypeVar("M", bound=nn.Module)


def shard(module: M, strategy: str | tuple[tuple[int, ...], ...]) -> M:
    """Annotate ``module`` with a TP style or MindSpore strategy tuple; returns ``module``."""
    if isinstance(strategy, str):
        if strategy not in STYLES:
            raise ConfigError(
                f"shard strategy {strategy!r} is unknown",
                hint=f"use one of {', '.join(STYLES)} or a tuple like ((1, 1), (1, 2))",
            )
    elif not _is_strategy_tuple(strategy):
        raise ConfigError(
            f"shard strategy {strategy!r} is not a pair of integer tuples", hint="for example ((1, 2), (1, 1))"
        )
    if not isinstance(module, (nn.Linear, nn.Embedding)) and strategy not in (
        "replicate",
        "sequence_parallel",
        "attention_input",
    ):
        raise ConfigError(
            f"shard({type(module).__name__}, {strategy!r}): tensor parallel styles apply to nn.Linear and nn.Embedding",
            hint="annotate the Linear/Embedding layers inside it, e.g. shard(block.fc1, 'colwise')",
        )
    setattr(module, ATTR, strategy)
    return module


def _is_strategy_tuple(value: Any) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(t, tuple) and len(t) == 2 and all(isinstance(d, int) and d >= 1 for d in t) for t in value)
    )


def strategy_to_style(module: nn.Module, strategy: Any, *, tp: int, name: str) -> str:
    """Translate one annotation into a style name (module doc), checking ``k == tp``."""
    if isinstance(strategy, str):
        return strategy
    (xa, xb), (wa, wb) = strategy
    if isinstance(module, nn.Embedding):
        (va, vb), _indices = strategy  # the first tuple is the table (vocab, dim)
        style = "embedding_colwise" if vb > 1 else "vocab_embedding" if va > 1 else "replicate"
        if va > 1 and vb > 1:
            raise ConfigError(
                f"strategy {strategy} on {name} splits both table dims",
                hint="split one: ((1, tp), (1, 1)) or ((tp, 1), (1, 1))",
            )
        splits = {d for d in (va, vb) if d > 1}
    else:
        if wa > 1 and wb > 1:
            raise ConfigError(
                f"strategy {strategy} on {name} splits the weight in 2-D",
                hint="split one dim: ((1, 1), (1, tp)) colwise or ((1, tp), (tp, 1)) rowwise",
            )
        if wa > 1 and xb != wa:
            raise ConfigError(
                f"strategy {strategy} on {name}: the input's last dim split {xb} must equal the weight's first {wa}",
                hint=f"write (({xa}, {wa}), ({wa}, 1))",
            )
        style = "colwise" if wb > 1 else "rowwise" if wa > 1 else "replicate"
        splits = {d for d in (wa, wb) if d > 1}
    bad = [d for d in splits if d != tp]
    if bad:
        fixed = tuple(tuple(tp if d > 1 else 1 for d in t) for t in strategy)
        raise ConfigError(f"strategy {strategy} on {name} splits {bad[0]} ways but the plan has tp={tp}",
                          hint=f"write {fixed}, or use tp={bad[0]}")
    return style


def annotated_styles(model: nn.Module, *, tp: int) -> TPStyles | None:
    """The TP styles the model's annotations describe (partners inferred), or None without any."""
    styles: dict[str, str] = {}
    for name, module in model.named_modules():
        strategy = getattr(module, ATTR, None)
        if strategy is not None:
            styles[name] = strategy_to_style(module, strategy, tp=tp, name=name or type(model).__name__)
    if not styles:
        return None
    for parent_name, parent in model.named_modules():
        prefix = f"{parent_name}." if parent_name else ""
        linears = [(prefix + n, m) for n, m in parent.named_children() if isinstance(m, nn.Linear)]
        paired: set[str] = set()
        for i, (name, layer) in enumerate(linears):  # colwise layers pick a later consumer first
            if styles.get(name) == "colwise":
                partner = _unique(
                    [
                        n
                        for n, m in linears[i + 1 :]
                        if m.in_features == layer.out_features
                        and styles.get(n) in (None, "rowwise")
                        and n not in paired
                    ]
                )
                if partner is None:
                    styles[name] = "colwise_rep"
                else:
                    styles[partner] = "rowwise"
                    paired.update((name, partner))
        for i, (name, layer) in enumerate(linears):  # then unpaired rowwise layers pick a producer
            if styles.get(name) == "rowwise" and name not in paired:
                partner = _unique(
                    [n for n, m in linears[:i] if m.out_features == layer.in_features and styles.get(n) is None]
                )
                if partner is None:
                    styles[name] = "rowwise_rep"
                else:
                    styles[partner] = "colwise"
                    paired.update((name, partner))
    return TPStyles.of({n: s for n, s in styles.items() if s != "replicate"})


def _unique(names: list[str]) -> str | None:
    return names[0] if len(names) == 1 else None
