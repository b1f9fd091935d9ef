"""The whole pipeline on a real Slurm cluster (one node on localhost, see tests.support.slurm_cluster),
submitted by ``snakemake --executor slurm --profile workflow/profiles/slurm``.

Every stage runs as a Slurm job; the model is, weight for weight, the one ``snakemake --cores
all`` trains. The train job, preempted (``scancel --signal=TERM``) and then cancelled
(``scancel``), is finished by running the same command again: training resumes from its
checkpoint and still reaches those weights.

Select with ``pytest -m slurm``. Needs root, ``slurm-wlm`` and ``munge`` (Debian 22.05; the fixture
apt-gets them where they are missing, as ``make test`` does) and ``pip install -e .[slurm]``.
They skip, saying why, only where Slurm cannot run (not root, or no Slurm and no apt-get); a
missing plugin, a failed install or daemons that do not start fail them.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.support.pipeline_tools import ToolError, run, tail
from tests.support.processes import ChildProcess
from tests.support.repo import tool_env
from tests.support.slurm_cluster import PARTITION, LocalSlurm
from tests.support.slurm_pipeline import RUN_TIMEOUT_S, assert_same_weights, local_cluster, slurm_env, slurm_repo_copy

# End to end: also `pipeline`, so `make test-fast` (-m "not pipeline") leaves them out.
pytestmark = [pytest.mark.slurm, pytest.mark.pipeline]

SLURM_COMMAND = (
    "snakemake",
    "--executor",
    "slurm",
    "--profile",
    "workflow/profiles/slurm",
    "--slurm-init-seconds-before-status-checks",
    "2",
)
WAIT_S = 900
SUBMITTED = re.compile(r"has been submitted with SLURM jobid (\d+) \(log: \S*/rule_(\w+)/")
CHECKPOINT_SAVED = re.compile(r"saved checkpoint \S*step-(\d+)\.pt")
RESUMED = re.compile(r"resuming from \S*step-(\d+)\.pt: step (\d+)")
STOPPED = re.compile(r"stopped at step (\d+) with a checkpoint saved")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running one-node Slurm cluster, torn down after the module."""
    yield from local_cluster(tmp_path_factory)


def run_on_slurm(
    cluster: LocalSlurm, copy: Path, *extra_args: str, check: bool = True, timeout_s: float = RUN_TIMEOUT_S
) -> subprocess.CompletedProcess:
    """``SLURM_COMMAND`` (plus ``extra_args``) in ``copy`` against ``cluster``. When ``check`` fails it, the
    error ends with the stage logs the run wrote (Snakemake's output names a failed job, not why it failed)."""
    started, started_at = time.monotonic(), time.time()
    try:
        result = run(copy, *SLURM_COMMAND, *extra_args, timeout=timeout_s, check=check, env=slurm_env(cluster, copy))
    except ToolError as error:
        raise ToolError(f"{error}\n{stage_logs_since(copy, started_at)}") from None
    print(f"{' '.join(SLURM_COMMAND[:3])}: exit {result.returncode} after {time.monotonic() - started:.0f} s")
    return result


def stage_logs_since(copy: Path, since: float, lines: int = 40) -> str:
    """The last ``lines`` of each stage log in ``copy/logs`` written at or after ``since`` (unix time)."""
    logs = sorted(path for path in (copy / "logs").glob("*.log") if path.stat().st_mtime >= since)
    return "\n".join(
        f"---- {path.relative_to(copy)}, its end:\n{tail(path.read_text(errors='replace'), lines)}" for path in logs
    )


