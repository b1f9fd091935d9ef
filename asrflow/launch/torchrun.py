"""Re-launching the train stage under torchrun when more than one process is asked for."""

from __future__ import annotations

import os
import socket
import sys
import time

from asrflow.errors import AsrflowError
from asrflow.training.run_config import RunConfig


def needs_torchrun(config: RunConfig) -> bool:
    """True when params ask for several processes and this one was not started by torchrun."""
    return (config.nproc_per_node > 1 or config.nnodes > 1) and "LOCAL_RANK" not in os.environ


def torchrun_command(config: RunConfig, module_args: list[str]) -> list[str]:
    """``python -m torch.distributed.run ...`` running ``python <module_args>`` on every process."""
    rendezvous = (
        ["--standalone"]
        if config.nnodes == 1
        # static: --node-rank is this machine's rank and node 0 hosts the store (c10d orders nodes by host
        # name and pid and ignores --node-rank, so global rank 0 could land on another machine than node 0)
        else ["--rdzv-backend=static", f"--rdzv-endpoint={config.rdzv_endpoint}", f"--node-rank={config.node_rank}"]
    )
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={config.nnodes}",
        f"--nproc-per-node={config.nproc_per_node}",
        *rendezvous,
        f"--rdzv-conf=join_timeout={int(config.dist_timeout_s)},timeout={int(config.dist_timeout_s)}",
        "--max-restarts=0",
        *module_args,
    ]


def check_launch(config: RunConfig) -> None:
    """Refuse a launch that could only fail or wait forever: more processes than devices (GPUs, or CPU
    cores without one), or, on a node other than the first, a rendezvous endpoint nobody listens on
    within ``run.dist_timeout_s``."""
    import torch

    on_gpu = torch.cuda.is_available()
    devices = torch.cuda.device_count() if on_gpu else len(os.sched_getaffinity(0))
    if config.nproc_per_node > devices:
        kind = "GPUs" if on_gpu else "CPU cores (no GPU)"
        raise AsrflowError(
            f"params.yaml: run.nproc_per_node is {config.nproc_per_node} but this machine has {devices} {kind}: "
            f"set run.nproc_per_node to at most {devices}"
        )
    if config.nnodes > 1 and config.node_rank > 0:
        wait_for_endpoint(config.rdzv_endpoint, config.dist_timeout_s)


def wait_for_endpoint(endpoint: str, timeout_s: float) -> None:
    """Return once something accepts TCP connections at ``host:port``; AsrflowError after ``timeout_s``."""
    host, _, port = endpoint.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host or "localhost", int(port)), timeout=2.0):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise AsrflowError(
                    f"nobody listens at {endpoint} (run.rdzv_endpoint) after {timeout_s:.0f} s ({error}): start "
                    "node 0 first, and check its address and port, and that the firewall lets them through"
                ) from None
            time.sleep(1.0)
