"""The workers' entry point (shardwise.launch.worker_main): a script or a module runs as
``python TARGET`` would (``__main__``, its argv, the file's directory first on sys.path, its exit
status), and with ``PYTHONUNBUFFERED=1`` every printed line leaves the process in one write."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import json, os, sys
print("part", "two", "three", sep="-")
sys.stdout.write("a "); sys.stdout.write("b\\n")
print("err", "line", file=sys.stderr)
print(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0], "file": __file__,
                  "line_buffering": sys.stdout.line_buffering}))
raise SystemExit(int(sys.argv[-1]))
"""


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # strace would show the writes; instead the child's stdout is a pipe read in one piece, and the
    # line-buffered stream is checked by its own flag and by the whole lines that come out
    return subprocess.run(
        [sys.executable, "-m", "shardwise.launch.worker_main", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_script_runs_as_main_with_its_argv_path_and_exit_status(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    script = tmp_path / "sub" / "train.py"
    script.write_text(SCRIPT)
    done = _run(tmp_path, "sub/train.py", "--lr", "3e-4", "3")
    assert done.returncode == 3, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == ["part-two-three", "a b"] and done.stderr == "err line\n"
    seen = json.loads(lines[2])
    assert seen["name"] == "__main__" and seen["argv"] == ["sub/train.py", "--lr", "3e-4", "3"]
    assert seen["path0"] == str(tmp_path / "sub") and seen["file"] == "sub/train.py" and seen["line_buffering"] is True


def test_a_module_runs_as_python_dash_m(tmp_path: Path) -> None:
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "train.py").write_text(SCRIPT)
    done = _run(tmp_path, "-m", "mypkg.train", "0")
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[2])
    assert seen["name"] == "__main__" and seen["argv"] == [str(tmp_path / "mypkg" / "train.py"), "0"]
    assert seen["line_buffering"] is True


def test_an_unbuffered_stream_becomes_line_buffered_on_the_same_descriptor() -> None:
    from shardwise.launch.worker_main import line_buffered

    raw = open(os.devnull, "wb", buffering=0)  # what python -u puts under sys.stdout
    import io

    unbuffered = io.TextIOWrapper(raw, write_through=True)
    stream = line_buffered(unbuffered)
    assert stream.line_buffering and stream.fileno() == raw.fileno() and stream is not unbuffered
    buffered = io.TextIOWrapper(io.BufferedWriter(raw))
    assert line_buffered(buffered) is buffered and buffered.line_buffering and not buffered.write_through
    raw.close()


def test_worker_errors_bad_input_is_one_line_with_its_ranks_a_crash_keeps_the_first_traceback(tmp_path: Path) -> None:
    from shardwise.errors import ConfigError
    from shardwise.launch.worker_errors import is_bad_input, read_records, record_failure, worker_failure
    from shardwise.layout import Plan

    try:
        Plan.parse("ep=4", world_size=2)
    except ConfigError as exc:
        own = exc
    from shardwise.launch import worker_errors

    package = os.path.dirname(os.path.dirname(os.path.abspath(worker_errors.__file__)))
    raised = {}
    for kind in ("ValueError", "TypeError", "IndexError"):  # as if raised by a line of shardwise's own code
        try:
            exec(compile(f"raise {kind}('checked')", os.path.join(package, "check.py"), "exec"))
        except Exception as exc:  # noqa: BLE001
            raised[kind] = exc
    assert is_bad_input(raised["ValueError"]) and is_bad_input(raised["TypeError"])
    inner = raised["IndexError"]  # a crash inside shardwise: only ValueError/TypeError are its checks
    try:
        Plan.parse("tp=x")  # shardwise's own ConfigError
    except ConfigError as exc:
        assert is_bad_input(exc)
    try:
        int("not a number")  # a ValueError from outside shardwise is a crash, not bad input
    except ValueError as exc:
        outside = exc
    assert is_bad_input(own) and not is_bad_input(outside) and not is_bad_input(RuntimeError("x"))
    assert not is_bad_input(inner)
    for rank in (1, 0):
        assert record_failure(own, directory=str(tmp_path), rank=rank)
    error, trace = worker_failure(read_records(str(tmp_path)))
    assert trace is None and str(error) == f"{own} (raised on ranks 0, 1)"
    crashes = tmp_path / "crashes"
    crashes.mkdir()
    record_failure(outside, directory=str(crashes), rank=3)
    record_failure(RuntimeError("later"), directory=str(crashes), rank=0)
    error, trace = worker_failure(read_records(str(crashes)))
    assert error is None and trace.startswith("Traceback") and "ValueError: invalid literal" in trace
    assert not record_failure(own, directory=str(tmp_path / "missing"))  # no launcher asked: the caller re-raises


def test_the_launchers_line_names_the_rank_whose_traceback_it_showed() -> None:
    """torch orders failures by whole seconds: rank 0, stopped in a collective by rank 1's crash in
    the same second, comes first there; the records' order (the traceback shown) decides the line."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from shardwise.launch.run import describe_failures

    failures = {r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=1, error_file="") for r in (0, 1)}
    for failure in failures.values():
        failure.timestamp = 1_700_000_000
    err = ChildFailedError("worker", failures)
    assert describe_failures(err, 0).startswith("rank 0 (local rank 0, pid 100) failed: exit code 1")  # torch's pick
    line = describe_failures(err, 0, first_recorded=1)
    assert line.startswith("rank 1 (local rank 1, pid 101) failed: exit code 1") and "1 other worker(s)" in line
    assert describe_failures(err, 0, first_recorded=5).startswith("rank 0 ")  # a record of no failed rank: torch's


def test_a_rank_killed_without_a_record_comes_before_its_peers_in_the_same_second() -> None:
    """SHARDWISE_FAULT SIGKILLs rank 1 (no record); rank 0 records gloo's read error and is then
    stopped by the agent (SIGTERM) or exits by itself, in the same second: rank 1 failed first."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from shardwise.launch.run import describe_failures

    failures = {0: ProcessFailure(local_rank=0, pid=100, exitcode=-signal.SIGTERM, error_file=""),
                1: ProcessFailure(local_rank=1, pid=101, exitcode=-signal.SIGKILL, error_file="")}
    for failure in failures.values():
        failure.timestamp = 1_700_000_000
    line = describe_failures(ChildFailedError("worker", failures), 0, first_recorded=0)
    assert line.startswith("rank 1 (local rank 1, pid 101) failed: killed by SIGKILL"), line
    failures[0] = ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file="")  # rank 0 exited by itself
    failures[0].timestamp = failures[1].timestamp
    line = describe_failures(ChildFailedError("worker", failures), 0, first_recorded=0)
    assert line.startswith("rank 1 (local rank 1, pid 101) failed: killed by SIGKILL"), line
    failures[0] = ProcessFailure(local_rank=0, pid=100, exitcode=-signal.SIGTERM, error_file="")
    failures[0].timestamp = failures[1].timestamp
    failures[1].timestamp += 1  # a second later: torch's order holds
    line = describe_failures(ChildFailedError("worker", failures), 0, first_recorded=0)
    assert line.startswith("rank 0 (local rank 0, pid 100) failed: killed by SIGTERM"), line
