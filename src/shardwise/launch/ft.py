"""Fault-tolerant replica groups: ``shardwise run --ft-replicas R`` and ``shardwise lighthouse``.

``--ft-replicas R`` on one machine starts torchft's lighthouse (the quorum server) in this
process and ``R`` replica groups, each an ordinary ``shardwise run --ft-replica-id r`` child with
its own c10d rendezvous, elastic agent and ``--max-restarts``: a failed worker restarts its own
group only, and the other groups keep training (:mod:`shardwise.train.ft`). Each child reads
end-of-file on its stdin when this launcher is gone (``--stop-with-stdin``), so none outlives it.

On several machines, host the lighthouse with ``shardwise lighthouse --port P`` and start one
group per machine (or per set of machines) with ``--ft-replica-id r --ft-replicas R --lighthouse
HOST:P``: that only sets the variables :mod:`shardwise.runtime.ft_env` reads in the workers.

Group rank 0 of each group appends its events to ``<ft dir>/replica<r>.jsonl``; at the end this
launcher writes ``<ft dir>/summary.json`` (:func:`summarize`).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Sequence

from shardwise.errors import LaunchError
from shardwise.runtime import ft_env


@dataclass(frozen=True)
class FtOptions:
    """The ``--ft-*`` flags of ``shardwise run``."""

    replicas: int
    replica_id: int | None = None  # this machine runs that one group (else all R, and the lighthouse)
    lighthouse: str | None = None  # HOST:PORT of a running lighthouse (else one is hosted here)
    min_replicas: int = 1
    timeout_s: float = 30.0
    quorum_timeout_s: float = 60.0
    heartbeat_timeout_s: float = 5.0
    join_timeout_s: float = 1.0
    ft_dir: str | None = None

    def check(self) -> None:
        if self.replicas < 1:
            raise LaunchError(f"--ft-replicas {self.replicas} must be at least 1", hint="e.g. --ft-replicas 2")
        if self.replica_id is not None and not 0 <= self.replica_id < self.replicas:
            raise LaunchError(f"--ft-replica-id {self.replica_id} is outside 0..{self.replicas - 1}",
                              hint=f"give each of the --ft-replicas {self.replicas} groups an index from 0")
        if self.replica_id is not None and not self.lighthouse:
            raise LaunchError(
                "--ft-replica-id needs --lighthouse HOST:PORT", hint="start 'shardwise lighthouse --port P' first"
            )
        if not 1 <= self.min_replicas <= self.replicas:
            raise LaunchError(
                f"--ft-min-replicas {self.min_replicas} is outside 1..{self.replicas}", hint="e.g. --ft-min-replicas 1"
            )
        for name, value in (
            ("--ft-timeout", self.timeout_s),
            ("--ft-quorum-timeout", self.quorum_timeout_s),
            ("--ft-heartbeat-timeout", self.heartbeat_timeout_s),
            ("--ft-join-timeout", self.join_timeout_s),
        ):
            if not value > 0:
                raise LaunchError(f"{name} {value:g} must be positive seconds", hint=f"e.g. {name} 10")

    def check_hang_timeout(self, hang_timeout_s: float | None) -> None:
        """The hang watchdog must outlast torchft's own timeouts, or it would stop a group that is
        only waiting for a quorum (the Trainer also pauses its step check while it waits)."""
        need = self.quorum_timeout_s + 2 * self.timeout_s
        if hang_timeout_s and hang_timeout_s < need:
            raise LaunchError(
                f"--hang-timeout {hang_timeout_s:g} is shorter than torchft's quorum and collective "
                f"timeouts ({need:g} s)",
                hint=f"give --hang-timeout {need:g} or more, or shorter --ft-*-timeout",
            )


def worker_env(options: FtOptions, replica: int, lighthouse: str, ft_dir: str) -> dict[str, str]:
    """The variables every worker of group ``replica`` reads (:mod:`shardwise.runtime.ft_env`)."""
    return {
        ft_env.REPLICA_VAR: str(replica),
        ft_env.REPLICAS_VAR: str(options.replicas),
        ft_env.LIGHTHOUSE_VAR: lighthouse,
        ft_env.MIN_REPLICAS_VAR: str(options.min_replicas),
        ft_env.TIMEOUT_VAR: f"{options.timeout_s:g}",
        ft_env.QUORUM_TIMEOUT_VAR: f"{options.quorum_timeout_s:g}",
        ft_env.DIR_VAR: ft_dir,
    }


def start_lighthouse(port: int, options: FtOptions) -> tuple[Any, str]:
    """torchft's LighthouseServer on ``port`` (0: a free one), every address; ``(server, HOST:PORT)``."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum request at info
    try:
        from torchft.coordination import LighthouseServer
    except ImportError:
        raise LaunchError("fault-tolerant replica groups need torchft", hint="pip install 'shardwise[ft]'") from None
    try:
        server = LighthouseServer(bind=f"[::]:{port}", min_replicas=options.min_replicas,
                                  join_timeout_ms=int(options.join_timeout_s * 1000),
                                  heartbeat_timeout_ms=int(options.heartbeat_timeout_s * 1000))
    except Exception as err:  # noqa: BLE001 - a taken port
        raise LaunchError(
            f"the lighthouse could not listen on port {port}: {err}", hint="pick another --port"
        ) from None
    return server, f"127.0.0.1:{server.address().rsplit(':', 1)[1]}"


