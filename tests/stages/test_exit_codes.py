"""The train stage's exit codes: one table in the code (asrflow.training.outcome.EXIT_CODES), which the
README's table is generated from, and every outcome and failure maps through it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from asrflow.errors import EXIT_USER_ERROR, AsrflowError
from asrflow.training.outcome import (
    EXIT_CODES,
    DataWorkerDied,
    Outcome,
    PeerFailed,
    Stalled,
    TrainingFailure,
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


def test_every_code_is_distinct_and_each_ending_has_one():
    assert len({row.code for row in EXIT_CODES}) == len(EXIT_CODES)
    assert exit_code(Outcome.FINISHED) == 0
    assert exit_code(Outcome.STOPPED) == 75
    assert exit_code(AsrflowError("x")) == EXIT_USER_ERROR == 2
    assert exit_code(PeerFailed("x")) == 70
    assert exit_code(DataWorkerDied("x")) == 71
    assert exit_code(Stalled) == 124
    with pytest.raises(KeyError):
        exit_code(ValueError("a bug has no exit code of its own"))


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
