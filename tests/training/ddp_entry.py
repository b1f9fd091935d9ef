"""Run one tiny ``Trainer`` on the yesno test data; tests/training/test_ddp.py starts it under torchrun.

Usage::

    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/training/ddp_entry.py SPEC.json
    python tests/training/ddp_entry.py SPEC.json            # one process

``SPEC.json`` holds ``data`` (a folder made by the ``yesno_data`` fixture), ``exp`` (the
output folder), ``config`` (overrides for ``tiny_train_config``) and ``tracking_uri``.
Rank 0 writes the run's summary to ``<exp>/summary.json``. A user error exits 2 with one
line, as the train stage does.

Test hooks (environment variables, read only by this script; the library has none):

``ASRFLOW_TEST_FAIL_RANK_AT_STEP=rank:step``
    that rank raises ``RuntimeError`` right after finishing that optimizer step.
``ASRFLOW_TEST_STALL_RANK_AT_STEP=rank:step``
    that rank sleeps forever right after finishing that optimizer step (the stall
    watchdog or the collective timeout must end the job).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest's helpers

from conftest import tiny_train_config, train_paths  # noqa: E402

from asrflow.data.features import FeatureConfig  # noqa: E402
from asrflow.errors import exit_on_user_error  # noqa: E402
from asrflow.logs import setup_logging  # noqa: E402
from asrflow.training.trainer import Trainer  # noqa: E402

FAIL_ENV = "ASRFLOW_TEST_FAIL_RANK_AT_STEP"
STALL_ENV = "ASRFLOW_TEST_STALL_RANK_AT_STEP"


def _hook(name: str) -> tuple[int, int] | None:
    value = os.environ.get(name)
    if not value:
        return None
    rank, step = value.split(":")
    return int(rank), int(step)


class HookedTrainer(Trainer):
    """A Trainer whose ranks can be made to fail or stall after a given step."""

    def _record(self, result, waited, elapsed) -> None:
        super()._record(result, waited, elapsed)
        here = (self.dist.rank, self.progress.global_step)
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
    trainer = HookedTrainer(
        tiny_train_config(**spec.get("config", {})), FeatureConfig(), int(spec.get("seed", 42)), {},
        train_paths(Path(spec["data"]), exp), tracking_uri=spec.get("tracking_uri"),
    )
    summary = trainer.run()
    if trainer.dist.is_main:
        (exp / "summary.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main(sys.argv[1])
