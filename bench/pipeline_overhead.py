"""Pipeline tool overhead: ``snakemake --cores all`` and ``dvc repro`` with nothing to do.

``python -m bench.pipeline_overhead [--quick] [--workdir DIR]``: in a repository copy with tiny params, the
pipeline built once by Snakemake and recorded by ``dvc commit``, then each tool run again (it must do nothing),
interleaved with its ``--version``. Record ``pipeline_overhead``: ``noop_s`` (median), ``startup_s``, ``ratio``.
"""

from __future__ import annotations

import shutil

from bench.common import emit, noop_runs, parse_args, rounded, timed_run, workdir
from tests.support.repo import copy_repo, tool_env, write_shipped_params
from tests.support.tiny_config import TINY_MODEL

#: params.yaml changes (dotted keys) that make the copy's pipeline quick to build, with the tiny model.
TRAIN = {
    "train.optim.epochs": 1,
    "run.num_workers": 0,
    "train.data.max_duration_s": 60.0,
    "train.optim.warmup_steps": 2,
    "train.optim.average_last": 1,
    "train.optim.num_threads": 1,
}


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(__doc__.splitlines()[0], argv)
    with workdir(args.workdir) as work:
        repo = work / "pipeline-copy"
        shutil.rmtree(repo, ignore_errors=True)
        copy_repo(repo)
        changes = {f"train.model.{key}": value for key, value in TINY_MODEL.items()} | TRAIN
        write_shipped_params(repo, {"features.num_jobs": 1, **changes})
        env = tool_env(repo)
        build_s, _ = timed_run(["snakemake", "--cores", "all"], repo, env)
        timed_run(["dvc", "init", "--no-scm", "-q"], repo, env)
        commit_s, _ = timed_run(["dvc", "commit", "-f", "-q"], repo, env)
        commands = {"snakemake": ["snakemake", "--cores", "all"], "dvc": ["dvc", "repro"]}
        found = noop_runs(repo, commands, 2 if args.quick else 3, version=True)
        shutil.rmtree(repo, ignore_errors=True)
    facts = {"benchmark": "pipeline_overhead", "snakemake_build_s": rounded(build_s), "dvc_commit_s": rounded(commit_s)}
    return [emit({**facts, **record}) for record in found]


if __name__ == "__main__":
    main()
