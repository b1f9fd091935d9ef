"""One name, one job: a function or class that the package or the shared helpers define is defined nowhere
else in the code (the package, the stages, the benches, the test helpers), so that a reader who meets a name
knows which one it is. Entry points (``main``, ``parse_args``) are each module's own."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.support.repo import REPO

#: Where names are looked for, and where a name is shared by whoever imports it.
CODE = ("asrflow", "stages", "bench", "tests/support")
SHARED = ("asrflow", "tests/support", "bench/common.py")
ENTRY_POINTS = {"main", "parse_args"}


def top_level_names(source: str) -> list[str]:
    """Public functions and classes defined at the top of ``source``."""
    return [
        node.name
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and not node.name.startswith("_")
    ]


def definitions(root: Path) -> dict[str, list[str]]:
    """Each public top-level name under ``root``'s :data:`CODE` folders, with the files that define it."""
    found = defaultdict(list)
    for folder in CODE:
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root)
            if any(part.startswith(".") for part in relative.parts):  # bench/.peer: the peer's own install
                continue
            for name in top_level_names(path.read_text()):
                found[name].append(str(relative))
    return found


def clashes(found: dict[str, list[str]]) -> dict[str, list[str]]:
    """The names of :data:`SHARED` code that another file defines too."""
    return {
        name: files
        for name, files in found.items()
        if len(files) > 1 and name not in ENTRY_POINTS and any(file.startswith(SHARED) for file in files)
    }


def test_a_shared_name_defined_twice_is_found():
    found = {"build_trainer": ["asrflow/training/assemble.py", "tests/support/train_entry.py"]}
    found |= {"measure": ["bench/scale.py", "bench/peer_speed.py"], "main": ["asrflow/a.py", "stages/b.py"]}
    assert clashes(found) == {"build_trainer": found["build_trainer"]}
    assert top_level_names("def a(): ...\nclass B: ...\ndef _c(): ...\nx = 1\n") == ["a", "B"]


def test_every_shared_name_has_one_definition():
    assert clashes(definitions(REPO)) == {}
