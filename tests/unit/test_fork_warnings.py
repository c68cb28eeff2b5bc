"""A forked worker's warning filters are those a fresh interpreter would start with under its own
``PYTHONWARNINGS``, plus those the server's imports added (shardwise.launch.fork_warnings)."""

from __future__ import annotations

import sys
import warnings

from shardwise.launch.fork_warnings import StartupFilters, options_of

DEFAULTS = [("default", None, DeprecationWarning, "__main__", 0), ("ignore", None, DeprecationWarning, None, 0),
            ("ignore", None, PendingDeprecationWarning, None, 0)]


def _worker_filters(server_options: list[str], environ: dict[str, str]) -> tuple[list, list[str]]:
    """A server started with ``server_options`` imports a library that adds a filter, then forks a
    worker whose environment is ``environ``: that worker's filters and warnoptions."""
    saved = list(sys.warnoptions)
    try:
        with warnings.catch_warnings():
            warnings.resetwarnings()
            warnings.filters[:] = DEFAULTS
            warnings._processoptions(server_options)  # the server's start-up
            sys.warnoptions[:] = server_options
            startup = StartupFilters.now()
            warnings.filterwarnings("ignore", category=UserWarning, module="somelib")  # its imports
            startup.apply(environ)
            return list(warnings.filters), list(sys.warnoptions)
    finally:
        sys.warnoptions[:] = saved


def test_the_workers_own_options_replace_the_servers_and_the_imports_filters_stay() -> None:
    filters, options = _worker_filters(["ignore"], {"PYTHONWARNINGS": "error::UserWarning,default::ResourceWarning"})
    assert options == ["error::UserWarning", "default::ResourceWarning"]
    assert [(f[0], f[2]) for f in filters] == [
        ("ignore", UserWarning),  # somelib's, added by the server's imports
        ("default", ResourceWarning), ("error", UserWarning),  # the worker's options, last first (as python does)
        *[(f[0], f[2]) for f in DEFAULTS],
    ]
    assert filters[0][3].pattern.startswith("somelib")


def test_a_worker_without_options_has_the_defaults_only() -> None:
    filters, options = _worker_filters(["ignore", "error::RuntimeWarning"], {})
    assert options == []
    assert filters[1:] == DEFAULTS


def test_options_split_as_the_interpreter_splits_them() -> None:
    assert options_of({"PYTHONWARNINGS": "ignore,,error::UserWarning "}) == ["ignore", "error::UserWarning "]
    assert options_of({}) == []
