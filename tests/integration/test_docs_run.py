"""Every documented command runs: the README's, docs/*.md's and every ``--help``'s ``examples:``
(found by :mod:`tests.doc_commands`, so a page or an example added later is run when it lands).

Each command runs in a fresh directory that holds what the docs assume is there: a training
script (``train.py``, ``-m mypkg.train``), a verify/plan script (``my_model.py``), ``run.toml``,
calibrated cluster specs, text/JSONL/parquet data under the globs the docs use, a small Hugging
Face model with its tokenizer under the names the docs give it (``my-hf-model/``,
``models/my-llama``, ``DIR``), and checkpoints of the two ``shardwise train`` jobs under the
docs' paths (``runs/gpt-stdlib-x``, ``runs/hf-x``, ``runs/ckpt``, ``runs/<name>``, and a LoRA run's
``runs/x``, ``runs/lora``), made by ``shardwise train`` itself first; chat and prompt/completion
records under ``sft/*.jsonl``, ``data/*.jsonl`` and ``qa.parquet``. A command that serves until
stopped (``shardwise rendezvous``) passes when it still serves after SERVE_S seconds. A ``file:///abs/...`` path lands in that directory.

Shrunk, with the same flags: the values of the flags below that set sizes (steps, layers, width,
data, message sizes, processes: at most this machine's two cores) are replaced, or added when the
command leaves them at a larger default; ``--plan auto`` plans for the ``cpu`` preset instead of
measuring the machine (SHARDWISE_CLUSTER, as the docs describe). A command passes when it exits
0, or, where its page shows it refused, exits non-zero with the line the page shows.

Skipped, with the reason: what needs a cluster (Slurm, MPI, other hosts over ssh, several nodes),
a network service, a GPU, or is a benchmark or this suite itself (:func:`skip_reason`). Usage
patterns (``...``, ``[--option]``, ``N``) are not invocations; tests/unit/test_docs_commands.py
checks their flags.

Fast: one process imports torch and shardwise once and forks a child per command
(:mod:`tests.forkrun`), two at a time; identical runs (the same parsed options) run once.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.doc_commands import Command, all_commands
from tests.forkrun import run_phases
from tests.integration.docs_fixtures import HF_NAMES, PRELOAD, fixtures, workdir

NPROC_CAP = 2  # this machine's cores
TINY_GPT = {"--max-steps": "2", "--model.layers": "1", "--model.hidden": "32", "--model.heads": "2", "--model.seq_len": "16",
            "--data.max_chars": "20000", "--train.global_batch_size": "4", "--train.warmup_steps": "1", "--train.eval_every": "0",
            "--train.eval_windows": "2", "--sample.chars": "8"}
TINY_HF = {"--max-steps": "2", "--model.seq_len": "16", "--train.global_batch_size": "4", "--train.warmup_steps": "1",
           "--train.eval_every": "0", "--train.eval_windows": "2"}
# instruction data: a chat with its template's role markers is about 44 tokens of the fixture model
INSTRUCT_FORMATS, INSTRUCT_SEQ = ("chat", "prompt_completion"), "64"
# per subcommand: flags set to a small value (added when absent), flags made smaller only where given
SET = {"verify": {"--steps": "2"}, "generate": {"--max-new-tokens": "4"}, "doctor": {"--max-size-mb": "1", "--iters": "2"},
       "calibrate": {"--max-size-mb": "1", "--iters": "1"}}
SMALLER = {"--step": "2", "--data.shuffle_windows": "4", "--nproc": str(NPROC_CAP), "--nproc-per-node": str(NPROC_CAP)}
# measuring this machine takes about as long at any size: one process (calibrations with another
# process count are the same run then, and run once)
NPROC_CAP_OF = {"calibrate": 1}
# a documented Python script's own size flags
SCRIPT_SET = {"examples/hf_finetune_llama.py": {"--steps": "2", "--nproc": "1"}}
CLUSTER_HOSTS = ("node0", "node1", "node2")
# commands that serve until they are stopped: they pass when they are still serving after
# SERVE_S seconds and printed their line (the port: a free one, so runs beside them do not collide)
SERVERS = {"rendezvous": "serving the c10d rendezvous store on port", "lighthouse": "serving torchft's quorum on port"}
SERVE_S = 15


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
        return {"test": "is this test suite", "setup": "makes the environment this suite runs in",
                "train": "runs `shardwise train` at full size (400 steps, minutes); the suite runs `shardwise train` shrunk"}.get(
            words[1] if len(words) > 1 else "", "a make target")
    if program in ("python", "python3") and len(words) > 1 and words[1].startswith("bench/"):
        return "a benchmark (minutes of interleaved timing); its results are committed in bench/results/"
    if "--hostfile" in words or "--hosts" in words:
        return "starts processes on other hosts over ssh (a cluster; tests/integration/test_hostfile.py runs it on a loopback sshd)"
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


def _set(words: list[str], flag: str, value: str, *, add: bool) -> list[str]:
    """``words`` with ``flag``'s value replaced by ``value`` (for --nproc-style caps: the smaller),
    or ``flag value`` appended when ``add`` and it is absent (before a ``--`` or the script)."""
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
    if sub in SERVERS:
        return _set(words, "--port", str(_free_port()), add=False)
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
        if flag == "--nproc" and sub in NPROC_CAP_OF:
            value = str(NPROC_CAP_OF[sub])
        head = _set(head, flag, value, add=False)
    return head + tail


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _script_index(words: list[str]) -> int:
    """Where ``shardwise run``'s script (and its own arguments) starts."""
    i = 1
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


