"""Random kills: the yesno pipeline under ``snakemake --cores all``, its whole process group SIGKILLed at N
seeded moments spread over every stage, re-run right after each kill without reaping the killed run first; it
must end as one uninterrupted run does (every tensor of ``exp/model.pt`` equal, the same
``exp/eval/metrics.json`` timings aside).

``python -m bench.random_kill --kills 20 [--seed 0] [--workdir DIR]``

Kill ``k`` aims at ``STAGES[k % 5]``, at a moment drawn from 5-95 % of that stage's clean duration divided by
the kills aimed at it, from its start in the run being killed. Observed per kill, from outside: the stages
running when it was sent (Snakemake's console, and the group's live ``python -m stages.<stage>`` processes,
read with the group stopped), and, once the re-run had started, the killed Snakemake's process status (an
unreaped zombie, as a user's terminal leaves it) and how many of its group's processes were still listed or
alive. Record ``random_kill``: ``clean_s``, ``killed_total_s`` (every run of the killed pipeline), their ratio,
the work lost per kill, the checks.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from bench.common import emit, load_average, machine, parse_args, ratio, workdir
from tests.support.processes import ChildProcess
from tests.support.repo import copy_repo, tool_env

STAGES = ("prepare", "features", "tokenizer", "train", "evaluate")
RULE_STARTED = re.compile(r"^(?:local)?rule (\w+):$", re.MULTILINE)
RULE_FINISHED = re.compile(r"^Finished jobid: \d+ \(Rule: (\w+)\)$", re.MULTILINE)
STAGE_COMMAND = re.compile(r"-m stages\.(\w+)")
POLL_S = 0.1
KILL_WINDOW = (0.05, 0.95)


class PipelineFailed(RuntimeError):
    """A Snakemake run (clean, or a re-run after a kill) exited non-zero; the message holds its output's tail."""


@dataclass(kw_only=True)
class Kill:
    """One planned kill: the stage aimed at and the delay after its start (s); what was observed."""

    stage: str
    delay_s: float
    made: bool = False
    landed_in: str | None = None  # the stages the console showed running when the group was killed
    processes_running: list[str] = field(default_factory=list)  # stages a live process of the group ran then
    run_s: float = 0.0  # how long the killed run had run
    # just after the re-run started: the killed Snakemake's psutil status, its group's processes still
    # listed (zombies included) and those of them not zombies
    snakemake_at_rerun: str | None = None
    group_listed_at_rerun: int | None = None
    group_alive_at_rerun: int | None = None

    @property
    def landed(self) -> bool:
        """Whether the aimed stage was running when the kill was sent, by the console and by a live process."""
        return self.stage in (self.landed_in or "").split(",") and self.stage in self.processes_running


@dataclass
class KillRun:
    kills: list[Kill]
    run_seconds: list[float] = field(default_factory=list)  # every run, the finishing one last

    @property
    def made(self) -> list[Kill]:
        return [kill for kill in self.kills if kill.made]


def group(pgid: int) -> list[dict]:
    """psutil's ``pid``, ``status`` and ``cmdline`` of each process now listed in process group ``pgid``, zombies
    included (a zombie's ``cmdline`` is None)."""
    members = []
    for process in psutil.process_iter(["pid", "status", "cmdline"]):
        try:
            if os.getpgid(process.pid) == pgid:
                members.append(process.info)
        except OSError:  # gone since it was listed
            continue
    return members


def fresh_copy(destination: Path) -> Path:
    """The repository copied to ``destination`` as a git repository of one commit."""
    copy_repo(destination)
    identity = ["-c", "user.name=asrflow", "-c", "user.email=bench@asrflow.invalid", "-c", "commit.gpgsign=false"]
    for command in (["init", "-q"], [*identity, "add", "-A"], [*identity, "commit", "-q", "-m", "random kill copy"]):
        subprocess.run(["git", *command], cwd=destination, check=True, capture_output=True, timeout=120)
    return destination


