"""The ``asrflow`` front door (asrflow.cli): every subcommand, its ``--help``, ``--version``, and dispatch."""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib.metadata import entry_points, version
from pathlib import Path

import pytest
import yaml

from asrflow.cli import DELEGATED, main
from tests.support.repo import REPO

SUBCOMMANDS = ("corpus", "preset", "tune", "transcribe", "export")


def asrflow(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "asrflow.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_version() -> None:
    done = asrflow("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"asrflow {version('asrflow')}"


def test_help_lists_every_subcommand_and_the_pipeline_tools() -> None:
    done = asrflow("--help")
    assert done.returncode == 0
    for command in SUBCOMMANDS:
        assert f"\n    {command} " in done.stdout, command
    for tool in ("snakemake --cores all", "dvc repro", "dvc exp run -S key=value", "mlflow ui --backend-store-uri"):
        assert tool in done.stdout, tool


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_each_subcommand_answers_help(command: str) -> None:
    done = asrflow(command, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: asrflow {command} "), done.stdout[:200]


def test_corpus_help_names_the_exit_codes_and_the_keys() -> None:
    done = asrflow("corpus", "--help")
    assert "3  nothing is usable" in done.stdout and "prepare.corpus" in done.stdout


def test_no_command_prints_help_and_fails(capsys) -> None:
    assert main([]) == 2
    assert "corpus" in capsys.readouterr().out


def test_preset_is_dispatched_to_the_presets_module(tmp_path: Path, capsys) -> None:
    params = tmp_path / "params.yaml"
    shutil.copy(REPO / "params.yaml", params)
    assert main(["preset", str(REPO / "presets" / "real-corpus.yaml"), "--params", str(params)]) == 0
    assert yaml.safe_load(params.read_text())["prepare"]["corpus"] == "librispeech"
    assert "key(s) set from" in capsys.readouterr().out


def test_a_delegated_usage_error_returns_its_code(capsys) -> None:
    assert main(["preset", "--no-such-option"]) == 2
    assert "usage: asrflow preset" in capsys.readouterr().err


def test_the_installed_script_is_the_front_door() -> None:
    scripts = {point.name: point.value for point in entry_points(group="console_scripts")}
    assert scripts.get("asrflow") == "asrflow.cli:main"
    assert set(DELEGATED) | {"corpus"} == set(SUBCOMMANDS)
    assert 'asrflow = "asrflow.cli:main"' in (REPO / "pyproject.toml").read_text()