def serve_lighthouse(port: int, options: FtOptions) -> int:
    """``shardwise lighthouse``: serve the quorum until stopped (SIGTERM, SIGINT)."""
    server, address = start_lighthouse(port, options)
    print(f"shardwise lighthouse: serving torchft's quorum on port {address.rsplit(':', 1)[1]} (every address), "
          f"min_replicas={options.min_replicas}; join with --lighthouse HOST:{address.rsplit(':', 1)[1]}", flush=True)
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.append(signum))
    while not stop:
        time.sleep(0.2)
    server.shutdown()
    return 0


def run_groups(options: FtOptions, child_args: Sequence[str], *, log_dir: str | None) -> int:
    """Start the lighthouse (unless ``--lighthouse``) and the ``R`` groups here; wait for all of them."""
    ft_dir = options.ft_dir or (os.path.join(log_dir, "ft") if log_dir else tempfile.mkdtemp(prefix="shardwise-ft-"))
    os.makedirs(ft_dir, exist_ok=True)
    server, lighthouse = (None, options.lighthouse) if options.lighthouse else start_lighthouse(0, options)
    print(
        f"[shardwise] ft: {options.replicas} replica group(s), lighthouse {lighthouse}, "
        f"min_replicas={options.min_replicas}, events in {ft_dir}",
        file=sys.stderr,
        flush=True,
    )
    children: list[subprocess.Popen] = []
    stopping: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        stopping.append(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    saved = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    start = time.time()
    try:
        for r in range(options.replicas):
            env = {
                "RUST_LOG": "warn",
                **os.environ,
                **worker_env(options, r, lighthouse, ft_dir),
            }  # torchft's Rust side: quiet
            argv = [sys.executable, "-m", "shardwise", "run", "--stop-with-stdin", *child_args]
            children.append(subprocess.Popen(argv, env=env, stdin=subprocess.PIPE))
        codes = _wait_groups(children, grace_s=options.timeout_s)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        for child in children:  # closing stdin stops a child still running (its lifeline)
            if child.stdin:
                child.stdin.close()
        for child in children:
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
        if server is not None:
            server.shutdown()
    summary = summarize(ft_dir, replicas=options.replicas, codes=codes, started=start)
    with open(os.path.join(ft_dir, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=2)
    print(f"[shardwise] ft: {summary['committed_steps']} step(s) committed, {summary['discarded_steps']} discarded, "
          f"{summary['healed_replicas']} heal(s), {summary['seconds_lost']:.1f} s lost; exit codes {codes} "
          f"({os.path.join(ft_dir, 'summary.json')})", file=sys.stderr, flush=True)
    if stopping:
        return 128 + stopping[0]
    return 0 if any(code == 0 for code in codes) else next(code for code in codes if code)


def _wait_groups(children: Sequence[subprocess.Popen], *, grace_s: float) -> list[int]:
    """Every group's exit code. Once one group has finished training (exit 0), the others get
    ``grace_s`` to finish too; a group still running then (restarting after the others' last step:
    it would train alone from its last state) is stopped with SIGTERM."""
    finished_at = None
    while any(child.poll() is None for child in children):
        if finished_at is None and any(child.poll() == 0 for child in children):
            finished_at = time.monotonic()
        if finished_at is not None and time.monotonic() - finished_at > grace_s:
            for child in children:
                if child.poll() is None:
                    print(
                        f"[shardwise] ft: the other groups finished {grace_s:g} s ago: stopping group pid {child.pid}",
                        file=sys.stderr,
                        flush=True,
                    )
                    child.send_signal(signal.SIGTERM)
            finished_at = float("inf")
        time.sleep(0.2)
    return [child.wait() for child in children]


def read_events(ft_dir: str) -> list[dict[str, Any]]:
    events = []
    for name in sorted(os.listdir(ft_dir)):
        if name.startswith("replica") and name.endswith(".jsonl"):
            with open(os.path.join(ft_dir, name)) as fh:
                events.extend(json.loads(line) for line in fh if line.strip())
    return sorted(events, key=lambda e: e["t"])


def summarize(ft_dir: str, *, replicas: int, codes: Sequence[int] = (), started: float | None = None) -> dict[str, Any]:
    """The job's fault-tolerance counts from the groups' events:

    - ``discarded_steps``: steps a group voted down (a peer failed in them);
    - ``healed_replicas``: heals after step 0 (a group that came back and loaded a peer's state);
    - ``seconds_lost``: per group, for each gap between two commits that holds a discarded step,
      the gap minus that group's median commit interval, summed;
    - ``samples_skipped``: the lost groups' shares of committed steps (skipped, not re-queued).
    """
    events = read_events(ft_dir)
    per: dict[int, dict[str, Any]] = {}
    lost = 0.0
    for r in range(replicas):
        mine = [e for e in events if e["replica"] == r]
        commits = [e for e in mine if e["event"] == "commit"]
        times = [e["t"] for e in commits]
        median = statistics.median([b - a for a, b in zip(times, times[1:])]) if len(times) > 2 else 0.0
        for e in (e for e in mine if e["event"] == "discarded"):
            before = [t for t in times if t <= e["t"]]
            after = [t for t in times if t > e["t"]]
            if before and after:
                lost += max(0.0, after[0] - before[-1] - median)
        per[r] = {"committed_steps": max((e["step"] for e in commits), default=0),
                  "discarded_steps": sum(e["event"] == "discarded" for e in mine),
                  "heals": sum(e["event"] == "healed" and e["step"] > 0 for e in mine),
                  "processes": len({e["pid"] for e in mine}),
                  "samples_skipped": sum(e.get("samples_skipped", 0) for e in commits),
                  "exit_code": codes[r] if r < len(codes) else None}
    return {"replicas": replicas, "committed_steps": max((p["committed_steps"] for p in per.values()), default=0),
            "discarded_steps": sum(p["discarded_steps"] for p in per.values()),
            "healed_replicas": sum(p["heals"] for p in per.values()), "seconds_lost": round(lost, 3),
            "samples_skipped": max((p["samples_skipped"] for p in per.values()), default=0),
            "quorum_changes": sum(e["event"] == "quorum" for e in events) ,
            "elapsed_s": round(time.time() - started, 3) if started else None, "groups": per}
