"""The workers that ``shardwise run`` / ``shardwise train`` start in the suite fork from one server per
pytest worker (:mod:`shardwise.launch.forkserver`) that imported torch, shardwise and transformers
once, instead of each paying 2-10 CPU-seconds of imports: the suite runs hundreds of such workers.

The server is started at the session's start and named in ``SHARDWISE_FORKSERVER``, which every
job a test starts inherits (``tests/checkout.py``). Until its imports are done, its socket does not
exist and workers start the usual way. A test about start-up itself (signals, process identity,
what a worker imports) carries ``@pytest.mark.fresh_workers`` and gets new interpreters;
``SHARDWISE_TEST_WORKER_START=spawn`` gives every test new interpreters.

A test's own ``python -m shardwise ...`` (or any ``python`` command) forks from the same server
through :func:`python` when its environment names the server, as the launcher's workers do, and is
then a real process of its own (its pipes, its exit code, the signals it is sent passed on, killed
with its client); where the environment does not (``fresh_workers``), it is a new interpreter.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from typing import Iterator, Mapping

from shardwise.launch.forkserver import FORKSERVER_VAR, PRELOAD, worker_command
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
    """The command line of ``python ARGS`` for a subprocess that runs with ``env`` (default
    ``os.environ``): through the fork client when it names the session's server (module doc)."""
    return [sys.executable, *worker_command(list(args), os.environ if env is None else env)]


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
