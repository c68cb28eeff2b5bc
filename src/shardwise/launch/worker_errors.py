"""How an exception raised in the workers reaches the user: once, and as one line for bad input.

Each worker of a launch (``shardwise run``/``train``'s :mod:`~shardwise.launch.worker_main`,
``shardwise.launch(fn)``'s function, ``shardwise verify``) that ends with an exception writes one
record, ``<dir>/rank<R>.json``, into a directory the launcher made for this launch (its path in
``SHARDWISE_ERROR_DIR``) instead of its traceback: with N ranks failing the same way the user would
otherwise read N copies of it, interleaved (a crash also prints its one line in the rank's own output,
so a restart that recovers from it, or the rank's ``--log-dir`` file, still says what happened). The launcher reads the
records when the agent reports the failure (:func:`worker_failure`):

- **bad input** — a :class:`~shardwise.errors.ShardwiseError`, or a ``ValueError``/``TypeError``
  raised by shardwise's own code (the innermost frame of its traceback is in the ``shardwise``
  package): the check's one line, once, with the ranks that raised it, as a :class:`WorkerInputError`
  (exit code 2, as for a check made before launch);
- **anything else** — the traceback of the rank that failed first (by the time it was recorded),
  printed once, then the agent's one-line summary of the failure (exit code 1).

A worker that records bad input waits up to 3 s for its node's other ranks to record theirs
(the agent stops the group when the first worker exits), then exits with code 2. The hang watchdog's verdict
(``os._exit`` after its own report, :mod:`shardwise.runtime.watchdog`) raises nothing and keeps its own format. Only the
standard library and :mod:`shardwise.errors` are imported: a worker starts as fast as before.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass

from shardwise.errors import ConfigError, ShardwiseError

ERROR_DIR_VAR = "SHARDWISE_ERROR_DIR"
INPUT_EXIT_CODE = 2
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../shardwise


class WorkerInputError(ConfigError):
    """Bad input that a check inside the workers refused (one line, exit code 2)."""


@dataclass(frozen=True)
class WorkerRecord:
    rank: int
    bad_input: bool  # a check's one line (module doc); else a crash with its traceback
    line: str
    traceback: str
    time: float


def is_bad_input(exc: BaseException) -> bool:
    """A :class:`ShardwiseError`, or a ``ValueError``/``TypeError`` raised inside shardwise's own code."""
    if isinstance(exc, ShardwiseError):
        return True
    if not isinstance(exc, (ValueError, TypeError)) or exc.__traceback__ is None:
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(_PACKAGE + os.sep)


def one_line(exc: BaseException) -> str:
    """The exception as the CLI would print it: a ShardwiseError's own text, else ``Type: first line``."""
    text = str(exc).strip()
    if isinstance(exc, ShardwiseError):
        return " ".join(text.split("\n"))
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def record_failure(exc: BaseException, *, directory: str | None = None, rank: int | None = None) -> bool:
    """Write this worker's record (module doc); False when no launcher asked for one (no
    ``SHARDWISE_ERROR_DIR``), in which case the caller lets the exception propagate as usual."""
    directory = directory or os.environ.get(ERROR_DIR_VAR)
    if not directory or not os.path.isdir(directory):
        return False
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    body = {"rank": rank, "bad_input": is_bad_input(exc), "line": one_line(exc),
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)), "time": time.time()}
    path = os.path.join(directory, f"rank{rank}.json")
    try:
        with open(path + ".tmp", "w") as fh:
            json.dump(body, fh)
        os.replace(path + ".tmp", path)
    except OSError:
        return False
    if body["bad_input"]:
        _wait_for_peers(directory, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    else:  # one line in this rank's own output: what a restart recovered from, or what its --log-dir file shows
        print(
            f"rank {rank} failed: {body['line']} (the launcher shows the traceback if the job ends with it)",
            file=sys.stderr,
            flush=True,
        )
    return True


def exit_for_launcher(exc: BaseException) -> None:
    """End this worker for the launcher: record ``exc`` and exit (code 2 for bad input, else 1).
    Returns only when no launcher asked for records; the caller then re-raises ``exc``."""
    if record_failure(exc):
        sys.stdout.flush()
        raise SystemExit(INPUT_EXIT_CODE if is_bad_input(exc) else 1) from None


def _wait_for_peers(directory: str, local_world: int, *, timeout_s: float = 3.0) -> None:
    """Give the other local ranks up to ``timeout_s`` to reach the same check and record it
    before this one exits (the agent stops the rest of the group when a worker exits): the
    message can then name every rank that raised it. A rank waiting in a collective for this one
    never records; the wait ends at the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            done = sum(1 for n in os.listdir(directory) if n.startswith("rank") and n.endswith(".json"))
        except OSError:
            return
        if done >= local_world:
            return
        time.sleep(0.05)


def read_records(directory: str) -> list[WorkerRecord]:
    """The records in ``directory``, earliest first (unreadable files are skipped)."""
    out = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if not (name.startswith("rank") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(directory, name)) as fh:
                data = json.load(fh)
            out.append(
                WorkerRecord(
                    int(data["rank"]),
                    bool(data["bad_input"]),
                    str(data["line"]),
                    str(data["traceback"]),
                    float(data["time"]),
                )
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(out, key=lambda r: (r.time, r.rank))


def _ranks(ranks: list[int]) -> str:
    ranks = sorted(set(ranks))
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def worker_failure(records: list[WorkerRecord]) -> tuple[WorkerInputError | None, str | None]:
    """What to tell the user about a failed launch: the bad-input error to raise (the first line
    recorded, with every rank that raised the same line; a different line on other ranks is
    counted), or else the first crash's traceback to print once. ``(None, None)``: no records."""
    bad = [r for r in records if r.bad_input]
    if bad:
        first = bad[0].line
        same = [r.rank for r in bad if r.line == first]
        others = len({r.rank for r in bad}) - len(set(same))
        more = f" ({others} other rank(s) refused with another message)" if others else ""
        return WorkerInputError(f"{first} (raised on {_ranks(same)}){more}"), None
    return None, records[0].traceback if records else None
