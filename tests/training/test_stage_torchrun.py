"""The train stage re-launches itself under torchrun when params ask for several processes,
as Snakemake and DVC run it: `python -m stages.train` from the repository root."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import asdict

import yaml
from conftest import REPO, tiny_train_config


def test_train_stage_runs_two_gloo_ranks_under_torchrun(yesno_data, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "fbank").symlink_to(yesno_data / "fbank")
    (tmp_path / "data" / "lang").symlink_to(yesno_data / "lang")
    train = asdict(tiny_train_config(epochs=1, nproc_per_node=2, num_workers=0, checkpoint_every_steps=2,
                                     dist_timeout_s=60.0, stall_timeout_s=120.0))
    params = {"seed": 42, "features": {"num_jobs": 1}, "train": train}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
           "GIT_PYTHON_REFRESH": "quiet"}
    env.pop("LOCAL_RANK", None)
    result = subprocess.run([sys.executable, "-m", "stages.train"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    assert "torch.distributed.run" in log and "--nproc-per-node=2" in log
    assert "rank 0 of 2 joined the gloo process group" in log
    assert "rank 1 of 2 joined the gloo process group" in log
    assert (tmp_path / "exp" / "model.pt").is_file()
