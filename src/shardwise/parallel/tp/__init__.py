"""Tensor (and sequence) parallel, one concern per module:

- :mod:`.styles`: which module gets which style (:class:`TPStyles`, what torch calls a
  ``parallelize_plan``), derived for common transformer
  shapes, validated, and how much of a model it shards;
- :mod:`.layers`: the styles torch's ``ColwiseParallel``/``RowwiseParallel`` do not cover (GPT-2's
  ``Conv1D``, fused projections, MoE experts as 3-D tensors);
- :mod:`.adapters`: LoRA adapters, each following its base layer's style;
- :mod:`.apply`: :func:`apply_tp` (``parallelize_module``), with the table of styles and their
  communication.

The names below are imported on first use (PEP 562), so ``shardwise.parallel.tp.layers`` loads alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwise.exports import lazy_exports

_NAMES = {
    **dict.fromkeys(("HEAD_ATTRS", "STYLES", "TPOptions", "TPStyles", "derive_tp_styles", "tp_share", "validate_tp"),
                    "shardwise.parallel.tp.styles"),
    **dict.fromkeys(("apply_tp", "to_torch_styles"), "shardwise.parallel.tp.apply"),
}
__all__ = sorted(_NAMES)
# the old names, deprecated
__getattr__, __dir__ = lazy_exports(
    __name__,
    _NAMES,
    deprecated={"TPPlan": "TPStyles", "derive_tp_plan": "derive_tp_styles", "to_torch_plan": "to_torch_styles"},
)

if TYPE_CHECKING:
    from shardwise.parallel.tp.apply import apply_tp, to_torch_styles
    from shardwise.parallel.tp.styles import (
        HEAD_ATTRS,
        STYLES,
        TPOptions,
        TPStyles,
        derive_tp_styles,
        tp_share,
        validate_tp,
    )
