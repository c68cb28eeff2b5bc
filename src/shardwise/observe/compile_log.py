"""What ``torch.compile`` did, in the training log (``Plan.compile``): after the first step, the
graphs compiled and the graph breaks with their reasons; after any later step that compiled again
(a recompile: a guard failed, e.g. a new shape or dtype reached a compiled block), a warning with
the count. Reads dynamo's own counters (:func:`shardwise.parallel.compile.compile_stats`); no
communication, nothing when the plan does not compile.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardwise.callback import Callback
from shardwise.parallel.compile import CompileStats, compile_stats, is_compiled
from shardwise.runtime.logging import get_logger

if TYPE_CHECKING:
    from shardwise.train.trainer import Trainer

log = get_logger("observe")


class CompileLog(Callback):
    """Logs compile statistics (module doc); ``recompiles``: graphs compiled after the first step."""

    def __init__(self) -> None:
        self.active = False
        self.first: CompileStats | None = None
        self.last: CompileStats | None = None
        self.recompiles = 0

    def on_fit_start(self, trainer: Trainer) -> None:
        self.active = is_compiled(trainer.model.module)
        self.first = self.last = None

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if not self.active:
            return
        stats = compile_stats()
        if self.first is None:
            self.first = self.last = stats
            log.info("torch.compile after step %d: %s", trainer.step, stats.summary())
        assert self.last is not None
        if stats.graphs > self.last.graphs:
            self.recompiles = stats.graphs - self.first.graphs
            log.warning("torch.compile recompiled at step %d: %d new graphs (%d since step 1); %s. "
                        "TORCH_LOGS=recompiles names the failed guard", trainer.step, stats.graphs - self.last.graphs,
                        self.recompiles, stats.summary())
        self.last = stats
        metrics["compile_recompiles"] = self.recompiles
