"""The pipeline on the local Slurm cluster of :mod:`tests.support.slurm_cluster`, for the Slurm tests.

:func:`local_cluster` starts a cluster for a test (or skips the test, saying why, only where Slurm cannot
run at all: not root, or neither Slurm nor apt-get), :func:`slurm_repo_copy` makes a copy of the repository
with a short training schedule, :func:`slurm_env` points a tool run in it at the cluster, and
:func:`assert_same_weights` compares the models two copies trained. The parts that skip or fail a test
import pytest only when called.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from tests.support.pipeline_tools import git_init, set_params
from tests.support.repo import copy_repo, tool_env
from tests.support.slurm_cluster import PARTITION, LocalSlurm, SlurmUnavailable, binaries_missing, install

#: Short training (8 epochs, ~80 steps on yesno), a checkpoint every 20 steps, no checkpoint averaging:
#: the final weights do not depend on which extra checkpoints an interruption wrote.
PARAMS = {"train.optim.epochs": 8, "train.checkpoint.checkpoint_every_steps": 20, "train.optim.average_last": 1}
#: Only a hung run reaches it: one takes 3-7 minutes on 2 shared cores (seconds).
RUN_TIMEOUT_S = 1800


def slurm_impossible_here() -> str | None:
    """Why Slurm cannot run here at all (the one reason to skip), or None."""
    if os.geteuid() != 0:
        return "the local Slurm test cluster runs its daemons as root; not root here"
    if binaries_missing() and shutil.which("apt-get") is None:
        return f"Slurm is not installed ({', '.join(binaries_missing())} missing) and there is no apt-get to install it"
    return None


def start_cluster(cluster: LocalSlurm) -> None:
    """Start ``cluster``; a Slurm that is there but does not start fails the test with its daemons' log lines."""
    import pytest

    try:
        cluster.start()
    except SlurmUnavailable as error:
        cluster.stop()
        pytest.fail(f"the local Slurm cluster did not start: {error}", pytrace=False)


def local_cluster(tmp_path_factory, nodes: int = 1) -> Iterator[LocalSlurm]:
    """Yield a running local Slurm cluster of ``nodes`` nodes (the body of a fixture); torn down after. Skips
    the test, saying why, only where Slurm cannot run here (not root, or neither Slurm nor apt-get); anything
    else that stops it (no plugin, a failed install, daemons that do not start) fails it."""
    import pytest

    reason = slurm_impossible_here()
    if reason:
        pytest.skip(reason)
    try:
        import snakemake_executor_plugin_slurm  # noqa: F401
    except ImportError:
        pytest.fail("no Slurm executor plugin: pip install -e .[slurm] (make test does)", pytrace=False)
    try:
        install()
    except (SlurmUnavailable, subprocess.SubprocessError) as error:
        pytest.fail(f"Slurm could not be installed: {error}", pytrace=False)
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"), nodes=nodes)
    started = time.monotonic()
    start_cluster(cluster)
    names = ",".join(cluster.node_names)
    print(f"\nSlurm up in {time.monotonic() - started:.1f} s (node(s) {names}, partition {PARTITION})")
    yield cluster
    cluster.stop()


def slurm_repo_copy(tmp_path_factory, name: str, **params) -> Path:
    """A git-committed copy of the repository whose params.yaml has :data:`PARAMS` and ``params``
    (``{"section.key": value}``)."""
    copy = copy_repo(tmp_path_factory.mktemp(name) / "repo")
    set_params(copy, {**PARAMS, **params})
    git_init(copy)
    return copy


def slurm_env(cluster: LocalSlurm, copy: Path) -> dict[str, str]:
    """The environment of a tool run in ``copy`` (:func:`tests.support.repo.tool_env`) whose Slurm clients
    talk to ``cluster``."""
    return cluster.env(tool_env(copy))


def weights(copy: Path) -> dict[str, torch.Tensor]:
    """The weights of the model bundle the pipeline trained in ``copy`` (``exp/model.pt``)."""
    bundle = torch.load(copy / "exp/model.pt", map_location="cpu", weights_only=True)
    return bundle["model"]


def assert_same_weights(a: Path, b: Path) -> None:
    """The models trained in copies ``a`` and ``b`` are ``torch.equal``, tensor for tensor."""
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    different = [name for name in wa if not torch.equal(wa[name], wb[name])]
    assert not different, f"{len(different)} of {len(wa)} tensors differ, e.g. {different[:3]}"
