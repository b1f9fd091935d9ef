"""The train stage re-launches itself under torchrun when params ask for several processes,
as Snakemake and DVC run it: `python -m stages.train` from the repository root."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml

from tests.support.processes import free_port
from tests.support.repo import REPO
from tests.support.tiny_config import tiny_params


@pytest.mark.slow
def test_train_stage_runs_two_gloo_ranks_under_torchrun(yesno_data, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "fbank").symlink_to(yesno_data / "fbank")
    (tmp_path / "data" / "lang").symlink_to(yesno_data / "lang")
    overrides = {
        "train.optim.epochs": 1,
        "run.nproc_per_node": 2,
        "run.num_workers": 0,
        "train.checkpoint.checkpoint_every_steps": 2,
        "run.dist_timeout_s": 60.0,
        "run.stall_timeout_s": 120.0,
    }
    params = tiny_params(yesno_data, overrides, seed=42)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "GIT_PYTHON_REFRESH": "quiet",
    }
    env.pop("LOCAL_RANK", None)
    # as the Snakemake rule runs it (workflow/rules/common.smk): the log to a file, the terminal on descriptor 3
    env.update({"ASRFLOW_PROGRESS_FD": "3", "ASRFLOW_STAGE": "train", "ASRFLOW_LOG_FILE": "logs/train.log"})
    result = subprocess.run(
        ["bash", "-c", f"{sys.executable} -m stages.train 3>&2 > train.log 2>&1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = (tmp_path / "train.log").read_text()
    assert result.returncode == 0, log + result.stderr
    assert "torch.distributed.run" in log and "--nproc-per-node=2" in log
    assert "rank 0 of 2 joined the gloo process group" in log
    assert "rank 1 of 2 joined the gloo process group" in log
    assert (tmp_path / "exp" / "model.pt").is_file()
    terminal = result.stderr
    assert terminal.count("[train] running; full log in logs/train.log") == 1, terminal
    assert re.search(r"\[train rank 0\] step 1/\d+ ", terminal), terminal  # rank 0's progress reaches the terminal
    assert "[train rank 1] step" not in terminal, terminal


@pytest.mark.slow
def test_two_nodes_on_localhost_train_as_the_readme_says(yesno_data, tmp_path):
    """Two "machines" (two torchrun launches sharing one folder, as on a shared filesystem):
    node 0 is the stage as the tools run it, node 1 is ``python -m stages.train --node-rank 1``.
    They meet at the static rendezvous node 0 hosts (--node-rank is each one's rank), train
    as 2 gloo ranks, and only rank 0, on node 0, writes the model."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "fbank").symlink_to(yesno_data / "fbank")
    (tmp_path / "data" / "lang").symlink_to(yesno_data / "lang")
    overrides = {
        "train.optim.epochs": 1,
        "run.nnodes": 2,
        "run.rdzv_endpoint": f"127.0.0.1:{free_port()}",
        "run.num_workers": 0,
        "train.checkpoint.checkpoint_every_steps": 2,
        "run.dist_timeout_s": 60.0,
        "run.stall_timeout_s": 120.0,
    }
    params = tiny_params(yesno_data, overrides, seed=42)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "GIT_PYTHON_REFRESH": "quiet",
    }
    env.pop("LOCAL_RANK", None)
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "stages.train", *extra],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for extra in ([], ["--node-rank", "1"])
    ]
    logs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n\n".join(logs)
    assert "--nnodes=2" in logs[0] and "--node-rank=0" in logs[0] and "--node-rank=1" in logs[1]
    assert "rank 0 of 2 joined the gloo process group" in logs[0]
    assert "rank 1 of 2 joined the gloo process group" in logs[1]
    assert "saved checkpoint" in logs[0] and "saved checkpoint" not in logs[1]
    assert (tmp_path / "exp" / "model.pt").is_file()
