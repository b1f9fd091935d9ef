"""Multi-node training under Slurm: the README's recipe, ``sbatch workflow/slurm/multinode.sbatch``,
on a local cluster of two Slurm nodes (two ``slurmd`` with their own names and ports on this
host, see tests.support.slurm_cluster), one gloo process per node on the CPU. The model is, weight for
weight, the one ``run.nproc_per_node: 2`` trains on one machine.

Select with ``pytest -m slurm``; skipped like tests/cluster/test_slurm.py where Slurm cannot run.
"""

from __future__ import annotations

import re

import pytest

from tests.support.pipeline_tools import run, tail
from tests.support.processes import free_port
from tests.support.slurm_pipeline import RUN_TIMEOUT_S, assert_same_weights, local_cluster, slurm_env, slurm_repo_copy

pytestmark = [pytest.mark.slurm, pytest.mark.pipeline]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A running two-node Slurm cluster on this host, torn down after the module."""
    yield from local_cluster(tmp_path_factory, nodes=2)


def static_rendezvous() -> bool:
    """Whether the train stage launches several nodes with torchrun's static rendezvous, where
    ``--node-rank`` decides the global ranks. Under c10d torchrun ignores it ("node_rank is only used
    for static rdzv_backend") and ranks nodes by (host name, pid), so rank 0, which alone writes
    checkpoints and the model, can land on any node."""
    from asrflow.launch.torchrun import torchrun_command
    from tests.support.tiny_config import tiny_settings

    run = tiny_settings(overrides={"run.nnodes": 2, "run.rdzv_endpoint": "head:29500"}).run
    return "--rdzv-backend=static" in torchrun_command(run, [])


def test_two_slurm_nodes_train_the_model_of_two_local_processes(two_nodes, tmp_path_factory):
    """The job as shipped (2 nodes, 1 task each): task 0 runs the pipeline, whose train stage is
    node 0, on the first node; task 1 runs ``python -m stages.train --node-rank 1`` on the second."""
    assert static_rendezvous(), "asrflow/launch/torchrun.py must use --rdzv-backend=static for nnodes > 1"
    local = slurm_repo_copy(tmp_path_factory, "two-processes", **{"run.nproc_per_node": 2})
    run(local, "snakemake", "--cores", "all", timeout=RUN_TIMEOUT_S)

    copy = slurm_repo_copy(tmp_path_factory, "slurm-multinode")
    shipped_params = (copy / "params.yaml").read_bytes()
    port = free_port()
    env = {**slurm_env(two_nodes, copy), "ASRFLOW_RDZV_PORT": str(port)}
    result = run(
        copy, "sbatch", "--wait", "workflow/slurm/multinode.sbatch", timeout=RUN_TIMEOUT_S, check=False, env=env
    )
    job = re.search(r"Submitted batch job (\d+)", result.stdout)
    assert job, result.stdout
    job_log = (copy / f"asrflow-multinode-{job.group(1)}.log").read_text(errors="replace")
    assert result.returncode == 0, f"sbatch --wait exited {result.returncode}:\n{tail(job_log)}"
    state = two_nodes.client("squeue", "--states=all", "-h", "-j", job.group(1), "-o", "%T|%D").strip()
    assert state == "COMPLETED|2", state  # state, number of nodes
    first, second = two_nodes.node_names

    endpoint = f"{two_nodes.host}:{port}"  # the first node's NodeAddr: this host
    assert "2 training nodes (tasks)" in job_log, tail(job_log)
    assert f"rendezvous at {endpoint}" in job_log, tail(job_log)
    # the allocation reached the stage through the job's environment; params.yaml is as it was
    assert (copy / "params.yaml").read_bytes() == shipped_params
    assert run(copy, "git", "status", "--porcelain", "--untracked-files=no").stdout == ""
    assert f"asrflow: node 0 on {first} " in job_log and f"asrflow: node 1 on {second} " in job_log, tail(job_log)
    node0 = (copy / "logs/train.log").read_text(errors="replace")  # node 0's train stage, under Snakemake
    assert "--nnodes=2" in node0 and "--node-rank=0" in node0, tail(node0)
    assert "rank 0 of 2 joined the gloo process group" in node0, tail(node0)
    assert "rank 1 of 2 joined the gloo process group" in job_log, tail(job_log)  # node 1, srun's output
    # rank 0, on node 0, alone writes checkpoints; node 1 (its lines in the job log) writes none
    assert "[rank 0] [asrflow.training.checkpoint_manager] saved checkpoint" in node0, tail(node0)
    assert not [line for line in job_log.splitlines() if "[rank 1]" in line and "saved checkpoint" in line]
    assert (copy / "exp/eval/metrics.json").is_file()  # the pipeline went on to evaluate on node 0
    assert_same_weights(copy, local)
    # a later local run has nothing to do: it neither trains again nor waits for a second node
    dry_run = run(copy, "snakemake", "--dry-run", "--cores", "1", timeout=300)
    assert "Nothing to be done" in dry_run.stdout, tail(dry_run.stdout)
