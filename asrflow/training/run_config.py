"""params.yaml's ``run:`` section: how and where a training run executes (its processes, their group, its
MLflow experiment). No stage's outputs depend on it, so a change re-runs nothing."""

from __future__ import annotations

from dataclasses import dataclass

from asrflow.allocator import ALLOCATORS
from asrflow.cores import available_cores
from asrflow.params import check_at_least, check_choice, check_positive, param_error

SECTION = "run"
#: Accepted values of ``run.mp_start_method`` (Python's multiprocessing start methods).
START_METHODS = ("spawn", "forkserver", "fork")
#: The fewest data workers ``num_workers: auto`` starts when features are computed on the fly.
AUTO_WORKERS_ON_THE_FLY = 2
#: ``auto``'s most workers for a GPU reading stored fbank: loading a batch is light, and each spawned worker
#: imports torch again; the figures behind it: bench/RESULTS.md#gpu-data-workers.
AUTO_WORKERS_GPU_STORED = 4
#: ``auto``'s most workers with features computed on the fly: enough to keep a GPU fed, where a machine's every
#: core as a worker never delivered a first batch in time (bench/RESULTS.md#gpu-data-workers).
AUTO_WORKERS_ON_THE_FLY_MOST = 8
#: Keys that must stay the same for a resume to continue the same run: the number of processes changes the
#: batches each one trains on. The other keys are bookkeeping, parallel loading and time limits.
WORLD_KEYS = ("nproc_per_node", "nnodes")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The ``run:`` section (each key is documented in params.yaml)."""

    experiment: str
    register_model_name: str | None
    num_workers: int | str
    mp_start_method: str
    allocator: str
    nproc_per_node: int
    nnodes: int
    node_rank: int
    rdzv_endpoint: str
    dist_timeout_s: float
    stall_timeout_s: float

    def __post_init__(self) -> None:
        if isinstance(self.num_workers, str):
            if self.num_workers != "auto":
                raise param_error(SECTION, "num_workers", self.num_workers, "must be auto or an integer >= 0")
        else:
            check_at_least(self, SECTION, 0, "num_workers")
        check_choice(self, SECTION, "mp_start_method", START_METHODS)
        check_choice(self, SECTION, "allocator", ALLOCATORS)
        check_at_least(self, SECTION, 1, "nproc_per_node", "nnodes")
        check_at_least(self, SECTION, 0, "node_rank", "stall_timeout_s")
        check_positive(self, SECTION, "dist_timeout_s")
        if self.node_rank >= self.nnodes:
            raise param_error(SECTION, "node_rank", self.node_rank, f"must be below run.nnodes ({self.nnodes})")
        if not self.experiment.strip():
            raise param_error(SECTION, "experiment", self.experiment, "must name an MLflow experiment")
        if self.register_model_name is not None and not self.register_model_name.strip():
            raise param_error(
                SECTION, "register_model_name", self.register_model_name, "must be null or a registered-model name"
            )

    def data_workers(self, on_the_fly: bool, *, gpu: bool = False, usable_cores: int | None = None) -> int:
        """Data-loading processes of each rank: ``num_workers``, or for ``auto``: 0 when a CPU trains on
        precomputed features (a batch of stored fbank loads quickly next to a CPU step, and each spawned
        worker would import torch again); when features are computed on the fly (fbank, speed perturbation,
        noise), the rank's share of the ``usable_cores`` (default: :func:`asrflow.cores.available_cores`) less one for
        the rank itself, at least :data:`AUTO_WORKERS_ON_THE_FLY` and at most :data:`AUTO_WORKERS_ON_THE_FLY_MOST`;
        when a ``gpu`` trains on precomputed features (its steps are short next to loading a batch), that share
        but at most :data:`AUTO_WORKERS_GPU_STORED`."""
        if self.num_workers != "auto":
            return int(self.num_workers)
        if not on_the_fly and not gpu:
            return 0
        cores = usable_cores if usable_cores is not None else available_cores()
        share = max(AUTO_WORKERS_ON_THE_FLY, cores // self.nproc_per_node - 1)
        return min(share, AUTO_WORKERS_ON_THE_FLY_MOST if on_the_fly else AUTO_WORKERS_GPU_STORED)

    @property
    def world(self) -> dict:
        """The keys of :data:`WORLD_KEYS` with their values."""
        return {key: getattr(self, key) for key in WORLD_KEYS}
