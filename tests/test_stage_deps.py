"""dvc.yaml lists, for every stage, each asrflow module its script imports (directly or not),
so that editing library code re-runs the stages that use it, under both tools."""

from __future__ import annotations

import ast
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def _module_file(name: str) -> Path | None:
    path = REPO / Path(*name.split("."))
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return None


def _imports(file: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.split(".")[0] == "asrflow"}


def _closure(script: Path) -> set[Path]:
    seen: set[Path] = set()
    todo = [script]
    while todo:
        file = todo.pop()
        for name in _imports(file):
            module = _module_file(name)
            if module and module not in seen:
                seen.add(module)
                todo.append(module)
    return {path for path in seen if path.name != "__init__.py" or path.stat().st_size > 0}


def _covered(path: Path, deps: list[str]) -> bool:
    relative = path.relative_to(REPO)
    return any(relative == Path(dep) or Path(dep) in relative.parents for dep in deps)


def test_every_imported_module_is_a_declared_dependency():
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    missing = {}
    for name, stage in stages.items():
        script = REPO / "stages" / f"{name}.py"
        assert _covered(script, stage["deps"]), f"{name}: its script is not a dependency"
        gaps = [str(p.relative_to(REPO)) for p in _closure(script) if not _covered(p, stage["deps"])]
        if gaps:
            missing[name] = sorted(gaps)
    assert missing == {}
