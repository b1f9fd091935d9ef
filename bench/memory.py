"""Peak memory of the prepare and features stages, and how it grows with the corpus.

For two sizes of a generated corpus of 0.5-1.5 s utterances, each stage runs as the pipeline runs it,
in its own process, under a wrapper (``python -m bench.memory --child REPORT MODULE ARGS``) that
reports its ``VmHWM`` before the interpreter shuts down (shutdown with torch loaded raises it).
Records: ``stage_memory`` (``peak_rss_mb``, the tree's polled ``peak_tree_pss_mb`` and
``peak_tree_rss_mb``, ``elapsed_s``), ``stage_memory_baseline`` (each stage's ``--help``: imports,
no data) and ``stage_memory_scaling`` (``rss_ratio``, ``rss_above_baseline_mb``, ``mb_per_1000_utts``).

Usage: ``python -m bench.memory [--quick] [--workdir DIR]``.
"""

from __future__ import annotations

import json
import logging
import os
import runpy
import sys
import time
from pathlib import Path

import yaml

from asrflow.testing.corpora import folder_corpus, generate_corpus
from asrflow.testing.processes import ChildProcess
from asrflow.testing.repo import REPO, repo_params
from bench.common import emit, machine, parse_args, ratio, rounded, workdir

SIZES = {"full": (2500, 10000), "quick": (100, 400)}
MIN_S, MAX_S = 0.5, 1.5
STAGES = ("prepare", "features")
CHILD_FLAG = "--child"
POLL_S = 0.25


def child(report: Path, module: str, argv: list[str]) -> None:
    """Run ``module`` as ``python -m module argv`` would, write ``{"vm_hwm_kb", "exit_code"}`` to
    ``report`` and leave with ``os._exit`` (no interpreter shutdown to inflate the figures)."""
    code = 0
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)  # spawn workers import it as -m does
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
    status = Path("/proc/self/status").read_text().splitlines()
    vm_hwm_kb = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    report.write_text(json.dumps({"vm_hwm_kb": vm_hwm_kb, "exit_code": code}))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def measure(module: str, argv: list[str], log_path: Path) -> dict:
    """``python -m module argv`` (wrapped, from the repository root): its peak memory and wall time."""
    report = log_path.with_suffix(".memory.json")
    report.unlink(missing_ok=True)
    command = [sys.executable, "-m", "bench.memory", CHILD_FLAG, str(report), module, *argv]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GIT_PYTHON_REFRESH": "quiet"}
    start = time.perf_counter()
    process = ChildProcess(command, log_path=log_path, env=env, cwd=REPO, memory_poll_s=POLL_S)
    returncode = process.wait()
    elapsed = time.perf_counter() - start
    if returncode != 0 or not report.is_file():
        raise RuntimeError(f"python -m {module} exited {returncode}; log {log_path}:\n{process.tail(15)}")
    return {
        "peak_rss_mb": rounded(json.loads(report.read_text())["vm_hwm_kb"] / 1024),
        "peak_tree_pss_mb": rounded(process.peak_pss / 2**20) if process.peak_pss else None,
        "peak_tree_rss_mb": rounded(process.peak_rss / 2**20) if process.peak_rss else None,
        "elapsed_s": rounded(elapsed),
    }


def corpus(work: Path, utterances: int) -> tuple[Path, dict]:
    """A generated corpus of ``utterances`` short utterances (cached in ``work``)."""
    folder = work / f"short-{utterances}" / "corpus"
    marker = folder / ".done"
    if marker.is_file():
        return folder, {"utterances": utterances, "audio_s": float(marker.read_text())}
    info = generate_corpus(folder, utterances, seed=0, min_s=MIN_S, max_s=MAX_S)
    marker.write_text(f"{info['audio_s']}")
    return folder, info


