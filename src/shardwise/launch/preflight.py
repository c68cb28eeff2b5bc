"""Pre-flight of a multi-host launch: check every host before anything starts.

For each host, in parallel, one ssh session runs :mod:`shardwise.launch.probe` (sent as program
text, so it works where shardwise is missing) with the job's environment, and the launcher judges
the answers:

- reachable by ssh at all (BatchMode, ``ConnectTimeout``; the whole probe has a hard timeout);
- the interpreter exists there, and Python, torch and shardwise have node 0's versions
  (mismatches hang collectives or give wrong results);
- the working directory and the script (or ``-m`` module) exist there;
- the master address resolves there, and on node 0 the master port is free (or, with no
  ``--master-port``, node 0 names a free one);
- the rendezvous store answers there, when it lives off the training nodes (``--rdzv-store``):
  on the launcher (at the launcher's address as the host sees it, from ``SSH_CONNECTION``) or at
  ``HOST:PORT``.

Each problem is one line that starts with the host; all of them are reported together, so one
round trip finds every broken host. Nothing is started unless the list is empty.
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from shardwise.errors import LaunchError
from shardwise.launch import probe as probe_module
from shardwise.launch.hosts import Host
from shardwise.launch.ssh import SshOptions, remote_command, ssh_argv

PROBE_EXTRA_S = 30.0  # on top of the connect timeout: start Python, read package metadata


@dataclass(frozen=True)
class Target:
    """What the job needs on every host."""

    python: str
    chdir: str
    script: str
    module: bool
    master_addr: str
    master_port: int | None  # None: node 0 picks a free one
    env: Mapping[str, str] = field(default_factory=dict)
    store: str | None = None  # HOST:PORT of a rendezvous store every host must reach
    store_client_port: int | None = None  # the store runs on the launcher, at this port


@dataclass(frozen=True)
class HostFacts:
    """One host's answer (``facts`` from the probe), or why there is none (``error``)."""

    host: Host
    facts: Mapping[str, object] | None
    error: str | None = None


@dataclass(frozen=True)
class Preflight:
    facts: tuple[HostFacts, ...]
    problems: tuple[str, ...]
    master_port: int | None

    def versions(self) -> str:
        """``python 3.11.7, torch 2.13.0, shardwise 0.1.0`` of node 0 (for the report)."""
        first = next((f.facts for f in self.facts if f.facts), None) or {}
        return f"python {first.get('python')}, torch {first.get('torch')}, shardwise {first.get('shardwise')}"


def _probe_source() -> bytes:
    with open(probe_module.__file__, "rb") as fh:
        return fh.read()


