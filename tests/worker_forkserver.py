"""The workers that ``shardwise run`` / ``shardwise train`` start in the suite fork from one server per
pytest worker (:mod:`shardwise.launch.forkserver`) that imported torch, shardwise and transformers
once, instead of each paying 2-10 CPU-seconds of imports: the suite runs hundreds of such workers.

The server is started at the session's start and named in ``SHARDWISE_FORKSERVER``, which every
job a test starts inherits (``tests/checkout.py``). Until its imports are done, its socket does not
exist and workers start the usual way. A test about start-up itself (signals, process identity,
what a worker imports) carries ``@pytest.mark.fresh_workers`` and gets new interpreters;
``SHARDWISE_TEST_WORKER_START=spawn`` gives every test new interpreters.

A test's own ``python -m shardwise ...`` (the launcher) or ``python SCRIPT`` forks from the same
server through :func:`python` when its environment names the server, as the launcher's workers do,
where the check is not about start-up itself; where the environment does not (``fresh_workers``),
it is a new interpreter.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from typing import Iterator, Mapping

from shardwise.launch.forkserver import CLIENT, FORKSERVER_VAR, PRELOAD, worker_command
from tests.checkout import checkout_env, stop

# what the suite's workers import beyond a `shardwise train` worker's (the HF, LoRA and QLoRA jobs)
SUITE_PRELOAD = (
    *PRELOAD, "shardwise.jobs.hf_train", "shardwise.launch.call_worker", "shardwise.commands.verify",
    "shardwise.commands.doctor", "shardwise.commands.generate", "shardwise.calibrate.calibration",
    "transformers", "transformers.models.llama.modeling_llama", "peft", "torchao", "matplotlib.pyplot",
    "torch.utils.tensorboard", "shardwise.cli", "shardwise.launch.run", "shardwise.commands.train",
)
MARKER = "fresh_workers"


def python(*args: str, env: Mapping[str, str] | None = None) -> list[str]:
    """The command line of ``python ARGS`` (``-m MODULE ...`` or ``SCRIPT.py ...``) for a subprocess
    that runs with ``env`` (default ``os.environ``): forked from the session's server when ``env``
    names it (src/shardwise/launch/fork_client.py, a few milliseconds instead of the imports), else
    a new interpreter. The process gets the caller's stdin/stdout/stderr (the pipes themselves),
    environment, working directory, exit status and the signals sent to the client; its pid is not
    the client's, a SIGKILLed client takes it along, and what the server imported prints nothing: a
    check of start-up itself, a kill or a pid keeps ``[sys.executable, *ARGS]``."""
    return [sys.executable, *worker_command(list(args), os.environ if env is None else env)]


def python_wrapper(folder: str) -> str:
    """An executable file in ``folder`` that runs as ``python`` does, forked from the server named in
    its own environment's ``SHARDWISE_FORKSERVER`` when set (:func:`python`), for a command that
    starts ``python`` itself: the hosts of ``shardwise run --hostfile --python FILE``."""
    path = os.path.join(folder, "python-forked")
    interpreter, client = shlex.quote(sys.executable), shlex.quote(CLIENT)
    with open(path, "w") as fh:
        fh.write(f'#!/bin/sh\nif [ -n "${FORKSERVER_VAR}" ]; then\n'
                 f'    exec {interpreter} -I -S {client} "${FORKSERVER_VAR}" "$@"\nfi\nexec {interpreter} "$@"\n')
    os.chmod(path, 0o755)
    return path


def start() -> Iterator[str | None]:
    """Run the server for the session; yields its socket path (None when turned off)."""
    if os.environ.get("SHARDWISE_TEST_WORKER_START", "fork") == "spawn":
        yield None
        return
    folder = tempfile.mkdtemp(prefix="sw-fs-")
    path = os.path.join(folder, "workers.sock")
    with open(os.path.join(folder, "server.log"), "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "shardwise.launch.forkserver", "--socket", path,
             "--preload", ",".join(SUITE_PRELOAD)],
            env=checkout_env(), stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
        )
    os.environ[FORKSERVER_VAR] = path
    try:
        yield path
    finally:
        os.environ.pop(FORKSERVER_VAR, None)
        stop(server)
        shutil.rmtree(folder, ignore_errors=True)
