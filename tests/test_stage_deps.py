"""dvc.yaml lists, for every stage, each asrflow module its script imports (directly or not),
so that editing library code re-runs the stages that use it, under both tools."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from asrflow.code_digest import import_closure

REPO = Path(__file__).resolve().parents[1]


def _closure(script: Path) -> set[Path]:
    return {path for path in import_closure([script], REPO) if path.name != "__init__.py" or path.stat().st_size > 0}


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


def _tracked_by_git(path: str) -> bool:
    listed = subprocess.run(["git", "ls-files", "--", path], cwd=REPO, capture_output=True, text=True, check=True)
    return bool(listed.stdout.strip())


def test_the_committed_dvc_lock_matches_the_committed_code():
    """dvc.lock records which code made the results: after editing a stage's code, run
    ``dvc repro`` and commit dvc.lock with the change."""
    env = {**os.environ, "GIT_PYTHON_REFRESH": "quiet"}
    status = subprocess.run(
        [sys.executable, "-m", "dvc", "status", "--json"], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    stale = {
        f"{stage}: {path}"
        for stage, changes in json.loads(status.stdout or "{}").items()
        for change in changes
        if isinstance(change, dict)
        for path, state in change.get("changed deps", {}).items()
        if state == "modified" and _tracked_by_git(path)
    }
    assert not stale, f"dvc.lock is older than these dependencies; run `dvc repro` and commit dvc.lock: {sorted(stale)}"
