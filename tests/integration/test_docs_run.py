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
stopped (``shardwise rendezvous``) passes when it still serves after SERVE_S seconds. A ``file:///abs/...``
path lands in that directory.

Shrunk, with the same flags (:mod:`tests.integration.docs_shrink`): the values of the flags that set
sizes (steps, layers, width, data, message sizes, processes: at most this machine's two cores) are
replaced, or added when the command leaves them at a larger default; ``--plan auto`` plans for the
``cpu`` preset instead of measuring the machine (SHARDWISE_CLUSTER, as the docs describe). A command passes
when it exits
0, or, where its page shows it refused, exits non-zero with the line the page shows.

Skipped, with the reason: what needs a cluster (Slurm, MPI, other hosts over ssh, several nodes),
a network service, a GPU, or is a benchmark or this suite itself (:func:`skip_reason`). Usage
patterns (``...``, ``[--option]``, ``N``) are not invocations; tests/unit/test_docs_commands.py
checks their flags.

Once per code path: a command that takes the same code path as one that runs (it differs only in
an option that the parser and the configuration alone read, or a number the run never branches on:
:data:`tests.integration.docs_plan.VALUE_ONLY`) is parsed and resolved in this process instead, and
its resolution must equal the run's.

Spread: each command is its own test item in its own pytest-xdist group (``--dist loadgroup``), so
the two workers share them; in each worker one process imports torch, shardwise and transformers
once and forks a child per command (:class:`tests.forkrun.Zygote`); a documented Python script
that starts ``shardwise`` as ``sys.executable -m shardwise.cli`` (the examples) finds there a
``python`` that forks from the session's server (:func:`tests.worker_forkserver.python_wrapper`).
The files, the Hugging Face model and the three fixture runs are made once per session (the first
worker to need them, under a file lock; the others wait for them). Each command's figures (wall
and CPU seconds, or how it was checked) are printed at the end of the run (``docs commands`` in the
summary).
"""

from __future__ import annotations

import fcntl
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.doc_commands import Command, all_commands
from tests.forkrun import Zygote
from tests.integration.docs_fixtures import HF_NAMES, PRELOAD, fixtures, workdir
from tests.integration.docs_plan import Planned, jobs_of, plan_commands, resolution
from tests.integration.docs_shrink import (  # noqa: F401 - the names this module has always offered
    INSTRUCT_SEQ, NPROC_CAP, SERVE_S, SERVERS, TINY_GPT, TINY_HF, shrunk, skip_reason)
from tests.worker_forkserver import python_wrapper

GPT_RUN = [
    "train",
    "--nproc",
    "1",
    "--run.name",
    "gpt-stdlib-x",
    "--checkpoint.every_n_steps",
    "1",
    *[x for kv in TINY_GPT.items() for x in kv],
]
HF_RUN = ["train", "--nproc", "1", "--model.hf", "my-hf-model", "--data.files", "corpus/**/*.txt", "--run.name", "hf-x",
          "--checkpoint.every_n_steps", "1", *[x for kv in TINY_HF.items() for x in kv]]
LORA_RUN = [
    "train",
    "--nproc",
    "1",
    "--model.hf",
    "my-hf-model",
    "--data.files",
    "sft/*.jsonl",
    "--data.format",
    "chat",
    "--lora.r",
    "4",
    "--run.name",
    "lora-x",
    "--checkpoint.every_n_steps",
    "1",
    *[x for kv in {**TINY_HF, "--model.seq_len": INSTRUCT_SEQ}.items() for x in kv],
]
ENV = {
    "OMP_NUM_THREADS": "1",
    "SHARDWISE_CLUSTER": "cpu",
    "WANDB_SILENT": "true",
    "WANDB_MODE": "offline",
    "PYTHONUNBUFFERED": "1",
}


@dataclass
class DocsRun:
    """The documented commands' plan under ``root``, the fixtures in ``root/fixtures``, and this
    worker's zygote that forks the commands."""

    root: Path
    planned: list[Planned]
    zygote: Zygote
    python: str  # the `python` a documented script starts (sys.executable): it forks from the server if there is one

    def run(self, p: Planned) -> dict[str, Any]:
        assert p.cwd is not None
        if not p.cwd.exists():
            workdir(self.root / "fixtures", p.cwd)
        phases = jobs_of(p, ENV)
        for job in (job for phase in phases for job in phase if job["kind"] == "python"):
            job["executable"] = self.python
        return self.zygote.run(phases)


