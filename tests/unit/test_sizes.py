"""Small files with one purpose, functions a reader can hold in mind: no source file of the package
over 400 lines, no function or method over 80 lines (its ``def`` to its last line, decorators
excluded, docstring included), found by walking the AST of every module under ``src/``."""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80


def _modules() -> list[pathlib.Path]:
    found = sorted(SRC.rglob("*.py"))
    assert len(found) > 100, f"the walk found only {len(found)} modules under {SRC}"
    return found


def long_functions(source: str, max_lines: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function in ``source`` longer than ``max_lines``."""
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef) and child.end_lineno - child.lineno + 1 > max_lines:
                    out.append((name, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def test_no_file_over_400_lines() -> None:
    long = [f"{p.relative_to(SRC)}: {n}" for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, "split these files (one purpose each):\n" + "\n".join(long)


def test_no_function_over_80_lines() -> None:
    long = [
        f"{p.relative_to(SRC)}: {name} ({n} lines)" for p in _modules() for name, n in long_functions(p.read_text())
    ]
    assert not long, "split these functions:\n" + "\n".join(long)


def test_the_walk_finds_a_long_function() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    assert long_functions(f"class A:\n  def f(self):\n{body}\n") == [("A.f", 82)]
    assert long_functions("def g():\n    return 1\n") == []