GPT_RUN = ["train", "--nproc", "1", "--run.name", "gpt-stdlib-x", "--checkpoint.every_n_steps", "1", *[x for kv in TINY_GPT.items() for x in kv]]
HF_RUN = ["train", "--nproc", "1", "--model.hf", "my-hf-model", "--data.files", "corpus/**/*.txt", "--run.name", "hf-x",
          "--checkpoint.every_n_steps", "1", *[x for kv in TINY_HF.items() for x in kv]]
LORA_RUN = ["train", "--nproc", "1", "--model.hf", "my-hf-model", "--data.files", "sft/*.jsonl", "--data.format", "chat", "--lora.r", "4",
            "--run.name", "lora-x", "--checkpoint.every_n_steps", "1", *[x for kv in {**TINY_HF, "--model.seq_len": INSTRUCT_SEQ}.items() for x in kv]]


@dataclass
class Planned:
    cmd: Command
    run: list[list[str]] | None  # the argv (after the program) of the command and of its `&& next` parts
    skipped: str | None
    cwd: Path | None = None


def _cost(argv: list[str]) -> float:
    """Rough CPU-seconds of a run on an idle machine: to start the longest first, and to cut the
    commands into groups of about GROUP_CPU_S."""
    n = int(_value(argv, "--nproc") or _value(argv, "--nproc-per-node") or (4 if argv[:1] == ["verify"] else 1))
    per_process = {"verify": 5.0, "calibrate": 25.0, "doctor": 3.0, "generate": 4.0, "train": 5.0 if "--model.hf" in argv else 3.0,
                   "run": 1.5}.get(argv[0] if argv else "", 0.5)
    return 1.0 + per_process * n + (15.0 if argv[:1] and argv[0].endswith(".py") else 0.0)


# Each group's first test waits for the group: about 200 s on two idle cores. Few large groups: a
# group ends with one command running alone on one core, so 7 groups of 80 CPU-s took 567 s where
# all commands in one batch took 386 s (the same commands, one suite run each, idle).
GROUP_CPU_S = 300.0


def _key(argv: list[str], cwd_name: str, program: str) -> str:
    """Two commands that parse to the same options are one run."""
    import contextlib
    import io

    from shardwise.cli import build_parser

    if program != "shardwise":
        return shlex.join([program, *argv])
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        try:
            ns = vars(build_parser().parse_args(argv))
        except SystemExit:
            return shlex.join(argv)
    ns.pop("func", None)
    return json.dumps(ns, sort_keys=True, default=str).replace(cwd_name, "CWD")


