"""The system's OpenSSH client, the way a multi-host launch uses it.

Every remote command goes through ``ssh`` with the user's own configuration and keys, in
BatchMode (a missing key or an unknown host key fails at once instead of waiting for a password
nobody will type), with a ``ConnectTimeout`` (an unreachable host fails in that time, never
hangs) and keep-alives (a host that vanishes mid-run ends its session within about 30 s).
``--ssh-config FILE`` is ``ssh -F FILE``; ``--ssh-option KEY=VALUE`` is ``ssh -o KEY=VALUE``
(repeatable; it wins over shardwise's defaults except BatchMode).

The remote command is one POSIX shell line: ``cd DIR && exec env NAME=VALUE ... PYTHON ARGS``;
every word is quoted with :func:`shlex.quote`, so spaces and quotes in paths, values and script
arguments arrive unchanged. ``exec`` leaves no shell between sshd and the command.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import dataclass
from typing import Mapping, Sequence

from shardwise.errors import LaunchError

DEFAULT_CONNECT_TIMEOUT_S = 10
FORWARDED_PREFIXES = ("NCCL_", "GLOO_", "SHARDWISE_")
FORWARDED_NAMES = ("PYTHONPATH",)


@dataclass(frozen=True)
class SshOptions:
    """How to reach the hosts: ``ssh -F`` file, extra ``-o`` options, the connect timeout."""

    config_file: str | None = None
    options: tuple[str, ...] = ()
    connect_timeout_s: int = DEFAULT_CONNECT_TIMEOUT_S
    executable: str = "ssh"

    def __post_init__(self) -> None:
        if self.connect_timeout_s < 1:
            raise LaunchError(
                f"--ssh-timeout {self.connect_timeout_s} must be at least 1 second", hint="for example --ssh-timeout 10"
            )
        for option in self.options:
            if "=" not in option or option.startswith("-"):
                raise LaunchError(
                    f"--ssh-option {option!r} is not KEY=VALUE", hint="for example --ssh-option Port=2222"
                )
        if self.config_file is not None and not os.path.isfile(self.config_file):
            raise LaunchError(
                f"--ssh-config {self.config_file!r} does not exist", hint="give an ssh_config file (ssh -F)"
            )


def ssh_argv(host: str, command: str, options: SshOptions) -> list[str]:
    """``ssh [-F file] -o ... host command``. ssh keeps the first value it reads for an option, so
    the user's ``--ssh-option`` values come before shardwise's defaults (BatchMode stays first)."""
    if host.startswith("-"):
        raise LaunchError(f"host {host!r} looks like an ssh option", hint="host names cannot start with '-'")
    argv = [options.executable, "-T", "-x", "-o", "BatchMode=yes"]
    if options.config_file:
        argv += ["-F", options.config_file]
    for option in options.options:
        argv += ["-o", option]
    argv += [
        "-o",
        f"ConnectTimeout={options.connect_timeout_s}",
        "-o",
        "ServerAliveInterval=10",
        "-o",
        "ServerAliveCountMax=3",
    ]
    return argv + ["--", host, command]


def resolve_hostname(host: str, options: SshOptions, timeout_s: float = 10.0) -> str:
    """The address ssh connects to for ``host`` (``ssh -G``: the alias's ``HostName``, without
    ``user@``), read from the configuration only, no connection. Falls back to the name itself."""
    argv = ssh_argv(host, "true", options)
    argv.insert(1, "-G")
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname" and value.strip():
            return value.strip()
    return host.rpartition("@")[2]


def forwarded_env(environ: Mapping[str, str], names: Sequence[str] = ()) -> dict[str, str]:
    """The variables a remote node gets from this one: ``NCCL_*``, ``GLOO_*``, ``SHARDWISE_*``,
    ``PYTHONPATH``, and each ``--env NAME`` (this machine's value) or ``--env NAME=VALUE``."""
    out = {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES}
    for item in names:
        name, sep, value = item.partition("=")
        if not name.isidentifier():
            raise LaunchError(
                f"--env {item!r} does not start with a variable name", hint="use --env NAME or --env NAME=VALUE"
            )
        if sep:
            out[name] = value
        elif name in environ:
            out[name] = environ[name]
        else:
            raise LaunchError(f"--env {name} is not set here", hint=f"export {name} first, or pass --env {name}=VALUE")
    return out


def remote_command(argv: Sequence[str], *, env: Mapping[str, str], chdir: str | None = None) -> str:
    """One shell line running ``argv`` with ``env`` (in ``chdir``), with nothing in between."""
    assignments = [f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    command = "exec " + (" ".join(["env", *assignments]) + " " if assignments else "") + shlex.join(argv)
    return f"cd {shlex.quote(chdir)} && {command}" if chdir else command