class SnakemakeRun(ChildProcess):
    """``snakemake --cores all`` in ``copy``, its own process group, its output in ``console``."""

    def __init__(self, copy: Path, console: Path):
        super().__init__(["snakemake", "--cores", "all"], log_path=console, env=tool_env(copy), cwd=copy)
        self.began = time.monotonic()

    def stages(self) -> tuple[list[str], list[str]]:
        """The stages this run started and those it finished so far, in the order Snakemake said so."""
        text = self.log()
        started = [rule for rule in RULE_STARTED.findall(text) if rule in STAGES]
        return started, [rule for rule in RULE_FINISHED.findall(text) if rule in STAGES]

    def elapsed(self) -> float:
        return time.monotonic() - self.began

    def finished(self) -> bool:
        return self.process.poll() is not None

    def check(self) -> None:
        if self.process.returncode:
            raise PipelineFailed(f"snakemake exited {self.process.returncode}:\n{self.tail(40)}")

    def kill(self) -> tuple[list[str], list[str]]:
        """SIGKILL the whole group and return once Snakemake has died, without reaping it (``waitid`` with
        ``WNOWAIT``): it stays a zombie until :meth:`reap`, and its workers exit in their own time, while the next
        run starts. Just before, the group is
        frozen (SIGSTOP) and read, so both readings are of the moment of the kill: the stages the console shows
        running (a rule line, no "Finished jobid" yet), and the stages a live process of the group runs (command
        line ``-m stages.<stage>``)."""
        self.signal(signal.SIGSTOP)
        started, finished = self.stages()
        console = [stage for stage in started if stage not in finished]
        live = (member for member in group(self.pid) if member["status"] != psutil.STATUS_ZOMBIE)
        processes = sorted(
            {stage for member in live for stage in STAGE_COMMAND.findall(" ".join(member["cmdline"] or []))}
        )
        self.signal(signal.SIGKILL)
        os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        return console, processes

    def remains(self) -> tuple[str, int, int]:
        """Read now: Snakemake's psutil status (``gone`` once no longer listed), how many of its group's
        processes are still listed (zombies included) and how many of them are not zombies."""
        members = group(self.pid)
        status = next((member["status"] for member in members if member["pid"] == self.pid), "gone")
        alive = sum(member["status"] != psutil.STATUS_ZOMBIE for member in members)
        return status, len(members), alive

    def reap(self) -> None:
        """Wait for Snakemake (killed before), so that no zombie outlives the benchmark."""
        self.process.wait(timeout=60)


def clean_run(copy: Path) -> tuple[float, dict[str, float]]:
    """One uninterrupted run: its wall seconds and each stage's duration (s), from Snakemake's rule lines
    (features and tokenizer may run side by side)."""
    run = SnakemakeRun(copy, copy.parent / "clean.log")
    starts: dict[str, float] = {}
    ends: dict[str, float] = {}
    while not run.finished():
        started, finished = run.stages()
        for stage in started:
            starts.setdefault(stage, run.elapsed())
        for stage in finished:
            ends.setdefault(stage, run.elapsed())
        time.sleep(POLL_S)
    run.check()
    total = run.elapsed()
    missing = [stage for stage in STAGES if stage not in starts]
    if missing:  # a stage that started and ended between two polls
        raise PipelineFailed(f"no rule line seen for {missing}:\n{run.tail(40)}")
    return total, {stage: ends.get(stage, total) - starts[stage] for stage in STAGES}


def plan_kills(count: int, durations: dict[str, float], seed: int) -> list[Kill]:
    """``count`` kills in pipeline order, each stage in turn, at seeded moments within the stage."""
    rng = random.Random(seed)
    kills = [Kill(stage=STAGES[k % len(STAGES)], delay_s=0.0) for k in range(count)]
    kills.sort(key=lambda kill: STAGES.index(kill.stage))
    for kill in kills:
        aimed = sum(other.stage == kill.stage for other in kills)
        kill.delay_s = rng.uniform(*KILL_WINDOW) * durations[kill.stage] / aimed
    return kills


def killed_run(copy: Path, kills: list[Kill]) -> KillRun:
    """Run the pipeline, killing it as ``kills`` plan and re-running right after each kill, until it finishes.

    A killed run is not waited for before the re-run starts (its Snakemake an unreaped zombie, its workers maybe
    still exiting); what is left of it is read once the re-run has started. The killed runs are reaped at the end.
    """
    record = KillRun(kills)
    pending = list(kills)
    killed: list[tuple[Kill, SnakemakeRun]] = []
    try:
        while True:
            run = SnakemakeRun(copy, copy.parent / f"killed-{len(record.run_seconds) + 1:02d}.log")
            if killed:
                last, before = killed[-1]
                last.snakemake_at_rerun, last.group_listed_at_rerun, last.group_alive_at_rerun = before.remains()
            kill = pending[0] if pending else None
            aim_start = None
            while not run.finished():
                started = run.stages()[0]
                if kill is not None and aim_start is None and _reached(started, kill.stage):
                    aim_start = run.elapsed()
                if aim_start is not None and run.elapsed() - aim_start >= kill.delay_s:
                    kill.run_s = run.elapsed()
                    console, kill.processes_running = run.kill()
                    kill.landed_in = ",".join(console) or "snakemake"  # none running: Snakemake between jobs
                    kill.made = True
                    killed.append((kill, run))
                    break
                time.sleep(POLL_S)
            record.run_seconds.append(run.elapsed())
            if kill is not None and kill.made:
                pending.pop(0)
                continue
            run.check()
            return record  # finished: any kill still pending could not be made
    finally:
        for _, before in killed:
            before.reap()


