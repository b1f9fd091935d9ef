"""Run one tiny ``Trainer`` on the yesno test data; tests/training/test_ddp.py starts it under torchrun.

Usage::

    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/training/ddp_entry.py SPEC.json
    python tests/training/ddp_entry.py SPEC.json            # one process

``SPEC.json`` holds ``data`` (a folder made by the ``yesno_data`` fixture), ``exp`` (the
output folder), ``config`` (overrides for ``tiny_train_config``, plus ``nonfinite_steps`` and
``nonfinite_ranks`` for :class:`asrflow.testing.faults.NonFiniteSteps`) and ``tracking_uri``.
Rank 0 writes the run's summary to ``<exp>/summary.json``. The exit code is the train stage's
(:func:`stages.train.run_trainer`, its signal handlers included); a user error exits 2 with one
line. Each rank prints ``asrflow.test.rank R pid P`` when its first step is next,
``asrflow.test.step R S T`` after each step (``T``: unix time), and
``asrflow.test.exit R CODE`` as it exits (a rank the stall watchdog ends says so in its log).

Faults (environment variables, read only by this script through a public observer; the
library has no test hooks of its own), each ``rank:step`` or ``rank:batch``:

``ASRFLOW_TEST_FAIL_RANK_AT_STEP``
    that rank raises ``RuntimeError`` right after finishing that optimizer step.
``ASRFLOW_TEST_STALL_RANK_AT_STEP``
    that rank sleeps forever right after finishing that optimizer step.
``ASRFLOW_TEST_PAUSE_RANK_IN_STEP``
    that rank holds that step in flight (right before its all-reduce), printing
    ``asrflow.test.paused R S``, until a stop is requested (SIGTERM to that rank).
``ASRFLOW_TEST_STALL_WORKER_AT_BATCH`` / ``ASRFLOW_TEST_KILL_WORKER_AT_BATCH``
    the data worker of that rank that builds that planned batch sleeps forever / SIGKILLs itself.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # tests/, repo

from conftest import tiny_train_config, train_paths  # noqa: E402

from asrflow.data.features import FeatureConfig  # noqa: E402
from asrflow.errors import exit_on_user_error  # noqa: E402
from asrflow.logs import setup_logging  # noqa: E402
from asrflow.testing.faults import NonFiniteSteps  # noqa: E402
from asrflow.training.observers import TrainObserver  # noqa: E402
from asrflow.training.trainer import Trainer  # noqa: E402
from stages.train import run_trainer  # noqa: E402

FAIL_ENV = "ASRFLOW_TEST_FAIL_RANK_AT_STEP"
STALL_ENV = "ASRFLOW_TEST_STALL_RANK_AT_STEP"
PAUSE_ENV = "ASRFLOW_TEST_PAUSE_RANK_IN_STEP"
WORKER_STALL_ENV = "ASRFLOW_TEST_STALL_WORKER_AT_BATCH"
WORKER_KILL_ENV = "ASRFLOW_TEST_KILL_WORKER_AT_BATCH"


def _hook(name: str) -> tuple[int, int] | None:
    value = os.environ.get(name)
    if not value:
        return None
    rank, where = value.split(":")
    return int(rank), int(where)


class FaultyDataset:
    """The real dataset; building planned batch ``batch_index`` stalls or kills the worker."""

    def __init__(self, dataset, batch_index: int, kill: bool):
        self.dataset, self.batch_index, self.kill = dataset, batch_index, kill

    def __getitem__(self, item):
        if item.batch_index == self.batch_index:
            print(f"injected worker fault at batch {item.batch_index} (pid {os.getpid()})", file=sys.stderr, flush=True)
            if self.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            while True:
                time.sleep(1)
        return self.dataset[item]

    def __len__(self) -> int:
        return len(self.dataset)


class Faults(TrainObserver):
    """Injects the faults the environment asks for on this rank."""

    def on_start(self, run) -> None:
        rank = run.dist.rank
        os.write(2, f"asrflow.test.rank {rank} pid {os.getpid()}\n".encode())  # one write: lines of ranks never mix
        for name, kill in ((WORKER_STALL_ENV, False), (WORKER_KILL_ENV, True)):
            hook = _hook(name)
            if hook and hook[0] == rank:
                run.data.dataset = FaultyDataset(run.data.dataset, hook[1], kill)

    def in_step(self, run, step: int) -> None:
        if (run.dist.rank, step) == _hook(PAUSE_ENV):
            print(f"asrflow.test.paused {run.dist.rank} {step}", file=sys.stderr, flush=True)
            while not run.stop.requested:
                time.sleep(0.02)

    def after_step(self, run, result) -> None:
        here = (run.dist.rank, result.step)
        os.write(2, f"asrflow.test.step {here[0]} {here[1]} {time.time():.3f}\n".encode())
        if here == _hook(FAIL_ENV):
            raise RuntimeError(f"injected failure on rank {here[0]} at step {here[1]} ({FAIL_ENV})")
        if here == _hook(STALL_ENV):
            print(f"injected stall on rank {here[0]} at step {here[1]} ({STALL_ENV})", file=sys.stderr, flush=True)
            while True:
                time.sleep(1)


@exit_on_user_error
def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    setup_logging()
    exp = Path(spec["exp"])
    overrides = dict(spec.get("config", {}))
    nonfinite = NonFiniteSteps(overrides.pop("nonfinite_steps", ()), overrides.pop("nonfinite_ranks", ()))
    trainer = Trainer(
        tiny_train_config(**overrides),
        FeatureConfig(),
        seed=int(spec.get("seed", 42)),
        paths=train_paths(Path(spec["data"]), exp),
        tracking_uri=spec.get("tracking_uri"),
        observers=[Faults(), nonfinite],
    )
    code, outcome = run_trainer(trainer)
    if outcome is not None and trainer.dist.is_main:
        (exp / "summary.json").write_text(json.dumps(outcome.summary))
    raise SystemExit(code)


def _report_exit(code: int) -> None:
    os.write(2, f"asrflow.test.exit {os.environ.get('RANK', '0')} {code}\n".encode())


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except SystemExit as done:
        _report_exit(done.code if isinstance(done.code, int) else 1)
        raise
    except BaseException:
        _report_exit(1)
        raise
    _report_exit(0)
