"""The Trainer callback: restore on ``resume``, save by policy, save and stop on pre-emption.

Hooks (called by :class:`shardwise.train.Trainer`): ``on_fit_start`` after the model is wrapped
and before the first step (restore the newest complete checkpoint into
``trainer.stateful_components()``), ``on_step_end`` (fault injection, pre-emption, policy saves),
``on_epoch_end`` and ``on_fit_end`` (wait for the save in flight). Works with any object that has
``stateful_components()``, a step counter and a ``should_stop`` attribute.

Every decision here that leads into a collective (a save, a load) is taken by all ranks together:
from the step counter, from :attr:`CheckpointManager.last_saved` (set by the training thread once
every rank entered a save), or from an all-reduce (:meth:`CheckpointManager.agree_max`). An async
save's writer thread finishes at a different moment on each rank, so nothing it sets may decide
whether a rank enters a collective: a rank that decided alone would wait in it forever.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from signal import Signals
from typing import Any, Mapping

from shardwise.checkpoint import commit as cm
from shardwise.checkpoint.manager import CheckpointManager, Loaded
from shardwise.checkpoint.signals import PreemptionSignal, process_signal
from shardwise.errors import ConfigError


@dataclass(frozen=True)
class Preemption:
    """A pre-emption the ranks acted on: the signal (the same name on every rank, agreed), the step
    training stopped after, and the checkpoint saved there."""

    signal: str
    step: int
    checkpoint: str


def trainer_step(trainer: Any) -> int:
    """The number of optimizer steps done so far (the checkpoint's step number)."""
    for attr in ("global_step", "step"):
        value = getattr(trainer, attr, None)
        if isinstance(value, int):
            return value
    state = trainer.stateful_components()["train_state"].state_dict()
    return int(state["step"])


class CheckpointCallback:
    """``CheckpointCallback(manager, resume="auto")``.

    ``resume``: ``"auto"`` (newest complete checkpoint if there is one, else start fresh),
    ``"never"``/``None``, or a step number (that checkpoint must exist and be complete).
    """

    def __init__(self, manager: CheckpointManager, *, resume: str | int | None = "auto", save_on_signal: bool = True,
                 save_on_fit_end: bool = True, signal: PreemptionSignal | None = None) -> None:
        if resume not in ("auto", "never", None) and not isinstance(resume, int):
            raise ConfigError(f"resume={resume!r} is not 'auto', 'never' or a step number")
        self.manager = manager
        self.resume = resume
        self.save_on_signal = save_on_signal
        self.save_on_fit_end = save_on_fit_end
        self.signal = signal if signal is not None else process_signal()
        self.loaded: Loaded | None = None
        self.preemption: Preemption | None = None
        self._installed = False
        self._metrics: dict[str, float] = {}

    @property
    def preempted(self) -> bool:
        return self.preemption is not None

    def on_fit_start(self, trainer: Any) -> None:
        self.manager.bind_layout(plan=getattr(trainer, "plan", None), dp_size=getattr(trainer, "dp_size", None),
                                 dp_rank=getattr(trainer, "dp_rank", None))
        self.preemption = None
        if self.save_on_signal:
            self._installed = self.signal.install()
        # Forms the checkpoint's process groups now, while the launcher's store is surely up: a
        # pre-emption save after the launcher died needs only these groups, not the store.
        self.manager.agree_max(0)
        if self.resume in ("never", None):
            return
        step = self.resume if isinstance(self.resume, int) else None
        self.loaded = self.manager.load(trainer.stateful_components(), step=step)
        if self.loaded is None and step is not None:
            raise ConfigError(f"no checkpoint of step {step} in {self.manager.directory}")
        if self.manager.rank == 0:
            print(f"checkpoint: resumed from step {self.loaded.step} ({self.loaded.path})" if self.loaded
                  else f"checkpoint: nothing to resume in {self.manager.directory}, starting fresh", flush=True)

    def _remember(self, metrics: Mapping[str, Any] | None) -> None:
        for key, value in (metrics or {}).items():
            try:
                self._metrics[key] = float(value)
            except (TypeError, ValueError):
                continue

    def _save(self, trainer: Any, *, block: bool | None = None) -> None:
        self.manager.save(trainer.stateful_components(), step=trainer_step(trainer), metrics=self._metrics, block=block)

    def on_step_end(self, trainer: Any, metrics: Mapping[str, Any] | None = None) -> None:
        self._remember(metrics)
        step = trainer_step(trainer)
        if self.manager.fault is not None:
            self.manager.fault.maybe_fire(rank=self.manager.rank, step=step, at="step")
        if self.save_on_signal:
            # The signal's number, agreed: ranks receive it at slightly different times (or only some do).
            signum = self.manager.agree_max((self.signal.received or 0) if self.signal.requested else 0)
            if signum:
                self._save(trainer, block=True)
                self.preemption = Preemption(signal=Signals(signum).name, step=step,
                                             checkpoint=os.path.join(self.manager.directory, cm.step_dirname(step)))
                self.signal.consume()
                trainer.should_stop = True
                return
        if self.manager.due(step):
            self._save(trainer)

    def on_after_backward(self, trainer: Any) -> None:
        return None

    def on_eval_end(self, trainer: Any, metrics: Mapping[str, Any] | None = None) -> None:
        self._remember(metrics)  # val_ metrics, for keep_best

    def on_epoch_end(self, trainer: Any, metrics: Mapping[str, Any] | None = None) -> None:
        self._remember(metrics)
        if self.manager.due(trainer_step(trainer), epoch_end=True):
            self._save(trainer)

    def on_fit_end(self, trainer: Any) -> None:
        try:
            # last_saved, not last_committed: the same value on every rank, so either every rank
            # enters the final save or none does (an async save's commit lands at different moments).
            if self.save_on_fit_end and not self.preempted and self.manager.last_saved != trainer_step(trainer):
                self._save(trainer, block=True)
            self.manager.wait()
            # Rank 0 seals the step after the others' writes returned: meet once more, so that when
            # fit returns on any rank its last checkpoint is committed.
            self.manager.agree_max(0)
        finally:
            if self._installed:
                self.signal.uninstall()
                self._installed = False


def checkpoint_callback(spec: Any) -> CheckpointCallback | None:
    """What ``Trainer(checkpoint=...)`` accepts: None, a directory, a manager or a callback.

    A directory gets the defaults: save at every epoch end and at the end of ``fit``, keep 3.
    Resuming is asked for separately, with ``fit(resume="auto")``.
    """
    if spec is None or isinstance(spec, CheckpointCallback):
        return spec
    if isinstance(spec, CheckpointManager):
        return CheckpointCallback(spec, resume=None)
    if isinstance(spec, (str, os.PathLike)):
        return CheckpointCallback(CheckpointManager(spec, on_epoch_end=True), resume=None)
    raise ConfigError(f"checkpoint={spec!r} is not a directory, a CheckpointManager or a CheckpointCallback")
