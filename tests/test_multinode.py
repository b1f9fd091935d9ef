"""asrflow.launch.multinode: a cluster job's node count and rendezvous, from the environment, for that job only."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from asrflow.errors import AsrflowError
from asrflow.launch.multinode import ENDPOINT_ENV, NNODES_ENV, rendezvous_from_environment
from asrflow.params import with_overrides
from asrflow.training.run_config import RunConfig
from tests.support.processes import free_port
from tests.support.repo import REPO, repo_params


def test_nothing_set_changes_nothing():
    assert rendezvous_from_environment({}) == {}
    assert rendezvous_from_environment({NNODES_ENV: "", ENDPOINT_ENV: " "}) == {}


def test_both_values_become_run_config_fields():
    environ = {NNODES_ENV: "4", ENDPOINT_ENV: "node17:29511"}
    assert rendezvous_from_environment(environ) == {"nnodes": 4, "rdzv_endpoint": "node17:29511"}
    assert {"nnodes", "rdzv_endpoint"} <= set(RunConfig.__dataclass_fields__)
    assert rendezvous_from_environment({ENDPOINT_ENV: "head:1"}) == {"rdzv_endpoint": "head:1"}


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({NNODES_ENV: "two"}, r"ASRFLOW_NNODES='two': must be a whole number of nodes, at least 1"),
        ({NNODES_ENV: "0"}, r"ASRFLOW_NNODES='0': must be a whole number"),
        ({ENDPOINT_ENV: "head"}, r"ASRFLOW_RDZV_ENDPOINT='head': must be host:port"),
        ({ENDPOINT_ENV: "head:99999"}, r"ASRFLOW_RDZV_ENDPOINT='head:99999': must be host:port"),
    ],
)
def test_bad_values_name_the_variable(environ, message):
    with pytest.raises(AsrflowError, match=message):
        rendezvous_from_environment(environ)


#: The shipped params with one node, 2 s to reach a rendezvous.
PARAMS = yaml.safe_dump(with_overrides(repo_params(), {"run.nnodes": 1, "run.dist_timeout_s": 2.0}, "this test"))


def _train_stage(tmp_path, **environ: str) -> subprocess.CompletedProcess:
    """The train stage as node 1, in ``tmp_path`` with :data:`PARAMS`, with ``environ``."""
    (tmp_path / "params.yaml").write_text(PARAMS)
    env = {**os.environ, "PYTHONPATH": str(REPO), "GIT_PYTHON_REFRESH": "quiet", **environ}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    command = [sys.executable, "-m", "stages.train", "--node-rank", "1"]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_train_stage_takes_the_jobs_rendezvous_and_leaves_params_alone(tmp_path):
    """Node 1 of a two-node job whose params.yaml says one node: it waits for the job's rendezvous
    (nobody listens there: it gives up after run.dist_timeout_s), and params.yaml is untouched."""
    endpoint = f"127.0.0.1:{free_port()}"
    result = _train_stage(tmp_path, ASRFLOW_NNODES="2", ASRFLOW_RDZV_ENDPOINT=endpoint)
    assert result.returncode == 2, result.stderr
    assert f"error: nobody listens at {endpoint} (run.rdzv_endpoint) after 2 s" in result.stderr, result.stderr
    assert (tmp_path / "params.yaml").read_text() == PARAMS


@pytest.mark.slow
def test_a_bad_variable_stops_the_train_stage_with_one_line(tmp_path):
    result = _train_stage(tmp_path, ASRFLOW_NNODES="two")
    assert result.returncode == 2, result.stderr
    assert "error: ASRFLOW_NNODES='two': must be a whole number of nodes, at least 1" in result.stderr
    assert "Traceback" not in result.stderr
