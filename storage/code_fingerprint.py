"""What code a stage runs, as a fingerprint its artifact's key covers (docs/architecture.md, "Cache keys").

A stage's code is its module and every project module that module imports, transitively, found by parsing the
sources with `ast` (nothing is imported, so a key is computed without torch in a few milliseconds), plus the
versions of the libraries that shape its output. Files are named relative to the project root and hashed by
content, so the fingerprint does not depend on where the project is installed; any change to a file counts, as
in Prefect's TASK_SOURCE cache policy. Everything is cached per process: a command line pays once.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import os
from collections.abc import Iterable
from typing import Any

from storage.fingerprint import canonical_json, hash_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def module_file(name: str) -> str | None:
    """The project file of module `name` (`a/b.py` or `a/b/__init__.py` under the root), or None outside it."""
    base = os.path.join(ROOT, *name.split("."))
    for candidate in (f"{base}.py", os.path.join(base, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


@functools.cache
def _imports(module: str) -> tuple[str, ...]:
    """The project modules that the project module `module` imports, in any of its import statements (functions
    included)."""
    path = module_file(module)
    if path is None:
        return ()
    return tuple(sorted({n for n in _imported_names(path, module) if n and module_file(n) is not None}))


def _imported_names(path: str, module: str) -> Iterable[str]:
    """Every module name an import statement of `path` may load; `from a import b` yields `a` and `a.b` (b may
    be a submodule)."""
    with open(path, "rb") as f:
        tree = ast.parse(f.read(), filename=path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names if alias.name != "*")


def _with_parents(name: str) -> list[str]:
    """`a.b.c` and the packages importing it runs first: `a`, `a.b`."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


@functools.cache
def import_closure(module: str) -> frozenset[str]:
    """The project files (absolute paths) `module` runs when imported: its own, its packages' `__init__.py`,
    and those of every project module it imports, transitively."""
    files: set[str] = set()
    pending = [module]
    seen: set[str] = set()
    while pending:
        for name in _with_parents(pending.pop()):
            if name in seen:
                continue
            seen.add(name)
            path = module_file(name)
            if path is not None:
                files.add(path)
                pending.extend(n for n in _imports(name) if n not in seen)
    return frozenset(files)


@functools.cache
def _file_hash(path: str) -> str:
    with open(path, "rb") as f:
        return hash_bytes(f.read())


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def describe_code(modules: tuple[str, ...], libraries: tuple[str, ...]) -> dict[str, Any]:
    """{"fingerprint", "files": {path relative to the root: content hash}, "libraries": {name: version}} of
    `modules` (their import closures) and `libraries` (distribution names; None where not installed)."""
    paths = sorted(set().union(*(import_closure(m) for m in modules)))
    files = {os.path.relpath(p, ROOT).replace(os.sep, "/"): _file_hash(p) for p in paths}
    versions = {name: _version(name) for name in sorted(libraries)}
    fingerprint = hash_bytes(canonical_json({"files": files, "libraries": versions}).encode())
    return {"fingerprint": fingerprint, "files": files, "libraries": versions}
