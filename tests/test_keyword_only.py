"""A function or constructor with more than four parameters takes the rest by keyword.

Long positional calls (``TrainingBatches(cuts, 42, max_duration_s, num_buckets, 1, 1, 0, 0, 0, 1)``)
cannot be read or safely reordered. So in asrflow/, stages/, bench/ and tests/: a function
with more than four parameters (``self``/``cls`` not counted) accepts at most four of them
by position (a ``*`` before the rest), and a dataclass with more than four fields is
``kw_only=True``. Read from the source with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("asrflow", "stages", "bench", "tests")
MAX_POSITIONAL = 4

#: Known offenders still to be converted, as ``path::qualified name``. Remove an entry when
#: its function is fixed (the test fails while an entry here is no longer an offender).
PENDING: set[str] = set()


def _is_dataclass(node: ast.ClassDef) -> tuple[bool, bool]:
    """(is a dataclass, is kw_only)."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "dataclass":
            kw_only = isinstance(decorator, ast.Call) and any(
                k.arg == "kw_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                for k in decorator.keywords
            )
            return True, kw_only
    return False, False


def _offenders(path: Path) -> set[str]:
    relative = path.relative_to(REPO).as_posix()
    found: set[str] = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                qualified = f"{prefix}{child.name}"
                is_dataclass, kw_only = _is_dataclass(child)
                fields = [item for item in child.body if isinstance(item, ast.AnnAssign)]
                if is_dataclass and not kw_only and len(fields) > MAX_POSITIONAL:
                    found.add(f"{relative}::{qualified}")
                visit(child, f"{qualified}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                qualified = f"{prefix}{child.name}"
                args = child.args
                positional = [a.arg for a in args.posonlyargs + args.args]
                if positional and positional[0] in ("self", "cls"):
                    positional = positional[1:]
                total = len(positional) + len(args.kwonlyargs)
                # pytest passes fixtures to test functions by name: they are exempt.
                is_test = child.name.startswith("test_") and relative.startswith("tests/")
                if total > MAX_POSITIONAL and len(positional) > MAX_POSITIONAL and not is_test:
                    found.add(f"{relative}::{qualified}")
                visit(child, f"{qualified}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), filename=relative), "")
    return found


@pytest.mark.slow
def test_long_parameter_lists_are_keyword_only():
    offenders = set()
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            if not any(part.startswith(".") for part in path.relative_to(REPO).parts):  # bench/.peer: SpeechBrain
                offenders |= _offenders(path)
    new = sorted(offenders - PENDING)
    assert not new, f"more than {MAX_POSITIONAL} positional parameters (add a `*`, or kw_only=True): {new}"
    fixed = sorted(PENDING - offenders)
    assert not fixed, f"no longer offenders: remove them from PENDING: {fixed}"