def plan_runs(root: Path) -> tuple[list[Planned], list[dict[str, Any]]]:
    commands = [c for c in all_commands() if not c.pattern]
    planned, jobs, seen = [], [], {}
    for i, cmd in enumerate(commands):
        reason = skip_reason(cmd)
        if reason is None and cmd.program not in ("shardwise", "python", "python3"):
            reason = f"not a command of this project ({cmd.program})"
        if reason:
            planned.append(Planned(cmd, None, reason))
            continue
        cwd = root / f"cmd{i:03d}"
        argvs = [shrunk(cmd, cwd)]
        notes = []
        for then in cmd.then:
            sub = Command(then, cmd.where, cmd.source)
            why = skip_reason(sub)
            if why:
                notes.append(f"then `{then}`: skipped, {why}")
            else:
                argvs.append(shrunk(sub, cwd) if sub.program == "shardwise" else sub.words[1:])
        programs = [cmd.program] + [Command(then).program for then in cmd.then if not skip_reason(Command(then))]
        key = " && ".join(_key(a, cwd.name, prog) for a, prog in zip(argvs, programs)) + f" > {cmd.stdout_file}" + json.dumps(cmd.env, sort_keys=True)
        if key in seen:
            planned.append(Planned(cmd, argvs, None, seen[key]))
            continue
        seen[key] = cwd
        planned.append(Planned(cmd, argvs, "; ".join(notes) or None if notes else None, cwd))
        for j, argv in enumerate(argvs):
            kind = "shardwise" if (cmd.program if j == 0 else Command(cmd.then[j - 1]).program) == "shardwise" else "python"
            jobs.append({"id": f"{cwd.name}.{j}", "kind": kind, "argv": argv, "cwd": str(cwd), "cost": _cost(argv),
                         "env": {**cmd.env, "SHARDWISE_CLUSTER": "cpu"}, "timeout_s": SERVE_S if _serves(cmd, j) else 480,
                         "stdout": str(cwd / (cmd.stdout_file or f"out.{j}.txt")) if j == 0 else str(cwd / f"out.{j}.txt"),
                         "stderr": str(cwd / f"err.{j}.txt")})
    return planned, jobs


def _serves(cmd: Command, part: int) -> bool:
    return part == 0 and cmd.program == "shardwise" and cmd.subcommand in SERVERS and not ({"--help", "-h"} & set(cmd.words))


