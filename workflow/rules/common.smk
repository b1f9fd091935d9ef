# Helpers that turn a dvc.yaml stage into a Snakemake rule's input, output, params and shell.
import functools
import json
import os
import re
import sys
from pathlib import Path

import yaml

DVC_STAGES = yaml.safe_load(Path("dvc.yaml").read_text())["stages"]


def _outs(stage):
    """``(path, options)`` of each of ``stage``'s dvc.yaml outs (``options`` such as ``persist``)."""
    for out in DVC_STAGES[stage].get("outs", []):
        yield next(iter(out.items())) if isinstance(out, dict) else (out, {})


PRODUCED = {path for stage in DVC_STAGES for path, _ in _outs(stage)}

# DVC runs an ``always_changed`` stage (corpus_listing) every time and re-runs the stages that
# depend on it only when its output changed. Snakemake has no such rule: it runs the stage's
# command when it first needs a rule's params (building the jobs: a run or a dry run, not
# --lint) and gives each dependent rule the output's SHA-256 as a param, so that a changed
# output (and only that) re-runs it; a file's time would not do, as one rewritten with the same
# content is newer. It runs once per invocation: a job's own reading of the workflow (under
# Slurm, each job reads it again) takes the digest of the output the main process wrote.
ALWAYS_RUN = [stage for stage, spec in DVC_STAGES.items() if spec.get("always_changed")]
ALWAYS_RUN_OUTS = {path for stage in ALWAYS_RUN for path, _ in _outs(stage)}


@functools.cache
def always_run_digests():
    """``{output path: SHA-256}`` of the always-changed stages' outputs, after running them (in the main process)."""
    import hashlib
    import subprocess

    from snakemake.exceptions import WorkflowError

    digests = {}
    for stage in ALWAYS_RUN:
        if workflow.is_main_process:
            done = subprocess.run(_resolve(DVC_STAGES[stage]["cmd"]), shell=True, capture_output=True, text=True)
            if done.returncode != 0:
                said = (done.stderr.strip().splitlines() or ["no message"])[-1]
                raise WorkflowError(f"asrflow: stage {stage} exited {done.returncode}: {said}")
        for path, _ in _outs(stage):
            digests[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return digests


def _always_run_digest(path):
    """A rule's param: the digest of ``path``, looked up when Snakemake builds the rule's jobs."""
    return lambda wildcards: always_run_digests()[path]


def _resolve(text):
    """Replace dvc.yaml's ${section.key} templates with values from params.yaml."""

    def value(match):
        return str(_param(match.group(1)))

    return re.sub(r"\$\{([^}]+)\}", value, text)


def _name(path):
    return re.sub(r"\W", "_", path)


def stage_inputs(stage):
    """Named inputs: files as they are; a folder another stage writes stays a folder;
    any other folder (library code, the corpus) is expanded to its files, so that editing
    one of them re-runs the rule."""
    inputs = {}
    for dep in DVC_STAGES[stage]["deps"]:
        dep = _resolve(dep)
        path = Path(dep)
        if dep in ALWAYS_RUN_OUTS:
            continue  # a param: stage_params
        if dep in PRODUCED or not path.is_dir():
            inputs[_name(dep)] = dep
        else:
            for i, file in enumerate(sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts)):
                inputs[_name(f"{dep}_{i}")] = str(file)
    return inputs


# Outputs that `snakemake --report report.html` shows: caption (reST, in workflow/report/)
# and category.
REPORTED = {
    "exp/eval/metrics.html": ("metrics.rst", "Evaluation"),
    "exp/eval/wer_by_duration.svg": ("wer_by_duration.rst", "Evaluation"),
    "exp/eval/train_loss.svg": ("train_loss.rst", "Training"),
}


def stage_outputs(stage):
    """Named outputs; persisted outs (checkpoints) are left to the stage, never deleted;
    those in REPORTED are marked for Snakemake's report."""
    outputs = {}
    for path, options in _outs(stage):
        if options.get("persist"):
            continue
        if path in REPORTED:
            caption, category = REPORTED[path]
            outputs[_name(path)] = report(
                path, caption=str(Path(workflow.basedir) / "report" / caption), category=category
            )
        else:
            outputs[_name(path)] = directory(path) if not Path(path).suffix else path
    return outputs


