"""The pipeline stage of ``Plan.sharded_accumulation`` (in its own module: it subclasses torch's
``PipelineStage``, and ``torch.distributed.pipelining`` is imported only when a pipeline is built)."""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import PipelineStage


class ShardedAccumulationStage(PipelineStage):
    """A stage under ``Plan.sharded_accumulation``: torch's stage turns an FSDP2 stage's gradient
    sync off for every microbatch but the schedule's end (unsharded gradients of the whole stage
    held across its microbatches); this one keeps it on, so each microbatch's backward
    reduce-scatters into the sharded gradient (under HSDP also all-reduces). The parameters stay
    gathered across the microbatches as torch's schedules keep them; the end-of-schedule reduction
    then finds nothing left to reduce."""

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.pipelining.stage import stage_backward

        if backward_type != "full" or not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.submod.set_is_last_backward(False)
        self.submod.set_reshard_after_backward(False)
        self.submod.set_requires_gradient_sync(True)
        return stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"]), None
