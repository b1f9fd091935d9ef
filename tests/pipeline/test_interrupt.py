"""A run killed with SIGKILL mid-training (a power cut, the OOM killer, a preempted node) or
stopped with Ctrl-C (SIGINT to the terminal's whole process group) is finished by running
the same command again: only train and evaluate run, and training goes on from its last
checkpoint instead of starting over; after Ctrl-C, from the very step it stopped at.

Each test changes train params in its tool's finished copy (a new training run), starts the
tool in its own process group, signals the whole group once step 50's checkpoint is saved,
and runs the tool again. The copies stay up to date with the new params afterwards.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.support.pipeline_tools import (
    LISTING,
    ToolError,
    dvc_ran_stages,
    dvc_status,
    run,
    set_params,
    snakemake_jobs,
    tail,
)
from tests.support.processes import ChildProcess
from tests.support.repo import tool_env

pytestmark = pytest.mark.pipeline

# A new lr makes the finished run's checkpoints useless (a fresh run); fewer epochs keep it short.
LR_FACTOR = 0.8
SHORT_EPOCHS = 8
KILL_AFTER_STEP = 50
CHECKPOINT_SAVED = re.compile(r"saved checkpoint \S*step-(\d+)\.pt")
RESUMED = re.compile(r"resuming from \S*step-(\d+)\.pt: step (\d+)")
STOPPED = re.compile(r"stopped at step (\d+) with a checkpoint saved")
WAIT_FOR_CHECKPOINT_S = 900
RERUN_TIMEOUT_S = 1200


def _group_alive(pgid: int) -> list[psutil.Process]:
    alive = []
    for process in psutil.process_iter(["status"]):
        try:
            if os.getpgid(process.pid) == pgid and process.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except (ProcessLookupError, psutil.Error):
            continue
    return alive


def _kill_group(child: ChildProcess) -> None:
    """SIGKILL the child's process group, and wait (bounded) until none of it runs."""
    child.kill()
    deadline = time.monotonic() + 30
    while _group_alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _group_alive(child.pid), f"processes outlived SIGKILL: {_group_alive(child.pid)}"


def _interrupt_group(child: ChildProcess) -> None:
    """Ctrl-C in a terminal: SIGINT to the whole group; then wait (bounded) for the tool to exit."""
    child.signal(signal.SIGINT)
    try:
        child.process.wait(timeout=120)
    finally:
        _kill_group(child)  # whatever is left (nothing, normally)


def interrupt_during_training(
    copy: Path, command: list[str], *, watched_log: Path, console: Path, how: signal.Signals = signal.SIGKILL
) -> int:
    """Start ``command`` in a new process group; once ``watched_log`` shows a checkpoint at step
    :data:`KILL_AFTER_STEP` or later, send ``how`` (SIGKILL or SIGINT) to the whole group.
    Returns the newest step saved when it saw that checkpoint."""
    process = ChildProcess(command, log_path=console, env=tool_env(copy), cwd=copy)
    try:
        deadline = time.monotonic() + WAIT_FOR_CHECKPOINT_S
        while True:
            time.sleep(0.5)
            text = watched_log.read_text(errors="replace") if watched_log.exists() else ""
            steps = [int(step) for step in CHECKPOINT_SAVED.findall(text)]
            if any(step >= KILL_AFTER_STEP for step in steps):
                break
            if process.process.poll() is not None:
                raise ToolError(
                    f"{' '.join(command)} ended (exit {process.process.returncode}) before a checkpoint at step "
                    f"{KILL_AFTER_STEP}:\n{tail(console.read_text(errors='replace'))}"
                )
            if time.monotonic() > deadline:
                raise ToolError(f"no checkpoint at step {KILL_AFTER_STEP} within {WAIT_FOR_CHECKPOINT_S} s")
    finally:
        if how == signal.SIGINT:
            _interrupt_group(process)
        else:
            _kill_group(process)
    return max(steps)


def new_training_run(copy: Path) -> None:
    """Change train params so that the next run trains afresh: another lr, fewer epochs."""
    train = yaml.safe_load((copy / "params.yaml").read_text())["train"]
    optim, checkpoint = train["optim"], train["checkpoint"]
    # ~10 steps an epoch on yesno: a periodic checkpoint at step 50 comes before the end (~80).
    assert optim["epochs"] >= SHORT_EPOCHS and KILL_AFTER_STEP % checkpoint["checkpoint_every_steps"] == 0, train
    changes = {"train.optim.lr": round(optim["lr"] * LR_FACTOR, 8)}
    if optim["epochs"] != SHORT_EPOCHS:  # an earlier test may have shortened it already
        changes["train.optim.epochs"] = SHORT_EPOCHS
    set_params(copy, changes)


def check_resumed(train_output: str, killed_at: int) -> None:
    assert "starting a fresh run" not in train_output, tail(train_output)
    resumed = RESUMED.search(train_output)
    assert resumed, f"training did not resume:\n{tail(train_output)}"
    assert int(resumed.group(2)) >= KILL_AFTER_STEP, resumed.group(0)
    assert int(resumed.group(2)) <= killed_at, f"resumed past the last saved step {killed_at}: {resumed.group(0)}"


