"""torchrun / DDP on the CPU (gloo): same result as one process, exact resume, no hangs.

Every job is ``torchrun --standalone --nproc-per-node 2`` (the command ``launch.py`` builds
for the train stage) running ``tests.support.train_entry``: the real ``Trainer`` on the prepared yesno
data, two ranks on 127.0.0.1 (gloo on the loopback interface), tiny model with dropout and
SpecAugment on. Every subprocess has a timeout, and every process a job started is
SIGKILLed when a test ends, so no test can hang or leave processes behind.

One optimizer step of the DDP runs takes 4 planned batches: ``accum_grad`` 2 micro-batches
on each of 2 ranks (so DDP's ``no_sync`` path runs). The single-process equivalent is
``accum_grad`` 4: the same 4 consecutive batches per step.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from asrflow.data.loading.planner import plan_epoch, steps_in_plan
from asrflow.data.manifests import load_cuts
from asrflow.training.checkpoint import list_checkpoints, load_checkpoint, step_of
from asrflow.training.monitoring import write_stacks
from asrflow.training.outcome import DataWorkerDied, Outcome, PeerFailed, Stalled, exit_code
from tests.support.exit_observer import observed, rank_exits
from tests.support.mlflow_store import fresh_mlflow_store
from tests.support.processes import ChildProcess
from tests.support.tiny_config import tiny_settings, tiny_trainer
from tests.support.train_entry import TrainingProcess

SEED = 42
#: One training job of 2 ranks unless ``ranks=`` says otherwise; ``env`` adds fault variables.
Job = functools.partial(TrainingProcess, ranks=2, seed=SEED)

#: Shared by every run that is compared: 2 epochs (6 + 5 steps with 2 ranks), checkpoints every 4 steps.
#: fp32 whatever ``auto`` picks on this CPU: the tolerances below are float32's (under bf16 autocast
#: the same summation-order noise is rounded to 8 mantissa bits and grows past them in 11 steps).
BASE = {
    "train.optim.epochs": 2,
    "train.data.max_duration_s": 12.0,
    "train.checkpoint.checkpoint_every_steps": 4,
    "train.checkpoint.validate_every_steps": 4,
    "train.checkpoint.keep_last": 50,
    "train.optim.average_last": 1,
    "train.optim.precision": "fp32",
}
DDP = {**BASE, "train.optim.accum_grad": 2}
NUM_BUCKETS = tiny_settings().train.data.num_buckets
# DDP vs one process: float32 sums in another order (each rank's sum, gloo's all-reduce, DDP's
# averaging). Per-step losses agree to 1e-4 (relative). Most weights agree to ~1e-7, but Adam
# turns rounding noise into a full step where a gradient is ~0 (the attention's key bias has
# none at all), so each weight is allowed 1e-3 (a third of one step at the peak lr of 3e-3),
# and the whole model's difference must stay below 1 % of how far training moved it.
# (Before dropout was seeded per batch the runs differed by ~2e-2 in loss and ~6e-3 in weights.)
LOSS_RTOL, LOSS_ATOL = 1e-4, 1e-5
WEIGHT_ATOL, DISPLACEMENT_RTOL = 1e-3, 1e-2


def _last_checkpoint(exp: Path) -> dict:
    state = load_checkpoint(list_checkpoints(exp / "checkpoints")[0])
    assert state["complete"]
    return state


def _summary(exp: Path) -> dict:
    return json.loads((exp / "summary.json").read_text())


@pytest.fixture
def jobs():
    """Start jobs through this (as :data:`Job`); whatever is still running at the end of the test is killed."""
    started: list[TrainingProcess] = []

    def start(*args, **kwargs) -> TrainingProcess:
        job = Job(*args, **kwargs)
        started.append(job)
        return job

    yield start
    for job in started:
        if job.process.poll() is None:
            job.kill()


@pytest.fixture(scope="module")
def ddp_reference(yesno_data, tmp_path_factory) -> Path:
    """An uninterrupted 2-rank run, 2 spawned data workers on each rank."""
    exp = tmp_path_factory.mktemp("ddp_reference")
    job = Job(yesno_data, exp, {**DDP, "run.num_workers": 2, "run.mp_start_method": "spawn"})
    code = job.wait()
    assert code == 0, job.log()
    assert "world size 2" in job.log()
    return exp


def _epoch_steps(data: Path, epoch: int, accum_grad: int, world_size: int) -> int:
    cuts = load_cuts(data / "fbank", "train").to_eager()
    plan = plan_epoch(cuts, epoch, seed=SEED, max_duration_s=BASE["train.data.max_duration_s"], num_buckets=NUM_BUCKETS)
    return steps_in_plan(plan, accum_grad, world_size)


@pytest.mark.slow
def test_two_ranks_match_one_process_with_the_same_global_batch(yesno_data, ddp_reference, tmp_path):
    single = tmp_path / "single"
    overrides = {**BASE, "train.optim.accum_grad": 4}
    summary = (
        tiny_trainer(yesno_data, single, overrides, seed=SEED, tracking_uri=fresh_mlflow_store(single)).run().summary
    )

    steps = sum(_epoch_steps(yesno_data, epoch, 2, 2) for epoch in range(BASE["train.optim.epochs"]))
    assert steps >= 8
    assert summary["steps"] == _summary(ddp_reference)["steps"] == steps
    ddp_state, one_state = _last_checkpoint(ddp_reference), _last_checkpoint(single)
    assert ddp_state["position"]["world_size"] == 2 and one_state["position"]["world_size"] == 1
    assert one_state["position"]["plan_digest"] == ddp_state["position"]["plan_digest"]
    # Per-step losses (nats per token over all 4 micro-batches) agree ...
    ddp_losses, one_losses = ddp_state["history"]["loss"], one_state["history"]["loss"]
    assert len(ddp_losses) == len(one_losses) == steps
    assert ddp_losses == pytest.approx(one_losses, rel=LOSS_RTOL, abs=LOSS_ATOL)
    # ... and so do the parameters at the end.
    start = load_checkpoint(list_checkpoints(single / "checkpoints")[-1])["model"]  # step 0: same init
    difference = displacement = 0.0
    for name, tensor in one_state["model"].items():
        torch.testing.assert_close(
            ddp_state["model"][name], tensor, atol=WEIGHT_ATOL, rtol=0.0, msg=lambda m, n=name: f"{n}: {m}"
        )
        if tensor.is_floating_point():
            difference += float((ddp_state["model"][name].double() - tensor.double()).square().sum())
            displacement += float((tensor.double() - start[name].double()).square().sum())
    assert difference**0.5 < DISPLACEMENT_RTOL * displacement**0.5, (difference**0.5, displacement**0.5)


@pytest.mark.slow
def test_sigkilled_ddp_job_resumes_bit_identical(yesno_data, ddp_reference, tmp_path, jobs, caplog):
    """SIGKILL the whole torchrun job after step 6 (checkpoint 4 on disk), run it again.

    Rank 0 is held after step 6 (``ASRFLOW_TEST_STALL_RANK_AT_STEP``) so the kill lands at a
    known place: two steps past the last checkpoint, which is mid-epoch (step 4 of 6 of
    epoch 0). The rerun (no data workers; the reference had two per rank) must end
    ``torch.equal`` to the uninterrupted run, with the same per-step losses.
    Then the killed run's checkpoints are resumed by one process: the plan differs, so the
    epoch restarts from its first batch, and training completes.
    """
    exp = tmp_path / "ddp"
    killed = jobs(yesno_data, exp, {**DDP, "run.num_workers": 0}, env={"ASRFLOW_TEST_STALL_RANK_AT_STEP": "0:6"})
    killed.wait_for("injected stall on rank 0 at step 6")
    killed.kill()
    assert killed.process.returncode == -signal.SIGKILL
    assert step_of(list_checkpoints(exp / "checkpoints")[0]) == 4
    assert _epoch_steps(yesno_data, 0, 2, 2) > 4  # so the resume starts mid-epoch
    one_process = tmp_path / "one_process"
    shutil.copytree(exp, one_process)

    resumed = jobs(yesno_data, exp, {**DDP, "run.num_workers": 0})
    assert resumed.wait() == 0, resumed.log()
    assert re.search(r"resuming from \S+step-00000004\.pt: step 4, epoch 0, batch 4 of", resumed.log()), resumed.log()
    new, reference = _last_checkpoint(exp), _last_checkpoint(ddp_reference)
    for name, tensor in reference["model"].items():
        assert torch.equal(new["model"][name], tensor), f"{name} differs after the resume"
    assert new["history"] == reference["history"]

    # The 2-rank checkpoint, resumed by one process (accum_grad unchanged).
    overrides = {**DDP, "run.num_workers": 0}
    uri = f"sqlite:///{one_process / 'mlflow.db'}"
    summary = tiny_trainer(yesno_data, one_process, overrides, seed=SEED, tracking_uri=uri).run().summary
    assert "written with 2 processes, this run has 1" in caplog.text
    assert "epoch 0 restarts from its first batch" in caplog.text
    assert summary["steps"] == 4 + _epoch_steps(yesno_data, 0, 2, 1) + _epoch_steps(yesno_data, 1, 2, 1)
    final = _last_checkpoint(one_process)
    assert final["position"]["world_size"] == 1
    assert all(torch.isfinite(t).all() for t in final["model"].values() if t.is_floating_point())


@pytest.mark.slow
def test_a_failing_rank_ends_the_job(yesno_data, tmp_path, jobs):
    """Rank 1 raises after step 2 (a bug: exit 1): rank 0's collective fails (70), nothing is left, and the job
    ends within the collective timeout."""
    job = jobs(
        yesno_data,
        tmp_path / "fail",
        {**DDP, "run.num_workers": 0, "run.dist_timeout_s": FAULT_TIMEOUT_S, "run.stall_timeout_s": 60.0},
        env={"ASRFLOW_TEST_FAIL_RANK_AT_STEP": "1:2"},
    )
    codes, log = _ends_cleanly(job, {0: (PEER_FAILED,), 1: (1,)}, timeout_s=FAULT_TIMEOUT_S)
    assert "RuntimeError: injected failure on rank 1 at step 2" in log
    assert "ChildFailedError" in log  # torchrun's summary of the failed rank
    assert not (tmp_path / "fail" / "model.pt").exists()


def test_stack_dumps_are_whole_lines_labelled_with_the_rank(tmp_path):
    with open(tmp_path / "stderr", "w") as stream:
        write_stacks(stream, "rank 3: ")
    lines = (tmp_path / "stderr").read_text().splitlines()
    assert lines and all(line.startswith("rank 3: ") for line in lines)
    assert any(
        re.fullmatch(
            r'rank 3:   File "\S+test_ddp\.py", line \d+ in '
            r"test_stack_dumps_are_whole_lines_labelled_with_the_rank",
            line,
        )
        for line in lines
    )


@pytest.mark.slow
def test_a_stalled_rank_ends_the_job_with_stack_dumps(yesno_data, tmp_path, jobs):
    """Rank 1 sleeps after step 2: its watchdog dumps every thread's stack and ends it (124); rank 0's own
    watchdog or its broken collective ends it too, within the stall timeout."""
    stall_timeout_s = 10.0
    job = jobs(
        yesno_data,
        tmp_path / "stall",
        {**DDP, "run.num_workers": 0, "run.dist_timeout_s": FAULT_TIMEOUT_S, "run.stall_timeout_s": stall_timeout_s},
        env={"ASRFLOW_TEST_STALL_RANK_AT_STEP": "1:2"},
    )
    codes, log = _ends_cleanly(job, {0: (STALLED, PEER_FAILED), 1: (STALLED,)}, timeout_s=stall_timeout_s)
    assert "injected stall on rank 1 at step 2" in log
    assert re.search(r"rank 1: no training step finished for \d+ s \(run\.stall_timeout_s = 10\)", log), log
    assert "most recent call first" in log  # faulthandler's dump of the stalled process's threads
    assert re.search(r'^rank 1:   File "\S+train_entry\.py", line \d+ in after_step$', log, re.M), log  # its sleep
    assert not (tmp_path / "stall" / "model.pt").exists()


@pytest.mark.slow
def test_ddp_bad_batches_are_written_once_with_the_whole_step(yesno_data, tmp_path, jobs):
    """Step 2 is non-finite on both ranks: rank 0 alone writes one line, naming all 4 batches of the step."""
    exp = tmp_path / "nan"
    job = jobs(yesno_data, exp, {**DDP, "train.optim.epochs": 1, "run.num_workers": 0, "nonfinite_steps": [2]})
    assert job.wait() == 0, job.log()
    lines = (exp / "bad_batches.jsonl").read_text().splitlines()
    assert len(lines) == 1, lines
    record = json.loads(lines[0])
    cuts = load_cuts(yesno_data / "fbank", "train").to_eager()
    plan = plan_epoch(cuts, 0, seed=SEED, max_duration_s=BASE["train.data.max_duration_s"], num_buckets=NUM_BUCKETS)
    group = DDP["train.optim.accum_grad"] * 2  # batches per optimizer step: accum_grad micro-batches on 2 ranks
    assert record["step"] == 2
    assert record["cut_ids"] == [cut_id for batch in plan[group : 2 * group] for cut_id in batch]
    assert _summary(exp)["nonfinite_skipped"] == 1


# ---------------------------------------------------------------------- faults: every rank ends, none hangs
#
# Each job below has 2 gloo ranks; ``dist_timeout_s`` bounds every collective. Each fault case asserts
# the exit code every rank documents (the table in asrflow.training.outcome, the README's) as the rank's
# process ended with it (its observer's waitpid, tests.support.exit_observer; never a log line), the
# same code wherever torchrun's failure summary lists the rank, torchrun's own exit code (1 when a rank
# failed), that no process of the job is left (torchrun's session and each rank's, which holds its data
# workers), and that the job ended within docs/distributed.md's bound: the configured timeout plus
# TEARDOWN_S after the fault (the last finished step, or the signal).

FAULT_TIMEOUT_S = 20.0
#: Seconds past the configured timeout a job may take to end (docs/distributed.md): the watchdog's check
#: interval (up to a quarter of the stall timeout, at most 5 s), then every process's teardown (the failing
#: rank's, torchrun noticing it and stopping the other rank, that rank's, torchrun's own exit).
TEARDOWN_S = 15.0
DOCS = Path(__file__).resolve().parents[2] / "docs" / "distributed.md"
#: torchrun's exit code when a rank failed (its ChildFailedError).
TORCHRUN_FAILED = 1
PEER_FAILED, WORKER_DIED = exit_code(PeerFailed), exit_code(DataWorkerDied)
STALLED, STOPPED = exit_code(Stalled), exit_code(Outcome.STOPPED)


def test_the_tested_time_bound_is_the_documented_one():
    text = " ".join(DOCS.read_text().split())
    assert f"plus {TEARDOWN_S:.0f} s" in text, f"{DOCS.name} should state the bound the fault tests check"


#: A child that counts the SIGTERMs it gets, exits 75 half a second after the first and says how many it got.
COUNTING_CHILD = """
import signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda *_: got.append(1))
print("ready", flush=True)
while not got:
    time.sleep(0.01)
