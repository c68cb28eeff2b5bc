"""Every command the project shows its users, found by parsing where they are shown.

Sources (nothing is listed by hand, so a page or a help text added later is covered when it lands):

- ``README.md`` and ``docs/*.md``: every line of a ``bash``/``sh``/``shell`` block, every ``$ ``
  line of a ``console`` or unlabelled block (the lines after it are its output; an output that is
  an error line makes it an example of a refused input), and every ``shardwise ...`` code span
  in the prose;
- the ``examples:`` section of ``shardwise --help`` and of every subcommand's ``--help``
  (``checkpoint inspect``, ``export``... too).

A trailing ``\\`` continues a command; ``# ...`` ends it; ``a && b`` and ``a; b`` are two commands
run in order; ``> FILE`` sends the output to a file; in a help example, two or more spaces
separate the command from its description. A command is a *pattern* rather than an invocation
when it holds ``...``, ``[optional parts]``, ``A|B`` alternatives or ``<name>``-style holes
written as prose, or (in running prose only) placeholder words such as ``N`` or ``DIR``: patterns
are checked for their flags only.
"""

from __future__ import annotations

import functools
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\s*$")
SHELL = ("bash", "sh", "shell")
PROGRAMS = (
    "shardwise",
    "python",
    "python3",
    "make",
    "torchrun",
    "srun",
    "sbatch",
    "salloc",
    "mpirun",
    "ssh",
    "ssh-keygen",
    "ssh-copy-id",
    "pip",
    "wandb",
    "mlflow",
)
ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")
# words that stand for something the user supplies (in prose, they make a command a pattern)
# `shardwise`'s own flags, given before the subcommand (`shardwise --verbose train ...`; see `shardwise --help`)
GLOBAL_FLAGS = ("--verbose",)
PLACEHOLDERS = re.compile(r"^(N|K|R|DIR|dir|OUT|FILE|CKPT|PLAN|PORT|HOST|SECONDS|PATH|TEMPLATE|V|VALUE|MIN:MAX)$")


@dataclass
class Command:
    """One documented command: its text, where it is shown, and what its page says it prints."""

    text: str
    where: list[str] = field(default_factory=list)
    source: str = "block"  # block | prose | help
    stdout_file: str | None = None  # `> FILE`
    error: str | None = None  # the page shows it failing with this line
    then: list[str] = field(default_factory=list)  # `&& next` / `; next`: run after it, in the same directory

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text)

    @property
    def env(self) -> dict[str, str]:
        out = {}
        for word in self.argv:
            if not ENV.match(word):
                break
            key, _, value = word.partition("=")
            out[key] = value
        return out

    @property
    def words(self) -> list[str]:
        """The command without its leading ``VAR=value`` assignments."""
        argv = self.argv
        return argv[len(self.env):]

    @property
    def program(self) -> str:
        return self.words[0] if self.words else ""

    @property
    def subcommand(self) -> str:
        """The subcommand of a ``shardwise`` command, after its global flags (``--verbose``); ""
        when there is none (``shardwise --version``) or the program is another."""
        if self.program != "shardwise":
            return ""
        rest = leading_globals(self.words[1:])[1]
        return rest[0] if rest and not rest[0].startswith("-") else ""

    @property
    def pattern(self) -> bool:
        """A usage pattern or a reference, not an invocation (module doc): in running prose also a
        command named without the arguments it needs (`shardwise checkpoint export --format hf`)."""
        raw = self.text
        if "..." in raw or re.search(r"(^|\s)\[", raw) or re.search(r"\s<\w+>", raw) or "section.key" in raw:
            return True
        if self.source == "prose":
            words = self.words
            if len(words) < 3 or any(PLACEHOLDERS.match(w) or "|" in w for w in words[2:]):
                return True
            error = parse_error(self.parse_argv()) if self.program == "shardwise" else None
            return error is not None and ("required" in error or "expected one argument" in error)
        return False

    def parse_argv(self) -> list[str]:
        """The arguments after ``shardwise`` with a pattern's markers taken out, for the parser."""
        text = re.sub(r"(^|\s)\[([^\]]*)\]", r"\1\2", self.text)  # [--step N] -> --step N
        words = shlex.split(text)[len(self.env):]
        return [w for w in words[1:] if w != "..." and "section.key" not in w and not w.startswith("<")]


def leading_globals(args: list[str]) -> tuple[list[str], list[str]]:
    """``shardwise``'s arguments split into its leading global flags and the rest (the subcommand on)."""
    n = 0
    while n < len(args) and args[n] in GLOBAL_FLAGS:
        n += 1
    return args[:n], args[n:]


@functools.cache
def parser() -> Any:
    """``shardwise``'s argument parser, built once per process: only parsed with (argparse keeps no
    state between parses), at collection time for every documented command."""
    from shardwise.cli import build_parser

    return build_parser()


def parse_error(argv: list[str]) -> str | None:
    """What ``shardwise``'s own parser says about ``argv`` (None: it parses)."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser().parse_args(argv)
        except SystemExit as exc:
            return (err.getvalue().strip() or "exit") if exc.code else None
    return None


def _unquoted(line: str) -> Iterator[int]:
    """The positions in ``line`` outside single or double quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        else:
            yield i


