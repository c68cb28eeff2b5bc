"""Dependencies' import-time warnings and log lines, kept off the user's terminal.

shardwise's entry points (the ``shardwise`` command, every worker of ``shardwise run``/``train``,
the processes of ``shardwise.launch``) call :func:`quiet_dependencies` before they import anything
heavy. It silences, each scoped to the library that emits it (never a warning of the user's own
modules, never a library's errors):

- torchao's logger (``torchao``): "Failed to load .../torchao/_C_mxfp8...so" for the optional GPU
  kernel libraries that do not load on this machine (``shardwise doctor`` reports them, with what
  they cost: no fast FP8/MX kernels);
- torch's ``torch.utils._pytree`` logger: "<enum ...> is an Enum subclass ... deprecated", logged
  when torchao registers its enums as pytree constants;
- warnings attributed to a dependency's module (``transformers``, ``peft``, ``accelerate``,
  ``torchao``, ``torchdata``): their FutureWarning and DeprecationWarning notices (transformers'
  "`is_gradient_checkpointing` is deprecated", which peft reads), and torchdata's call of torch's
  deprecated ``set_vital`` (a UserWarning attributed to ``torchdata``);
- torch's checkpoint (DCP) notice "torch.distributed is disabled ... assuming the intent is to load
  in a single process", which it gives even when told so (``no_dist=True``).

``SHARDWISE_LOG_LEVEL=debug`` (what ``shardwise --verbose`` sets, for the command and the workers it
starts) leaves all of them shown. Standard library only: the workers' entry point imports it first.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass
from typing import Iterator, Mapping

LOG_LEVEL_VAR = "SHARDWISE_LOG_LEVEL"
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")
LIBRARIES = r"(transformers|peft|accelerate|torchao|torchdata)(\.|$)"  # a module of one of them


@dataclass(frozen=True)
class WarningRule:
    """One ``warnings.filterwarnings("ignore", ...)``: ``module`` is a regex matched at the start
    of the name of the module the warning is attributed to."""

    category: type[Warning]
    module: str
    message: str = ""


RULES = (
    WarningRule(FutureWarning, LIBRARIES),
    WarningRule(DeprecationWarning, LIBRARIES),
    WarningRule(UserWarning, r"torchdata(\.|$)", r"'set_vital' is deprecated"),
    # DCP warns on every single-process load or save, even one that says so (no_dist=True)
    WarningRule(
        UserWarning,
        r"torch\.distributed\.checkpoint(\.|$)",
        r"torch\.distributed is disabled, unavailable or uninitialized",
    ),
)


def verbose(environ: Mapping[str, str]) -> bool:
    """Whether ``SHARDWISE_LOG_LEVEL`` asks for everything (``debug``)."""
    return environ.get(LOG_LEVEL_VAR, "").strip().lower() == "debug"


def quiet_dependencies(environ: Mapping[str, str]) -> bool:
    """Silence the dependencies' noise of the module doc unless ``environ`` asks for it (idempotent);
    True when it did."""
    if verbose(environ):
        return False
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for rule in RULES:
        warnings.filterwarnings("ignore", message=rule.message, category=rule.category, module=rule.module)
    return True


@contextlib.contextmanager
def quiet_while(environ: Mapping[str, str]) -> Iterator[None]:
    """:func:`quiet_dependencies` for the block only: the warning filters and the loggers' levels
    are as before after it. A fork server preloads the dependencies inside it, so its own stderr
    stays clean while each worker it forks still decides for itself (``--verbose`` shows all)."""
    levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    with warnings.catch_warnings():
        quiet_dependencies(environ)
        try:
            yield
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)
