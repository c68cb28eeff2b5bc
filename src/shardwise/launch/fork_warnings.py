"""A forked worker's warning filters: those ``python`` would start it with, under its own ``PYTHONWARNINGS``.

An interpreter builds its warning filters when it starts: its ``-W`` and ``PYTHONWARNINGS``
options first, then the defaults (``DeprecationWarning`` shown in ``__main__`` only, ...). The
modules it imports may add filters of their own. A worker forked from the fork server inherits the
server's filters, built from the *server's* options, so a job that sets ``PYTHONWARNINGS=error``
(or ``ignore``) for its workers would not get what it asked for. :class:`StartupFilters`, taken
when the server starts, tells the three kinds apart; :meth:`StartupFilters.apply` gives the worker
the filters its imports added, then its own options', then the defaults, as a fresh interpreter
that imported the same modules would have. Standard library only.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

Filter = tuple[Any, ...]  # an entry of warnings.filters


def _option_filters(options: list[str]) -> list[Filter]:
    """The filters that ``-W``/``PYTHONWARNINGS`` ``options`` make, in the interpreter's order."""
    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings._processoptions(options)  # what the interpreter runs on sys.warnoptions at start-up
        return list(warnings.filters)


def options_of(environ: Mapping[str, str]) -> list[str]:
    """``PYTHONWARNINGS`` as the interpreter splits it into ``sys.warnoptions`` (at commas, empty
    entries dropped; each entry's fields are stripped when it is applied)."""
    return [option for option in environ.get("PYTHONWARNINGS", "").split(",") if option]


@dataclass(frozen=True)
class StartupFilters:
    """The server's filters as it started (``startup``) and, of them, the interpreter's defaults."""

    startup: tuple[Filter, ...]
    defaults: tuple[Filter, ...]

    @classmethod
    def now(cls) -> StartupFilters:
        """Taken before the server imports anything."""
        startup = tuple(warnings.filters)
        from_options = _option_filters(list(sys.warnoptions))
        return cls(startup, tuple(f for f in startup if f not in from_options))

    def apply(self, environ: Mapping[str, str]) -> None:
        """In a forked worker: the filters the imports added, then those of ``environ``'s options,
        then the defaults; ``sys.warnoptions`` is the worker's."""
        added = [f for f in warnings.filters if f not in self.startup]
        options = options_of(environ)
        warnings.filters[:] = [*added, *_option_filters(options), *self.defaults]
        mutated = getattr(warnings, "_filters_mutated", None) or getattr(warnings, "_filters_mutated_lock_held")
        mutated()  # the warn() caches: the filters changed
        sys.warnoptions[:] = options