def write_params(root: Path, corpus_dir: Path, num_jobs: int | None = None) -> Path:
    """The repository's params with ``prepare:`` pointed at ``corpus_dir`` (and ``features.num_jobs`` set)."""
    params = repo_params()
    params["prepare"].update(corpus="folder", corpus_dir=str(corpus_dir), splits=folder_corpus(corpus_dir).splits)
    if num_jobs is not None:
        params["features"]["num_jobs"] = num_jobs
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def stage_argv(stage: str, root: Path, params: Path) -> tuple[str, list[str]]:
    """The module and arguments of ``stage`` for the corpus prepared under ``root``."""
    manifests, fbank = root / "manifests", root / "fbank"
    if stage == "prepare":
        return "stages.prepare", ["--params", str(params), "--out", str(manifests)]
    return "stages.features", ["--params", str(params), "--manifests", str(manifests), "--out", str(fbank)]


def scaling(base: dict, lo: dict, hi: dict, *, small: int, large: int) -> dict:
    """How a stage's peaks and time grow from ``small`` to ``large`` utterances."""
    peaks, pss = [lo["peak_rss_mb"], hi["peak_rss_mb"]], [lo["peak_tree_pss_mb"], hi["peak_tree_pss_mb"]]
    return {
        "baseline_rss_mb": base["peak_rss_mb"],
        "baseline_pss_mb": base["peak_tree_pss_mb"],
        "peak_rss_mb": peaks,
        "rss_ratio": rounded(ratio(peaks[1], peaks[0])),
        "rss_above_baseline_mb": [rounded(peak - base["peak_rss_mb"]) for peak in peaks],
        "mb_per_1000_utts": rounded((peaks[1] - peaks[0]) * 1000 / (large - small)),
        "peak_tree_pss_mb": pss,
        "tree_pss_ratio": rounded(ratio(pss[1] or 0, pss[0] or 0)),
        "elapsed_s": [lo["elapsed_s"], hi["elapsed_s"]],
        "elapsed_ratio": rounded(ratio(hi["elapsed_s"], lo["elapsed_s"])),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv)
    sizes = SIZES["quick" if args.quick else "full"]
    num_jobs = 1 if args.quick else None  # quick: no extraction workers to start, so it stays short
    with workdir(args.workdir) as work:
        emit({"benchmark": "machine", **machine()})
        base = {}
        for stage in STAGES:
            base[stage] = measure(f"stages.{stage}", ["--help"], work / f"baseline-{stage}.log")
            command = f"python -m stages.{stage} --help"
            emit({"benchmark": "stage_memory_baseline", "stage": stage, "command": command, **base[stage]})
        corpora = {n: corpus(work, n) for n in sizes}
        params = {n: write_params(folder.parent, folder, num_jobs) for n, (folder, _) in corpora.items()}
        figures: dict[tuple[str, int], dict] = {}
        for stage in STAGES:  # each record printed when measured: a run cut short keeps what it measured
            for n in sizes:
                folder, info = corpora[n]
                module, stage_args = stage_argv(stage, folder.parent, params[n])
                figures[stage, n] = measure(module, stage_args, folder.parent / f"{stage}.log")
                audio_s = rounded(info["audio_s"])
                emit(
                    {
                        "benchmark": "stage_memory",
                        "stage": stage,
                        "utterances": n,
                        "audio_s": audio_s,
                        **figures[stage, n],
                    }
                )
        features = repo_params().get("features", {})
        record = {
            "benchmark": "stage_memory_scaling",
            "utterances": list(sizes),
            "utterance_ratio": sizes[1] / sizes[0],
        }
        record |= {
            "features_num_jobs": num_jobs or features.get("num_jobs"),
            "features_on_the_fly": features.get("on_the_fly"),
        }
        for stage in STAGES:
            record[stage] = scaling(
                base[stage], figures[stage, sizes[0]], figures[stage, sizes[1]], small=sizes[0], large=sizes[1]
            )
        emit(record)


if __name__ == "__main__":
    if sys.argv[1:2] == [CHILD_FLAG]:
        child(Path(sys.argv[2]), sys.argv[3], sys.argv[4:])
    else:
        main()
