"""The wheel (``pip wheel --no-deps .``) holds the ``asrflow`` package alone: no top-level ``stages``, ``bench`` or
``tests`` (they run from the checkout), and none of its modules imports them or finds its way to the checkout
from its own file (``Path(__file__).parents[...]`` above the package, ``params.yaml`` beside ``__file__``): installed,
there is no checkout around it.

The wheel is built from a copy of the checkout's files as a fresh clone has them (tracked, or new and not ignored),
so that build outputs left in the checkout (``build/``, ``*.egg-info``) neither reach it nor are written there.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.repo import REPO

#: The checkout's own top-level packages, which an installed asrflow has no copy of.
CHECKOUT_PACKAGES = ("stages", "bench", "tests", "workflow")
#: Files that only the checkout holds: a module that names one beside its own ``__file__`` looks for the checkout.
CHECKOUT_FILES = ("params.yaml", "dvc.yaml", "dvc.lock", "Snakefile", "pyproject.toml", ".git", "pretrained")


def clone_files(source: Path, destination: Path) -> Path:
    """``source``'s files that a fresh clone of it would have (git's tracked files, and new files it does not
    ignore), copied to ``destination``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=source,
        capture_output=True,
        check=True,
        timeout=120,
    ).stdout.split(b"\0")
    for name in filter(None, (entry.decode() for entry in listed)):
        if (source / name).is_file():  # a tracked file deleted in the working tree is not listed as a file
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / name, destination / name)
    return destination


def build_wheel(source: Path, out: Path) -> Path:
    """The wheel pip builds from ``source`` (offline: no build isolation, the venv's setuptools)."""
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), "."]
    built = subprocess.run(command, cwd=source, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    return wheel


def outside_the_package(names: list[str]) -> list[str]:
    """The files of a wheel that are neither under ``asrflow/`` nor in its ``.dist-info`` folder."""
    return [
        name for name in names if not name.startswith("asrflow/") and not name.split("/", 1)[0].endswith(".dist-info")
    ]


def checkout_imports(tree: ast.Module) -> list[str]:
    """The modules of :data:`CHECKOUT_PACKAGES` that ``tree`` imports (anywhere: at the top, in a function, through
    ``importlib.import_module("...")``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append(node.args[0].value)
    return [module for module in found if module.split(".")[0] in CHECKOUT_PACKAGES]


def _levels_up(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> int:
    """How many folders above ``__file__`` (the Name ``node``) the expression around it climbs: ``.parent`` one
    each, ``.parents[k]`` k + 1, ``os.path.dirname(...)`` one each; calls such as ``Path(...)``, ``.resolve()`` and
    ``os.path.abspath(...)`` in between keep the count."""
    levels, here = 0, node
    while (above := parents.get(here)) is not None and isinstance(above, ast.expr):
        if isinstance(above, ast.Attribute) and above.attr == "parent":
            levels += 1
        elif isinstance(above, ast.Subscript) and isinstance(above.value, ast.Attribute) and here is above.value:
            if above.value.attr == "parents" and isinstance(above.slice, ast.Constant):
                levels += int(above.slice.value) + 1
        elif isinstance(above, ast.Call) and here in above.args:
            callee = above.func.attr if isinstance(above.func, ast.Attribute) else getattr(above.func, "id", "")
            levels += callee == "dirname"
        here = above
    return levels


def _joined_outside_the_package(tree: ast.Module, name: str) -> bool:
    """Whether ``tree`` joins the variable ``name`` with a path not under ``asrflow`` (``name / "params.yaml"``,
    ``os.path.join(name, "stages")``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            base, parts = node.left, [node.right]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("join", "joinpath") and node.args:
            base, parts = (node.args[0], node.args[1:]) if node.func.attr == "join" else (node.func.value, node.args)
        else:
            continue
        named = isinstance(base, ast.Name) and base.id == name and parts and isinstance(parts[0], ast.Constant)
        if named and str(parts[0].value).split("/")[0] != "asrflow":
            return True
    return False


def checkout_paths(tree: ast.Module, depth: int) -> list[str]:
    """Where ``tree`` (a module ``depth`` folders inside the wheel: 1 for ``asrflow/x.py``) finds its way from its
    own ``__file__`` to the checkout, each as ``line N: ...``: a climb above the folder that holds the package
    (nothing of an installed package is there); a climb to that folder (site-packages once installed, the
    checkout's root in a clone) that is then joined with anything but ``asrflow/...``; a statement that names one
    of :data:`CHECKOUT_FILES` beside ``__file__``."""
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Name) and node.id == "__file__"):
            continue
        statement = node
        while not isinstance(statement, ast.stmt):
            statement = parents[statement]
        named = {
            constant.value
            for constant in ast.walk(statement)
            if isinstance(constant, ast.Constant) and isinstance(constant.value, str)
        }
        levels = _levels_up(node, parents)
        targets = [target.id for target in getattr(statement, "targets", []) if isinstance(target, ast.Name)]
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            targets.append(statement.target.id)
        to_the_root = levels == depth + 1 and any(_joined_outside_the_package(tree, name) for name in targets)
        if levels > depth + 1 or to_the_root or any(name in text for text in named for name in CHECKOUT_FILES):
            found.append((node.lineno, f"line {node.lineno}: {ast.unparse(statement).splitlines()[0]}"))
    return [where for _, where in sorted(found)]