time.sleep(0.5)
print("sigterms", len(got), flush=True)
sys.exit(75)
"""


def _observe(tmp_path: Path, code: str) -> ChildProcess:
    """``python -c code`` under the exit observer recording into ``tmp_path/exits``, in a session of its own
    as torchrun starts a rank (killed if a wait times out); its output goes to ``tmp_path/log``."""
    return ChildProcess([sys.executable, *observed(tmp_path / "exits", ["-c", code])], log_path=tmp_path / "log")


@pytest.mark.parametrize(
    "code, returncode",
    [("raise SystemExit(3)", 3), ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL)],
)
def test_the_exit_observer_records_how_its_child_ended_and_ends_the_same_way(tmp_path, code, returncode):
    process = _observe(tmp_path, code)
    assert process.wait(timeout=30) == returncode
    (record,) = rank_exits(tmp_path / "exits").values()
    assert record.returncode == returncode and record.session == process.pid != record.pid


@pytest.mark.parametrize("to_group", [True, False])
def test_a_sigterm_reaches_the_observed_child_and_never_ends_the_observer(tmp_path, to_group):
    """From the observer's parent to the whole group (torchrun's way), or from another process to the observer
    alone (passed on): the child stops on it (75), and so does the observer."""
    process = _observe(tmp_path, COUNTING_CHILD)
    process.wait_for("ready", timeout=30)
    if to_group:
        process.signal(signal.SIGTERM)
    else:
        subprocess.run([sys.executable, "-c", f"import os; os.kill({process.pid}, {int(signal.SIGTERM)})"], check=True)
    assert process.wait(timeout=30) == STOPPED, process.log()
    assert "sigterms 1\n" in process.log()
    assert rank_exits(tmp_path / "exits")[0].returncode == STOPPED


def _torchrun_reported(log: str) -> dict[int, int]:
    """The exit code of each failed rank as torchrun's failure summary lists it (a cross-check)."""
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", log)
    return {int(rank): int(code) for rank, code in found}


