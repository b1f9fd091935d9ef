"""Pipeline tool overhead: ``snakemake --cores all`` and ``dvc repro`` with nothing to do.

In a copy of the repository with a tiny params.yaml, the pipeline is built once with Snakemake and
recorded by DVC (``dvc commit -f``); then each tool runs again on the up-to-date pipeline and must
have nothing to do. ``noop_s``: median wall seconds of the no-op runs; baseline ``startup_s``: the
same tool's ``--version``; ``ratio`` = noop / startup; ``snakemake_build_s`` for scale.

Usage: ``python -m bench.pipeline_overhead [--quick] [--workdir DIR]``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
from pathlib import Path

import yaml

from asrflow.testing.repo import copy_repo
from asrflow.testing.tiny_config import TINY_MODEL
from asrflow.training.config import set_train_keys
from bench.common import emit, parse_args, ratio, rounded, timed_run, tool, workdir

REPEATS = {"full": 3, "quick": 2}
#: params.yaml changes that make the copy's pipeline quick to build.
TRAIN = {"epochs": 1, "num_workers": 0, "max_duration_s": 60.0, "warmup_steps": 2, "average_last": 1, "num_threads": 1}
TINY = {"features": {"num_jobs": 1}, "train": {**TINY_MODEL, **TRAIN}}


def tiny_copy(destination: Path) -> Path:
    """The repository copied to ``destination`` with the :data:`TINY` params."""
    copy_repo(destination)
    params_file = destination / "params.yaml"
    params = yaml.safe_load(params_file.read_text())
    params["features"].update(TINY["features"])
    set_train_keys(params, TINY["train"])
    params_file.write_text(yaml.safe_dump(params, sort_keys=False))
    return destination


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(__doc__.splitlines()[0], argv)
    mode = "quick" if args.quick else "full"
    repeats = REPEATS[mode]
    env = {**os.environ, "GIT_PYTHON_REFRESH": "quiet", "DVC_NO_ANALYTICS": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)  # the copy's own sqlite:///mlflow.db
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    snakemake, dvc = tool("snakemake"), tool("dvc")
    with workdir(args.workdir) as work:
        repo = work / "pipeline-copy"
        shutil.rmtree(repo, ignore_errors=True)
        tiny_copy(repo)
        build_s, _ = timed_run([snakemake, "--cores", "all"], repo, env)
        timed_run([dvc, "init", "--no-scm", "-q"], repo, env)
        commit_s, _ = timed_run([dvc, "commit", "-f", "-q"], repo, env)
        commands = {
            "snakemake": (
                [snakemake, "--cores", "all"],
                [snakemake, "--version"],
                lambda out: "Nothing to be done" in out,
            ),
            "dvc": ([dvc, "repro"], [dvc, "--version"], lambda out: "up to date" in out and "Running stage" not in out),
        }
        records = []
        for name, (noop, version, nothing_done) in commands.items():
            noop_times, startup_times, idle = [], [], True
            for _ in range(repeats):  # interleaved, so both see the same load
                elapsed, output = timed_run(noop, repo, env)
                noop_times.append(elapsed)
                idle = idle and nothing_done(output)
                startup_times.append(timed_run(version, repo, env)[0])
            noop_s, startup_s = statistics.median(noop_times), statistics.median(startup_times)
            status = "ok" if idle else "failed: the no-op run did work"
            record = {"benchmark": "pipeline_overhead", "status": status, "mode": mode, "tool": name}
            record |= {"command": " ".join([Path(noop[0]).name, *noop[1:]]), "noop_s": rounded(noop_s)}
            record |= {"noop_s_all": [rounded(t) for t in noop_times], "startup_s": rounded(startup_s)}
            record |= {"ratio": rounded(ratio(noop_s, startup_s)), "snakemake_build_s": rounded(build_s)}
            record |= {"dvc_commit_s": rounded(commit_s), "repeats": repeats, "nothing_to_do": idle}
            records.append(emit(record))
        shutil.rmtree(repo, ignore_errors=True)
        return records


if __name__ == "__main__":
    main()
