"""Launches that could only fail or wait forever end at once with one message and exit 2."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from asrflow.errors import AsrflowError
from asrflow.launch.torchrun import check_launch
from asrflow.training.distributed import DistInfo, check_same_everywhere
from stages import train as train_stage
from tests.support.processes import free_port
from tests.support.repo import write_shipped_params
from tests.support.tiny_config import tiny_settings


def test_more_processes_than_cores_is_refused_by_the_stage(tmp_path, monkeypatch, capsys):
    cores = len(os.sched_getaffinity(0))
    write_shipped_params(tmp_path, {"seed": 1, "run.nproc_per_node": cores + 1})
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        train_stage.main(["--params", "params.yaml"])
    assert stop.value.code == 2
    error = capsys.readouterr().err
    assert f"run.nproc_per_node is {cores + 1} but this machine has {cores} CPU cores" in error
    assert f"set run.nproc_per_node to at most {cores}" in error


def test_a_rendezvous_endpoint_nobody_listens_on_ends_within_the_timeout():
    run = {"run.nnodes": 2, "run.node_rank": 1, "run.rdzv_endpoint": f"127.0.0.1:{free_port()}"}
    config = tiny_settings(overrides={**run, "run.dist_timeout_s": 2.0}).run
    began = time.monotonic()
    with pytest.raises(AsrflowError, match=r"nobody listens at 127\.0\.0\.1:\d+ \(run\.rdzv_endpoint\) after 2 s"):
        check_launch(config)
    assert time.monotonic() - began < 30  # bounded by dist_timeout_s, not torchrun's own 15 minutes


def _compare_on_rank(rank: int, port: int, results: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"})
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        check_same_everywhere(DistInfo(2, rank, rank), "params-digest-a", "params")
        outcome = {"same": "no error"}
        try:
            check_same_everywhere(DistInfo(2, rank, rank), f"params-digest-{rank}", "params, code or data")
            outcome["different"] = "no error"
        except AsrflowError as error:
            outcome["different"] = str(error)
    finally:
        dist.destroy_process_group()
    Path(results, f"rank{rank}.json").write_text(json.dumps(outcome))


@pytest.mark.slow
def test_nodes_with_different_params_stop_on_every_rank(tmp_path):
    mp.spawn(_compare_on_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        outcome = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert outcome["same"] == "no error"
        assert outcome["different"].startswith("rank(s) [1] run with other params, code or data than rank 0")
