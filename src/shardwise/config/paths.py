"""Checks of the paths a command is given, run before any work starts: an input must be a readable
file, an output a writable place. Each failure is one :class:`~shardwise.errors.ConfigError` line
that names the option and the path."""

from __future__ import annotations

import os

from shardwise.errors import ConfigError


def check_input_file(path: str, *, option: str) -> None:
    """Refuse an input path that is not a readable file before any work starts: the readers would
    otherwise stop with a traceback (IsADirectoryError, PermissionError)."""
    if not os.path.exists(path):
        raise ConfigError(f"{option} {path!r} does not exist", hint="check the path")
    if os.path.isdir(path):
        raise ConfigError(f"{option} {path!r} is a directory", hint="give the path of a file")
    try:
        with open(path, "rb") as fh:
            fh.read(1)
    except OSError as err:
        raise ConfigError(
            f"{option} {path!r} cannot be read: {err.strerror or err}", hint="check its permissions"
        ) from None


def check_output_file(path: str, *, option: str) -> None:
    """Refuse an output path that cannot be written, before the work that produces it starts: a
    measurement or an export should not fail at its last step, nor leave a partial file behind."""
    if os.path.isdir(path):
        raise ConfigError(f"{option} {path} is a directory", hint="give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConfigError(
            f"{option} {path}: directory {parent} does not exist", hint="create it first, or choose another path"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {path}: directory {parent} is not writable", hint="choose another path")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ConfigError(f"{option} {path} is not writable", hint="choose another path, or change its permissions")


def check_output_dir(path: str, *, what: str, hint: str) -> None:
    """Refuse a directory that cannot be created or written, before anything is written into it:
    its nearest existing ancestor (``path`` itself when it exists) must be a directory that this
    user may write. ``what`` names it in the message (``"run directory"``)."""
    probe = path
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    probe = probe or "."
    if not os.path.isdir(probe):
        raise ConfigError(f"{what} {path!r}: {probe!r} is a file, not a directory", hint=hint)
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {path!r} is not writable ({probe!r} is read-only for this user)", hint=hint)
