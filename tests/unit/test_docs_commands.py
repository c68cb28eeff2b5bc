"""The planner's pages cannot go stale: every ```console block of docs/planner.md (and README.md,
should it show one) is run and its output compared with the page, line for line; every other
`shardwise ...` command docs/planner.md shows, and the README's planner commands (inline, in tables
and shell blocks: commands that measure a machine or train), must parse with the real command line;
and the published-runs table and figures in docs/planner.md must equal the ones
bench/planner_published.py makes from the committed results.

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
from pathlib import Path

import pytest

from shardwise.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "docs" / "planner.md", ROOT / "README.md"]
# which commands of a page are checked: all of the planner's page, the planner's in the README
CHECKED = {"planner.md": None, "README.md": ("plan", "calibrate")}
FENCE = re.compile(r"^```(\w*)\s*$")


def _blocks(path: Path) -> list[tuple[str, int, list[str]]]:
    """(language, first line number, lines) of every fenced block."""
    out, lang, start, body = [], None, 0, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        m = FENCE.match(line)
        if m and lang is None:
            lang, start, body = m.group(1), number, []
        elif line.strip() == "```" and lang is not None:
            out.append((lang, start, body))
            lang = None
        elif lang is not None:
            body.append(line)
    return out


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


def _inline_commands(path: Path) -> list[str]:
    """`shardwise ...` commands outside console blocks: in code spans and in bash blocks."""
    text = path.read_text()
    found = [m.group(1) for m in re.finditer(r"`(shardwise [^`]+)`", text)]
    for lang, _, body in _blocks(path):
        if lang in ("bash", "sh", "shell", ""):
            joined = "\n".join(body).replace("\\\n", " ")
            for line in joined.splitlines():
                line = line.split("#", 1)[0].strip()
                if line.startswith("shardwise "):
                    found.append(line)
    return found


@pytest.mark.parametrize("path", PAGES, ids=[p.name for p in PAGES])
def test_every_other_shardwise_command_on_the_page_parses(path: Path) -> None:
    subcommands = CHECKED[path.name]
    commands = [c for c in _inline_commands(path) if subcommands is None or c.split()[1] in subcommands]
    assert commands
    parser = build_parser()
    for command in commands:
        argv = shlex.split(command)[1:]
        if "..." in command or "[" in command or len(argv) < 2:  # a usage pattern or a name, not an invocation
            continue
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                parser.parse_args(argv)
            except SystemExit as exc:
                if exc.code:
                    pytest.fail(f"{path.name}: `{command}` does not parse: {err.getvalue().strip()}")


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
    quoted = f"median absolute error **{100 * overall['median_abs_error']:.1f}%**, **{100 * overall['within_15']:.0f}%** of the"
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
