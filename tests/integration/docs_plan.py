"""What the docs test does with each documented command (tests/integration/test_docs_run.py):
skip it (with the reason), run it (shrunk, :mod:`tests.integration.docs_shrink`), or parse and
resolve it in-process when a command that runs takes the same code path.

Same code path: the two parse to the same options once the ones in :data:`VALUE_ONLY` are left
out, each a value that only the parser and the configuration read, or a number the run computes
with and never branches on (each with its reason). Such a command is checked by parsing and
resolving its configuration in this process (:func:`resolution`: for ``train`` the whole resolved
configuration, its process count and plan; for the others their own flag checks), and by finding
it equal to the resolution of the command that runs, the value-only options left out. Identical
commands (the same options) are one run for the same reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.doc_commands import Command, all_commands, leading_globals, parser
from tests.integration.docs_shrink import SERVE_S, SERVERS, _value, shrunk, skip_reason

# Options (argparse destinations, per subcommand) that change no code path: a command that differs
# from a run command only in these is parsed and resolved instead of run.
VALUE_ONLY: dict[str, dict[str, str]] = {
    "train": {"config": "the TOML file is read by the configuration's resolution alone (compared resolved)",
              "cfg:train.lr": "the optimizer's step size: a number the step computes with",
              "cfg:log.progress_every_s": "how often the progress line prints: a number of seconds",
              "cfg:log.experiment": "the tracker's experiment name: a string passed on to it"},
    "run": {"script_args": "the user's script's own arguments: read by the script, not by shardwise"},
    "plan": {"top": "how many plans the table lists"},
}
# Values that mean the same here: (destination, given, as) per subcommand
SAME_VALUE: dict[str, tuple[tuple[str, Any, Any], ...]] = {
    "doctor": (("nproc", None, 2),),  # the default on a machine without GPUs: 2 processes
}


@dataclass
class Planned:
    cmd: Command
    run: list[list[str]] | None  # the argv (after the program) of the command and of its `&& next` parts
    skipped: str | None  # why it is not run (None: it runs, or `same_as` covers it)
    cwd: Path | None = None
    same_as: int | None = None  # the index of the command whose run takes the same code path
    why_same: str = ""
    cost: float = 0.0  # expected CPU-seconds of the run


def _cost(argv: list[str]) -> float:
    """Rough CPU-seconds of a run on an idle machine (to start the longest first)."""
    argv = leading_globals(argv)[1]
    n = int(_value(argv, "--nproc") or _value(argv, "--nproc-per-node") or (4 if argv[:1] == ["verify"] else 1))
    per_process = {
        "verify": 5.0,
        "calibrate": 25.0,
        "doctor": 3.0,
        "generate": 4.0,
        "train": 5.0 if "--model.hf" in argv else 3.0,
        "run": 1.5,
    }.get(argv[0] if argv else "", 0.5)
    return 1.0 + per_process * n + (15.0 if argv[:1] and argv[0].endswith(".py") else 0.0)


def namespace(argv: list[str]) -> dict[str, Any] | None:
    """``shardwise``'s parsed options for ``argv`` (None: the parser refuses them)."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        try:
            ns = vars(parser().parse_args(argv))
        except SystemExit:
            return None
    ns.pop("func", None)
    return ns