def check_live_locks_stand(copy: Path) -> None:
    """The killed Snakemake left its locks, which workflow/rules/common.smk removes once their
    holder is gone; while the holder runs (here: pretend it is this process) they must stand."""
    holder = copy / ".snakemake/asrflow_lock_holder.json"
    assert list((copy / ".snakemake/locks").glob("*.lock")), "the killed Snakemake left no locks"
    assert holder.is_file(), "the killed Snakemake did not record who held its locks"
    recorded = holder.read_text()
    me = psutil.Process()
    holder.write_text(json.dumps({"host": socket.gethostname(), "pid": me.pid, "started": me.create_time()}))
    try:
        blocked = run(copy, "snakemake", "--cores", "all", check=False, timeout=180)
    finally:
        holder.write_text(recorded)
    assert blocked.returncode != 0 and "LockException" in blocked.stdout, tail(blocked.stdout)


def test_snakemake_finishes_a_killed_run_and_resumes_training(snakemake_run):
    copy = snakemake_run.copy
    new_training_run(copy)
    train_log = copy / "logs/train.log"
    train_log.unlink()  # the finished run's log also shows a step-50 checkpoint
    killed_at = interrupt_during_training(
        copy, ["snakemake", "--cores", "all"], watched_log=train_log, console=copy.parent / "snakemake-killed.log"
    )
    assert (copy / f"exp/checkpoints/step-{killed_at:08d}.pt").is_file(), "the checkpoints did not survive"
    check_live_locks_stand(copy)

    started = time.time()
    result = run(copy, "snakemake", "--cores", "all", timeout=RERUN_TIMEOUT_S)
    assert snakemake_jobs(result.stdout) == {"train", "evaluate"}, tail(result.stdout)
    check_resumed(train_log.read_text(), killed_at)
    assert (copy / "exp/eval/metrics.json").stat().st_mtime >= started - 1
    assert "Nothing to be done" in run(copy, "snakemake", "--dry-run", "--cores", "1", timeout=180).stdout


def test_dvc_finishes_a_killed_run_and_resumes_training(dvc_run):
    copy = dvc_run.copy
    new_training_run(copy)
    console = copy.parent / "dvc-killed.log"
    killed_at = interrupt_during_training(copy, ["dvc", "repro"], watched_log=console, console=console)
    assert dvc_ran_stages(console.read_text()) == {LISTING, "train"}, tail(console.read_text())
    assert (copy / f"exp/checkpoints/step-{killed_at:08d}.pt").is_file(), "the checkpoints did not survive"

    started = time.time()
    result = run(copy, "dvc", "repro", timeout=RERUN_TIMEOUT_S)
    assert dvc_ran_stages(result.stdout) == {LISTING, "train", "evaluate"}, tail(result.stdout)
    check_resumed(result.stdout, killed_at)
    assert (copy / "exp/eval/metrics.json").stat().st_mtime >= started - 1
    assert dvc_status(copy) == {}  # up to date (the listing stage is always changed)


def check_stopped_and_resumed_at_the_same_step(interrupted_output: str, rerun_output: str) -> None:
    """Ctrl-C: the train stage saved the step it was in and exited 75; the re-run starts right after it."""
    assert "received SIGINT" in interrupted_output, tail(interrupted_output)
    stopped = STOPPED.search(interrupted_output)
    assert stopped, f"the train stage did not stop with a checkpoint:\n{tail(interrupted_output)}"
    resumed = RESUMED.search(rerun_output)
    assert resumed, f"training did not resume:\n{tail(rerun_output)}"
    assert int(resumed.group(2)) == int(stopped.group(1)) >= KILL_AFTER_STEP, (stopped.group(0), resumed.group(0))


def test_snakemake_after_ctrl_c_resumes_training_where_it_stopped(snakemake_run):
    copy = snakemake_run.copy
    new_training_run(copy)
    train_log = copy / "logs/train.log"
    train_log.unlink()
    interrupt_during_training(
        copy,
        ["snakemake", "--cores", "all"],
        watched_log=train_log,
        console=copy.parent / "snakemake-ctrl-c.log",
        how=signal.SIGINT,
    )
    interrupted = train_log.read_text()
    result = run(copy, "snakemake", "--cores", "all", timeout=RERUN_TIMEOUT_S)
    assert snakemake_jobs(result.stdout) == {"train", "evaluate"}, tail(result.stdout)
    check_stopped_and_resumed_at_the_same_step(interrupted, train_log.read_text())
    assert "Nothing to be done" in run(copy, "snakemake", "--dry-run", "--cores", "1", timeout=180).stdout


def test_dvc_after_ctrl_c_resumes_training_where_it_stopped(dvc_run):
    copy = dvc_run.copy
    new_training_run(copy)
    console = copy.parent / "dvc-ctrl-c.log"
    interrupt_during_training(copy, ["dvc", "repro"], watched_log=console, console=console, how=signal.SIGINT)
    result = run(copy, "dvc", "repro", timeout=RERUN_TIMEOUT_S)
    assert dvc_ran_stages(result.stdout) == {LISTING, "train", "evaluate"}, tail(result.stdout)
    check_stopped_and_resumed_at_the_same_step(console.read_text(errors="replace"), result.stdout)
    assert dvc_status(copy) == {}  # up to date (the listing stage is always changed)
