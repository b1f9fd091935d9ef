"""A multi-node training run's size and rendezvous, from the cluster job that runs it.

``run.nnodes`` and ``run.rdzv_endpoint`` are facts of the allocation (how many nodes the
job got, which one is first), known only once the job runs. The Slurm recipe
(``workflow/slurm/multinode.sbatch``) exports them for that job alone::

    ASRFLOW_NNODES=2 ASRFLOW_RDZV_ENDPOINT=node17:29500

and the train stage (every node's, and every torchrun worker's, which inherit the environment)
takes them over ``params.yaml``, which stays as it is: a later local run neither trains again
nor waits for a second node, and the git tree stays clean. ``rdzv_endpoint`` is not among the training
params a resume compares (:func:`asrflow.training.fingerprint.training_params`): an unfinished run resumes on
another allocation.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from asrflow.errors import AsrflowError

NNODES_ENV = "ASRFLOW_NNODES"
ENDPOINT_ENV = "ASRFLOW_RDZV_ENDPOINT"


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); anything else is an :class:`AsrflowError` naming the variable."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise AsrflowError(f"{ENDPOINT_ENV}={endpoint!r}: must be host:port, with a port from 1 to 65535")
    return host, int(port)


def rendezvous_from_environment(environ: Mapping[str, str] | None = None) -> dict:
    """``{"nnodes": int, "rdzv_endpoint": "host:port"}`` from ``$ASRFLOW_NNODES`` and
    ``$ASRFLOW_RDZV_ENDPOINT``, each only where set (and not empty): ``run:`` keys to replace."""
    environ = os.environ if environ is None else environ
    overrides: dict = {}
    nnodes = environ.get(NNODES_ENV, "").strip()
    if nnodes:
        if not nnodes.isdigit() or int(nnodes) < 1:
            raise AsrflowError(f"{NNODES_ENV}={nnodes!r}: must be a whole number of nodes, at least 1")
        overrides["nnodes"] = int(nnodes)
    endpoint = environ.get(ENDPOINT_ENV, "").strip()
    if endpoint:
        parse_endpoint(endpoint)
        overrides["rdzv_endpoint"] = endpoint
    return overrides