def masked(sub: str, ns: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``ns`` without the value-only options of ``sub`` (and those options' names, when given)."""
    out, dropped = dict(ns), []
    for key in VALUE_ONLY.get(sub, {}):
        if out.pop(key, None) not in (None, [], False):
            dropped.append(key)
    for key, given, same in SAME_VALUE.get(sub, ()):
        if out.get(key) == given:
            out[key] = same
    return out, dropped


def _key(cmd: Command, argvs: list[list[str]], programs: list[str], cwd: Path) -> tuple[str, list[str]]:
    parts, dropped = [], []
    for argv, program in zip(argvs, programs):
        ns = namespace(argv) if program == "shardwise" else None
        if ns is None:
            parts.append(shlex.join([program, *argv]))
            continue
        sub = leading_globals(argv)[1][:1]
        ns, gone = masked(sub[0] if sub else "", ns)
        dropped += gone
        parts.append(json.dumps(ns, sort_keys=True, default=str))
    key = " && ".join(parts) + f" > {cmd.stdout_file}" + json.dumps(cmd.env, sort_keys=True) + f" ! {cmd.error}"
    return key.replace(str(cwd), "CWD"), dropped


def plan_commands(root: Path) -> list[Planned]:
    """Every documented invocation (not the usage patterns), in order, planned under ``root``."""
    commands = [c for c in all_commands() if not c.pattern]
    planned: list[Planned] = []
    seen: dict[str, int] = {}
    dropped_of: dict[int, list[str]] = {}
    for i, cmd in enumerate(commands):
        reason = skip_reason(cmd)
        if reason is None and cmd.program not in ("shardwise", "python", "python3"):
            reason = f"not a command of this project ({cmd.program})"
        if reason:
            planned.append(Planned(cmd, None, reason))
            continue
        cwd = root / f"cmd{i:03d}"
        argvs, programs, notes = [shrunk(cmd, cwd)], [cmd.program], []
        for then in cmd.then:
            sub = Command(then, cmd.where, cmd.source)
            why = skip_reason(sub)
            if why:
                notes.append(f"then `{then}`: skipped, {why}")
            else:
                argvs.append(shrunk(sub, cwd) if sub.program == "shardwise" else sub.words[1:])
                programs.append(sub.program)
        p = Planned(cmd, argvs, "; ".join(notes) or None, cwd, cost=sum(_cost(a) for a in argvs))
        key, dropped = _key(cmd, argvs, programs, cwd)
        dropped_of[i] = dropped
        if key in seen and not _serves(cmd, 0):
            differ = sorted(set(dropped) | set(dropped_of[seen[key]]))
            sub = cmd.subcommand
            p.same_as, p.cost = seen[key], 0.0
            p.why_same = (
                "; ".join(f"{d}: {VALUE_ONLY.get(sub, {}).get(d, 'the same value here')}" for d in differ)
                or "the same options once shrunk: it differs only in sizes"
            )
        else:
            seen[key] = i
        planned.append(p)
    return planned


def _serves(cmd: Command, part: int) -> bool:
    return (
        part == 0
        and cmd.program == "shardwise"
        and cmd.subcommand in SERVERS
        and not ({"--help", "-h"} & set(cmd.words))
    )


def jobs_of(p: Planned, env: dict[str, str]) -> list[list[dict[str, Any]]]:
    """The phases (one job each: the command, then its `&& next` parts) that run ``p``."""
    assert p.run is not None and p.cwd is not None
    phases = []
    for j, argv in enumerate(p.run):
        program = p.cmd.program if j == 0 else Command(p.cmd.then[j - 1]).program
        phases.append(
            [
                {
                    "id": f"{p.cwd.name}.{j}",
                    "kind": "shardwise" if program == "shardwise" else "python",
                    "argv": argv,
                    "cwd": str(p.cwd),
                    "cost": _cost(argv),
                    "env": {**env, **p.cmd.env, "SHARDWISE_CLUSTER": "cpu"},
                    "timeout_s": SERVE_S if _serves(p.cmd, j) else 480,
                    "stdout": str(p.cwd / (p.cmd.stdout_file if j == 0 and p.cmd.stdout_file else f"out.{j}.txt")),
                    "stderr": str(p.cwd / f"err.{j}.txt"),
                }
            ]
        )
    return phases


def resolution(argv: list[str]) -> dict[str, Any]:
    """Parse ``argv`` and resolve it the way its command does before it starts anything (in the
    current directory; raises what the command would refuse with): the value-only options left out."""
    from shardwise.cli import build_parser

    with contextlib.redirect_stderr(io.StringIO()):  # a parser of its own: the resolution may change what it parsed
        args = build_parser().parse_args(argv)
    sub = argv[0]
    if sub == "train":
        from shardwise.commands.train import job_plan, nproc_of, resolve_config

        config = resolve_config(args)
        nproc = nproc_of(config)
        resolved = dataclasses.asdict(config)
        for key in VALUE_ONLY["train"]:
            if key.startswith("cfg:"):
                section, field = key[4:].split(".")
                resolved[section].pop(field)
        rest = {k: v for k, v in vars(args).items() if not k.startswith("cfg:") and k not in ("func", "config")}
        return {"config": resolved, "nproc": nproc, "plan": str(job_plan(config, nproc)), "args": masked(sub, rest)[0]}
    checks = {
        "doctor": ("shardwise.commands.doctor", "_check_args"),
        "plan": ("shardwise.commands.plan", "_check"),
        "verify": ("shardwise.commands.verify", "_check_numbers"),
        "run": ("shardwise.commands.run", "_check_flags"),
    }
    if sub in checks:
        import importlib

        module, function = checks[sub]
        getattr(importlib.import_module(module), function)(args)
    ns = {k: v for k, v in vars(args).items() if k != "func"}
    return {"args": json.loads(json.dumps(masked(sub, ns)[0], default=str))}
