"""Which machines a job runs on: ``--hostfile FILE`` or ``--hosts h1:4,h2:4``.

Two spellings users already have:

- a hostfile as DeepSpeed and OpenMPI write it, one host per line, ``#`` starts a comment
  (OpenMPI's ``max_slots=M`` is accepted and ignored)::

      # 2 nodes of 8 GPUs
      node1 slots=8
      node2 slots=8

- ``--hosts node1:8,node2:8``, the list of ``mpirun --host`` (MindSpore's guide, OpenMPI).

A host is a name ``ssh`` understands: a DNS name, an address, ``user@host`` or an alias of the
user's ``~/.ssh/config`` (ports and keys belong there). ``slots`` is the number of processes on
that host; left out (``node1`` or ``node1:``), ``--nproc-per-node`` decides there (``auto``: one
per GPU). The first host is node 0: it holds the rendezvous, and its address is the master
address unless ``--master-addr`` says otherwise. Pure parsing, so every rule is unit-tested.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardwise.errors import LaunchError

# What ssh accepts as a destination, minus anything that could be read as an option (a leading '-').
_NAME = re.compile(r"^[A-Za-z0-9_.%\[\]:@][A-Za-z0-9_.%\[\]:@-]*$")


@dataclass(frozen=True)
class Host:
    """One machine of the job, in the order of the hostfile (node rank = position)."""

    name: str
    slots: int | None = None  # processes there; None: --nproc-per-node

    def __str__(self) -> str:
        return self.name if self.slots is None else f"{self.name}:{self.slots}"


def _check_name(name: str, where: str) -> str:
    if not _NAME.match(name):
        raise LaunchError(f"{where}: {name!r} is not a host name",
                          hint="use a DNS name, an address, user@host or an alias of your ~/.ssh/config")
    return name


def _slots(raw: str, where: str) -> int:
    if not raw.isdigit() or int(raw) < 1:
        raise LaunchError(
            f"{where}: slots={raw!r} is not a positive number of processes", hint="for example 'node1 slots=8'"
        )
    return int(raw)


def _unique(hosts: list[Host], source: str) -> tuple[Host, ...]:
    if not hosts:
        raise LaunchError(
            f"{source} names no hosts", hint="list one host per line ('node1 slots=8'), or use --hosts node1:8,node2:8"
        )
    seen: set[str] = set()
    for host in hosts:
        if host.name in seen:
            raise LaunchError(
                f"{source}: host {host.name!r} is listed twice", hint="list each host once, with all its slots"
            )
        seen.add(host.name)
    return tuple(hosts)


def parse_hostfile(text: str, source: str = "hostfile") -> tuple[Host, ...]:
    """DeepSpeed/OpenMPI lines ``host [slots=N]``; ``#`` comments and blank lines are skipped."""
    hosts = []
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"{source} line {number}"
        host = Host(_check_name(words[0], where))
        for word in words[1:]:
            key, sep, value = word.partition("=")
            if key not in ("slots", "max_slots") or not sep:
                raise LaunchError(
                    f"{where}: {word!r} is not understood", hint="write 'host slots=N' (N processes on that host)"
                )
            if key == "slots":
                host = Host(host.name, _slots(value, where))
            else:
                _slots(value, where)  # OpenMPI's oversubscription limit: checked, not needed (slots are started)
        hosts.append(host)
    return _unique(hosts, source)


def read_hostfile(path: str) -> tuple[Host, ...]:
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError as exc:
        raise LaunchError(
            f"--hostfile {path!r} cannot be read ({exc.strerror or exc})", hint="check the path"
        ) from None
    return parse_hostfile(text, source=f"hostfile {path}")


def parse_hosts(spec: str) -> tuple[Host, ...]:
    """``--hosts node1:8,node2:8`` (``node1`` alone: ``--nproc-per-node`` processes there)."""
    hosts = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, slots = item.rpartition(":") if ":" in item else (item, "", "")
        where = f"--hosts item {item!r}"
        hosts.append(Host(_check_name(name, where), _slots(slots, where) if sep and slots else None))
    return _unique(hosts, "--hosts")


def hosts_from(hostfile: str | None, hosts: str | None) -> tuple[Host, ...]:
    """The hosts of ``--hostfile`` or ``--hosts`` (exactly one of them)."""
    if hostfile and hosts:
        raise LaunchError("--hostfile and --hosts both name the hosts", hint="use one of them")
    return read_hostfile(hostfile) if hostfile else parse_hosts(hosts or "")
