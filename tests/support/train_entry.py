"""The real Trainer in a process of its own, with test hooks, for tests and benchmarks that kill,
interrupt, fault and resume training (one process, or several ranks under torchrun).

Usage::

    python -m tests.support.train_entry --data DATA --exp EXP [--overrides JSON] [--seed N]
        [--log-every-step] [--pause-after-step N] [--pause-in-step N]
    python -m torch.distributed.run --standalone --nproc-per-node=2 -m tests.support.train_entry ...

``DATA`` holds ``fbank/`` and ``lang/``; ``EXP`` receives the run's outputs and, from rank 0,
``summary.json``. The params are :func:`~tests.support.tiny_config.tiny_params` with ``--overrides``
(dotted keys, ``{"train.optim.epochs": 3}``), assembled as the train stage assembles them; MLflow goes to
``$MLFLOW_TRACKING_URI`` (default ``sqlite:///EXP/mlflow.db``). The exit status is the train stage's
(:func:`stages.train.run_trainer`); a user error exits 2 with one line.

Hooks that observe the loop without changing what it computes:

* ``--log-every-step`` prints ``asrflow.test.step <rank> <step> <unix time> <process CPU seconds>``;
* ``--pause-after-step N`` holds the loop right after step ``N`` (before its checkpoint) and prints
  ``asrflow.test.paused N`` until a stop is requested: SIGTERM lets step ``N + 1`` finish and save;
* ``--pause-in-step N`` holds step ``N`` in flight, right before the trainer reads its stop flag:
  SIGTERM then makes step ``N`` the last.

Faults, from environment variables each ``rank:step`` or ``rank:batch``: ``ASRFLOW_TEST_FAIL_RANK_AT_STEP``
(raise after the step), ``ASRFLOW_TEST_STALL_RANK_AT_STEP`` (sleep forever after it),
``ASRFLOW_TEST_PAUSE_RANK_IN_STEP`` (hold it in flight, printing ``asrflow.test.paused R S``),
``ASRFLOW_TEST_STALL_WORKER_AT_BATCH`` / ``ASRFLOW_TEST_KILL_WORKER_AT_BATCH`` (the data worker that
builds that planned batch sleeps forever / SIGKILLs itself). Each rank prints ``asrflow.test.rank R
pid P`` when its first step is next (for a reader of the log). :class:`TrainingProcess` runs each rank
under torchrun through :mod:`~tests.support.exit_observer`, which records how it ended.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path

from asrflow.allocator import environment_with_jemalloc, jemalloc_to_preload
from asrflow.training.observers import TrainObserver
from tests.support.exit_observer import RankExit, observed, rank_exits
from tests.support.faults import NonFiniteSteps
from tests.support.mlflow_store import fresh_mlflow_store
from tests.support.processes import ChildProcess
from tests.support.repo import REPO
from tests.support.tiny_config import tiny_settings, tiny_trainer

STEP_MARK = "asrflow.test.step"
PAUSE_MARK = "asrflow.test.paused"
FAIL_ENV = "ASRFLOW_TEST_FAIL_RANK_AT_STEP"
STALL_ENV = "ASRFLOW_TEST_STALL_RANK_AT_STEP"
PAUSE_ENV = "ASRFLOW_TEST_PAUSE_RANK_IN_STEP"
WORKER_STALL_ENV = "ASRFLOW_TEST_STALL_WORKER_AT_BATCH"
WORKER_KILL_ENV = "ASRFLOW_TEST_KILL_WORKER_AT_BATCH"


def _env_hook(name: str) -> tuple[int, int] | None:
    value = os.environ.get(name)
    if not value:
        return None
    rank, where = value.split(":")
    return int(rank), int(where)


def _hold(run, mark: str) -> None:
    print(mark, file=sys.stderr, flush=True)
    while not run.stop.requested:
        time.sleep(0.02)


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


class Hooks(TrainObserver):
    """The command-line hooks and the faults the environment asks for on this rank."""

    def __init__(self, log_every_step: bool = False, pause_after_step: int | None = None, pause_in_step=None):
        self.log_every_step = log_every_step
        self.pause_after_step = pause_after_step
        self.pause_in_step = pause_in_step

    def on_start(self, run) -> None:
        rank = run.dist.rank
        os.write(2, f"asrflow.test.rank {rank} pid {os.getpid()}\n".encode())  # one write: ranks' lines never mix
        for name, kill in ((WORKER_STALL_ENV, False), (WORKER_KILL_ENV, True)):
            hook = _env_hook(name)
            if hook and hook[0] == rank:
                run.data.dataset = FaultyDataset(run.data.dataset, hook[1], kill)

    def in_step(self, run, step: int) -> None:
        if step == self.pause_in_step:
            _hold(run, f"{PAUSE_MARK} {step}")
        if (run.dist.rank, step) == _env_hook(PAUSE_ENV):
            _hold(run, f"{PAUSE_MARK} {run.dist.rank} {step}")

    def after_step(self, run, result) -> None:
        step = result.step
        if self.log_every_step:  # one write: ranks' lines never mix
            os.write(2, f"{STEP_MARK} {run.dist.rank} {step} {time.time():.6f} {time.process_time():.6f}\n".encode())
        if step == self.pause_after_step:
            _hold(run, f"{PAUSE_MARK} {step}")
        here = (run.dist.rank, step)
        if here == _env_hook(FAIL_ENV):
            raise RuntimeError(f"injected failure on rank {here[0]} at step {here[1]} ({FAIL_ENV})")
        if here == _env_hook(STALL_ENV):
            print(f"injected stall on rank {here[0]} at step {here[1]} ({STALL_ENV})", file=sys.stderr, flush=True)
            while True:
                time.sleep(1)


def faulty_tiny_trainer(data: Path, exp: Path, overrides: dict, tracking_uri: str, *, seed: int = 42, observers=()):
    """The tiny Trainer with ``overrides`` on ``data``, writing under ``exp``; ``nonfinite_steps`` and
    ``nonfinite_ranks`` in ``overrides`` go to :class:`~tests.support.faults.NonFiniteSteps`."""
    overrides = dict(overrides)
    nonfinite = NonFiniteSteps(overrides.pop("nonfinite_steps", ()), overrides.pop("nonfinite_ranks", ()))
    return tiny_trainer(data, exp, overrides, seed=seed, tracking_uri=tracking_uri, observers=[*observers, nonfinite])


def train_in_process(data: Path, exp: Path, overrides: dict, tracking_uri: str, *, seed: int = 42) -> dict:
    """Run the tiny Trainer in this process (no data workers unless asked): for quick checks."""
    return faulty_tiny_trainer(data, exp, overrides, tracking_uri, seed=seed).run().summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--exp", type=Path, required=True)
    parser.add_argument("--overrides", default="{}", help="JSON object of params overrides (dotted keys)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--log-every-step", action="store_true")
    parser.add_argument("--pause-after-step", type=int, default=None)
    parser.add_argument("--pause-in-step", type=int, default=None)
    args = parser.parse_args(argv)

    from asrflow.errors import exit_on_user_error
    from asrflow.logs import setup_logging
    from stages.train import run_trainer

    setup_logging(logging.INFO)
    args.exp.mkdir(parents=True, exist_ok=True)
    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(args.exp / 'mlflow.db').resolve()}"
    hooks = Hooks(args.log_every_step, args.pause_after_step, args.pause_in_step)
    trainer = faulty_tiny_trainer(
        args.data, args.exp, json.loads(args.overrides), uri, seed=args.seed, observers=[hooks]
    )
    code, outcome = exit_on_user_error(run_trainer)(trainer)
    if outcome is not None and trainer.dist.is_main:
        (args.exp / "summary.json").write_text(json.dumps(outcome.summary))
        print(json.dumps({"summary": outcome.summary}), flush=True)
    raise SystemExit(code)


class TrainingProcess(ChildProcess):
    """This module run on ``data`` into ``exp`` (cwd), in a session of its own; ``ranks`` > 1 runs it
    under torchrun with gloo (and sets ``run.nproc_per_node`` to ``ranks`` unless ``overrides`` do), each
    rank under :mod:`~tests.support.exit_observer` recording into :attr:`exits` (:meth:`rank_exits`). Steps
    are always logged (:meth:`steps`). MLflow goes to ``tracking_uri``, else to ``EXP/mlflow.db`` (a fresh
    store when there is none yet)."""

    def __init__(
        self,
        data: Path,
        exp: Path,
        overrides: dict,
        *,
        log_path: Path | None = None,
        ranks: int = 1,
        pause_after_step: int | None = None,
        pause_in_step: int | None = None,
        tracking_uri: str | None = None,
        seed: int = 42,
        env: dict[str, str] | None = None,
    ):
        self.exp = Path(exp)
        self.exp.mkdir(parents=True, exist_ok=True)
        if tracking_uri is None:
            store = self.exp / "mlflow.db"
            tracking_uri = f"sqlite:///{store.resolve()}" if store.is_file() else fresh_mlflow_store(self.exp)
        if ranks > 1:  # the params say how many processes run, as the train stage's do
            overrides = {"run.nproc_per_node": ranks, **overrides}
        args = ["--data", str(data), "--exp", str(self.exp), "--overrides", json.dumps(overrides)]
        args += ["--seed", str(seed), "--log-every-step"]
        if pause_after_step is not None:
            args += ["--pause-after-step", str(pause_after_step)]
        if pause_in_step is not None:
            args += ["--pause-in-step", str(pause_in_step)]
        module = ["-m", "tests.support.train_entry", *args]
        started = time.monotonic_ns()
        #: This job's rank records (one folder per job: a rerun in ``exp`` starts with none).
        self.exits = self.exp / "exits" / str(started)
        if ranks > 1:
            from dataclasses import replace

            from asrflow.launch.torchrun import torchrun_command

            run = replace(tiny_settings().run, nproc_per_node=ranks)
            command = torchrun_command(run, observed(self.exits, module))
        else:
            command = [sys.executable, *module]
        full_env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "GIT_PYTHON_REFRESH": "quiet",
            "PYTHONUNBUFFERED": "1",
            "GLOO_SOCKET_IFNAME": "lo",
            "MLFLOW_TRACKING_URI": tracking_uri,
            **(env or {}),
        }
        shipped = tiny_settings()
        jemalloc = jemalloc_to_preload(
            overrides.get("run.allocator", shipped.run.allocator),
            overrides.get("train.optim.precision", shipped.train.optim.precision),
        )
        if jemalloc is not None:  # the malloc the train stage would run under
            full_env = environment_with_jemalloc(full_env, jemalloc)
        log_path = log_path or self.exp / f"train-{started}.log"
        super().__init__(command, log_path=log_path, env=full_env, cwd=self.exp)

    def steps(self) -> list[tuple[int, float, float]]:
        """``(global step, unix time, process CPU seconds)`` of every step finished so far."""
        pattern = re.compile(rf"^{re.escape(STEP_MARK)} 0 (\d+) ([\d.]+) ([\d.]+)$", re.MULTILINE)
        return [(int(step), float(at), float(cpu)) for step, at, cpu in pattern.findall(self.log())]

    def rank_exits(self) -> dict[int, RankExit]:
        """Each torchrun rank's pid, session and, once it ended, exit status, as its observer saw them."""
        return rank_exits(self.exits)

    def wait(self, timeout: float | None = 300.0) -> int:
        return super().wait(timeout)

    def wait_paused(self, timeout: float = 300.0) -> None:
        """Block until the process holds at a pause; raise if it ends or ``timeout`` passes first."""
        self.wait_for(PAUSE_MARK, timeout)


def run_training(data: Path, exp: Path, overrides: dict, *, log_path: Path, expect: int = 0, **kwargs) -> str:
    """Run to the end; assert the exit status is ``expect``; return the log."""
    process = TrainingProcess(data, exp, overrides, log_path=log_path, **kwargs)
    code = process.wait()
    assert code == expect, f"exit {code}, expected {expect}:\n{process.log()}"
    return process.log()


if __name__ == "__main__":
    main()
