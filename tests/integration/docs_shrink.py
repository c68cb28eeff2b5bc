"""How the docs test (tests/integration/test_docs_run.py) runs a documented command here: which
cannot run on this machine and why (:func:`skip_reason`), and the same command shrunk to the
smallest sizes with the same flags (:func:`shrunk`): the values of the flags that set sizes (steps,
layers, width, data, message sizes, processes: at most this machine's two cores) are replaced, or
added when the command leaves them at a larger default; ``--plan auto`` plans for the ``cpu`` preset
instead of measuring the machine (SHARDWISE_CLUSTER, as the docs describe)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.doc_commands import Command, leading_globals

NPROC_CAP = 2  # this machine's cores
TINY_GPT = {
    "--max-steps": "2",
    "--model.layers": "1",
    "--model.hidden": "32",
    "--model.heads": "2",
    "--model.seq_len": "16",
    "--data.max_chars": "20000",
    "--train.global_batch_size": "4",
    "--train.warmup_steps": "1",
    "--train.eval_every": "0",
    "--train.eval_windows": "2",
    "--sample.chars": "8",
}
TINY_HF = {"--max-steps": "2", "--model.seq_len": "16", "--train.global_batch_size": "4", "--train.warmup_steps": "1",
           "--train.eval_every": "0", "--train.eval_windows": "2"}
# instruction data: a chat with its template's role markers is about 44 tokens of the fixture model
INSTRUCT_FORMATS, INSTRUCT_SEQ = ("chat", "prompt_completion"), "64"
# per subcommand: flags set to a small value (added when absent), flags made smaller only where given
# (None: a switch; calibrate --quick measures fewer sizes along the same code path)
SET = {
    "verify": {"--steps": "2"},
    "generate": {"--max-new-tokens": "4"},
    "doctor": {"--max-size-mb": "1", "--iters": "2"},
    "calibrate": {"--max-size-mb": "1", "--iters": "1", "--quick": None},
}
SMALLER = {"--step": "2", "--data.shuffle_windows": "4", "--nproc": str(NPROC_CAP), "--nproc-per-node": str(NPROC_CAP)}
# measuring this machine takes about as long at any process count: two processes of one thread each
# (calibrations with another count are the same run then, and run once); one process would measure
# with both cores' threads, whose OpenMP spin-waits cost it 4x the CPU while the suite's other tests run
NPROC_OF = {"calibrate": "2"}
# a documented Python script's own size flags
SCRIPT_SET = {"examples/hf_finetune_llama.py": {"--steps": "2", "--nproc": "1"},
              # 2 steps, a checkpoint and an evaluation at each, resumed to 3 (steps // 2 more)
              "examples/finetune_chat.py": {"--steps": "2"}}
CLUSTER_HOSTS = ("node0", "node1", "node2")
# commands that serve until they are stopped: they pass when they are still serving after
# SERVE_S seconds and printed their line (the port: a free one, so runs beside them do not collide).
# Forked from the zygote, each prints its line within about 0.4 s on a loaded machine (2.5 s as a
# fresh interpreter), and after it only waits in its serve loop (a wake-up every 0.2 s or 1 s).
SERVERS = {"rendezvous": "serving the c10d rendezvous store on port", "lighthouse": "serving torchft's quorum on port"}
SERVE_S = 3


def skip_reason(cmd: Command) -> str | None:
    """Why ``cmd`` cannot run here, or None."""
    words, program = cmd.words, cmd.program
    if program in ("srun", "sbatch", "salloc"):
        return "needs a Slurm cluster"
    if program == "mpirun":
        return "needs MPI and its hosts (mpirun)"
    if program in ("ssh", "ssh-keygen", "ssh-copy-id"):
        return "sets up ssh logins on other hosts (a cluster)"
    if program == "pip":
        return "installs packages from a package index (network)"
    if program == "make":
        return {
            "test": "is this test suite",
            "setup": "makes the environment this suite runs in",
            "train": "runs `shardwise train` at full size (400 steps, minutes); the suite runs `shardwise train` "
            "shrunk",
        }.get(words[1] if len(words) > 1 else "", "a make target")
    if program in ("python", "python3") and len(words) > 1 and words[1].startswith("bench/"):
        return "a benchmark (minutes of interleaved timing); its results are committed in bench/results/"
    if "--hostfile" in words or "--hosts" in words:
        return (
            "starts processes on other hosts over ssh (a cluster; tests/integration/test_hostfile.py runs it on a "
            "loopback sshd)"
        )
    if any(h in w for w in words for h in CLUSTER_HOSTS):
        return "needs other nodes (node0, node1: a cluster)"
    lighthouse = _value(words, "--lighthouse")
    if lighthouse and lighthouse.split(":")[0] not in ("localhost", "127.0.0.1"):
        return f"joins a lighthouse on another machine ({lighthouse}: a cluster)"
    nnodes = _value(words, "--nnodes")
    if nnodes and nnodes.split(":")[-1] != "1":
        return f"needs {nnodes} nodes (a cluster)"
    for w in words:
        m = re.match(r"^(https?)://([^:/]+)", w)
        if m and m.group(2) not in ("localhost", "127.0.0.1"):
            return f"needs a network service ({m.group(0)})"
    if any(w in ("cuda", "nccl") or "--gpus" in w and cmd.subcommand != "slurm" for w in words):
        return "needs a GPU"
    return None


def _value(words: list[str], flag: str) -> str | None:
    for i, w in enumerate(words):
        if w == flag and i + 1 < len(words):
            return words[i + 1]
        if w.startswith(flag + "="):
            return w.split("=", 1)[1]
    return None


def _set(words: list[str], flag: str, value: str | None, *, add: bool) -> list[str]:
    """``words`` with ``flag``'s value replaced by ``value`` (for --nproc-style caps: the smaller),
    or ``flag value`` appended when ``add`` and it is absent (before a ``--`` or the script);
    ``value`` None: a switch (``--quick``), appended when ``add`` and absent."""
    if value is None:
        return words + [flag] if add and flag not in words else list(words)
    out, found = list(words), False
    for i, w in enumerate(out):
        if w == flag and i + 1 < len(out):
            out[i + 1], found = _smaller(out[i + 1], value, flag), True
        elif w.startswith(flag + "="):
            out[i], found = f"{flag}={_smaller(w.split('=', 1)[1], value, flag)}", True
    if not found and add:
        out += [flag, value]
    return out


def _smaller(given: str, value: str, flag: str) -> str:
    if flag in ("--nproc", "--nproc-per-node") and given.isdigit():
        return str(min(int(given), int(value)))
    return value


def shrunk(cmd: Command, cwd: Path) -> list[str]:
    """The arguments after ``shardwise`` that the suite runs for ``cmd`` (module doc)."""
    words = [w.replace("file:///abs/", f"file://{cwd}/abs/") for w in cmd.words[1:]]
    if cmd.error or "--help" in words or "-h" in words:  # a refusal is shown as it is; help starts nothing
        return words
    if cmd.program != "shardwise":
        for flag, value in SCRIPT_SET.get(words[0] if words else "", {}).items():
            words = _set(words, flag, value, add=True)
        return words
    sub = cmd.subcommand
    lead, words = leading_globals(words)  # `--verbose` before the subcommand stays there
    if sub in SERVERS:
        return lead + _set(words, "--port", str(_free_port()), add=False)
    script_at = _script_index(words) if sub == "run" else len(words)
    head, tail = words[:script_at], words[script_at:]
    if sub == "train" and "--print-config" not in head:
        tiny = TINY_HF if _value(head, "--model.hf") else TINY_GPT
        if _value(head, "--data.format") in INSTRUCT_FORMATS:
            tiny = {**tiny, "--model.seq_len": INSTRUCT_SEQ}
        for flag, value in tiny.items():
            head = _set(head, flag, value, add=True)
    for flag, value in SET.get(sub, {}).items():
        if not (sub == "doctor" and _value(head, "--nproc") == "0"):
            head = _set(head, flag, value, add=True)
    for flag, value in SMALLER.items():
        if flag == "--nproc" and sub in NPROC_OF:
            head = [f"--nproc={NPROC_OF[sub]}" if w.startswith("--nproc=") else w for w in head]
            head = [NPROC_OF[sub] if i and head[i - 1] == "--nproc" else w for i, w in enumerate(head)]
        else:
            head = _set(head, flag, value, add=False)
    return lead + head + tail


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _script_index(words: list[str]) -> int:
    """Where ``shardwise run``'s script (and its own arguments) starts in ``words`` (``run`` and
    its flags first; any global flags before ``run`` are skipped)."""
    i = len(leading_globals(words)[0]) + 1
    while i < len(words):
        w = words[i]
        if w in ("-m", "--module", "--stop-with-stdin"):
            i += 1
        elif w.startswith("--") and "=" not in w:
            i += 2
        elif w.startswith("-"):
            i += 1
        else:
            return i
    return len(words)
