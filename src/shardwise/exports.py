"""How a package serves names it does not define (standard library only).

- :func:`lazy_exports`: a package's public names imported from their modules on first use (PEP 562),
  and old names that still work with a ``DeprecationWarning`` naming the new one;
- :func:`renamed`: a module's own renamed names, the old ones still working with that warning;
- :func:`keep_moved_modules`: old module paths (``shardwise.parallel.tp_plan``) that still import, as the
  module that moved (the same object, so attributes and patches are shared), with a ``DeprecationWarning``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any, Callable, Mapping


def lazy_exports(package: str, names: Mapping[str, str], deprecated: Mapping[str, str] | None = None
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: ``names`` maps a public name to the module
    that defines it; ``deprecated`` maps an old name to its new public name."""
    old = dict(deprecated or {})

    def __getattr__(name: str) -> Any:
        if name in old:
            warnings.warn(
                f"{package}.{name} is deprecated: use {package}.{old[name]}", DeprecationWarning, stacklevel=2
            )
            return getattr(importlib.import_module(names[old[name]]), old[name])
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(names[name]), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__


def renamed(module: str, old: Mapping[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``module`` for its renamed names (``old`` maps an old name to the new one)."""

    def __getattr__(name: str) -> Any:
        if name not in old:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} is deprecated: use {module}.{old[name]}", DeprecationWarning, stacklevel=2)
        return vars(sys.modules[module])[old[name]]

    return __getattr__


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, moves: Mapping[str, str]) -> None:
        self.moves = dict(moves)
        self.specs: dict[str, importlib.machinery.ModuleSpec | None] = {}  # old name -> the moved module's own spec

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(fullname, self) if fullname in self.moves else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = self.moves[spec.name]
        warnings.warn(f"{spec.name} moved to {new}", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self.specs[spec.name] = module.__spec__  # the import system sets the old name's spec on it next
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.specs.pop(module.__spec__.name)  # it ran when it was imported; give it back its own spec


def keep_moved_modules(moves: Mapping[str, str]) -> None:
    """Let each old module path of ``moves`` (old -> new) import as its new module. Consulted only
    when no file answers to the name."""
    if not any(isinstance(f, _Moved) and f.moves == dict(moves) for f in sys.meta_path):
        sys.meta_path.append(_Moved(moves))