def wheel_findings(wheel: Path) -> dict[str, list[str]]:
    """What :func:`outside_the_package`, :func:`checkout_imports` and :func:`checkout_paths` find in ``wheel``."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        modules = {name: archive.read(name).decode() for name in names if name.endswith(".py")}
    found = {"outside the package": outside_the_package(names), "imports": [], "checkout paths": []}
    for name, source in sorted(modules.items()):
        tree = ast.parse(source, filename=name)
        found["imports"] += [f"{name}: import {module}" for module in checkout_imports(tree)]
        found["checkout paths"] += [f"{name} {where}" for where in checkout_paths(tree, name.count("/"))]
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    return build_wheel(clone_files(REPO, root / "clone"), root / "dist")


def test_the_wheel_holds_the_asrflow_package_and_its_metadata_only(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert outside_the_package(names) == []
    assert "asrflow/__init__.py" in names and "asrflow/generate/words.txt" in names  # the package, data included
    (metadata,) = {name.split("/", 1)[0] for name in names} - {"asrflow"}
    assert metadata.endswith(".dist-info")


def test_no_module_of_the_wheel_imports_the_checkouts_packages(wheel):
    assert wheel_findings(wheel)["imports"] == []


def test_no_module_of_the_wheel_finds_the_checkout_from_its_own_file(wheel):
    assert wheel_findings(wheel)["checkout paths"] == []


def test_the_scan_finds_a_checkout_import_and_a_checkout_path():
    """The scan itself, on modules that do what an installed package cannot: each way is found, and a module's
    path within its own package is not."""
    bad = """
import os
from pathlib import Path
from stages.train import main
import bench.common

ROOT = Path(__file__).resolve().parents[3]
TOP = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PARAMS = Path(__file__).parent / "params.yaml"
CHECKOUT = Path(__file__).parents[2]
DVC = CHECKOUT / "dvc.yaml"


def later():
    import importlib

    return importlib.import_module("tests.support.repo")
"""
    tree = ast.parse(bad)
    assert sorted(checkout_imports(tree)) == ["bench.common", "stages.train", "tests.support.repo"]
    found = [line.split(":")[0] for line in checkout_paths(tree, depth=2)]
    assert found == ["line 7", "line 8", "line 9", "line 10"]
    own = """
from pathlib import Path
WORDS = Path(__file__).parent / "words.txt"
PACKAGE = Path(__file__).parents[1]
SOURCE_ROOT = Path(__file__).resolve().parents[2]
TRAINER = SOURCE_ROOT / "asrflow/training/trainer.py"
"""
    assert checkout_paths(ast.parse(own), depth=2) == []
