"""Run the real Trainer in its own process, for tests that kill, interrupt and resume training.

Usage::

    python tests/training/train_entry.py --data DATA --exp EXP [--overrides JSON] [--seed N]

``DATA`` holds ``fbank/`` and ``lang/`` (see the ``yesno_data`` fixture), ``EXP`` receives
``checkpoints/``, ``model.pt`` and ``plots/``. The config is ``tiny_train_config(**overrides)``
from ``tests/conftest.py``. MLflow goes to ``$MLFLOW_TRACKING_URI``, or to
``sqlite:///EXP/mlflow.db`` when that is unset. The exit status is the trainer's: 0 when
training finished, 75 after SIGTERM/SIGINT (checkpoint saved), 2 for a user error.

Logging goes to stderr as in the train stage, so tests can watch "step N" lines; with
``--log-every-step`` every step is logged (``asrflow.test.step <n> <time>``), which the
kill tests and ``bench/resume_cost.py`` use to know where training is.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS.parent))

#: Prefix of the per-step log line written with ``--log-every-step``.
STEP_MARK = "asrflow.test.step"


def _log_every_step() -> None:
    """Print ``STEP_MARK <global step> <unix time>`` to stderr after every optimizer step."""
    from asrflow.training import trainer

    original = trainer.Trainer._record

    def record(self, result, waited, elapsed):
        original(self, result, waited, elapsed)
        print(f"{STEP_MARK} {self.progress.global_step} {time.time():.6f}", file=sys.stderr, flush=True)

    trainer.Trainer._record = record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--exp", type=Path, required=True)
    parser.add_argument("--overrides", default="{}", help="JSON object of TrainConfig overrides")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--log-every-step", action="store_true")
    args = parser.parse_args(argv)

    from asrflow.errors import exit_on_user_error
    from asrflow.logs import setup_logging

    setup_logging(logging.INFO)
    from conftest import tiny_train_config, train_paths

    from asrflow.data.features import FeatureConfig
    from asrflow.training.trainer import Trainer

    if args.log_every_step:
        _log_every_step()
    overrides = json.loads(args.overrides)
    config = tiny_train_config(**overrides)
    features = FeatureConfig(num_jobs=1)
    all_params = {"seed": args.seed, "features": asdict(features), "train": asdict(config)}
    tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(args.exp / 'mlflow.db').resolve()}"
    args.exp.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(config, features, args.seed, all_params, train_paths(args.data, args.exp), tracking_uri)
    summary = exit_on_user_error(trainer.run)()
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
