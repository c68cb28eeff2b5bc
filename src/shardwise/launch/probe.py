"""What pre-flight asks one host: versions, the working directory, the script, the master address,
and whether the rendezvous store (on the launcher or another host that does not train) answers.

This file is sent as the program text over ssh (``ssh host python - ARGS < probe.py``), so it runs
even where shardwise is missing or another version: it uses the standard library only, imports
nothing of shardwise, and reads versions from the installed package metadata (no ``import torch``,
which takes seconds). It prints one line, ``SHARDWISE_PROBE {json}``, for
:mod:`shardwise.launch.preflight` to judge; a login script that prints more does not confuse it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import socket
import sys

MARKER = "SHARDWISE_PROBE "


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def port_free(port: int) -> bool:
    """Whether ``port`` can be bound on every interface of this host (shared with
    :mod:`shardwise.launch.options`, which imports it: this file stays standard-library only)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free on ``host`` ("": every interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _reach(host: str, port: int, timeout_s: float = 5.0) -> str | None:
    """None when ``host:port`` accepts a TCP connection from here, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__


def _store(store: str | None, store_client_port: int | None) -> dict[str, object]:
    """Can this host reach the rendezvous store: at ``HOST:PORT``, or on the machine this ssh
    session comes from (the launcher, its address as this host sees it) at ``store_client_port``."""
    if store is not None:
        host, _, port = store.rpartition(":")
        return {"store_addr": host.strip("[]"), "store_error": _reach(host.strip("[]"), int(port))}
    if store_client_port is None:
        return {}
    client = os.environ.get("SSH_CONNECTION", "").split()
    if not client:
        return {
            "store_addr": None,
            "store_error": "SSH_CONNECTION is not set, so the launcher's address is unknown here",
        }
    return {"store_addr": client[0], "store_error": _reach(client[0], store_client_port)}


def probe(chdir: str, script: str, module: bool, master_addr: str, port: int | None, find_port: bool,
          store: str | None = None, store_client_port: int | None = None) -> dict[str, object]:
    """The facts of this host; no judgement (that happens on the launching machine)."""
    facts: dict[str, object] = {
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch": _version("torch"),
        "shardwise": _version("shardwise"),
        "chdir_ok": os.path.isdir(chdir),
    }
    if facts["chdir_ok"]:
        os.chdir(chdir)
        if module:
            sys.path.insert(0, chdir)
            try:
                facts["script_ok"] = importlib.util.find_spec(script.split(".")[0]) is not None
            except (ImportError, ValueError):
                facts["script_ok"] = False
        else:
            facts["script_ok"] = os.path.isfile(script)
    try:
        socket.getaddrinfo(master_addr, None)
        facts["master_resolves"] = True
    except (socket.gaierror, UnicodeError) as exc:
        facts["master_resolves"] = False
        facts["master_error"] = str(exc)
    if port is not None:
        facts["port_free"] = port_free(port)
    if find_port:
        facts["free_port"] = free_port("")
    facts.update(_store(store, store_client_port))
    return facts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="shardwise-probe")
    p.add_argument("--chdir", required=True)
    p.add_argument("--script", required=True)
    p.add_argument("--module", action="store_true")
    p.add_argument("--master-addr", required=True)
    p.add_argument("--port", type=int, default=None, help="is this port free here (node 0)")
    p.add_argument("--find-port", action="store_true", help="report a free port here (node 0)")
    p.add_argument("--store", default=None, metavar="HOST:PORT", help="can this host reach the rendezvous store there")
    p.add_argument("--store-client-port", type=int, default=None, metavar="PORT",
                   help="can this host reach the rendezvous store on the launcher (the ssh client) at this port")
    a = p.parse_args(argv)
    facts = probe(a.chdir, a.script, a.module, a.master_addr, a.port, a.find_port, a.store, a.store_client_port)
    print(MARKER + json.dumps(facts), flush=True)


if __name__ == "__main__":
    main()
