"""Session fixtures: one copy of the repository that Snakemake ran, one that DVC ran.

Each tool runs the whole pipeline once per session, with the default params. The tests
that follow edit params or code in these copies and put them back, so a copy is up to
date between tests; the interrupt tests, which run last, leave theirs up to date with
new train params. What the first run wrote is kept in :class:`PipelineRun`.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.pipeline_tools import dvc_init, git_init, output_files, read_metrics, run
from tests.support.repo import copy_repo

# A bound that only a hung tool reaches: one run takes 1-2 minutes on 2 idle cores.
FULL_RUN_TIMEOUT_S = 1800

# Module order within tests/pipeline: the interrupt tests change their copies for good.
_ORDER = (
    "test_tools_agree.py",
    "test_rerun.py",
    "test_reports.py",
    "test_experiments.py",
    "test_sweeps.py",
    "test_interrupt.py",
)


@dataclass(kw_only=True)
class PipelineRun:
    tool: str
    copy: Path
    files: set[str]  # files under data/{manifests,fbank,lang} and exp/ after the first run
    metrics: dict  # exp/eval/metrics.json after the first run
    output: str  # what the tool printed
    seconds: float


def pytest_collection_modifyitems(config, items):
    """Run this folder's tests last, in the order of :data:`_ORDER`."""
    here = Path(__file__).parent
    ours = [item for item in items if item.path.parent == here]
    if not ours:
        return
    rank = {name: index for index, name in enumerate(_ORDER)}
    ours.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    ids = {id(item) for item in ours}
    items[:] = [item for item in items if id(item) not in ids] + ours


@pytest.fixture(scope="session")
def repo_snapshot(tmp_path_factory, repo_root) -> Path:
    """The repository's files as they are when the session starts: both tools' copies come
    from this one snapshot, so they run the same code even while someone edits the repository."""
    snapshot = copy_repo(tmp_path_factory.mktemp("snapshot") / "repo")
    if (repo_root / ".dvc/config").is_file():  # copy_repo leaves .dvc/ out; dvc_init wants its config
        shutil.copyfile(repo_root / ".dvc/config", snapshot.parent / "dvc-config")
    return snapshot


def _fresh_copy(snapshot: Path, tmp_path_factory, name: str) -> Path:
    copy = tmp_path_factory.mktemp(name) / "repo"
    shutil.copytree(snapshot, copy, symlinks=True)
    git_init(copy)
    return copy


def _run_pipeline(tool: str, copy: Path, *command: str) -> PipelineRun:
    start = time.monotonic()
    result = run(copy, *command, timeout=FULL_RUN_TIMEOUT_S)
    seconds = time.monotonic() - start
    print(f"\n{tool}: the whole pipeline ran in {seconds:.0f} s")
    return PipelineRun(
        tool=tool,
        copy=copy,
        files=output_files(copy),
        metrics=read_metrics(copy),
        output=result.stdout,
        seconds=seconds,
    )


@pytest.fixture(scope="session")
def snakemake_run(repo_snapshot, tmp_path_factory) -> PipelineRun:
    """A copy of the repository where ``snakemake --cores all`` ran the whole pipeline."""
    copy = _fresh_copy(repo_snapshot, tmp_path_factory, "snakemake")
    return _run_pipeline("snakemake", copy, "snakemake", "--cores", "all")


@pytest.fixture(scope="session")
def dvc_run(repo_snapshot, tmp_path_factory) -> PipelineRun:
    """A copy of the repository where ``dvc repro`` ran the whole pipeline."""
    copy = _fresh_copy(repo_snapshot, tmp_path_factory, "dvc")
    dvc_init(copy, repo_snapshot.parent / "dvc-config")
    return _run_pipeline("dvc", copy, "dvc", "repro")