def _last_step_time(log: str) -> float:
    return max(float(at) for at in re.findall(r"asrflow\.test\.step \d \d+ ([\d.]+)", log))


def _processes_left(sessions: set[int]) -> list[str]:
    """Live processes (zombies aside) in the sessions ``sessions``."""
    left = []
    for process in psutil.process_iter(["status", "cmdline"]):
        with contextlib.suppress(psutil.Error, OSError):
            if process.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(process.pid) in sessions:
                left.append(f"pid {process.pid}: {' '.join(process.info['cmdline'] or [])[:200]}")
    return left


def _ends_cleanly(
    job: Job, ranks: dict[int, tuple[int, ...]], *, timeout_s: float | None = None, fault_at: float | None = None
) -> tuple[dict[int, int], str]:
    """Wait for the job and assert how it ended: each rank's exit code, as its observer saw the rank's process
    end, is one of ``ranks[rank]``, and torchrun's summary lists exactly the ranks that did not exit 0, with
    those codes; torchrun's own code is 0 when every rank's is, else 1; no process of the job is left; with
    ``timeout_s``, the job ended within ``timeout_s`` + :data:`TEARDOWN_S` of the fault (``fault_at``, unix
    time, or else the last finished step). Returns each rank's exit code and the log."""
    code = job.wait()
    ended = time.time()
    log = job.log()
    exits = job.rank_exits()
    assert sorted(exits) == sorted(ranks), (exits, log)
    sessions = {job.process.pid, *(record.session for record in exits.values())}  # torchrun's, each rank's
    deadline = time.monotonic() + 10.0
    while _processes_left(sessions) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_left(sessions) == [], log
    codes = {rank: record.returncode for rank, record in exits.items()}
    for rank, allowed in ranks.items():
        assert codes[rank] in allowed, (rank, codes, allowed, log)
    assert _torchrun_reported(log) == {rank: code for rank, code in codes.items() if code != 0}, (codes, log)
    assert code == (0 if all(allowed == (0,) for allowed in ranks.values()) else TORCHRUN_FAILED), log
    if timeout_s is not None:
        took = ended - (fault_at if fault_at is not None else _last_step_time(log))
        assert took <= timeout_s + TEARDOWN_S, (
            f"ended {took:.1f} s after the fault ({timeout_s} + {TEARDOWN_S} s):\n{log}"
        )
    return codes, log


