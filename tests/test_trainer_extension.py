"""Tests and benchmarks extend the trainer only through its public observers and ``request_stop()``, and
train what users run.

No file under tests/, bench/ or tests/support/ (the helpers they share) subclasses ``Trainer``, reads or
writes a private attribute of a trainer object, or monkeypatches the class; none constructs a ``Trainer``
itself: a run is assembled by :func:`asrflow.training.assemble.build_trainer`, as the train stage's is.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FILES = sorted(
    path
    for folder in ("tests", "bench", "tests/support")
    for path in (REPO / folder).rglob("*.py")
    if not any(part.startswith(".") for part in path.relative_to(REPO).parts)  # bench/.peer: SpeechBrain's install
)


def _owner_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def private_trainer_uses(source: str) -> list[str]:
    """Places in ``source`` that reach into the trainer: ``line: what``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and any(_owner_name(base) == "Trainer" for base in node.bases):
            found.append(f"{node.lineno}: class {node.name} subclasses Trainer")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if "trainer" in _owner_name(node.value).lower():
                found.append(f"{node.lineno}: {_owner_name(node.value)}.{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and _owner_name(node.func) == "setattr"
            and node.args
            and "trainer" in _owner_name(node.args[0]).lower()
        ):
            found.append(f"{node.lineno}: setattr on {_owner_name(node.args[0])}")
    return found


def direct_trainer_constructions(source: str) -> list[str]:
    """Places in ``source`` that construct a ``Trainer`` (``Trainer(...)``, ``trainer.Trainer(...)``)."""
    return [
        f"{node.lineno}: {ast.unparse(node.func)}(...)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and _owner_name(node.func) == "Trainer"
    ]


def test_the_check_finds_each_way_of_reaching_in():
    source = (
        "class Mine(Trainer):\n    pass\n"
        "trainer._stop_requested = True\n"
        "self.trainer._record(1)\n"
        "monkeypatch.setattr(Trainer, 'run', None)\n"
        "trainer.request_stop()\n"
    )
    assert sorted(int(line.split(":")[0]) for line in private_trainer_uses(source)) == [1, 3, 4, 5]
    built = "trainer = Trainer(config, run, features)\nother = training.trainer.Trainer(c)\nbuild_trainer(s, p)\n"
    assert direct_trainer_constructions(built) == ["1: Trainer(...)", "2: training.trainer.Trainer(...)"]


@pytest.mark.parametrize("path", FILES, ids=lambda path: str(path.relative_to(REPO)))
def test_no_private_trainer_access(path: Path):
    assert private_trainer_uses(path.read_text()) == []


@pytest.mark.parametrize("path", FILES, ids=lambda path: str(path.relative_to(REPO)))
def test_runs_are_assembled_as_the_stage_assembles_them(path: Path):
    assert direct_trainer_constructions(path.read_text()) == [], "use asrflow.training.assemble.build_trainer"
