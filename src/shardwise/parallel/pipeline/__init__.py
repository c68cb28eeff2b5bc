"""Pipeline parallelism through ``torch.distributed.pipelining``, one concern per module:

- :mod:`.split`: where the cuts go (explicit :class:`PipelineStages`, split points, or balanced);
- :mod:`.stage`: a stage module, a slice of the trunk that runs the model's own ``forward``;
- :mod:`.ties`: weights tied across stages (one gradient all-reduce per tie and step);
- :mod:`.schedule`: :func:`build_pipeline`, the schedules (GPipe, 1F1B, interleaved) and the
  runner a training step calls;
- :mod:`.accumulation`: the stage of ``Plan.sharded_accumulation`` (loaded only when one is built).

The names below are imported on first use (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwise.exports import lazy_exports

_NAMES = {
    **dict.fromkeys(("LocalStages", "PipelineOptions", "PipelineSchedule", "build_pipeline", "check_microbatches",
                     "check_pipeline", "local_stage_indices", "split_for_rank", "stage_device", "stage_modules"),
                    "shardwise.parallel.pipeline.schedule"),
    **dict.fromkeys(("Balance", "PipelineStages", "Tie", "check_ties", "find_trunk", "split_model", "stage_summary",
                     "stage_ties"), "shardwise.parallel.pipeline.split"),
}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)

if TYPE_CHECKING:
    from shardwise.parallel.pipeline.schedule import (LocalStages, PipelineOptions, PipelineSchedule, build_pipeline,
                                                      check_microbatches, check_pipeline, local_stage_indices,
                                                      split_for_rank, stage_device, stage_modules)
    from shardwise.parallel.pipeline.split import (Balance, PipelineStages, Tie, check_ties, find_trunk, split_model,
                                                   stage_summary, stage_ties)