def _equal_to_reference(exp: Path, reference: Path) -> None:
    new, expected = _last_checkpoint(exp), _last_checkpoint(reference)
    for name, tensor in expected["model"].items():
        assert torch.equal(new["model"][name], tensor), f"{name} differs from the uninterrupted run"
    assert new["history"] == expected["history"]


@pytest.mark.slow
def test_intervals_that_do_not_divide_and_a_dev_loss_that_stops_improving(yesno_data, tmp_path, jobs):
    """Validation every 3 steps, checkpoints every 5: a validation that does not improve must not send
    one rank to a checkpoint barrier the other never reaches. (lr 1e-30 leaves the weights as they
    are, so every dev loss after the first ties the best: not an improvement.)"""
    overrides = {
        **DDP,
        "run.num_workers": 0,
        "train.checkpoint.validate_every_steps": 3,
        "train.checkpoint.checkpoint_every_steps": 5,
        "train.optim.lr": 1e-30,
        "train.optim.weight_decay": 0.0,
        "run.dist_timeout_s": FAULT_TIMEOUT_S,
    }
    codes, log = _ends_cleanly(jobs(yesno_data, tmp_path / "exp", overrides), {0: (0,), 1: (0,)})
    for rank in (0, 1):
        losses = re.findall(rf"\[rank {rank}\] \S+ step (\d+): dev loss (\S+)", log)
        assert [int(step) for step, _ in losses] == [3, 6, 9], log
        assert len({loss for _, loss in losses}) == 1, losses  # equal: steps 6 and 9 did not improve
    assert [step_of(path) for path in list_checkpoints(tmp_path / "exp" / "checkpoints")][-4:] == [10, 5, 3, 0]


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_both_after_the_same_step_and_resumes_exactly(
    yesno_data, ddp_reference, tmp_path, jobs
):
    """A preempted node: rank 1 alone gets SIGTERM while step 5 is in flight."""
    exp = tmp_path / "exp"
    overrides = {**DDP, "run.num_workers": 0, "run.dist_timeout_s": FAULT_TIMEOUT_S}
    job = jobs(yesno_data, exp, overrides, env={"ASRFLOW_TEST_PAUSE_RANK_IN_STEP": "1:5"})
    job.wait_for("asrflow.test.paused 1 5")
    signalled = time.time()
    os.kill(job.rank_exits()[1].pid, signal.SIGTERM)
    # The first rank to exit 75 makes torchrun send the other SIGTERM; once its run has ended, a rank ignores it
    # (stages.train.run_trainer), so both exit 75 as decided.
    codes, log = _ends_cleanly(job, {0: (STOPPED,), 1: (STOPPED,)}, timeout_s=FAULT_TIMEOUT_S, fault_at=signalled)
    for rank in (0, 1):
        assert re.search(rf"\[rank {rank}\] .*stopped at step 5 with a checkpoint saved", log), log
    newest = load_checkpoint(list_checkpoints(exp / "checkpoints")[0])
    assert newest["step"] == 5 and not newest["complete"]

    resumed = jobs(yesno_data, exp, {**DDP, "run.num_workers": 0})
    assert resumed.wait() == 0, resumed.log()
    assert "resuming from" in resumed.log() and "step 5, epoch 0" in resumed.log()
    _equal_to_reference(exp, ddp_reference)


