"""The pages cannot go stale: every ```console block of docs/planner.md (and README.md, should it
show one) is run and its output compared with the page, line for line; every command the README,
docs/*.md and the --help texts show (:mod:`tests.doc_commands`) names only flags, files and make
targets that exist (tests/integration/test_docs_run.py runs them); and the published-runs table and
figures in docs/planner.md must equal the ones bench/planner_published.py makes from the committed
results.

A console block is ``$ shardwise ...`` (continued with a trailing backslash) followed by exactly
what the command prints. The planner is a pure function of its inputs, so the output is the same on
every machine. To refresh a page after a deliberate change, run the command and paste its output.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import sys

import pytest

from shardwise.cli import main
from tests.doc_commands import ROOT, _blocks, all_commands, parse_error

PAGES = [ROOT / "docs" / "planner.md", ROOT / "README.md"]


def console_examples() -> list[tuple[str, str, list[str]]]:
    """(where, command, expected output lines) of every console block."""
    out = []
    for path in PAGES:
        for lang, start, body in _blocks(path):
            if lang != "console":
                continue
            i = 0
            while i < len(body):
                if not body[i].startswith("$ "):
                    i += 1
                    continue
                command = body[i][2:]
                while command.endswith("\\"):
                    i += 1
                    command = command[:-1] + " " + body[i].strip()
                i += 1
                expected = []
                while i < len(body) and not body[i].startswith("$ "):
                    expected.append(body[i])
                    i += 1
                out.append((f"{path.name}:{start}", command, expected))
    return out


def _run(command: str) -> tuple[int, str]:
    argv = shlex.split(command)
    assert argv[0] == "shardwise", f"a console block runs shardwise commands only: {command}"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv[1:])
    return rc, buf.getvalue()


EXAMPLES = console_examples()


def test_the_pages_show_planner_examples() -> None:
    assert len([e for e in EXAMPLES if e[0].startswith("planner.md")]) >= 4


@pytest.mark.parametrize(("where", "command", "expected"), EXAMPLES, ids=[f"{w} {c[:60]}" for w, c, _ in EXAMPLES])
def test_console_blocks_print_what_the_page_shows(where: str, command: str, expected: list[str]) -> None:
    rc, out = _run(command)
    assert rc == 0, f"{where}: {command} exited {rc}"
    got = out.rstrip("\n").splitlines()
    assert got == expected, f"{where}: `{command}` now prints:\n" + "\n".join(got)


USER_SCRIPTS = ("train.py", "my_model.py")  # what the docs call the user's own files


DOCUMENTED = all_commands()


def test_the_docs_and_the_help_show_commands() -> None:
    sources = {c.source for c in DOCUMENTED}
    assert sources == {"block", "prose", "help"} and len(DOCUMENTED) >= 80
    helps = {w.split(" --help")[0] for c in DOCUMENTED for w in c.where if w.endswith("--help")}
    assert {"shardwise train", "shardwise run", "shardwise plan", "shardwise checkpoint"} <= helps


@pytest.mark.parametrize("cmd", DOCUMENTED, ids=[f"{c.where[0]} {c.text[:60]}" for c in DOCUMENTED])
def test_every_documented_command_names_what_exists(cmd) -> None:
    """Every documented command (README, docs/*.md, every --help's examples; patterns too, with
    ``...`` and the brackets taken out) names flags the command line has, files that exist and
    make targets the Makefile has. A page that shows a command refused (its output an error line)
    is checked by tests/integration/test_docs_run.py, which runs every command."""
    where = ", ".join(cmd.where)
    if cmd.program == "shardwise":
        error = parse_error(cmd.parse_argv())
        if error and not cmd.error:
            # a reference in prose may leave out required arguments; no command may name a flag that does not exist
            assert cmd.pattern and "unrecognized arguments" not in error and "invalid choice" not in error, (
                f"{where}: `{cmd.text}`: {error}"
            )
    elif cmd.program in ("python", "python3"):
        target = cmd.words[1:]
        if target[:1] == ["-m"]:
            import importlib.util

            assert importlib.util.find_spec(target[1]) is not None, f"{where}: `{cmd.text}`: no module {target[1]}"
        else:
            assert target[0] in USER_SCRIPTS or (ROOT / target[0]).is_file(), (
                f"{where}: `{cmd.text}`: {target[0]} does not exist"
            )
    elif cmd.program == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M)
        assert cmd.words[1] in targets, f"{where}: `{cmd.text}`: the Makefile has no target {cmd.words[1]!r}"


def test_the_published_runs_table_is_the_committed_result() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from planner_published import markdown

    results = json.loads((ROOT / "bench" / "results" / "planner_published.json").read_text())
    page = (ROOT / "docs" / "planner.md").read_text()
    begin, end = "<!-- published-runs:begin -->", "<!-- published-runs:end -->"
    assert begin in page and end in page
    table = page.split(begin, 1)[1].split(end, 1)[0].strip()
    assert table == markdown(results)
    overall = results["overall"]
    quoted = (
        f"median absolute error **{100 * overall['median_abs_error']:.1f}%**, "
        f"**{100 * overall['within_15']:.0f}%** of the"
    )
    assert quoted in page, quoted


def test_the_fill_in_table_is_what_the_rules_do() -> None:
    """docs/planner.md's table of plan strings: each `you write` on `N` processes becomes the plan
    it shows (or fails with the error it quotes; `...` stands for the part left out)."""
    from shardwise.errors import ConfigError
    from shardwise.resolve import resolve_plan

    page = (ROOT / "docs" / "planner.md").read_text()
    section = page.split("## Plan strings", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]*)` \| (\d+) \| `([^`]*)`", section, flags=re.M)
    assert len(rows) >= 9
    for text, world, shown in rows:
        if text.startswith("--"):
            continue
        try:
            got = str(resolve_plan(text, int(world)))
        except ConfigError as exc:
            got = str(exc)
        if "..." in shown or shown.startswith("plan "):  # an error, quoted in part
            parts = [p.strip(" ;") for p in shown.split("...") if p.strip(" ;")]
            assert all(p in got for p in parts), (text, world, shown, got)
        else:
            assert got == shown, (text, world, shown, got)


def test_a_global_flag_before_the_subcommand_is_shrunk_like_the_subcommand(tmp_path) -> None:
    """``shardwise --verbose train --nproc 2`` is the train command with its global flag: it names
    the subcommand, and the docs test shrinks it (tiny sizes) with ``--verbose`` kept before it, as
    it does a ``run`` command's flags (the script's own arguments untouched). The global flags
    listed are ``shardwise --help``'s (less --help and --version, which start nothing)."""
    from shardwise.cli import build_parser
    from tests.doc_commands import GLOBAL_FLAGS, Command
    from tests.integration.docs_shrink import shrunk

    top = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")}
    assert top - {"--help", "--version"} == set(GLOBAL_FLAGS)
    train = Command("shardwise --verbose train --nproc 2")
    assert train.subcommand == "train" and Command("shardwise --version").subcommand == ""
    argv = shrunk(train, tmp_path)
    assert argv[:2] == ["--verbose", "train"] and shrunk(Command("shardwise train --nproc 2"), tmp_path) == argv[1:]
    assert "--max-steps" in argv and argv[argv.index("--model.layers") + 1] == "1"
    run = shrunk(Command("shardwise --verbose run --nproc-per-node 4 train.py --nproc 9"), tmp_path)
    assert run == ["--verbose", "run", "--nproc-per-node", "2", "train.py", "--nproc", "9"]
