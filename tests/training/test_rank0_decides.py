"""Under DDP, rank 0 alone reads the checkpoints and decides; the other ranks follow its decision.

Two real processes (gloo on the loopback interface) each set up the real ``Trainer``. Rank
0's checkpoint folder holds a run; rank 1's is empty, as on a second machine that does
not see the first one's ``exp/checkpoints``. Rank 1 must resume from the file rank 0 chose
(not start a fresh run of its own), and when rank 0's decision is an error (an unfinished
run made with another model shape), rank 1 must raise the same clear error instead of
waiting at a collective.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from asrflow.errors import AsrflowError
from asrflow.training import checkpoint as ckpt
from asrflow.training.checkpoint_manager import CheckpointManager
from asrflow.training.distributed import shutdown_distributed
from tests.support.mlflow_store import fresh_mlflow_store
from tests.support.processes import free_port
from tests.support.tiny_config import tiny_trainer
from tests.support.train_entry import train_in_process

WORLD_SIZE = 2
SEED = 42
OVERRIDES = {
    "train.optim.epochs": 1,
    "train.checkpoint.checkpoint_every_steps": 4,
    "train.checkpoint.validate_every_steps": 0,
}


def _decide_on_rank(rank: int, data: str, folders: dict, port: int) -> None:
    """Build a Trainer on ``rank``; record what its checkpoint manager decides for each scenario."""
    os.environ.update(
        {
            "WORLD_SIZE": str(WORLD_SIZE),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
        }
    )
    exp = Path(folders[f"rank{rank}"])
    result = {}
    try:  # constructing the Trainer joins the process group and builds the run
        trainer = tiny_trainer(Path(data), exp, OVERRIDES, seed=SEED)
        fingerprint = trainer.checkpoints.facts["fingerprint"]
        decision, state, path = trainer.checkpoints.resume(fingerprint, trainer.train_params)
        result["finished"] = {"decision": decision, "path": str(path), "step": state["step"]}
        folder = Path(folders["other_shape"]) if rank == 0 else exp / "checkpoints"
        other = CheckpointManager(folder, every_steps=4, keep_last=20, dist=trainer.dist, facts={})
        try:
            other.resume(fingerprint, trainer.train_params)
            result["other_shape"] = "no error"
        except AsrflowError as error:
            result["other_shape"] = str(error)
    finally:
        shutdown_distributed()
    Path(folders["results"], f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_other_ranks_follow_rank_0s_decision(yesno_data, tmp_path):
    finished = tmp_path / "rank0"
    train_in_process(yesno_data, finished, OVERRIDES, fresh_mlflow_store(tmp_path / "store"))
    newest = ckpt.list_checkpoints(finished / "checkpoints")[0]
    assert ckpt.step_of(newest) == 9

    other_shape = tmp_path / "other_shape"
    summary = train_in_process(
        yesno_data, other_shape, {**OVERRIDES, "train.model.d_model": 48}, fresh_mlflow_store(tmp_path / "store2")
    )
    (other_shape / "checkpoints" / f"step-{summary['steps']:08d}.pt").unlink()  # now an unfinished run
    (tmp_path / "rank1").mkdir()
    (tmp_path / "results").mkdir()
    folders = {
        "rank0": str(finished),
        "rank1": str(tmp_path / "rank1"),
        "other_shape": str(other_shape / "checkpoints"),
        "results": str(tmp_path / "results"),
    }

    mp.spawn(_decide_on_rank, args=(str(yesno_data), folders, free_port()), nprocs=WORLD_SIZE, join=True)

    results = [json.loads((tmp_path / "results" / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    for rank, result in enumerate(results):
        assert result["finished"] == {"decision": "resume", "path": str(newest), "step": 9}, (rank, result)
        assert "holds an unfinished run" in result["other_shape"], (rank, result)
        assert "model.d_model: 48 -> 32" in result["other_shape"], (rank, result)
    assert not list((tmp_path / "rank1").iterdir()), "rank 1 wrote into its own checkpoint folder"