def every_output():
    """Every stage's outputs (persisted ones aside): the pipeline's targets. Snakemake re-makes
    a missing file only when a target needs it, and a file whose consumers are all up to date
    is not needed: with metrics.json alone as the target, a train stage that failed or was
    stopped (Snakemake removes its model first) left "Nothing to be done" and no model.
    DVC checks every stage's outs the same way."""
    return [
        path
        for stage in DVC_STAGES
        for path, options in _outs(stage)
        if not options.get("persist") and stage not in ALWAYS_RUN
    ]


def _param(dotted):
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node


def stage_params(stage):
    """The params.yaml sections and keys the stage declares (``train.optim``: one nested
    section), so a change re-runs it; and the SHA-256 of each dep an always-run stage writes."""
    params = {_name(key): _param(key) for key in DVC_STAGES[stage]["params"]}
    for dep in DVC_STAGES[stage]["deps"]:
        if dep in ALWAYS_RUN_OUTS:
            params[_name(dep)] = _always_run_digest(dep)
    return params


# The cores each stage keeps busy, so that `snakemake --cores N` runs side by side only what fits
# (features and the tokenizer both follow prepare). ALL_CORES: the stage spreads over every core
# it may use; Snakemake gives a rule at most --cores threads, and the stage keeps to its grant
# ($ASRFLOW_THREADS, asrflow/cores.py). prepare's thread pool waits on the disk, not the CPU.
ALL_CORES = os.cpu_count() or 1
STAGE_THREADS = {
    "prepare": lambda: 1,
    "features": lambda: _param("features.num_jobs") or ALL_CORES,
    "tokenizer": lambda: 1,  # SentencePiece's trainer on one thread (asrflow/tokenizer.py)
    "train": lambda: ALL_CORES,  # ranks, torch threads and data workers (run.num_workers: auto)
    "evaluate": lambda: ALL_CORES,  # torch's threads
}


def stage_threads(stage):
    """The rule's ``threads:``: the cores the stage keeps busy (STAGE_THREADS)."""
    return STAGE_THREADS[stage]()


def stage_shell(stage):
    """dvc.yaml's command with its output in the rule's log. Snakemake's stderr (the
    terminal) stays open as descriptor 3, where the stage shows its progress, warnings and
    the log's path (asrflow/logs.py); the tags of the MLflow run say Snakemake ran it. The
    threads Snakemake granted reach the stage as $ASRFLOW_THREADS."""
    env = (
        f"ASRFLOW_PIPELINE=snakemake ASRFLOW_STAGE={stage} ASRFLOW_LOG_FILE={{log}} ASRFLOW_PROGRESS_FD=3 "
        "ASRFLOW_THREADS={threads}"
    )
    return f"{env} {_resolve(DVC_STAGES[stage]['cmd'])} 3>&2 > {{log}} 2>&1"


# A Snakemake killed with SIGKILL (OOM killer, preempted node, power cut) leaves its locks in
# .snakemake/locks, and the next `snakemake` refuses to start until `snakemake --unlock`.
# So a run records who holds the locks (host, pid, process start time) once it has taken
# them, and a later run on the same host removes them when that process no longer exists.
# A live run, or one on another host sharing the folder, keeps its locks.
LOCK_HOLDER = Path(".snakemake/asrflow_lock_holder.json")


def _this_process():
    import socket

    import psutil

    process = psutil.Process()
    return {"host": socket.gethostname(), "pid": process.pid, "started": process.create_time()}


def _still_running(holder):
    import psutil

    try:
        process = psutil.Process(holder["pid"])
        # a killed run not yet reaped by its parent is a zombie: gone, though its pid is listed
        return abs(process.create_time() - holder["started"]) < 1.0 and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True


def clear_stale_locks():
    try:
        holder = json.loads(LOCK_HOLDER.read_text())
    except (OSError, ValueError):
        return
    if holder.get("host") != _this_process()["host"] or _still_running(holder):
        return
    stale = sorted(Path(".snakemake/locks").glob("*.lock"))
    for lock in stale:
        lock.unlink(missing_ok=True)
    LOCK_HOLDER.unlink(missing_ok=True)
    if stale:
        print(
            f"asrflow: removed the locks of an interrupted Snakemake run (pid {holder['pid']}, now gone)",
            file=sys.stderr,
        )


clear_stale_locks()


# Under `snakemake --executor slurm`: before anything is submitted, Slurm must answer and every
# partition the jobs ask for (resource slurm_partition, workflow/profiles/slurm) must exist;
# otherwise one message says which, instead of a failed sbatch per job.
SLURM_CHECK_TIMEOUT_S = 30


