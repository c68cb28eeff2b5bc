"""The package's layers: imports only point down (docs/architecture.md), and the planner is torch-free.

The walk reads every module's imports with ``ast`` (function-level imports included, ``if
TYPE_CHECKING:`` blocks excluded, since they never run) and checks three rules:

1. no import cycle among modules;
2. a module imports only its own package or packages of a lower layer (:data:`LAYERS`);
3. no upward import (:data:`MAX_UPWARD` is 0; one that ever must exist would say why, in a comment
   starting "Upward import" on the lines just above it, and raise the limit).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from dataclasses import dataclass

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
PACKAGE = "shardwise"
MAX_UPWARD = 0

# Lowest first. A unit is a top-level module or subpackage of shardwise; the top package itself
# (shardwise/__init__.py, the public API) is "" and sits above everything it re-exports.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "version", "callback", "exports"),  # leaves: import nothing of ours
    ("degrees",),  # the fill-in rules of a plan's degrees (errors only), below the Plan that applies them
    ("layout", "shape"),  # the value objects every layer passes around
    ("resolve",),  # a plan for a world (fills in and re-plans Plans)
    ("config", "runtime"),
    ("launch",),
    ("plan",),  # the pure cost model: no torch
    ("models", "data"),
    ("parallel",),
    ("optim",),  # optimizers that need whole matrices (Muon), over the parallel layer's placements
    ("verify",),
    ("checkpoint",),
    ("observe",),
    ("calibrate",),  # runs parallelized steps (parallel/, verify/) to measure the machine; auto's plan="auto" uses it
    ("auto", "generate"),  # plan="auto": size, measure, choose (plan/), certify (verify/); train's build step calls it;
    # sharded text generation: a model from a checkpoint, parallelized, and the decode loop
    ("train",),
    ("jobs", "testing"),
    ("commands",),
    ("cli", ""),
    ("__main__",),
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


@dataclass(frozen=True)
class Import:
    source: str  # importing module, e.g. "shardwise.train.build"
    target: str  # imported module
    line: int
    why: str  # the "Upward import ..." comment above it, if any


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in (SRC / PACKAGE).rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _resolve(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(sub) for sub in ast.walk(node))
    return skip


def _why(lines: list[str], lineno: int) -> str:
    """The comment block right above line ``lineno`` (1-based) if it starts with "Upward import"."""
    block = []
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        block.insert(0, lines[i].strip().lstrip("#").strip())
        i -= 1
    text = " ".join(block)
    return text if text.startswith("Upward import") else ""


def imports() -> list[Import]:
    modules = _modules()
    found = []
    for name, path in modules.items():
        text = path.read_text()
        tree, lines = ast.parse(text), text.splitlines()
        skip = _type_checking_nodes(tree)
        is_pkg = path.name == "__init__.py"
        base = name if is_pkg else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    b = base
                    for _ in range(node.level - 1):
                        b = b.rpartition(".")[0]
                    mod = f"{b}.{node.module}" if node.module else b
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" for a in node.names] + [mod]
            else:
                continue
            for t in targets:
                if t.split(".")[0] != PACKAGE:
                    continue
                r = _resolve(t, modules)
                # a package's own __init__ is not an edge from its submodules
                if r and r != name and not (modules[r].name == "__init__.py" and name.startswith(r + ".")):
                    found.append(Import(name, r, node.lineno, _why(lines, node.lineno)))
                    break
    return found


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def cycles(edges: list[Import]) -> list[list[str]]:
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    return out


def test_every_unit_has_a_layer() -> None:
    units = {unit_of(m) for m in _modules()}
    assert units <= set(RANK), f"put {sorted(units - set(RANK))} into LAYERS (and docs/architecture.md)"


def test_no_import_cycles() -> None:
    assert cycles(imports()) == []


def test_imports_point_down() -> None:
    upward, unexplained = [], []
    for e in imports():
        src, dst = unit_of(e.source), unit_of(e.target)
        if src == dst or RANK[dst] < RANK[src]:
            continue
        upward.append(e)
        if not e.why:
            unexplained.append(f"{e.source}:{e.line} imports {e.target} ({dst} is not below {src})")
    assert not unexplained, "imports must point down (or say why, in an 'Upward import' comment):\n" + "\n".join(
        unexplained
    )
    assert len(upward) <= MAX_UPWARD, [f"{e.source} -> {e.target}" for e in upward]


def test_the_walk_sees_what_it_checks() -> None:
    """Guard against a walk that finds nothing (and so passes vacuously)."""
    edges = imports()
    pairs = {(e.source, e.target) for e in edges}
    assert ("shardwise.train.trainer", "shardwise.train.build") in pairs  # a module-level import
    assert ("shardwise.commands.plan", "shardwise.plan.planner") in pairs  # a function-level import
    assert len(edges) > 150
    assert cycles([Import("a", "b", 1, ""), Import("b", "a", 1, "")]) == [["a", "b"]]


def test_the_planner_imports_no_torch() -> None:
    for path in (SRC / PACKAGE / "plan").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "torch" for n in names), f"{path.name} imports torch"
    out = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-c",
            "import shardwise.plan, shardwise.cli; shardwise.cli.build_parser()",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    loaded = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line]
    assert "shardwise.plan.search" in loaded and not [m for m in loaded if m.split(".")[0] == "torch"]


def test_the_repository_stands_alone() -> None:
    """Docs and code refer to nothing outside the repository (no shared design notes)."""
    root = SRC.parent
    suffixes = {".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".ini", ".yml", ".yaml"}
    offenders = []
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if (
            rel.parts[0] in (".venv", ".git", "build")
            or "egg-info" in str(rel)
            or not path.is_file()
            or path.suffix not in suffixes
        ):
            continue
        if path == pathlib.Path(__file__).resolve():
            continue
        text = path.read_text(errors="replace")
        if "DESIGN.md" in text or "../shared" in text:
            offenders.append(str(rel))
    assert not offenders, f"these files point outside the repository: {offenders}"
