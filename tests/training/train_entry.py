"""Run the real Trainer in its own process, for tests that kill, interrupt and resume training.

Usage::

    python tests/training/train_entry.py --data DATA --exp EXP [--overrides JSON] [--seed N]
                                         [--log-every-step] [--pause-after-step N] [--pause-in-step N]

``DATA`` holds ``fbank/`` and ``lang/`` (see the ``yesno_data`` fixture); ``EXP`` receives
``checkpoints/``, ``model.pt`` and ``plots/``. The config is ``tiny_train_config(**overrides)``
from ``tests/conftest.py``. MLflow goes to ``$MLFLOW_TRACKING_URI``, or to
``sqlite:///EXP/mlflow.db`` when that is unset. The exit status is the train stage's
(:func:`stages.train.run_trainer`, its SIGTERM/SIGINT handlers included): 0 when training
finished, 75 after SIGTERM/SIGINT (checkpoint saved), 2 for a user error.

Three test hooks observe the loop without changing what it computes:

* ``--log-every-step`` prints ``asrflow.test.step <global step> <unix time> <CPU seconds>``
  to stderr after every optimizer step (CPU time of this process, data workers excluded);
* ``--pause-after-step N`` stops the loop right after step ``N`` is recorded (before any
  checkpoint of that step) and prints ``asrflow.test.paused N``: the process then waits
  for a signal. SIGKILL loses step ``N`` and any step after the last checkpoint; SIGTERM
  or SIGINT lets the loop go on, so the trainer finishes step ``N + 1``, saves and exits 75;
* ``--pause-in-step N`` holds step ``N`` in flight, right before the trainer reads its stop
  flag (the observers' ``in_step`` point, just before the step's all-reduce), and prints
  ``asrflow.test.paused N``. SIGTERM or SIGINT then makes step ``N`` the last: it is
  finished, saved, and the trainer exits 75.

:class:`TrainingProcess` launches this script from tests and benchmarks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
sys.path[:0] = [str(TESTS), str(REPO)]

from conftest import fresh_mlflow_store  # noqa: E402, F401  (imported from here by the training tests)

from asrflow.training.observers import TrainObserver  # noqa: E402

#: Prefix of the per-step line written with ``--log-every-step``.
STEP_MARK = "asrflow.test.step"
#: Line written when ``--pause-after-step`` holds the loop.
PAUSE_MARK = "asrflow.test.paused"


class StepHooks(TrainObserver):
    """The hooks of ``--log-every-step``, ``--pause-after-step`` and ``--pause-in-step``."""

    def __init__(self, log_every_step: bool, pause_after_step: int | None, pause_in_step: int | None):
        self.log_every_step = log_every_step
        self.pause_after_step = pause_after_step
        self.pause_in_step = pause_in_step

    def in_step(self, run, step: int) -> None:
        if step == self.pause_in_step:
            _wait_for_stop(run, step)

    def after_step(self, run, result) -> None:
        step = result.step
        if self.log_every_step:
            print(f"{STEP_MARK} {step} {time.time():.6f} {time.process_time():.6f}", file=sys.stderr, flush=True)
        if step == self.pause_after_step:
            _wait_for_stop(run, step)


def _wait_for_stop(run, step: int) -> None:
    print(f"{PAUSE_MARK} {step}", file=sys.stderr, flush=True)
    while not run.stop.requested:
        time.sleep(0.02)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--exp", type=Path, required=True)
    parser.add_argument("--overrides", default="{}", help="JSON object of TrainConfig overrides")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--log-every-step", action="store_true")
    parser.add_argument("--pause-after-step", type=int, default=None)
    parser.add_argument("--pause-in-step", type=int, default=None)
    args = parser.parse_args(argv)

    from conftest import tiny_train_config, train_paths

    from asrflow.data.features import FeatureConfig
    from asrflow.errors import exit_on_user_error
    from asrflow.logs import setup_logging
    from asrflow.training.trainer import Trainer
    from stages.train import run_trainer

    setup_logging(logging.INFO)
    config = tiny_train_config(**json.loads(args.overrides))
    features = FeatureConfig(num_jobs=1)
    all_params = {"seed": args.seed, "features": asdict(features), "train": asdict(config)}
    tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(args.exp / 'mlflow.db').resolve()}"
    args.exp.mkdir(parents=True, exist_ok=True)
    hooks = StepHooks(args.log_every_step, args.pause_after_step, args.pause_in_step)
    trainer = Trainer(
        config,
        features,
        seed=args.seed,
        all_params=all_params,
        paths=train_paths(args.data, args.exp),
        tracking_uri=tracking_uri,
        observers=[hooks],
    )
    code, outcome = exit_on_user_error(run_trainer)(trainer)
    if code == 0:
        print(json.dumps({"summary": outcome.summary}), flush=True)
    raise SystemExit(code)


# ---------------------------------------------------------------------- launching it


class TrainingProcess:
    """One run of this script in its own session (so a signal can reach it and its data workers).

    stdout and stderr go to ``log_path``; poll it with :meth:`steps` or :meth:`wait_paused`.
    """

    def __init__(
        self,
        data: Path,
        exp: Path,
        overrides: dict,
        *,
        log_path: Path,
        pause_after_step: int | None = None,
        pause_in_step: int | None = None,
        tracking_uri: str | None = None,
        seed: int = 42,
    ):
        self.exp = Path(exp)
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--data",
            str(data),
            "--exp",
            str(self.exp),
            "--overrides",
            json.dumps(overrides),
            "--seed",
            str(seed),
            "--log-every-step",
        ]
        if pause_after_step is not None:
            command += ["--pause-after-step", str(pause_after_step)]
        if pause_in_step is not None:
            command += ["--pause-in-step", str(pause_in_step)]
        env = {**os.environ, "GIT_PYTHON_REFRESH": "quiet", "PYTHONUNBUFFERED": "1"}
        if tracking_uri:
            env["MLFLOW_TRACKING_URI"] = tracking_uri
        self.started = time.time()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=self.exp.parent,
                start_new_session=True,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def steps(self) -> list[tuple[int, float, float]]:
        """``(global step, unix time, process CPU seconds)`` of every step finished so far."""
        pattern = re.compile(rf"^{re.escape(STEP_MARK)} (\d+) ([\d.]+) ([\d.]+)$", re.MULTILINE)
        return [(int(step), float(at), float(cpu)) for step, at, cpu in pattern.findall(self.log())]

    def wait_paused(self, timeout: float = 300.0) -> None:
        """Block until the process holds at its pause (after or in a step); fail if it ends or times out."""
        deadline = time.monotonic() + timeout
        while PAUSE_MARK not in self.log():
            if self.process.poll() is not None:
                raise AssertionError(f"training ended (exit {self.process.returncode}) before pausing:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"training did not pause within {timeout} s:\n{self.log()}")
            time.sleep(0.05)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the trainer and its data workers (as a batch scheduler or Ctrl-C would)."""
        os.killpg(self.process.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole process group (a power cut, as far as the run can tell) and reap it."""
        with contextlib.suppress(ProcessLookupError):
            self.signal(signal.SIGKILL)
        self.process.wait(timeout=60)

    def wait(self, timeout: float = 300.0) -> int:
        """The exit status; on a timeout the group is killed and an AssertionError raised."""
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"training did not end within {timeout} s:\n{self.log()}") from None
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)  # orphaned data workers, if any


def run_training(data: Path, exp: Path, overrides: dict, *, log_path: Path, expect: int = 0, **kwargs) -> str:
    """Run to the end; assert the exit status is ``expect``; return the log."""
    process = TrainingProcess(data, exp, overrides, log_path=log_path, **kwargs)
    code = process.wait()
    assert code == expect, f"exit {code}, expected {expect}:\n{process.log()}"
    return process.log()


def train_in_process(data: Path, exp: Path, overrides: dict, tracking_uri: str, *, seed: int = 42) -> dict:
    """Run the Trainer in this process (no data workers unless asked): for quick checks."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from conftest import tiny_train_config, train_paths

    from asrflow.data.features import FeatureConfig
    from asrflow.training.trainer import Trainer

    config = tiny_train_config(**overrides)
    features = FeatureConfig(num_jobs=1)
    all_params = {"seed": seed, "features": asdict(features), "train": asdict(config)}
    return (
        Trainer(
            config, features, seed=seed, all_params=all_params, paths=train_paths(data, exp), tracking_uri=tracking_uri
        )
        .run()
        .summary
    )


if __name__ == "__main__":
    main()