def submitted(output: str) -> dict[str, str]:
    """rule -> Slurm job id, from the executor's "submitted with SLURM jobid" lines."""
    return {rule: job for job, rule in SUBMITTED.findall(output)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The same params run by ``snakemake --cores all``, no Slurm."""
    copy = slurm_repo_copy(tmp_path_factory, "local")
    run(copy, "snakemake", "--cores", "all", timeout=RUN_TIMEOUT_S)
    return copy


def test_the_whole_pipeline_runs_as_slurm_jobs_and_trains_the_same_model(slurm, reference, tmp_path_factory):
    copy = slurm_repo_copy(tmp_path_factory, "slurm-run")
    result = run_on_slurm(slurm, copy)
    jobs = submitted(result.stdout)
    assert set(jobs) == {"prepare", "features", "tokenizer", "train", "evaluate"}, tail(result.stdout)
    accounted = slurm.client("squeue", "--states=all", "-h", "-o", "%i|%k|%T")
    states = {line.split("|")[0]: line.split("|")[1:] for line in accounted.splitlines()}
    for rule, job in jobs.items():
        assert states.get(job) == [f"rule_{rule}", "COMPLETED"], (rule, job, accounted)
        assert (copy / f".snakemake/slurm_logs/rule_{rule}/{job}.log").is_file()
    assert_same_weights(copy, reference)


def wait_for(condition, what: str, child: ChildProcess, console: Path):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if child.process.poll() is not None:
            raise ToolError(f"Snakemake exited {child.process.returncode} before {what}:\n{tail(console.read_text())}")
        time.sleep(0.5)
    raise ToolError(f"no {what} within {WAIT_S} s:\n{tail(console.read_text())}")


def running_train_job(cluster: LocalSlurm) -> str | None:
    for line in cluster.client("squeue", "-h", "-o", "%i|%k|%T").splitlines():
        job, comment, state = line.split("|")
        if comment == "rule_train" and state == "RUNNING":
            return job
    return None


def cancel_train_during_training(cluster: LocalSlurm, copy: Path, *scancel_options: str, after_step: int) -> str:
    """Start the Slurm run, wait until train saved a checkpoint past ``after_step``, scancel
    the train job; returns the train log of the cancelled run after Snakemake exited."""
    train_log = copy / "logs/train.log"
    train_log.unlink(missing_ok=True)
    console = copy.parent / f"snakemake-scancel{''.join(scancel_options)}.log"
    process = ChildProcess(list(SLURM_COMMAND), log_path=console, env=slurm_env(cluster, copy), cwd=copy)
    try:

        def past_step():
            text = train_log.read_text(errors="replace") if train_log.exists() else ""
            return any(int(step) > after_step for step in CHECKPOINT_SAVED.findall(text))

        wait_for(past_step, f"checkpoint after step {after_step}", process, console)
        job = wait_for(lambda: running_train_job(cluster), "running train job in squeue", process, console)
        cluster.client("scancel", *scancel_options, job)
        returncode = process.wait(timeout=WAIT_S)
    finally:
        if process.process.poll() is None:
            process.kill()
    output = console.read_text(errors="replace")
    assert returncode != 0, f"Snakemake succeeded although its train job was cancelled:\n{tail(output)}"
    assert f"SLURM-job '{job}' failed" in output, tail(output)
    assert f"asrflow: Slurm job {job} (train stage) ended " in output, tail(output)
    return train_log.read_text(errors="replace")


def test_preempted_and_cancelled_train_jobs_resume_to_the_same_model(slurm, reference, tmp_path_factory):
    copy = slurm_repo_copy(tmp_path_factory, "slurm-preempt")

    # Preemption: SIGTERM to the job's steps. The stage finishes its step, saves it, exits 75.
    preempted = cancel_train_during_training(slurm, copy, "--signal=TERM", after_step=0)
    stopped = STOPPED.search(preempted)
    assert stopped, f"the train stage did not stop with a checkpoint on SIGTERM:\n{tail(preempted)}"
    stopped_at = int(stopped.group(1))

    # scancel: SIGTERM to every process of the job, SIGKILL after KillWait. Again a checkpoint.
    cancelled = cancel_train_during_training(slurm, copy, after_step=stopped_at)
    resumed = RESUMED.search(cancelled)
    assert resumed and int(resumed.group(2)) == stopped_at, f"did not resume at step {stopped_at}:\n{tail(cancelled)}"
    stopped = STOPPED.search(cancelled)
    assert stopped, f"the train stage did not stop with a checkpoint on scancel:\n{tail(cancelled)}"
    stopped_at = int(stopped.group(1))

    result = run_on_slurm(slurm, copy)
    assert set(submitted(result.stdout)) == {"train", "evaluate"}, tail(result.stdout)
    finished = (copy / "logs/train.log").read_text()
    resumed = RESUMED.search(finished)
    assert resumed and int(resumed.group(2)) == stopped_at, f"did not resume at step {stopped_at}:\n{tail(finished)}"
    assert_same_weights(copy, reference)


def test_no_reachable_slurm_gets_one_message_before_any_submission(slurm, tmp_path_factory):
    copy = slurm_repo_copy(tmp_path_factory, "slurm-unreachable")
    stopped = LocalSlurm(tmp_path_factory.mktemp("slurm-stopped"))
    stopped.write_config()  # a real config whose slurmctld is not running
    result = run(copy, *SLURM_COMMAND, timeout=300, check=False, env=stopped.env(tool_env(copy)))
    assert result.returncode != 0
    assert "asrflow: Slurm is not reachable (sinfo exited" in result.stdout, tail(result.stdout)
    assert not submitted(result.stdout), tail(result.stdout)
    assert not list((copy / ".snakemake/locks").glob("*.lock")), "the failed start left its locks"


def test_a_partition_that_does_not_exist_is_named_before_any_submission(slurm, tmp_path_factory):
    copy = slurm_repo_copy(tmp_path_factory, "slurm-partition")
    result = run_on_slurm(slurm, copy, "--set-resources", "train:slurm_partition=gpu", check=False, timeout_s=300)
    assert result.returncode != 0
    assert f"asrflow: no such Slurm partition: gpu (rules train). sinfo lists: {PARTITION}." in result.stdout, tail(
        result.stdout
    )
    assert not submitted(result.stdout), tail(result.stdout)


def stage_processes(copy: Path) -> list[psutil.Process]:
    """The train stage's Python processes running in ``copy`` (inside the Slurm job's step)."""
    found = []
    for process in psutil.process_iter(["cmdline", "cwd"]):
        if process.info["cwd"] == str(copy) and "stages.train" in (process.info["cmdline"] or []):
            found.append(process)
    return found


def job_state(cluster: LocalSlurm, job: str) -> str:
    return cluster.client("squeue", "--states=all", "-h", "-j", job, "-o", "%T", check=False).strip()


def test_a_train_job_over_its_time_limit_ends_timeout_and_the_rerun_resumes_to_the_same_model(
    slurm, reference, tmp_path_factory
):
    """``runtime: 1`` (minute) for train. Once it saved a checkpoint, the stage is paused (SIGSTOP:
    a job slower than its limit, on a machine of any speed) until Slurm's time limit ends the job.
    The state is TIMEOUT, asrflow's line says so and what to raise; the same command again
    resumes from the last checkpoint to the uninterrupted model."""
    copy = slurm_repo_copy(tmp_path_factory, "slurm-timeout")
    train_log = copy / "logs/train.log"
    console = copy.parent / "snakemake-timeout.log"
    command = [*SLURM_COMMAND, "--set-resources", "train:runtime=1"]
    process = ChildProcess(command, log_path=console, env=slurm_env(slurm, copy), cwd=copy)
    paused: list[psutil.Process] = []
    try:

        def past_step():
            text = train_log.read_text(errors="replace") if train_log.exists() else ""
            return any(int(step) > 0 for step in CHECKPOINT_SAVED.findall(text))

        wait_for(past_step, "checkpoint after step 0", process, console)
        job = wait_for(lambda: running_train_job(slurm), "running train job in squeue", process, console)
        paused = wait_for(lambda: stage_processes(copy), "the train stage's process", process, console)
        for stage in paused:
            stage.suspend()
        wait_for(lambda: job_state(slurm, job) != "RUNNING", f"job {job} to reach its time limit", process, console)
        returncode = process.wait(timeout=WAIT_S)
    finally:
        for stage in paused:
            with contextlib.suppress(psutil.NoSuchProcess):
                stage.resume()
        if process.process.poll() is None:
            process.kill()
    output = console.read_text(errors="replace")
    assert returncode != 0, tail(output)
    assert job_state(slurm, job) == "TIMEOUT", job_state(slurm, job)
    message = re.search(rf"asrflow: Slurm job {job} \(train stage\) ended TIMEOUT(.*)", output)
    assert message, tail(output)
    print(message.group(0))
    assert "raise runtime (minutes) for train" in message.group(1), message.group(0)

    result = run_on_slurm(slurm, copy)
    assert set(submitted(result.stdout)) == {"train", "evaluate"}, tail(result.stdout)
    assert RESUMED.search(train_log.read_text()), f"did not resume:\n{tail(train_log.read_text())}"
    assert_same_weights(copy, reference)


def test_a_job_over_its_memory_gets_one_message_with_the_job_the_stage_and_slurms_reason(slurm, tmp_path_factory):
    copy = slurm_repo_copy(tmp_path_factory, "slurm-oom")
    result = run_on_slurm(slurm, copy, "--set-resources", "prepare:mem_mb=100", check=False, timeout_s=600)
    assert result.returncode != 0
    job = submitted(result.stdout)["prepare"]
    message = re.search(rf"asrflow: Slurm job {job} \(prepare stage\) ended (\w+)(.*)", result.stdout)
    assert message, tail(result.stdout)
    print(message.group(0))
    # jobacct_gather's OverMemoryKill ends the job: state FAILED, the reason in the job's log
    assert message.group(1) in ("OUT_OF_MEMORY", "FAILED"), message.group(0)
    assert "exceeded memory limit" in message.group(2), message.group(0)
    assert "raise mem_mb for prepare" in message.group(2), message.group(0)
