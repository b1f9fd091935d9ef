"""The local test cluster itself: a Slurm that is installed but whose daemons do not start fails
the Slurm tests with the daemons' own log lines; it never skips them."""

from __future__ import annotations

import pytest

from tests.support.slurm_cluster import SYSTEM_CONF, LocalSlurm, install
from tests.support.slurm_pipeline import slurm_impossible_here, start_cluster

pytestmark = pytest.mark.slurm


class UnknownKeyCluster(LocalSlurm):
    """A cluster whose slurm.conf holds a key Slurm does not know: slurmctld stops at start."""

    def write_config(self) -> None:
        super().write_config()
        with open(self.conf, "a") as conf:
            conf.write("AsrflowNoSuchKey=1\n")


def test_daemons_that_do_not_start_fail_the_test_with_their_log_lines(tmp_path):
    reason = slurm_impossible_here()
    if reason:
        pytest.skip(reason)
    install()
    cluster = UnknownKeyCluster(tmp_path / "slurm")
    with pytest.raises(pytest.fail.Exception) as failure:
        start_cluster(cluster)
    message = str(failure.value)
    assert "the local Slurm cluster did not start: slurmctld exited" in message, message
    assert "--- slurmctld" in message and "AsrflowNoSuchKey" in message, message  # slurmctld's own line
    assert not cluster.processes and not (SYSTEM_CONF.is_symlink() and SYSTEM_CONF.resolve() == cluster.conf)