def _shared_root(factory: pytest.TempPathFactory) -> Path:
    """One directory for the whole session: under pytest-xdist, the workers' common parent."""
    base = factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "docs"
    root.mkdir(exist_ok=True)
    return root


def _make_fixtures(root: Path, zygote: Zygote) -> None:
    """The files the docs assume, the tiny HF model and the three fixture runs (about 20 s), once:
    the first worker makes them under a lock, the others find them (or the reason they failed)."""
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        failed = root / "fixtures.failed"
        if failed.exists():
            pytest.fail(failed.read_text())
        if (root / "fixtures.ok").exists():
            return
        fx = root / "fixtures"
        fx.mkdir()
        fixtures(fx)
        jobs = [
            [
                {
                    "id": "hf-model",
                    "kind": "call",
                    "argv": ["tests.integration.docs_fixtures", "make_hf_model", str(fx / HF_NAMES[0])],
                    "cwd": str(fx),
                    "stdout": str(root / "hf-model.out"),
                    "stderr": str(root / "hf-model.err"),
                    "timeout_s": 120,
                }
            ],
            [
                {
                    "id": name,
                    "kind": "shardwise",
                    "argv": argv,
                    "cwd": str(fx),
                    "env": ENV,
                    "stdout": str(root / f"{name}.out"),
                    "stderr": str(root / f"{name}.err"),
                    "timeout_s": 180,
                }
                for name, argv in (("gpt-run", GPT_RUN), ("hf-run", HF_RUN), ("lora-run", LORA_RUN))
            ],
        ]
        results = zygote.run(jobs, parallel=os.cpu_count() or 1)
        for name in ("hf-model", "gpt-run", "hf-run", "lora-run"):
            if results[name]["rc"] != 0:
                failed.write_text(
                    f"fixture {name} failed:\n" + _tail(root / f"{name}.out") + _tail(root / f"{name}.err")
                )
                pytest.fail(failed.read_text())
        (root / "fixtures.ok").write_text("")


@pytest.fixture(scope="session")
def docs_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DocsRun]:
    """This worker's zygote (torch, shardwise, transformers imported once), the fixtures (made once
    per session) and the plan of every command; each test runs its own command."""
    root, mine = _shared_root(tmp_path_factory), tmp_path_factory.getbasetemp()
    zygote = Zygote(env=ENV, preload=PRELOAD, log=str(mine / "docs-zygote.log"))
    try:
        _make_fixtures(root, zygote)
        yield DocsRun(root, plan_commands(root), zygote, python_wrapper(str(mine)))
    finally:
        zygote.close()


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


PLANNED_IDS = [f"{c.where[0]} {c.text[:70]}" for c in all_commands() if not c.pattern]
_PLAN = plan_commands(Path("/docs-root"))  # the same plan as at run time, for the marks
assert len(_PLAN) == len(PLANNED_IDS)


def _param(index: int) -> Any:
    """One item per command, each its own pytest-xdist group (spread over the workers), the
    expected CPU-seconds for the order in which they start (tests/suite_order.py)."""
    marks = [pytest.mark.xdist_group(f"docs-{index:03d}"), pytest.mark.expected_s(_PLAN[index].cost)]
    return pytest.param(index, id=PLANNED_IDS[index], marks=marks)


