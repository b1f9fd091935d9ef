"""The train stage's exit codes: one table in the code (asrflow.training.outcome.EXIT_CODES), which the
README's table is generated from, and every outcome and failure maps through it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from asrflow.training.outcome import (
    EXIT_CODES,
    DataWorkerDied,
    Outcome,
    PeerFailed,
    TrainingFailure,
    TrainOutcome,
    as_failure,
    exit_code,
)

REPO = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- exit codes:", "<!-- end of exit codes -->"


def exit_code_table() -> str:
    """The README's table, from :data:`EXIT_CODES`."""
    rows = [f"| {row.code} | {row.meaning} | {row.what_to_do} |" for row in EXIT_CODES]
    return "\n".join(["| exit code | meaning | what to do |", "|---|---|---|", *rows])


def test_the_readme_table_is_the_codes_table():
    readme = (REPO / "README.md").read_text()
    block = readme[readme.index(BEGIN) : readme.index(END)]
    assert block.split("\n", 1)[1].strip() == exit_code_table()


def documented_codes() -> dict[str, int]:
    """The train stage's docstring's exit codes, each ending's words -> its code ("Exit codes (...): 0 finished,
    2 a mistake to fix, ...;" in stages/train.py)."""
    import stages.train

    text = " ".join(stages.train.__doc__.split())
    listed = text.split("Exit codes (asrflow.training.outcome.EXIT_CODES): ", 1)[1].split(";", 1)[0]
    return {words: int(code) for code, words in (item.split(" ", 1) for item in listed.split(", "))}


class EndsWith:
    """A trainer whose run ends as given: an outcome it returns, or an error it raises."""

    def __init__(self, ending: Outcome | BaseException):
        self.ending = ending

    def run(self) -> TrainOutcome:
        if isinstance(self.ending, BaseException):
            raise self.ending
        return TrainOutcome(self.ending, {"steps": 5})

    def request_stop(self) -> None:
        raise AssertionError("no signal arrives in this test")


#: A process whose step never finishes, watched by the stall watchdog the trainer runs its steps under.
_STALLED = """
import time
from asrflow.training.monitoring import StallWatchdog

with StallWatchdog(0.5, label="[rank 0] "):
    time.sleep(60)
raise SystemExit("the watchdog let a stalled step go on")
"""


def test_each_way_a_training_run_ends_exits_with_the_code_the_stage_documents(tmp_path):
    """Runs that end each way, through the stage's own code: :func:`run_trainer` for what a trainer returns or
    raises (a gloo error and a killed data worker as the trainer turns them into failures), the stage's process
    for a user's mistake, the stall watchdog's process for a stalled step."""
    from stages.train import run_trainer

    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    worker = RuntimeError("DataLoader worker (pid 9) is killed by signal: Killed.")
    endings = {
        "finished": EndsWith(Outcome.FINISHED),
        "stopped": EndsWith(Outcome.STOPPED),
        "another rank failed": EndsWith(as_failure(gloo, distributed=True)),
        "a data worker died": EndsWith(as_failure(worker, distributed=False)),
    }
    found = {name: run_trainer(trainer)[0] for name, trainer in endings.items()}
    missing = [sys.executable, "-m", "stages.train", "--params", str(tmp_path / "missing.yaml")]
    mistake = subprocess.run(missing, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "params file" in mistake.stderr, mistake.stderr
    found["a mistake to fix"] = mistake.returncode
    stalled = subprocess.run([sys.executable, "-c", _STALLED], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "no training step finished" in stalled.stderr, stalled.stderr[-2000:]
    found["stalled"] = stalled.returncode

    documented = documented_codes()
    named = {
        next((words for words in documented if words.startswith(name)), name): code for name, code in found.items()
    }
    assert named == documented
    assert len(set(found.values())) == len(found)  # each ending tells itself apart
    with pytest.raises(ValueError, match="a bug"):  # a bug has no exit code: it keeps its traceback
        run_trainer(EndsWith(ValueError("a bug")))


def test_failures_around_the_process_become_typed_errors():
    assert isinstance(as_failure(EOFError(), distributed=False), DataWorkerDied)
    killed = RuntimeError("DataLoader worker (pid 9) is killed by signal: Killed.")
    assert isinstance(as_failure(killed, distributed=False), DataWorkerDied)
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    assert as_failure(gloo, distributed=False) is None  # alone, there is no peer to blame
    failure = as_failure(gloo, distributed=True)
    assert isinstance(failure, PeerFailed) and isinstance(failure, TrainingFailure)
    assert re.search(r"a collective with the other ranks failed \(.*Connection closed", str(failure))
    assert as_failure(ValueError("a bug"), distributed=True) is None


def test_the_stage_and_the_watchdog_use_no_literal_exit_codes():
    """No other module of the training path spells a code: the table is the one place."""
    for path in [REPO / "stages" / "train.py", *sorted((REPO / "asrflow" / "training").glob("*.py"))]:
        if path.name == "outcome.py":
            continue
        text = path.read_text()
        assert not re.search(r"SystemExit\(\d|_exit\(\d|EXIT_[A-Z_]+ = \d", text), path


#: A process whose training run has ended (stopped, 75) and which is sent SIGTERM while the interpreter shuts
#: down, after Python has put back the default action of every signal it had a handler for: what torchrun
#: does to the other ranks once one has exited. The trainer is a stand-in whose run has already ended: the
#: test is of the signal handling around any run.
_SIGNALLED_WHILE_EXITING = """
import os, signal, sys, time
sys.path.insert(0, {repo!r})
from stages.train import run_trainer
from asrflow.training.outcome import Outcome, TrainOutcome

class RunEnded:
    def run(self):
        return TrainOutcome(Outcome.STOPPED, {{"steps": 5}})

    def request_stop(self):
        raise AssertionError("no signal arrived during the run")

class SignalledAtShutdown:
    def __del__(self):  # runs as the interpreter clears this module, after its signal handlers are gone
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)

torchrun = SignalledAtShutdown()
code, _ = run_trainer(RunEnded())
raise SystemExit(code)
"""


def test_a_signal_while_the_process_exits_keeps_the_exit_code_decided():
    script = _SIGNALLED_WHILE_EXITING.format(repo=str(REPO))
    ended = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert ended.returncode == exit_code(Outcome.STOPPED), (ended.returncode, ended.stderr)
