"""An experiment in DVC's temporary workspace keeps its checkpoints in the queuing repository, under a
folder named by the params that shape the model, and holds that folder's lock while it trains."""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

import pytest

from asrflow.tracking.store import resolve_tracking_uri
from asrflow.training.sweep import SWEEP_DIR, checkpoints_outside_temp_workspace, origin_repo, sweep_key
from tests.support.repo import repo_params

#: The train stage's persistent output, relative to the stage's folder.
LINK = Path("exp/checkpoints")


@pytest.fixture
def temp_workspace(tmp_path, monkeypatch):
    """A queuing repository (returned) and DVC's copy of it, the cwd, as ``dvc queue start`` runs a stage."""
    origin, copy = tmp_path / "origin", tmp_path / "origin/.dvc/tmp/exps/tmpabc"
    (copy / "exp").mkdir(parents=True)
    monkeypatch.chdir(copy)
    monkeypatch.setenv("DVC_ROOT", str(origin))
    return origin


def test_origin_is_the_queuing_repository_only_in_a_temporary_workspace(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    assert origin_repo() is None
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))  # dvc repro, dvc exp run in the workspace
    assert origin_repo() is None
    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "repo"))
    assert origin_repo() == tmp_path / "repo"


def test_key_follows_the_params_that_shape_the_model():
    params = repo_params()
    changed = json.loads(json.dumps(params))
    changed["train"]["optim"]["lr"] *= 2
    bookkeeping = json.loads(json.dumps(params))
    bookkeeping["run"]["experiment"] = "other"
    bookkeeping["evaluate"]["decoder"] = "beam"
    bookkeeping["train"]["checkpoint"]["keep_last"] += 1
    assert sweep_key(params) != sweep_key(changed)
    assert sweep_key(params) == sweep_key(bookkeeping) and len(sweep_key(params)) == 8


def test_checkpoints_stay_where_they_are_outside_a_temporary_workspace(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    with checkpoints_outside_temp_workspace(tmp_path / "exp/checkpoints", repo_params()) as folder:
        assert folder == tmp_path / "exp/checkpoints"
    assert not (tmp_path / "exp").exists()


def test_checkpoints_outlive_the_temporary_workspace(temp_workspace):
    params, link = repo_params(), LINK
    with checkpoints_outside_temp_workspace(link, params) as folder:
        assert folder == temp_workspace / SWEEP_DIR / sweep_key(params)
        assert link.is_symlink() and link.resolve() == folder.resolve()
        (link / "step-00000050.pt").write_bytes(b"checkpoint")
        with open(folder.with_name(folder.name + ".lock"), "rb") as lock, pytest.raises(BlockingIOError):
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while training runs
    assert (folder / "step-00000050.pt").read_bytes() == b"checkpoint"
    link.unlink()  # DVC deletes its copy; the same params queued again find the checkpoint
    with checkpoints_outside_temp_workspace(link, params) as again:
        assert again == folder and (link / "step-00000050.pt").is_file()
    with checkpoints_outside_temp_workspace(link, params, main_process=False) as other_rank:
        assert other_rank == folder


def test_relative_store_is_the_queuing_repositorys(temp_workspace):
    assert resolve_tracking_uri("sqlite:///mlflow.db") == f"sqlite:///{temp_workspace.resolve()}/mlflow.db"