def _strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (a ``#`` outside quotes, after a space)."""
    for i in _unquoted(line):
        if line[i] == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _split_description(line: str) -> str:
    """A help example without its description: cut at the first run of 2+ spaces outside quotes."""
    for i in _unquoted(line):
        if line.startswith("  ", i):
            return line[:i]
    return line


def _is_command(text: str) -> bool:
    words = text.split()
    while words and ENV.match(words[0]):
        words = words[1:]
    if not words or words[0] not in PROGRAMS:
        return False
    return not (len(words) > 1 and words[1].endswith(":"))  # "shardwise train: error: ..." is output


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


def _joined(lines: list[str], first: int) -> list[tuple[int, str]]:
    """(line number, logical line): continuation backslashes joined, comments dropped."""
    out: list[tuple[int, str]] = []
    pending, at = "", first
    for number, line in enumerate(lines, first):
        text = _strip_comment(line) if not pending else _strip_comment(line.strip())
        if not pending:
            at = number
        if text.endswith("\\"):
            pending += text[:-1].rstrip() + " "
            continue
        out.append((at, (pending + text.strip()).strip() if pending else text))
        pending = ""
    return out


def _split(text: str) -> list[str]:
    """``a && b`` / ``a; b`` / ``a &`` -> the commands, in order (quotes respected)."""
    parts, current, quote, i = [], "", None, 0
    while i < len(text):
        ch = text[i]
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif text.startswith("&&", i) or ch == ";":
            parts.append(current)
            current, i = "", i + (2 if ch == "&" else 1)
            continue
        elif ch == "&" and not text.startswith("&&", i) and not text[:i].endswith(">"):  # not 2>&1
            i += 1  # a background job: the same command
            continue
        current += ch
        i += 1
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def _command(text: str, where: str, source: str, error: str | None = None) -> Command | None:
    parts = _split(text)
    if not parts or not _is_command(parts[0]):
        return None
    first, stdout_file = re.sub(r"\s+2>&1(?=\s|$)", "", parts[0]), None  # stderr beside stdout: both are kept anyway
    m = re.match(r"^(.*?)\s+>\s*(\S+)$", first)
    if m:
        first, stdout_file = m.group(1), m.group(2)
    return Command(first, [where], source, stdout_file, error, then=parts[1:])


def page_commands(path: Path) -> list[Command]:
    """Every command of one Markdown page (module doc)."""
    rel, out = path.relative_to(ROOT).as_posix(), []
    for lang, start, body in _blocks(path):
        if lang in SHELL:
            for number, text in _joined(body, start + 1):
                cmd = _command(text, f"{rel}:{number}", "block")
                if cmd:
                    out.append(cmd)
        elif lang in ("console", ""):
            lines = _joined(body, start + 1)
            for i, (number, text) in enumerate(lines):
                if not text.startswith("$ "):
                    continue
                following = lines[i + 1][1] if i + 1 < len(lines) else ""
                error = following if re.match(r"^shardwise(\s\w+)?: error: ", following) else None
                cmd = _command(text[2:], f"{rel}:{number}", "block", error)
                if cmd:
                    out.append(cmd)
    text = path.read_text()
    for m in re.finditer(r"`((?:[A-Z_][A-Z0-9_]*=\S+ )*shardwise [^`]+)`", text):
        number = text.count("\n", 0, m.start()) + 1
        cmd = _command(" ".join(m.group(1).split()), f"{rel}:{number}", "prose")
        if cmd:
            out.append(cmd)
    return out


def help_examples(parser: object, name: str = "shardwise") -> list[Command]:
    """The ``examples:`` section of ``parser``'s help and of every subcommand's, recursively."""
    import argparse

    out: list[Command] = []
    epilog = getattr(parser, "epilog", None) or ""
    lines = epilog.splitlines()
    if "examples:" in lines:
        body: list[str] = []
        for line in lines[lines.index("examples:") + 1:]:
            if not line.strip():
                break
            body.append(line)
        body = [line.strip() if line.strip().endswith("\\") else _split_description(line.strip()) for line in body]
        for _, text in _joined(body, 1):
            cmd = (
                _command(text.strip(), f"{name} --help", "help")
                if text.strip() and not text.strip().startswith("#")
                else None
            )
            if cmd:
                out.append(cmd)
    for action in getattr(parser, "_actions", []):
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                out.extend(help_examples(sub, f"{name} {sub_name}"))
    return out


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def all_commands() -> list[Command]:
    """Every documented command, each once (the places it is shown merged), in the order found."""
    found: dict[str, Command] = {}
    for cmd in [c for path in pages() for c in page_commands(path)] + help_examples(parser()):
        key = (
            " ".join(cmd.argv)
            + (f" > {cmd.stdout_file}" if cmd.stdout_file else "")
            + "".join(f" && {t}" for t in cmd.then)
        )
        if key in found:
            seen = found[key]
            seen.where.extend(cmd.where)
            if seen.source == "prose" and cmd.source != "prose":  # shown as an invocation somewhere: it is one
                seen.source = cmd.source
            seen.error = seen.error or cmd.error
        else:
            found[key] = cmd
    return list(found.values())