def _chain(jobs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Phases: the `&& next` parts of a command after its first part."""
    phases: list[list[dict[str, Any]]] = []
    for job in jobs:
        part = int(job["id"].rsplit(".", 1)[1])
        while len(phases) <= part:
            phases.append([])
        phases[part].append(job)
    return phases


@dataclass
class DocsRun:
    """The documented commands, run a group at a time when a test first asks for one of them."""

    planned: list[Planned]
    jobs: dict[str, list[dict[str, Any]]]  # by work directory: the command's parts, in order
    group_of: dict[str, int]
    env: dict[str, str]
    results: dict[str, Any]

    def results_for(self, cwd: Path) -> dict[str, Any]:
        if f"{cwd.name}.0" not in self.results:
            group = self.group_of[cwd.name]
            members = [job for name, parts in self.jobs.items() if self.group_of[name] == group for job in parts]
            self.results.update(run_phases(_chain(members), env={**self.env, "PYTHONUNBUFFERED": "1"}, preload=PRELOAD))
        return self.results


def _groups(jobs: dict[str, list[dict[str, Any]]]) -> dict[str, int]:
    """Work directories -> group, about GROUP_CPU_S of expected CPU each (the longest placed first,
    each in the lightest group)."""
    costs = {name: sum(j["cost"] for j in parts) for name, parts in jobs.items()}
    count = max(1, round(sum(costs.values()) / GROUP_CPU_S))
    load, out = [0.0] * count, {}
    for name in sorted(costs, key=lambda n: -costs[n]):
        group = min(range(count), key=load.__getitem__)
        out[name], load[group] = group, load[group] + costs[name]
    return out


@pytest.fixture(scope="module")
def docs_run(tmp_path_factory: pytest.TempPathFactory) -> DocsRun:
    """The files the docs assume, the three fixture runs of shardwise train (about 30 s), and the plan
    of every command; the commands themselves run by group (DocsRun.results_for)."""
    root = tmp_path_factory.mktemp("docs")
    fx = root / "fixtures"
    fx.mkdir()
    fixtures(fx)
    planned, jobs = plan_runs(root)
    for p in planned:
        if p.cwd is not None and not p.cwd.exists():
            workdir(fx, p.cwd)
    env = {"OMP_NUM_THREADS": "1", "SHARDWISE_CLUSTER": "cpu", "WANDB_SILENT": "true", "WANDB_MODE": "offline"}
    fixture_jobs = [
        [{"id": "hf-model", "kind": "call", "argv": ["tests.integration.docs_fixtures", "make_hf_model", str(fx / HF_NAMES[0])],
          "cwd": str(fx), "stdout": str(root / "hf-model.out"), "stderr": str(root / "hf-model.err"), "timeout_s": 120}],
        [{"id": name, "kind": "shardwise", "argv": argv, "cwd": str(fx), "env": env, "stdout": str(root / f"{name}.out"),
          "stderr": str(root / f"{name}.err"), "timeout_s": 180, "cost": 3} for name, argv in (("gpt-run", GPT_RUN), ("hf-run", HF_RUN), ("lora-run", LORA_RUN))],
    ]
    results = run_phases(fixture_jobs, env={**env, "PYTHONUNBUFFERED": "1"}, preload=PRELOAD)
    for name in ("hf-model", "gpt-run", "hf-run", "lora-run"):
        assert results[name]["rc"] == 0, f"fixture {name} failed:\n" + _tail(root / f"{name}.out") + _tail(root / f"{name}.err")
    by_dir: dict[str, list[dict[str, Any]]] = {}
    for job in jobs:
        job["env"] = {**env, **job["env"]}
        by_dir.setdefault(job["id"].rsplit(".", 1)[0], []).append(job)
    return DocsRun(planned, by_dir, _groups(by_dir), env, results)


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


PLANNED_IDS = [f"{c.where[0]} {c.text[:70]}" for c in all_commands() if not c.pattern]


# Over 30 s: the first test of a group waits for its group (GROUP_CPU_S: about 200 s on two idle
# cores, two commands at a time, forked from one pre-imported process, each at its smallest size);
# the first of all also for the fixture runs (about 15 s). `slow`: not in the quick edit-test loop.
# The timeout allows for a machine shared with other jobs (a group of 80 CPU-s took 10 minutes at load 40).
@pytest.mark.slow
@pytest.mark.slow_allowed(seconds=300, why="the first test of a group runs its group of documented commands (about 200 s on "
                          "two idle cores), the first of all the fixture runs too (about 15 s): the others then take no time")
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("index", range(len(PLANNED_IDS)), ids=PLANNED_IDS)
def test_the_documented_command_runs(docs_run: DocsRun, index: int) -> None:
    p = docs_run.planned[index]
    if p.run is None:
        pytest.skip(f"{', '.join(p.cmd.where)}: `{p.cmd.text}` {p.skipped}")
    results = docs_run.results_for(p.cwd)
    for j, argv in enumerate(p.run):
        got = results[f"{p.cwd.name}.{j}"]
        out, err = p.cwd / (p.cmd.stdout_file if j == 0 and p.cmd.stdout_file else f"out.{j}.txt"), p.cwd / f"err.{j}.txt"
        shown = f"{', '.join(p.cmd.where)}: `{p.cmd.text}` ran as `{shlex.join(argv)}`"
        if p.cmd.error and j == 0:
            assert got["rc"] not in (0, "timeout"), f"{shown} exited {got['rc']}; the page shows it refused"
            assert p.cmd.error.strip() in _tail(err, 100000), f"{shown} did not print the page's line {p.cmd.error!r}:\n{_tail(err)}"
            continue
        if _serves(p.cmd, j):
            assert got["rc"] == "timeout", f"{shown} exited {got['rc']} before it was stopped:\n{_tail(out)}\n{_tail(err)}"
            assert SERVERS[p.cmd.subcommand] in _tail(out) + _tail(err), f"{shown} did not say it serves:\n{_tail(out)}\n{_tail(err)}"
            continue
        assert got["rc"] == 0, f"{shown} exited {got['rc']} after {got['seconds']:.0f} s:\n{_tail(out)}\n{_tail(err)}"
        if argv[:1] == ["train"] and not {"--print-config", "--help"} & set(argv):  # its output is a file: lines, no bar
            log = _tail(out, 10**7) + _tail(err, 10**7)
            assert "\r" not in log, f"{shown}: a carriage return in its log:\n{log[-2000:]}"
            assert re.search(r"^train \d\d:\d\d:\d\d step 2/2 \(100%\)  loss \d", log, flags=re.M), f"{shown}: no progress line:\n{log[-2000:]}"
