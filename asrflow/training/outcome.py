"""How a training run ends: an outcome it returns, or a typed error of the job around it, and the one
table of the train stage's exit codes for each (the README's table is tested against it)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch.distributed

from asrflow.errors import EXIT_USER_ERROR, AsrflowError


class Outcome(enum.Enum):
    """How :meth:`~asrflow.training.trainer.Trainer.run` returned."""

    FINISHED = "finished"
    STOPPED = "stopped"


@dataclass(frozen=True)
class TrainOutcome:
    """What a run returned: its outcome and a summary (steps, best dev loss, skipped steps, ...)."""

    outcome: Outcome
    summary: dict = field(default_factory=dict)


class TrainingFailure(Exception):
    """Something outside the training code failed; the message is one line naming the cause."""


class PeerFailed(TrainingFailure):
    """A collective with the other ranks failed or timed out: another rank failed, stalled or vanished."""


class DataWorkerDied(TrainingFailure):
    """A data worker of this rank died (often the kernel's out-of-memory killer)."""


class Stalled(TrainingFailure):
    """No step finished within ``run.stall_timeout_s``. Never raised: the stall watchdog ends the process
    itself, since the main thread may be stuck inside a collective."""


@dataclass(frozen=True)
class ExitCode:
    """One row of the exit-code table: the code, what ends with it, what it means and what to do."""

    code: int
    ending: Outcome | type[BaseException]
    meaning: str
    what_to_do: str


#: The train stage's exit codes; the stage and the stall watchdog read them here and nowhere else.
EXIT_CODES = (
    ExitCode(0, Outcome.FINISHED, "done", "-"),
    ExitCode(
        EXIT_USER_ERROR,
        AsrflowError,
        "a mistake you can fix: a param, a missing input, too much bad data",
        "read the one-line message",
    ),
    ExitCode(
        70, PeerFailed, "another rank of a distributed run failed", "run the same command again: training resumes"
    ),
    ExitCode(
        71,
        DataWorkerDied,
        "a data worker died (e.g. the OOM killer)",
        "lower `train.data.max_duration_s` or `run.num_workers`, run again",
    ),
    ExitCode(
        75,
        Outcome.STOPPED,
        "stopped by SIGTERM/SIGINT after saving a checkpoint",
        "run the same command again to resume",
    ),
    ExitCode(
        124,
        Stalled,
        "a step stalled longer than `run.stall_timeout_s`",
        "the log holds every thread's stack; run again",
    ),
)


def exit_code(ending: Outcome | BaseException | type[BaseException]) -> int:
    """The code of ``ending`` (an outcome, an error or its class) in :data:`EXIT_CODES`."""
    for row in EXIT_CODES:
        if ending is row.ending:
            return row.code
        if isinstance(row.ending, type) and (
            isinstance(ending, row.ending) or (isinstance(ending, type) and issubclass(ending, row.ending))
        ):
            return row.code
    raise KeyError(f"no exit code for {ending!r}")


#: Words in the messages of gloo and NCCL errors that mean a peer is gone or late.
_COLLECTIVE_SIGNS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "broken pipe")


def as_failure(error: BaseException, *, distributed: bool) -> TrainingFailure | None:
    """``error`` as the failure of the job around this process it stands for, or None for any other error
    (a bug, which keeps its traceback)."""
    text = str(error)
    # A worker killed mid-transfer breaks the loader's pipe; one killed between batches the DataLoader names.
    lost_pipe = isinstance(error, ConnectionResetError | BrokenPipeError | EOFError)
    if lost_pipe or (isinstance(error, RuntimeError) and "DataLoader worker" in text):
        cause = f"{type(error).__name__}: {text}" if lost_pipe else text.splitlines()[0]
        return DataWorkerDied(
            f"a data worker died ({cause}); look for the out-of-memory killer in the kernel log (dmesg), "
            "lower run.num_workers or train.data.max_duration_s"
        )
    if not distributed:
        return None
    lowered = text.lower()
    if isinstance(error, torch.distributed.DistError) or (
        isinstance(error, RuntimeError) and any(sign in lowered for sign in _COLLECTIVE_SIGNS)
    ):
        return PeerFailed(
            f"a collective with the other ranks failed ({text.splitlines()[0][:300]}): "
            "another rank failed, stalled or was killed (its own message says which)"
        )
    return None
