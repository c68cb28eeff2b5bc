"""The callback protocol of the training loop (a leaf, so that every layer that offers a callback,
``observe/`` and ``checkpoint/`` among them, can subclass it without importing the trainer).

Protocol (every method optional; subclass :class:`Callback` and override what you need):

- ``on_fit_start(trainer)``: after the model is wrapped and the loader built, before the first
  step. A checkpoint callback restores ``trainer.stateful_components()`` here.
- ``on_after_backward(trainer)``: after the last micro-batch's backward of a step, before
  unscaling, clipping and the optimizer step; gradients are already data-parallel reduced (and
  still multiplied by the fp16 loss scale). For gradient inspection and fault injection.
- ``on_step_end(trainer, metrics)``: after every optimizer step. ``metrics`` always holds
  ``step``, ``epoch`` and ``lr``; on logging steps (every ``log_every`` steps) also the
  globally reduced ``loss`` averaged over the steps since the last log, ``samples_per_s``,
  ``tokens_per_s`` and ``mfu`` where known, ``grad_norm`` with clipping and ``loss_scale`` in fp16.
  Keys a callback adds reach the loggers.
- ``on_epoch_end(trainer)``, ``on_eval_end(trainer, metrics)`` (``val_``-prefixed), ``on_fit_end(trainer)``.

Callbacks run on **every rank** (a checkpoint needs all of them); metrics are identical on all
ranks because they are reduced globally, so decisions such as early stopping agree. Anything that
prints or writes a single file checks ``trainer.env.is_main``. Setting ``trainer.should_stop =
True`` ends training after the current step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardwise.train.trainer import Trainer


class Callback:
    """Base class: every hook is a no-op."""

    def on_fit_start(self, trainer: Trainer) -> None: ...

    def on_after_backward(self, trainer: Trainer) -> None: ...

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None: ...

    def on_epoch_end(self, trainer: Trainer) -> None: ...

    def on_eval_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None: ...

    def on_fit_end(self, trainer: Trainer) -> None: ...
