"""Re-launching the train stage under torchrun when more than one process is asked for."""

from __future__ import annotations

import os
import sys

from asrflow.training.config import TrainConfig


def needs_torchrun(config: TrainConfig) -> bool:
    """True when params ask for several processes and this one was not started by torchrun."""
    return (config.nproc_per_node > 1 or config.nnodes > 1) and "LOCAL_RANK" not in os.environ


def torchrun_command(config: TrainConfig, module_args: list[str]) -> list[str]:
    """``python -m torch.distributed.run ...`` running ``python <module_args>`` on every process."""
    rendezvous = (
        ["--standalone"]
        if config.nnodes == 1
        else ["--rdzv-backend=c10d", f"--rdzv-endpoint={config.rdzv_endpoint}", f"--node-rank={config.node_rank}"]
    )
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={config.nnodes}", f"--nproc-per-node={config.nproc_per_node}",
        *rendezvous, "--max-restarts=0", *module_args,
    ]