@pytest.mark.slow
def test_sigkill_of_one_rank_mid_step_ends_the_other_and_a_rerun_resumes(yesno_data, ddp_reference, tmp_path, jobs):
    """Rank 1 dies (SIGKILL) inside step 6; rank 0, inside the step's all-reduce, must end too."""
    exp = tmp_path / "exp"
    overrides = {**DDP, "run.num_workers": 2, "run.dist_timeout_s": FAULT_TIMEOUT_S}
    job = jobs(yesno_data, exp, overrides, env={"ASRFLOW_TEST_PAUSE_RANK_IN_STEP": "1:6"})
    job.wait_for("asrflow.test.paused 1 6")
    killed = time.time()
    os.kill(job.rank_exits()[1].pid, signal.SIGKILL)
    codes, log = _ends_cleanly(
        job, {0: (PEER_FAILED,), 1: (-signal.SIGKILL,)}, timeout_s=FAULT_TIMEOUT_S, fault_at=killed
    )
    assert re.search(r"\[rank 0\] .*stopping: a collective with the other ranks failed", log), log

    resumed = jobs(yesno_data, exp, overrides)
    assert resumed.wait() == 0, resumed.log()
    assert "step 4, epoch 0" in resumed.log()
    _equal_to_reference(exp, ddp_reference)