# Over 30 s: a 4-process verify takes about 20 s on two cores; the first command on each worker
# also starts its zygote (about 10 s) and the first of all makes the fixtures (about 20 s).
@pytest.mark.slow
@pytest.mark.slow_allowed(
    seconds=150,
    why="the first documented command on each worker starts its zygote (about 10 s) and the "
    "first of all makes the fixture runs (about 20 s); a 4-process verify takes about 20 s on two cores",
)
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("index", [_param(i) for i in range(len(PLANNED_IDS))])
def test_the_documented_command_runs(index: int, request: pytest.FixtureRequest, record_property: Any,
                                     monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    p = _PLAN[index]
    where = f"{', '.join(p.cmd.where)}: `{p.cmd.text}`"
    if p.run is None:
        record_property("docs_command", f"skipped  {where}: {p.skipped}")
        pytest.skip(f"{where} {p.skipped}")
    if p.same_as is not None:
        _check_resolved(p, _PLAN[p.same_as], tmp_path, monkeypatch)
        record_property(
            "docs_command", f"resolved {where}: the code path of `{_PLAN[p.same_as].cmd.text}` ({p.why_same})"
        )
        return
    docs_run: DocsRun = request.getfixturevalue("docs_run")  # only a command that runs needs the runs and the zygote
    p = docs_run.planned[index]
    assert p.run is not None and p.cwd is not None
    results = docs_run.run(p)
    spent = [results[f"{p.cwd.name}.{j}"] for j in range(len(p.run))]
    record_property("docs_command", f"ran      {where}: {sum(r['seconds'] for r in spent):6.1f} s "
                    f"{sum(r.get('cpu_s', 0.0) for r in spent):6.1f} CPU-s")
    for j, argv in enumerate(p.run):
        _check_part(p, j, argv, results[f"{p.cwd.name}.{j}"])


def _check_resolved(p: Planned, first: Planned, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parsed and resolved here, in a directory with the files the docs assume: equal to the
    resolution of the command whose run stands for it (docs_plan's module doc)."""
    fixtures(cwd)
    monkeypatch.chdir(cwd)
    shown = f"{', '.join(p.cmd.where)}: `{p.cmd.text}`"
    parts = [
        [p.cmd, *[Command(t, p.cmd.where) for t in p.cmd.then]],
        [first.cmd, *[Command(t, first.cmd.where) for t in first.cmd.then]],
    ]
    mine, theirs = (
        [shrunk(c, cwd) if c.program == "shardwise" else c.words[1:] for c in cs if not skip_reason(c)] for cs in parts
    )
    assert len(mine) == len(theirs), f"{shown}: {len(mine)} parts, `{first.cmd.text}` {len(theirs)}"
    for j, (a, b) in enumerate(zip(mine, theirs)):
        if parts[0][0].program != "shardwise" or j > 0:
            assert a == b, f"{shown}: part {j} `{shlex.join(a)}` is not the run's `{shlex.join(b)}`"
            continue
        assert resolution(a) == resolution(b), (
            f"{shown} resolves differently from `{first.cmd.text}`, whose run stands for it ({p.why_same})"
        )


def _check_part(p: Planned, j: int, argv: list[str], got: dict[str, Any]) -> None:
    assert p.cwd is not None
    out, err = p.cwd / (p.cmd.stdout_file if j == 0 and p.cmd.stdout_file else f"out.{j}.txt"), p.cwd / f"err.{j}.txt"
    shown = f"{', '.join(p.cmd.where)}: `{p.cmd.text}` ran as `{shlex.join(argv)}`"
    if p.cmd.error and j == 0:
        assert got["rc"] not in (0, "timeout"), f"{shown} exited {got['rc']}; the page shows it refused"
        assert p.cmd.error.strip() in _tail(err, 100000), (
            f"{shown} did not print the page's line {p.cmd.error!r}:\n{_tail(err)}"
        )
        return
    if (
        j == 0
        and p.cmd.program == "shardwise"
        and p.cmd.subcommand in SERVERS
        and not ({"--help", "-h"} & set(p.cmd.words))
    ):
        assert got["rc"] == "timeout", f"{shown} exited {got['rc']} before it was stopped:\n{_tail(out)}\n{_tail(err)}"
        assert SERVERS[p.cmd.subcommand] in _tail(out) + _tail(err), (
            f"{shown} did not say it serves:\n{_tail(out)}\n{_tail(err)}"
        )
        return
    assert got["rc"] == 0, f"{shown} exited {got['rc']} after {got['seconds']:.0f} s:\n{_tail(out)}\n{_tail(err)}"
    if argv[:1] == ["train"] and not {"--print-config", "--help"} & set(argv):  # its output is a file: lines, no bar
        log = _tail(out, 10**7) + _tail(err, 10**7)
        assert "\r" not in log, f"{shown}: a carriage return in its log:\n{log[-2000:]}"
        assert re.search(r"^train \d\d:\d\d:\d\d step 2/2 \(100%\)  loss \d", log, flags=re.M), (
            f"{shown}: no progress line:\n{log[-2000:]}"
        )
