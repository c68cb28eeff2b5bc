"""Tensor (and sequence) parallel, one concern per module:

- :mod:`.styles`: which module gets which style (:class:`TPPlan`), derived for common transformer
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
    **dict.fromkeys(("HEAD_ATTRS", "STYLES", "TPOptions", "TPPlan", "derive_tp_plan", "tp_share", "validate_tp"),
                    "shardwise.parallel.tp.styles"),
    **dict.fromkeys(("apply_tp", "to_torch_plan"), "shardwise.parallel.tp.apply"),
}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)

if TYPE_CHECKING:
    from shardwise.parallel.tp.apply import apply_tp, to_torch_plan
    from shardwise.parallel.tp.styles import HEAD_ATTRS, STYLES, TPOptions, TPPlan, derive_tp_plan, tp_share, validate_tp
