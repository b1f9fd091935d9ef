"""run.allocator: the train stage re-executes itself with jemalloc preloaded to train in bf16 when it is installed
(auto), or in any precision when told to; keeps the C library's malloc for fp32 (auto) or when told to; and
refuses a value it does not know or a jemalloc that is not there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import asrflow.allocator
from asrflow.allocator import REEXECUTED_FLAG, environment_with_jemalloc, find_jemalloc, jemalloc_to_preload
from asrflow.errors import AsrflowError
from tests.support.repo import REPO, repo_params

needs_jemalloc = pytest.mark.skipif(
    find_jemalloc() is None, reason="no jemalloc installed (Debian: apt install libjemalloc2; make test does)"
)


def stage_log(tmp_path: Path, allocator: str, precision: str, env: dict[str, str] | None = None) -> str:
    """What the train stage, run as the tools run it with ``run.allocator: allocator`` to train in ``precision``,
    logs before it stops at its first input check (``--fbank`` names no folder: exit 2)."""
    params = repo_params()
    params["run"]["allocator"] = allocator
    params["train"]["optim"]["precision"] = precision
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    done = subprocess.run(
        [sys.executable, "-m", "stages.train", "--params", "params.yaml", "--fbank", "no-such-folder"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "--fbank no-such-folder: no such folder" in done.stderr
    return done.stderr


@pytest.mark.slow
@needs_jemalloc
def test_the_train_stage_reexecutes_itself_with_jemalloc_to_train_in_bf16(tmp_path):
    log = stage_log(tmp_path, "auto", "bf16")
    assert "malloc: jemalloc" in log
    assert log.count("train stage started") == 1  # the re-executed process logs it, once


@pytest.mark.parametrize(
    ("allocator", "precision", "jemalloc"),
    [("auto", "fp32", False), ("auto", "auto", False), ("jemalloc", "fp32", True), ("system", "bf16", False)],
)
@needs_jemalloc
def test_fp32_keeps_the_c_librarys_malloc_unless_jemalloc_is_asked_for(tmp_path, allocator, precision, jemalloc):
    assert ("malloc: jemalloc" in stage_log(tmp_path, allocator, precision)) is jemalloc


@needs_jemalloc
def test_a_process_reexecuted_once_does_not_again(tmp_path):
    """The flag a re-execution sets stands for a preload the loader refused: the stage goes on with the C library's
    malloc, says so, and does not loop."""
    log = stage_log(tmp_path, "auto", "bf16", env={REEXECUTED_FLAG: "1"})
    assert "malloc: jemalloc" not in log
    assert "did not load" in log


def test_an_unknown_allocator_is_refused_with_the_choices():
    with pytest.raises(AsrflowError, match=r"run\.allocator = 'tcmalloc' is not valid; use one of auto, jemalloc"):
        jemalloc_to_preload("tcmalloc", "bf16")


def test_required_jemalloc_that_is_not_installed_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(asrflow.allocator, "find_jemalloc", lambda: None)
    with pytest.raises(AsrflowError, match="apt install libjemalloc2"):
        jemalloc_to_preload("jemalloc", "fp32")
    assert jemalloc_to_preload("auto", "bf16") is None


def test_the_preload_goes_first_and_keeps_what_was_there():
    env = environment_with_jemalloc({"LD_PRELOAD": "libother.so", "HOME": "/h"}, "libjemalloc.so.2")
    assert env == {"LD_PRELOAD": "libjemalloc.so.2 libother.so", "HOME": "/h"}
    assert environment_with_jemalloc({}, "libjemalloc.so.2") == {"LD_PRELOAD": "libjemalloc.so.2"}
