"""The asrflow source files a module runs, and a digest of them.

A module's *import closure* is the module's file and every asrflow module it imports,
directly or not, at top level or inside functions (read from the source with ``ast``, so
it does not depend on which code paths ran). Training records the digest of its closure
in each checkpoint, so that a finished run re-run by edited code trains again.
"""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Iterable
from pathlib import Path

PACKAGE = "asrflow"
#: The folder that holds the ``asrflow`` package.
SOURCE_ROOT = Path(__file__).resolve().parents[1]


def module_file(name: str, root: Path = SOURCE_ROOT) -> Path | None:
    """The file of the dotted module ``name`` under ``root``, or None when it is not a module."""
    path = root / Path(*name.split("."))
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return None


def imported_modules(file: Path) -> set[str]:
    """Dotted names of the asrflow modules (or their members) ``file`` imports."""
    names = set()
    for node in ast.walk(ast.parse(file.read_text(), filename=str(file))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.split(".")[0] == PACKAGE}


def import_closure(files: Iterable[Path], root: Path = SOURCE_ROOT) -> set[Path]:
    """Every asrflow module file ``files`` reach through imports (``files`` not included)."""
    seen: set[Path] = set()
    todo = list(files)
    while todo:
        for name in imported_modules(todo.pop()):
            found = module_file(name, root)
            if found and found not in seen:
                seen.add(found)
                todo.append(found)
    return seen


def source_digest(module: str) -> str:
    """SHA-256 (first 16 hex digits) of ``module``'s file and its import closure: paths and contents."""
    start = module_file(module)
    if start is None:
        raise ValueError(f"{module} is not an {PACKAGE} module")
    digest = hashlib.sha256()
    for path in sorted({start, *import_closure([start])}):
        digest.update(str(path.relative_to(SOURCE_ROOT)).encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
