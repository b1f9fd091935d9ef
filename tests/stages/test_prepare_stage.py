"""The prepare stage as a user runs it: python -m stages.prepare."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.repo import write_shipped_params

REPO = Path(__file__).resolve().parents[2]


def run_stage(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stages.prepare", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def write_params(tmp_path: Path, **prepare) -> Path:
    return write_shipped_params(tmp_path, {f"prepare.{key}": value for key, value in prepare.items()})


@pytest.mark.slow
def test_stage_prepares_the_shipped_corpus(tmp_path: Path) -> None:
    params = write_params(tmp_path, corpus_dir=str(REPO / "data" / "corpora" / "yesno"))
    out = tmp_path / "manifests"
    result = run_stage("--params", str(params), "--out", str(out))
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert {name: split["utterances"] for name, split in summary["splits"].items()} == {
        "train": 27,
        "dev": 3,
        "test": 30,
    }
    assert (out / "train_cuts.jsonl.gz").is_file()
    assert "prepare:" in result.stderr  # the summary is logged


@pytest.mark.slow
def test_stage_missing_corpus_dir_exits_2_with_one_line(tmp_path: Path) -> None:
    params = write_params(tmp_path, corpus_dir=str(tmp_path / "no_such_corpus"))
    out = tmp_path / "manifests"
    result = run_stage("--params", str(params), "--out", str(out))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no_such_corpus" in errors[0] and "corpus_dir" in errors[0]
    assert not out.exists()


def test_stage_help_names_its_options() -> None:
    result = run_stage("--help")
    assert result.returncode == 0
    assert "--params" in result.stdout and "--out" in result.stdout
