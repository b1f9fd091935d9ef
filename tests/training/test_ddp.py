"""torchrun / DDP on the CPU (gloo): same result as one process, exact resume, no hangs.

Every job is ``torchrun --standalone --nproc-per-node 2`` (the command ``launch.py`` builds
for the train stage) running ``ddp_entry.py``: the real ``Trainer`` on the prepared yesno
data, two ranks on 127.0.0.1 (gloo on the loopback interface), tiny model with dropout and
SpecAugment on. Every subprocess has a timeout, and every process a job started is
SIGKILLed when a test ends, so no test can hang or leave processes behind.

One optimizer step of the DDP runs takes 4 planned batches: ``accum_grad`` 2 micro-batches
on each of 2 ranks (so DDP's ``no_sync`` path runs). The single-process equivalent is
``accum_grad`` 4: the same 4 consecutive batches per step.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, tiny_train_config, train_paths
from train_entry import fresh_mlflow_store

from asrflow.data.batches import plan_epoch, steps_in_plan
from asrflow.data.features import FeatureConfig
from asrflow.data.manifests import load_cuts
from asrflow.training.checkpoint import list_checkpoints, load_checkpoint, step_of
from asrflow.training.config import TrainConfig
from asrflow.training.launch import torchrun_command
from asrflow.training.trainer import Trainer
from asrflow.training.watchdog import write_stacks

ENTRY = Path(__file__).with_name("ddp_entry.py")
SEED = 42
JOB_TIMEOUT_S = 240.0
#: Shared by every run that is compared: 2 epochs (6 + 5 steps with 2 ranks), checkpoints every 4 steps.
BASE = dict(epochs=2, max_duration_s=12.0, checkpoint_every_steps=4, validate_every_steps=4, keep_last=50,
            average_last=1)
DDP = dict(BASE, accum_grad=2)
# DDP vs one process: float32 sums in another order (each rank's sum, gloo's all-reduce, DDP's
# averaging). Per-step losses agree to 1e-4 (relative). Most weights agree to ~1e-7, but Adam
# turns rounding noise into a full step where a gradient is ~0 (the attention's key bias has
# none at all), so each weight is allowed 1e-3 (a third of one step at the peak lr of 3e-3),
# and the whole model's difference must stay below 1 % of how far training moved it.
# (Before dropout was seeded per batch the runs differed by ~2e-2 in loss and ~6e-3 in weights.)
LOSS_RTOL, LOSS_ATOL = 1e-4, 1e-5
WEIGHT_ATOL, DISPLACEMENT_RTOL = 1e-3, 1e-2


class Job:
    """One training job (torchrun with 2 ranks, or a single process) in its own session.

    Output goes to ``log_path``. :meth:`kill` SIGKILLs the launcher and every process
    below it (torchrun starts each rank in a session of its own, with its data workers).
    """

    def __init__(self, data: Path, exp: Path, overrides: dict, *, ranks: int = 2, env: dict | None = None):
        self.exp = Path(exp)
        self.exp.mkdir(parents=True, exist_ok=True)
        spec = self.exp / "spec.json"
        tracking = self.exp / "mlflow.db"
        uri = f"sqlite:///{tracking}" if tracking.is_file() else fresh_mlflow_store(self.exp)
        spec.write_text(json.dumps({"data": str(data), "exp": str(self.exp), "config": overrides,
                                    "tracking_uri": uri, "seed": SEED}))
        if ranks > 1:
            command = torchrun_command(TrainConfig(nproc_per_node=ranks), [str(ENTRY), str(spec)])
        else:
            command = [sys.executable, str(ENTRY), str(spec)]
        full_env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "GIT_PYTHON_REFRESH": "quiet",
            "PYTHONUNBUFFERED": "1",
            "GLOO_SOCKET_IFNAME": "lo",
            "MLFLOW_TRACKING_URI": uri,
            **(env or {}),
        }
        self.log_path = self.exp / f"job-{time.monotonic_ns()}.log"
        self.started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=full_env, cwd=self.exp, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float = JOB_TIMEOUT_S) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"job did not end within {timeout} s:\n{self.log()}") from None

    def wait_for(self, text: str, timeout: float = JOB_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log():
            if self.process.poll() is not None:
                raise AssertionError(f"job ended (exit {self.process.returncode}) before {text!r}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"no {text!r} within {timeout} s:\n{self.log()}")
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL the launcher and all its descendants (a node dying), then reap the launcher."""
        victims = [self.process.pid, *_descendants(self.process.pid)]
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(timeout=60)
        for pid in victims[1:]:  # torchrun puts each rank in its own process group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def _descendants(root: int) -> list[int]:
    """Every process below ``root``, from /proc (parents before children)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [root]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


@pytest.fixture
def jobs():
    """Start jobs through this; whatever is still running at the end of the test is killed."""
    started: list[Job] = []

    def start(*args, **kwargs) -> Job:
        job = Job(*args, **kwargs)
        started.append(job)
        return job

    yield start
    for job in started:
        if job.process.poll() is None:
            job.kill()


def _last_checkpoint(exp: Path) -> dict:
    state = load_checkpoint(list_checkpoints(exp / "checkpoints")[0])
    assert state["complete"]
    return state


def _summary(exp: Path) -> dict:
    return json.loads((exp / "summary.json").read_text())


@pytest.fixture(scope="module")
def ddp_reference(yesno_data, tmp_path_factory) -> Path:
    """An uninterrupted 2-rank run, 2 spawned data workers on each rank."""
    exp = tmp_path_factory.mktemp("ddp_reference")
    job = Job(yesno_data, exp, dict(DDP, num_workers=2, mp_start_method="spawn"))
    code = job.wait()
    assert code == 0, job.log()
    assert "world size 2" in job.log()
    return exp


def _epoch_steps(data: Path, epoch: int, accum_grad: int, world_size: int) -> int:
    cuts = load_cuts(data / "fbank", "train").to_eager()
    plan = plan_epoch(cuts, epoch, SEED, BASE["max_duration_s"], tiny_train_config().num_buckets)
    return steps_in_plan(plan, accum_grad, world_size)


def test_two_ranks_match_one_process_with_the_same_global_batch(yesno_data, ddp_reference, tmp_path):
    single = tmp_path / "single"
    config = tiny_train_config(**dict(BASE, accum_grad=4))
    summary = Trainer(config, FeatureConfig(), SEED, {}, train_paths(yesno_data, single),
                      tracking_uri=fresh_mlflow_store(single)).run()

    steps = sum(_epoch_steps(yesno_data, epoch, 2, 2) for epoch in range(BASE["epochs"]))
    assert steps >= 8
    assert summary["steps"] == _summary(ddp_reference)["steps"] == steps
    ddp_state, one_state = _last_checkpoint(ddp_reference), _last_checkpoint(single)
    assert ddp_state["world_size"] == 2 and one_state["world_size"] == 1
    assert one_state["plan_digest"] == ddp_state["plan_digest"]
    # Per-step losses (nats per token over all 4 micro-batches) agree ...
    ddp_losses, one_losses = ddp_state["progress"]["history"]["loss"], one_state["progress"]["history"]["loss"]
    assert len(ddp_losses) == len(one_losses) == steps
    assert ddp_losses == pytest.approx(one_losses, rel=LOSS_RTOL, abs=LOSS_ATOL)
    # ... and so do the parameters at the end.
    start = load_checkpoint(list_checkpoints(single / "checkpoints")[-1])["model"]  # step 0: same init
    difference = displacement = 0.0
    for name, tensor in one_state["model"].items():
        torch.testing.assert_close(ddp_state["model"][name], tensor, atol=WEIGHT_ATOL, rtol=0.0,
                                   msg=lambda m, n=name: f"{n}: {m}")
        if tensor.is_floating_point():
            difference += float((ddp_state["model"][name].double() - tensor.double()).square().sum())
            displacement += float((tensor.double() - start[name].double()).square().sum())
    assert difference**0.5 < DISPLACEMENT_RTOL * displacement**0.5, (difference**0.5, displacement**0.5)


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
    killed = jobs(yesno_data, exp, dict(DDP, num_workers=0), env={"ASRFLOW_TEST_STALL_RANK_AT_STEP": "0:6"})
    killed.wait_for("injected stall on rank 0 at step 6")
    killed.kill()
    assert killed.process.returncode == -signal.SIGKILL
    assert step_of(list_checkpoints(exp / "checkpoints")[0]) == 4
    assert _epoch_steps(yesno_data, 0, 2, 2) > 4  # so the resume starts mid-epoch
    one_process = tmp_path / "one_process"
    shutil.copytree(exp, one_process)

    resumed = jobs(yesno_data, exp, dict(DDP, num_workers=0))
    assert resumed.wait() == 0, resumed.log()
    assert re.search(r"resuming from \S+step-00000004\.pt: step 4, epoch 0, batch 4 of", resumed.log()), resumed.log()
    new, reference = _last_checkpoint(exp), _last_checkpoint(ddp_reference)
    for name, tensor in reference["model"].items():
        assert torch.equal(new["model"][name], tensor), f"{name} differs after the resume"
    assert new["progress"]["history"] == reference["progress"]["history"]

    # The 2-rank checkpoint, resumed by one process (accum_grad unchanged).
    config = tiny_train_config(**dict(DDP, num_workers=0))
    summary = Trainer(config, FeatureConfig(), SEED, {}, train_paths(yesno_data, one_process),
                      tracking_uri=f"sqlite:///{one_process / 'mlflow.db'}").run()
    assert "written with 2 processes, this run has 1" in caplog.text
    assert "epoch 0 restarts from its first batch" in caplog.text
    assert summary["steps"] == 4 + _epoch_steps(yesno_data, 0, 2, 1) + _epoch_steps(yesno_data, 1, 2, 1)
    final = _last_checkpoint(one_process)
    assert final["world_size"] == 1
    assert all(torch.isfinite(t).all() for t in final["model"].values() if t.is_floating_point())


def test_a_failing_rank_ends_the_job(yesno_data, tmp_path, jobs):
    """Rank 1 raises after step 2: the job exits non-zero, naming the error, within the timeout."""
    job = jobs(yesno_data, tmp_path / "fail", dict(DDP, num_workers=0, dist_timeout_s=20.0, stall_timeout_s=60.0),
               env={"ASRFLOW_TEST_FAIL_RANK_AT_STEP": "1:2"})
    code = job.wait()
    log = job.log()
    assert code != 0, log
    assert "RuntimeError: injected failure on rank 1 at step 2" in log
    assert "ChildFailedError" in log  # torchrun's summary of the failed rank
    assert not (tmp_path / "fail" / "model.pt").exists()


def test_stack_dumps_are_whole_lines_labelled_with_the_rank(tmp_path):
    with open(tmp_path / "stderr", "w") as stream:
        write_stacks(stream, "rank 3: ")
    lines = (tmp_path / "stderr").read_text().splitlines()
    assert lines and all(line.startswith("rank 3: ") for line in lines)
    assert any(re.fullmatch(r'rank 3:   File "\S+test_ddp\.py", line \d+ in '
                            r"test_stack_dumps_are_whole_lines_labelled_with_the_rank", line) for line in lines)


def test_a_stalled_rank_ends_the_job_with_stack_dumps(yesno_data, tmp_path, jobs):
    """Rank 1 sleeps after step 2: the watchdog dumps every thread's stack and the job ends non-zero."""
    job = jobs(yesno_data, tmp_path / "stall", dict(DDP, num_workers=0, dist_timeout_s=20.0, stall_timeout_s=10.0),
               env={"ASRFLOW_TEST_STALL_RANK_AT_STEP": "1:2"})
    code = job.wait()
    log = job.log()
    assert code != 0, log
    assert "injected stall on rank 1 at step 2" in log
    assert re.search(r"rank 1: no training step finished for \d+ s \(train\.stall_timeout_s = 10\)", log), log
    assert "most recent call first" in log  # faulthandler's dump of the stalled process's threads
    assert re.search(r'^rank 1:   File "\S+ddp_entry\.py", line \d+ in _record$', log, re.M), log  # where it sleeps
    assert not (tmp_path / "stall" / "model.pt").exists()


def test_ddp_bad_batches_are_written_once_with_the_whole_step(yesno_data, tmp_path, jobs):
    """Step 2 is non-finite on both ranks: rank 0 alone writes one line, naming all 4 batches of the step."""
    exp = tmp_path / "nan"
    job = jobs(yesno_data, exp, dict(DDP, epochs=1, num_workers=0, inject_nonfinite_steps=[2]))
    assert job.wait() == 0, job.log()
    lines = (exp / "bad_batches.jsonl").read_text().splitlines()
    assert len(lines) == 1, lines
    record = json.loads(lines[0])
    cuts = load_cuts(yesno_data / "fbank", "train").to_eager()
    plan = plan_epoch(cuts, 0, SEED, BASE["max_duration_s"], tiny_train_config().num_buckets)
    group = DDP["accum_grad"] * 2  # batches per optimizer step: accum_grad micro-batches on 2 ranks
    assert record["step"] == 2
    assert record["cut_ids"] == [cut_id for batch in plan[group : 2 * group] for cut_id in batch]
    assert _summary(exp)["nonfinite_skipped"] == 1