def check_slurm():
    import subprocess

    from snakemake.exceptions import WorkflowError

    plugin = workflow.executor_plugin
    if plugin is None or plugin.cli_prefix != "slurm":
        return
    try:
        answer = subprocess.run(
            ["sinfo", "--noheader", "--format=%R"], capture_output=True, text=True, timeout=SLURM_CHECK_TIMEOUT_S
        )
    except FileNotFoundError:
        raise WorkflowError("asrflow: --executor slurm, but sinfo is not on PATH: run Snakemake where Slurm's "
                            "client commands are installed (a login node)")
    except subprocess.TimeoutExpired:
        raise WorkflowError(f"asrflow: Slurm is not reachable: sinfo did not answer within {SLURM_CHECK_TIMEOUT_S} s")
    if answer.returncode != 0:
        reason = (answer.stderr.strip().splitlines() or ["no message"])[-1]
        raise WorkflowError(f"asrflow: Slurm is not reachable (sinfo exited {answer.returncode}: {reason}); "
                            "is slurmctld running, and SLURM_CONF or /etc/slurm/slurm.conf pointing at it?")
    partitions = set(answer.stdout.split())
    missing = {}
    for job in workflow.dag.needrun_jobs():
        partition = job.resources.get("slurm_partition")
        if partition and partition not in partitions:
            missing.setdefault(partition, set()).add(job.rule.name)
    if missing:
        asked = "; ".join(f"{name} (rules {', '.join(sorted(rules))})" for name, rules in sorted(missing.items()))
        raise WorkflowError(f"asrflow: no such Slurm partition: {asked}. sinfo lists: {', '.join(sorted(partitions))}. "
                            "Set slurm_partition in the profile's default-resources/set-resources.")


onstart:
    check_slurm()
    if workflow.executor_plugin is not None and workflow.executor_plugin.cli_prefix == "slurm":
        import atexit

        atexit.register(explain_slurm_failures, log)
    LOCK_HOLDER.write_text(json.dumps(_this_process()))


onsuccess:
    LOCK_HOLDER.unlink(missing_ok=True)


# Under --executor slurm, a failed job gets one asrflow line: the job, the stage, Slurm's state
# (FAILED, CANCELLED, OUT_OF_MEMORY, TIMEOUT, ...), Slurm's own words from the job's log, what to
# do. Snakemake runs no onerror hook when a job fails (it raises), so the main process prints
# these at exit (atexit, registered by onstart).
# (\x3a is ":", spelt so that `snakemake --lint` does not take the pattern for a rule)
SLURM_JOB_FAILED = re.compile(r"Error in rule (\w+)\x3a\n\s+message\x3a SLURM-job '(\d+)' failed, SLURM status is\x3a '(\w+)'")
SLURM_REASONS = ("exceeded memory limit", "DUE TO TIME LIMIT", "CANCELLED", "Exited with exit code", "killed")


def _slurm_said(slurm_log):
    if slurm_log is None:
        return ""
    lines = [
        line.strip()
        for line in slurm_log.read_text(errors="replace").splitlines()
        if "slurmstepd" in line or "srun: error" in line
    ]
    for key in SLURM_REASONS:
        for line in lines:
            if key in line:
                return line
    return lines[-1] if lines else ""


def explain_slurm_failures(log):
    """``log``: Snakemake's log file, or the list of them that Snakemake 9 passes."""
    text = ""
    for path in log if isinstance(log, (list, tuple)) else [log]:
        try:
            text += Path(path).read_text(errors="replace")
        except (OSError, TypeError):
            continue
    for rule, job, state in SLURM_JOB_FAILED.findall(text):
        slurm_log = next(Path(".snakemake/slurm_logs").glob(f"rule_{rule}/**/{job}.log"), None)
        said = _slurm_said(slurm_log)
        if state == "OUT_OF_MEMORY" or "memory limit" in said:
            hint = f"raise mem_mb for {rule} in the profile's set-resources"
        elif state == "TIMEOUT" or "TIME LIMIT" in said:
            hint = f"raise runtime (minutes) for {rule} in the profile's set-resources"
        else:
            hint = f"see logs/{rule}.log"
        reason = f" ({said})" if said else ""
        print(
            f"asrflow: Slurm job {job} ({rule} stage) ended {state}{reason}; {hint}, then run the same command "
            f"again (finished stages are kept, training resumes from its checkpoint). Slurm's log: {slurm_log}",
            file=sys.stderr,
        )


onerror:
    LOCK_HOLDER.unlink(missing_ok=True)