@pytest.mark.slow
def test_a_nonfinite_loss_on_one_rank_is_skipped_by_both(yesno_data, tmp_path, jobs):
    exp = tmp_path / "exp"
    job = jobs(
        yesno_data,
        exp,
        {**DDP, "train.optim.epochs": 1, "run.num_workers": 0, "nonfinite_steps": [2], "nonfinite_ranks": [1]},
    )
    codes, log = _ends_cleanly(job, {0: (0,), 1: (0,)})
    for rank in (0, 1):
        assert re.search(rf"\[rank {rank}\] .*step 2: non-finite loss .* step skipped \(1 in a row\)", log), log
    assert [json.loads(line)["step"] for line in (exp / "bad_batches.jsonl").read_text().splitlines()] == [2]
    assert _summary(exp)["nonfinite_skipped"] == 1


@pytest.mark.slow
def test_a_stalled_data_worker_ends_the_job_with_the_stalled_ranks_stacks(yesno_data, tmp_path, jobs):
    """Rank 1's data worker sleeps building its first batch of step 3: rank 1's watchdog prints its stacks and
    ends it (124). Rank 0, waiting in the step's all-reduce, is ended by its own watchdog (124) or, when rank
    1's fires first (each looks every 2.5 s on a clock of its own), by the collective rank 1's exit breaks (70)."""
    group = DDP["train.optim.accum_grad"] * 2
    overrides = {**DDP, "run.num_workers": 1, "run.stall_timeout_s": 10.0, "run.dist_timeout_s": 60.0}
    job = jobs(
        yesno_data, tmp_path / "exp", overrides, env={"ASRFLOW_TEST_STALL_WORKER_AT_BATCH": f"1:{2 * group + 1}"}
    )
    codes, log = _ends_cleanly(
        job, {0: (STALLED, PEER_FAILED), 1: (STALLED,)}, timeout_s=overrides["run.stall_timeout_s"]
    )
    assert "injected worker fault" in log
    for rank in (rank for rank, code in codes.items() if code == STALLED):
        assert re.search(rf"rank {rank}: no training step finished for \d+ s", log), log
        assert re.search(rf'^rank {rank}:   File "\S+trainer\.py", line \d+ in _train$', log, re.M), log
    if codes[0] == PEER_FAILED:
        assert re.search(r"\[rank 0\] .*stopping: a collective with the other ranks failed", log), log


@pytest.mark.slow
def test_a_killed_data_worker_ends_the_job_with_a_clear_message(yesno_data, tmp_path, jobs):
    group = DDP["train.optim.accum_grad"] * 2
    overrides = {**DDP, "run.num_workers": 1, "run.dist_timeout_s": FAULT_TIMEOUT_S}
    job = jobs(yesno_data, tmp_path / "exp", overrides, env={"ASRFLOW_TEST_KILL_WORKER_AT_BATCH": f"1:{2 * group + 1}"})
    job.wait_for("injected worker fault")  # the worker may die before any step ends (it builds batches ahead)
    killed = time.time()
    codes, log = _ends_cleanly(job, {0: (PEER_FAILED,), 1: (WORKER_DIED,)}, timeout_s=FAULT_TIMEOUT_S, fault_at=killed)
    # The DataLoader's own error, or the pipe's (the worker killed mid-transfer): both are named.
    worker_died = r"\[rank 1\] .*stopping: a data worker died \((DataLoader worker|ConnectionResetError|EOFError)"
    assert re.search(worker_died, log), log
    assert re.search(r"\[rank 0\] .*stopping: a collective with the other ranks failed", log), log
