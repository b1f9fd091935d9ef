"""The whole yesno pipeline SIGKILLed (its whole process group) at seeded random moments over
every stage, re-run right after each kill without reaping the killed run, ends as one uninterrupted
run does: every model tensor ``torch.equal``, the same evaluation (bench/random_kill.py; ``--kills 20``
is the benchmark). Each kill is seen, from outside, to land in the stage it aims at (Snakemake's
console and a live ``python -m stages.<stage>`` of the group), and the killed Snakemake is seen to be
a zombie (dead, its pid not yet reaped) when its re-run starts: its locks must count as stale. Each re-run, by
its console, starts no stage that an earlier run finished: it redoes only what the kill interrupted.
The second test checks that last rule alone, without a pipeline run.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from bench.random_kill import (
    RULE_FINISHED,
    RULE_STARTED,
    STAGES,
    Kill,
    fresh_copy,
    kill_status,
    killed_run,
    measure,
)
from tests.support.pipeline_tools import run, tail

pytestmark = pytest.mark.pipeline

KILLS = 5
SEED = 26
RULE_PATTERNS = (RULE_STARTED, RULE_FINISHED)


def stages_of_each_run(folder: Path) -> list[tuple[list[str], list[str]]]:
    """The stages each run of a killed pipeline (its console, ``folder/killed-NN.log``) started and finished."""
    runs = []
    for console in sorted(folder.glob("killed-*.log")):
        text = console.read_text()
        started, finished = ([rule for rule in rules.findall(text) if rule in STAGES] for rules in RULE_PATTERNS)
        runs.append((started, finished))
    return runs


def check_each_rerun_resumes(runs: list[tuple[list[str], list[str]]]) -> None:
    """Each run starts work, and none starts a stage an earlier run finished (its outputs are complete: only
    what a kill interrupted is done again); the last run finishes what it started, and every stage got done."""
    done: set[str] = set()
    for number, (started, finished) in enumerate(runs, 1):
        assert started, f"run {number} started no stage"
        again = done & set(started)
        assert not again, f"run {number} started {sorted(again)} again, which an earlier run had finished"
        done |= set(finished)
    assert set(runs[-1][1]) == set(runs[-1][0]), runs[-1]
    assert done == set(STAGES), runs


def test_random_kills_over_every_stage_end_with_the_uninterrupted_model_and_evaluation(tmp_path):
    record = measure(tmp_path, kills=KILLS, seed=SEED)
    print(json.dumps({key: record[key] for key in ("kills", "clean_s", "killed_total_s", "ratio")}))
    assert record["kills_made"] == KILLS, record["status"]
    for kill in record["kills"]:  # observed when the kill was sent: the console's running rules, the group's processes
        assert kill["stage"] in kill["landed_in"].split(","), kill
        assert kill["stage"] in kill["processes_running"], kill
    # read from each run's console: a re-run redoes only what the kill interrupted
    check_each_rerun_resumes(stages_of_each_run(tmp_path / "killed"))
    # observed once each re-run had started: the killed Snakemake dead but not yet reaped (its locks left behind)
    assert record["reruns_beside_zombie"] == KILLS, record["kills"]
    assert record["tensors"] > 0 and record["tensors_different"] == [], record["tensors_different"]
    assert record["evaluation_equal"]

    # a kill the pipeline's end comes before is reported, not made: the clean copy has nothing left to do
    late = killed_run(tmp_path / "clean" / "repo", [Kill(stage="evaluate", delay_s=0.0)])
    assert late.made == [] and len(late.run_seconds) == 1
    assert kill_status(late) == "made 0 of 1 kills: the pipeline finished before the kills aimed at evaluate"


def test_locks_held_by_a_zombie_snakemake_count_as_stale(tmp_path):
    copy = fresh_copy(tmp_path / "repo")
    zombie = subprocess.Popen(["true"])  # exits, never waited for until the end: a zombie of this process
    try:
        deadline = time.monotonic() + 30
        while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.05)
        locks = copy / ".snakemake/locks"
        locks.mkdir(parents=True)
        (locks / "0.input.lock").write_text("")
        (locks / "0.output.lock").write_text("")
        holder = {"host": socket.gethostname(), "pid": zombie.pid, "started": psutil.Process(zombie.pid).create_time()}
        (copy / ".snakemake/asrflow_lock_holder.json").write_text(json.dumps(holder))
        result = run(copy, "snakemake", "--dry-run", "--cores", "1", timeout=300)
    finally:
        zombie.wait()
    assert f"removed the locks of an interrupted Snakemake run (pid {zombie.pid}, now gone)" in result.stdout, tail(
        result.stdout
    )
    assert not list(locks.glob("*.lock"))