def _ask(host: Host, node_rank: int, target: Target, ssh: SshOptions, source: bytes) -> HostFacts:
    args = [target.python, "-", "--chdir", target.chdir, "--script", target.script, "--master-addr", target.master_addr]
    if target.module:
        args.append("--module")
    if node_rank == 0:
        args += ["--port", str(target.master_port)] if target.master_port is not None else ["--find-port"]
    if target.store is not None:
        args += ["--store", target.store]
    elif target.store_client_port is not None:
        args += ["--store-client-port", str(target.store_client_port)]
    argv = ssh_argv(host.name, remote_command(args, env=target.env), ssh)
    timeout = ssh.connect_timeout_s + PROBE_EXTRA_S
    try:
        done = subprocess.run(argv, input=source, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return HostFacts(
            host, None, f"no answer within {timeout:.0f} s over ssh; check that it is up and reachable from here"
        )
    except OSError as exc:
        return HostFacts(
            host, None, f"cannot run {ssh.executable!r} ({exc.strerror or exc}); install the OpenSSH client"
        )
    out, err = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
    for line in out.splitlines():
        if line.startswith(probe_module.MARKER):
            return HostFacts(host, json.loads(line[len(probe_module.MARKER):]))
    last = next((line.strip() for line in reversed(err.splitlines()) if line.strip()), f"exit code {done.returncode}")
    if done.returncode == 255:
        return HostFacts(host, None, f"not reachable by ssh ({last}); {_ssh_hint(last, host.name)}")
    return HostFacts(
        host,
        None,
        f"{target.python} did not run there ({last}); install the same environment at the same "
        "path on every host, or pass --python PATH",
    )


def _ssh_hint(message: str, name: str) -> str:
    low = message.lower()
    if "host key verification failed" in low:
        return f"connect once by hand (ssh {name}) to accept its host key"
    if "permission denied" in low:
        return f"install your public key there (ssh-copy-id {name}) or load it into ssh-agent"
    if "could not resolve" in low:
        return "check the host name (or its alias in ~/.ssh/config)"
    return f"check that 'ssh {name} true' works without a password"


def judge(facts: Sequence[HostFacts], target: Target) -> tuple[list[str], int | None]:
    """The problem lines (host first) and node 0's master port (pure: unit-tested on dicts)."""
    problems: list[str] = []
    port = target.master_port
    reference = next((f for f in facts if f.facts), None)
    for rank, f in enumerate(facts):
        name = f.host.name
        if f.facts is None:
            problems.append(f"host {name}: {f.error}")
            continue
        got = f.facts
        ref = reference.facts if reference is not None and reference is not f else None
        for key in ("python", "torch", "shardwise"):
            mine = got.get(key)
            if mine is None:
                problems.append(
                    f"host {name}: {key} is not installed for {target.python}; install it (or pass --python PATH)"
                )
            elif ref is not None and ref.get(key) is not None and mine != ref.get(key):
                problems.append(
                    f"host {name}: {key} {mine} differs from {key} {ref.get(key)} on {reference.host.name}; "  # type: ignore[union-attr]
                    "install the same versions on every host"
                )
        if not got.get("chdir_ok"):
            problems.append(
                f"host {name}: directory {target.chdir} does not exist there; use the same path on every host, "
                "or pass --chdir DIR"
            )
        elif not got.get("script_ok"):
            what = (
                f"module {target.script!r} cannot be imported"
                if target.module
                else f"script {target.script} does not exist"
            )
            problems.append(f"host {name}: {what} in {target.chdir}; copy it there (or use a shared file system)")
        if (target.store is not None or target.store_client_port is not None) and (
                got.get("store_error") or not got.get("store_addr")):
            where = target.store or (
                f"{got.get('store_addr')}:{target.store_client_port} (this machine, as {name} sees it)"
                if got.get("store_addr")
                else "this machine"
            )
            problems.append(
                f"host {name}: cannot reach the rendezvous store at {where}: {got.get('store_error') or 'no answer'}; "
                "open that port to the hosts, or pass --rdzv-store HOST:PORT of a 'shardwise rendezvous' they reach "
                "(or --rdzv-store node0)"
            )
        if not got.get("master_resolves"):
            problems.append(f"host {name}: the master address {target.master_addr!r} does not resolve there; "
                            "pass --master-addr with an address every host can reach")
        if rank == 0:
            if target.master_port is not None and not got.get("port_free", True):
                problems.append(
                    f"host {name}: the master port {target.master_port} is in use there; pick another --master-port"
                )
            if target.master_port is None:
                port = int(got["free_port"]) if got.get("free_port") else None  # type: ignore[call-overload]
    return problems, port


def run_preflight(hosts: Sequence[Host], target: Target, ssh: SshOptions) -> Preflight:
    """Ask every host in parallel (each within its hard timeout) and judge the answers."""
    source = _probe_source()
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        facts = tuple(pool.map(lambda item: _ask(item[1], item[0], target, ssh, source), enumerate(hosts)))
    problems, port = judge(facts, target)
    return Preflight(facts, tuple(problems), port)


def check(pre: Preflight) -> Preflight:
    """Raise one :class:`LaunchError` listing every problem (a single one stays a single line)."""
    if len(pre.problems) == 1:
        raise LaunchError(pre.problems[0])
    if pre.problems:
        raise LaunchError(
            f"pre-flight found {len(pre.problems)} problems, nothing was started:\n  " + "\n  ".join(pre.problems)
        )
    return pre