def _reached(started: list[str], stage: str) -> bool:
    """Whether this run started ``stage``, or a stage after it (then an earlier run finished ``stage``)."""
    return any(STAGES.index(name) >= STAGES.index(stage) for name in started)


def kill_status(record: KillRun) -> str:
    """``ok`` when every planned kill was made; else how many were, and which the pipeline's end came before."""
    missed = [kill.stage for kill in record.kills if not kill.made]
    if not missed:
        return "ok"
    return (
        f"made {len(record.made)} of {len(record.kills)} kills: the pipeline finished before the kills "
        f"aimed at {', '.join(missed)}"
    )


def model_tensors(copy: Path) -> dict:
    import torch

    return torch.load(copy / "exp/model.pt", map_location="cpu", weights_only=True)["model"]


def different_tensors(a: Path, b: Path) -> list[str]:
    """Names of the model tensors that are not ``torch.equal`` between two copies' exp/model.pt."""
    import torch

    wa, wb = model_tensors(a), model_tensors(b)
    if wa.keys() != wb.keys():
        return sorted(set(wa) ^ set(wb))
    return [name for name in wa if not torch.equal(wa[name], wb[name])]


def evaluation(copy: Path) -> dict:
    """exp/eval/metrics.json without its timings (``rtf_*``, the decoder's real-time factors)."""
    import json

    metrics = json.loads((copy / "exp/eval/metrics.json").read_text())
    return {key: value for key, value in metrics.items() if not key.startswith("rtf_")}


def measure(root: Path, kills: int, seed: int) -> dict:
    """The clean run, then the killed one, in two fresh copies under ``root``; the figures and the checks."""
    clean_copy = fresh_copy(root / "clean" / "repo")
    killed_copy = fresh_copy(root / "killed" / "repo")
    clean_s, durations = clean_run(clean_copy)
    record = killed_run(killed_copy, plan_kills(kills, durations, seed))
    made, killed_total, ended = record.made, sum(record.run_seconds), evaluation(clean_copy)
    found = {"benchmark": "random_kill", "status": kill_status(record), "seed": seed, "kills_planned": kills}
    found |= {"kills_made": len(made), "kills": [asdict(kill) | {"landed": kill.landed} for kill in record.kills]}
    found |= {"kills_landed": sum(kill.landed for kill in made)}
    found |= {"reruns_beside_zombie": sum(kill.snakemake_at_rerun == psutil.STATUS_ZOMBIE for kill in made)}
    found["stages_hit"] = sorted({name for kill in made for name in kill.landed_in.split(",") if name in STAGES})
    found |= {"clean_s": clean_s, "stage_s": durations, "killed_total_s": killed_total, "runs": len(record.run_seconds)}
    lost = (killed_total - clean_s) / len(made) if made else None
    found |= {"ratio": ratio(killed_total, clean_s), "lost_per_kill_s": lost}
    found |= {"tensors_different": different_tensors(killed_copy, clean_copy)}
    found |= {"tensors": len(model_tensors(clean_copy)), "evaluation_equal": evaluation(killed_copy) == ended}
    return found | {"wer": ended["wer"], "load_average": load_average()}


def main(argv: list[str] | None = None) -> list[dict]:
    def options(parser):
        parser.add_argument("--kills", type=int, default=20, help="how many SIGKILLs of the whole group (default 20)")
        parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments")

    args = parse_args(__doc__.splitlines()[0], argv, options)
    with workdir(args.workdir) as root:
        record = emit({**measure(root, args.kills, args.seed), "machine": machine()})
    return [record]


if __name__ == "__main__":
    main()
