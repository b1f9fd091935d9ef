"""train stage: Conformer-CTC training with step checkpoints, exact resume and MLflow logging.

Reads the features stage's output (--fbank, data/fbank/), the tokenizer stage's (--lang,
data/lang/) and params.yaml (`seed`, `features:`, `train:`), and with train.finetune.init_from
a model under pretrained/ or an MLflow model URI (docs/training.md, "Fine-tuning"); writes into --exp (exp/):
model.pt (a self-contained bundle) and plots/train_loss.csv; keeps checkpoints in
checkpoints/ across runs, so running again after an interruption resumes (in a queued DVC
experiment, checkpoints/ links to the queuing repository's exp/sweeps/<params digest>/,
which outlives DVC's temporary workspace: asrflow.training.sweep). With
run.nproc_per_node > 1 or run.nnodes > 1 it re-launches itself under torchrun; on the
machines other than the first of a multi-node run, start it with --node-rank; a cluster job
sets the run's node count and rendezvous with $ASRFLOW_NNODES and $ASRFLOW_RDZV_ENDPOINT.
Exit codes (asrflow.training.outcome.EXIT_CODES): 0 finished, 2 a mistake to fix, 70 another rank
failed, 71 a data worker died, 75 stopped by SIGTERM/SIGINT after saving a checkpoint, 124 stalled;
after 70, 71 and 75, run again to resume.

Start-up: training in bf16 with run.allocator auto (the default) and jemalloc installed, the stage first
re-executes itself with jemalloc preloaded (asrflow.allocator.use_allocator), before torch is imported.
MLflow is imported and its run opened in a background thread once the first step is done (its points are
kept, with their times, until then). run.num_workers: auto builds the batches in this process when features
are precomputed (a batch loads in milliseconds; each spawned worker would import torch again) and starts 2
spawned workers with features.on_the_fly: true; an integer sets the number of workers.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from asrflow.allocator import malloc_in_use, use_allocator
from asrflow.errors import AsrflowError, exit_on_user_error
from asrflow.launch.multinode import rendezvous_from_environment
from asrflow.launch.torchrun import check_launch, needs_torchrun, torchrun_command
from asrflow.logs import setup_logging
from asrflow.params import flatten, load_params
from asrflow.tracking.store import check_tracking_uri
from asrflow.training.sweep import checkpoints_outside_temp_workspace

if TYPE_CHECKING:
    from asrflow.training.observers import TrainObserver
    from asrflow.training.outcome import TrainOutcome
    from asrflow.training.trainer import Trainer

#: Named after this module's import path (``__name__`` is ``__main__`` under ``python -m``).
logger = logging.getLogger("stages.train")


def input_folder(path: str, option: str, stage: str) -> Path:
    """``path`` as a folder another stage wrote; a missing one is a user error naming ``option``."""
    folder = Path(path)
    if not folder.is_dir():
        raise AsrflowError(f"{option} {folder}: no such folder; run the {stage} stage first or pass its output folder")
    return folder


def run_trainer(trainer: Trainer) -> tuple[int, TrainOutcome | None]:
    """Run ``trainer`` with SIGTERM/SIGINT making the step in flight the last; the exit code for how it ended
    (from :data:`~asrflow.training.outcome.EXIT_CODES`) and its outcome (None after a failure).
    A user's mistake (:class:`AsrflowError`) propagates: the stage's wrapper prints it and exits 2.

    For a process's entry point: once the run has ended, SIGTERM/SIGINT are ignored until the process exits,
    so that the signal torchrun sends the other ranks when one has exited cannot turn the exit code already
    decided (75 after a stop, with its checkpoint saved) into death by that signal. Ignored by the kernel,
    not by a Python handler: the interpreter puts back the default action of every signal it handles as it
    shuts down, while the process still has its modules (torch's among them) to tear down."""
    from asrflow.training.outcome import Outcome, TrainingFailure, exit_code  # imports torch: see main

    def on_signal(signum, _frame) -> None:
        logger.warning("received %s: finishing the current step, then saving a checkpoint", signal.Signals(signum).name)
        trainer.request_stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        outcome = trainer.run()
    except TrainingFailure as failure:
        logger.error("stopping: %s; run the same command again to resume from the last checkpoint", failure)
        return exit_code(failure), None
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
    if outcome.outcome is Outcome.STOPPED:
        logger.warning(
            "stopped at step %d with a checkpoint saved; run the same command again to resume",
            outcome.summary["steps"],
        )
    else:
        logger.info("training done: %s", outcome.summary)
    return exit_code(outcome.outcome), outcome


@exit_on_user_error
def main(
    argv: list[str] | None = None, observers: Sequence[TrainObserver] = (), *, process_entry: bool = False
) -> None:
    """The stage; ``observers`` watch the run (tests inject faults through them). As the ``process_entry`` (run
    as a script) it may first re-execute the process with jemalloc preloaded (``run.allocator``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml", help="params file (default: %(default)s)")
    parser.add_argument("--fbank", default="data/fbank", help="features stage output (default: %(default)s)")
    parser.add_argument("--lang", default="data/lang", help="tokenizer stage output (default: %(default)s)")
    parser.add_argument("--exp", default="exp", help="experiment folder (default: %(default)s)")
    parser.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="this machine's rank in a multi-node run (overrides run.node_rank; 0 .. run.nnodes-1)",
    )
    args = parser.parse_args(argv)
    setup_logging()
    params = load_params(args.params)
    if process_entry:  # read before the sections are checked, which needs torch; checked there too
        flat = flatten(params)
        use_allocator(flat.get("run.allocator", "auto"), flat.get("train.optim.precision", "auto"))
    # Imported only now: torch takes seconds to import, which a re-execution above would have paid twice.
    from asrflow.training.assemble import build_trainer
    from asrflow.training.config import TrainPaths
    from asrflow.training.init_model import check_declared
    from asrflow.training.settings import TrainingSettings

    logger.info("train stage started (pid %d, malloc: %s)", os.getpid(), malloc_in_use())  # bench.startup's mark
    overrides = rendezvous_from_environment()  # a cluster job's allocation, for that job only
    if args.node_rank is not None:
        overrides["node_rank"] = args.node_rank
    settings = TrainingSettings.from_params(params, **overrides)
    check_declared(settings.train.finetune.init_from)  # a model file is a declared dependency: under pretrained/
    check_tracking_uri()  # an unreachable MLFLOW_TRACKING_URI stops here, before any training
    if needs_torchrun(settings.run):
        check_launch(settings.run)
        module = ["-m", "stages.train", *(argv if argv is not None else sys.argv[1:])]
        command = torchrun_command(settings.run, module)
        logger.info("launching %s", " ".join(command))
        os.execvp(command[0], command)
    fbank_dir = input_folder(args.fbank, "--fbank", "features")
    lang_dir = input_folder(args.lang, "--lang", "tokenizer")
    paths = TrainPaths.under(args.exp, fbank_dir=fbank_dir, lang_dir=lang_dir)
    main_process = os.environ.get("RANK", "0") == "0"
    params = settings.params
    with checkpoints_outside_temp_workspace(paths.checkpoint_dir, params, main_process=main_process) as folder:
        trainer = build_trainer(settings, replace(paths, checkpoint_dir=folder), observers=observers)
        code, _ = run_trainer(trainer)
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    main(process_entry=True)
