"""The fork server (shardwise.launch.forkserver): a worker forked from it is the worker ``python`` would
start. The same ``shardwise run`` with and without ``SHARDWISE_FORKSERVER`` prints the same lines,
fails with the same line and exit code, passes SIGTERM on the same way; without a server at the
socket it starts the workers fresh. The workers import nothing but the standard library, so the
four launches cost a few CPU-seconds; the server preloads a module of the test's own, which tells
a forked worker from a fresh one."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from shardwise.launch.forkserver import FORKSERVER_VAR
from tests.checkout import checkout_env

pytestmark = pytest.mark.fresh_workers  # this file starts its own server (or none)

SCRIPT = '''
import json, os, signal, sys, time, warnings
rank = int(os.environ["RANK"])
mode = sys.argv[1]
filters = [(f[0], f[2].__name__, getattr(f[3], "pattern", f[3])) for f in warnings.filters]
print(json.dumps({"rank": rank, "world": os.environ["WORLD_SIZE"], "argv": sys.argv[1:], "cwd": os.getcwd(),
                  "path0": sys.path[0], "name": __name__, "forked": "preloaded_marker" in sys.modules,
                  "threads": os.environ.get("OMP_NUM_THREADS"), "warnoptions": sys.warnoptions,
                  "filters": filters}), flush=True)
if mode == "fail" and rank == 1:
    sys.exit(3)
if mode == "fail":  # stopped by the agent (else whether it ended first, exit 0, would be a race)
    time.sleep(60)
if mode == "wait":
    def stop(signum, frame):
        print(f"rank {rank} got {signal.Signals(signum).name}", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    open(f"ready-{rank}", "w").close()
    time.sleep(60)
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("fs")
    (folder / "preloaded_marker.py").write_text("MARK = 1\n")
    (folder / "markerpkg").mkdir()
    (folder / "markerpkg" / "__init__.py").write_text("")
    (folder / "markerpkg" / "job.py").write_text("if __name__ == '__main__':\n    print('marker ran')\n")
    path = str(folder / "s.sock")
    env = checkout_env(PYTHONPATH=f"{folder}:" + checkout_env()["PYTHONPATH"])
    env.pop("PYTHONWARNINGS")  # read at start-up: the forked workers have the server's warning filters
    # what the client runs (worker_main) and a job module (markerpkg.job), preloaded too
    preload = "json,shardwise.launch.worker_main,preloaded_marker,markerpkg.job"
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardwise.launch.forkserver", "--socket", path, "--preload", preload], env=env
    )
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    yield path
    proc.terminate()
    proc.wait(timeout=30)
    assert not os.path.exists(path), "the server removes its socket when it stops"


def _run(cwd: Path, mode: str, server: str | None, **popen: object) -> subprocess.Popen:
    (cwd / "job.py").write_text(SCRIPT)
    env = checkout_env()
    env.pop(FORKSERVER_VAR, None)
    # not the server's (it has none): a forked worker takes its filters from its own; and a warning
    # a forked worker prints (runpy's about a preloaded module) shows
    env["PYTHONWARNINGS"] = "ignore::BytesWarning"
    if server:
        env[FORKSERVER_VAR] = server
    return subprocess.Popen([sys.executable, "-m", "shardwise", "run", "--nproc-per-node", "2", "job.py", mode, "x y"],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def _lines(out: str) -> list[dict]:
    return sorted((json.loads(line) for line in out.splitlines() if line.startswith("{")), key=lambda r: r["rank"])


def test_a_forked_worker_is_the_worker_python_starts(server: str, tmp_path: Path) -> None:
    outs = {}
    for name, path in (("fresh", None), ("forked", server), ("no server", str(tmp_path / "missing.sock"))):
        cwd = tmp_path / name.replace(" ", "_")
        cwd.mkdir()
        out, err = _run(cwd, "ok", path).communicate(timeout=120)
        rows = _lines(out)
        assert [r["rank"] for r in rows] == [0, 1], (out, err)
        assert "Warning" not in err, err
        assert all(r["forked"] == (name == "forked") for r in rows), rows
        assert all(r["cwd"] == str(cwd) and r["path0"] == str(cwd) for r in rows), rows
        outs[name] = [{k: v for k, v in r.items() if k not in ("forked", "cwd", "path0")} for r in rows]
    assert outs["forked"] == outs["fresh"] == outs["no server"]
    assert outs["fresh"][0]["argv"] == ["ok", "x y"] and outs["fresh"][0]["name"] == "__main__"
    assert outs["fresh"][0]["warnoptions"] == ["ignore::BytesWarning"]
    assert ["ignore", "BytesWarning", None] in outs["fresh"][0]["filters"]


def test_a_forked_worker_fails_and_stops_as_a_fresh_one(server: str, tmp_path: Path) -> None:
    ends = {}
    for name, path in (("fresh", None), ("forked", server)):
        cwd = tmp_path / name
        cwd.mkdir()
        proc = _run(cwd, "fail", path)
        out, err = proc.communicate(timeout=120)
        failed = [line for line in err.splitlines() if "failed" in line]
        ends[name] = (proc.returncode, [re.sub(r" \(local rank \d+, pid \d+\)", "", line) for line in failed])
        proc = _run(cwd, "wait", path, start_new_session=True)
        deadline = time.monotonic() + 60
        while not all((cwd / f"ready-{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        ends[name] += (proc.returncode, sorted(line for line in out.splitlines() if "got" in line))
    assert ends["forked"] == ends["fresh"], ends
    assert ends["fresh"][0] != 0 and "exit code 3" in ends["fresh"][1][0], ends
    assert ends["fresh"][2] == 128 + signal.SIGTERM and ends["fresh"][3] == ["rank 0 got SIGTERM", "rank 1 got SIGTERM"]


def test_a_preloaded_module_runs_as_main_without_a_warning(server: str, tmp_path: Path) -> None:
    """``shardwise run -m P.M`` where the server imported P.M (as the suite's server imports
    ``shardwise.jobs.train``): P.M runs once, as ``__main__``, and runpy prints no warning."""
    env = checkout_env(PYTHONPATH=f"{os.path.dirname(server)}:" + checkout_env()["PYTHONPATH"])
    env.pop("PYTHONWARNINGS", None)
    env[FORKSERVER_VAR] = server
    done = subprocess.run([sys.executable, "-m", "shardwise", "run", "--nproc-per-node", "1", "-m", "markerpkg.job"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.count("marker ran") == 1, (done.stdout, done.stderr)
    assert "Warning" not in done.stderr, done.stderr


def test_a_server_that_preloads_transformers_peft_and_torchao_prints_nothing(worker_server: str | None) -> None:
    """The suite's own server (tests/worker_forkserver.py) preloads what the HF, LoRA and QLoRA workers
    import; torchao's optional kernels that do not load here and torch's pytree notices are the
    dependencies' noise, which the server silences before its imports as a worker would."""
    if worker_server is None:
        pytest.skip("this session starts its workers fresh (SHARDWISE_TEST_WORKER_START=spawn)")
    deadline = time.monotonic() + 120
    while not os.path.exists(worker_server) and time.monotonic() < deadline:  # its imports are done
        time.sleep(0.2)
    assert os.path.exists(worker_server), "the suite's fork server did not finish its imports in 120 s"
    log = (Path(worker_server).parent / "server.log").read_text(errors="replace")
    noise = [line for line in log.splitlines() if re.search(r"Failed to load|Warning|deprecated", line)]
    assert not noise, "\n".join(noise)
