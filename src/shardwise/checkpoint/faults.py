"""A fault injector for recovery tests: fail rank R at step S, or in the middle of a save.

Spelled as an option (``CheckpointManager(fault=Fault.parse(...))``) or, for the built-in job, in
the environment variable ``SHARDWISE_FAULT`` (read once into the runtime's settings)::

    SHARDWISE_FAULT="rank=1,step=25"                 # SIGKILL rank 1 when it reaches step 25
    SHARDWISE_FAULT="rank=0,step=20,at=save"         # SIGKILL rank 0 while it writes step 20
    SHARDWISE_FAULT="rank=0,step=7,how=raise"        # raise instead of being killed

A fault fires only in the launch attempt given by ``restart`` (default 0, the first attempt;
torch's elastic agent numbers attempts in ``TORCHELASTIC_RESTART_COUNT``), so a restarted group
that replays step S does not fail again.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Literal

from shardwise.errors import ConfigError

ENV = "SHARDWISE_FAULT"  # read by shardwise.runtime.settings


class InjectedFault(RuntimeError):
    """Raised by a fault with ``how="raise"``."""


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    at: Literal["step", "save"] = "step"
    how: Literal["kill", "raise"] = "kill"
    restart: int = 0

    @classmethod
    def parse(cls, text: str) -> "Fault":
        values: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep:
                raise ConfigError(
                    f"fault spec part {part!r} is not key=value", hint="e.g. SHARDWISE_FAULT='rank=1,step=25'"
                )
            values[key.strip()] = value.strip()
        try:
            fault = cls(rank=int(values.pop("rank")), step=int(values.pop("step")), at=values.pop("at", "step"),  # type: ignore[arg-type]
                        how=values.pop("how", "kill"), restart=int(values.pop("restart", "0")))  # type: ignore[arg-type]
        except (KeyError, ValueError) as err:
            raise ConfigError(
                f"bad fault spec {text!r} ({err})", hint="needs rank=R,step=S[,at=step|save][,how=kill|raise]"
            ) from None
        if values or fault.at not in ("step", "save") or fault.how not in ("kill", "raise"):
            raise ConfigError(
                f"bad fault spec {text!r}", hint="keys: rank, step, at=step|save, how=kill|raise, restart"
            )
        return fault

    @classmethod
    def for_attempt(cls, text: str, attempt: int) -> "Fault | None":
        """The fault ``text`` describes (``SHARDWISE_FAULT``, read into the runtime's settings) if it
        fires in launch attempt ``attempt`` (``settings.restart_count``), else None."""
        fault = cls.parse(text) if text.strip() else None
        return fault if fault is not None and fault.restart == attempt else None

    def maybe_fire(self, *, rank: int, step: int, at: str) -> None:
        """Fail now if this is the configured rank, step and place."""
        if (rank, step, at) != (self.rank, self.step, self.at):
            return
        if self.how == "raise":
            raise InjectedFault(f"injected fault: rank {rank} at {at} of step {step}")
        os.kill(os.getpid(), signal.SIGKILL)
