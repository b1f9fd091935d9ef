"""Peak memory of the prepare and features stages, and how it grows with the corpus.

For two sizes of a generated ``corpus: folder`` corpus (short utterances of 0.5-1.5 s:
tone-burst "words" in noise, 16 kHz WAV, see :func:`bench.common.generate_corpus`), this
runs the real stages as the pipeline does, each in its own process from the repository
root, with a params file that is the repository's ``params.yaml`` pointed at the corpus::

    python -m stages.prepare  --params P --out M
    python -m stages.features --params P --manifests M --out F

Each stage runs under a thin wrapper (``python -m bench.memory --child REPORT MODULE ARGS``)
that runs ``MODULE`` exactly as ``python -m`` does and then, before the interpreter shuts
down, writes its own high-water mark. This matters: Python's shutdown with torch loaded
raises a process's RSS high-water mark by ~180 MB (measured: ``import torch`` alone peaks
at 705 MB ending with ``os._exit``, 888 MB ending normally), which would swamp what the
data costs if ``ru_maxrss`` were read after exit.

Figures per stage and size:

* ``peak_rss_mb``: the stage process' peak resident set (``VmHWM``) at the end of its work;
* ``peak_tree_pss_mb``: the largest sum of the proportional set sizes (shared pages split
  between the processes sharing them) of the stage and all its workers, polled every
  0.5 s with psutil: what the machine must hold while the workers run at once;
  ``peak_tree_rss_mb``: the same with resident sets (counts shared pages once in every
  process; polled every 50 ms); short spikes between polls may be missed;
* ``elapsed_s``: wall seconds of the stage.

The baseline of each stage, measured in the same run under the same wrapper, is the
stage run with ``--help``: every import done, no data touched (``baseline_rss_mb``,
``baseline_pss_mb``). ``scaling`` compares the two sizes: ``rss_ratio`` = peak at the
large size / peak at the small size (the utterance ratio is 4), ``rss_above_baseline_mb``
= each peak minus the stage's baseline (what the data costs), and ``mb_per_1000_utts`` =
the growth of the peak per 1,000 utterances.

Usage: ``python -m bench.memory [--quick] [--workdir DIR]`` (sizes 2,500 and 10,000 with the
repository's ``features.num_jobs``; 100 and 400 with one extraction job with ``--quick``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import runpy
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from asrflow.testing.corpora import generate_corpus
from asrflow.testing.repo import REPO, repo_params
from bench.common import emit, machine, parse_args, ratio, rounded, workdir

#: (small, large) corpus sizes in utterances, per mode.
SIZES = {"full": (2500, 10000), "quick": (100, 400)}
#: Utterance lengths of the generated corpus, seconds.
MIN_S, MAX_S = 0.5, 1.5

STAGES = ("prepare", "features")
#: First argument of the wrapper mode.
CHILD_FLAG = "--child"


def _tree(pid: int) -> list:
    """``pid`` and its descendants as psutil processes (empty once it is gone)."""
    import psutil

    try:
        process = psutil.Process(pid)
        return [process, *process.children(recursive=True)]
    except psutil.Error:
        return []


def _tree_memory(pid: int, with_pss: bool) -> tuple[int, int]:
    """Summed RSS and (when ``with_pss``, else 0) PSS in bytes of ``pid`` and its descendants."""
    import psutil

    rss = pss = 0
    for proc in _tree(pid):
        with contextlib.suppress(psutil.Error):  # a worker that just ended
            if with_pss:
                info = proc.memory_full_info()
                rss, pss = rss + info.rss, pss + info.pss
            else:
                rss += proc.memory_info().rss
    return rss, pss


def _status_kb(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmHWM``: peak resident set)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(report: Path, module: str, argv: list[str]) -> None:
    """The wrapper: run ``module`` as ``python -m module argv`` would, then report its peaks.

    Writes ``{"vm_hwm_kb", "exit_code"}`` to ``report`` and leaves
    with ``os._exit`` (no interpreter shutdown to inflate the figures).
    """
    code = 0
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)  # spawn workers import it as -m does
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
    report.write_text(json.dumps({"vm_hwm_kb": _status_kb("VmHWM"), "exit_code": code}))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def measure(module: str, argv: list[str], log_path: Path) -> dict:
    """Run ``python -m module argv`` (wrapped, from the repository root); its peak memory and wall time.

    Raises:
        RuntimeError: the command failed (its log is named).
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GIT_PYTHON_REFRESH": "quiet"}
    report = log_path.with_suffix(".memory.json")
    report.unlink(missing_ok=True)
    command = [sys.executable, "-m", "bench.memory", CHILD_FLAG, str(report), module, *argv]
    peaks = {"rss": 0, "pss": 0}
    done = threading.Event()
    start = time.perf_counter()
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)

        def poll() -> None:
            try:
                import psutil  # noqa: F401
            except ImportError:
                return
            tick = 0
            while not done.is_set():
                rss, pss = _tree_memory(process.pid, with_pss=tick % 10 == 0)
                peaks["rss"], peaks["pss"] = max(peaks["rss"], rss), max(peaks["pss"], pss)
                tick += 1
                done.wait(0.05)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        returncode = process.wait()
        elapsed = time.perf_counter() - start
        done.set()
        poller.join()
    if returncode != 0 or not report.is_file():
        tail = "\n".join(log_path.read_text().splitlines()[-15:])
        raise RuntimeError(f"python -m {module} exited {returncode}; log {log_path}:\n{tail}")
    figures = json.loads(report.read_text())
    return {
        "peak_rss_mb": rounded(figures["vm_hwm_kb"] / 1024),
        "peak_tree_pss_mb": rounded(peaks["pss"] / 2**20) if peaks["pss"] else None,
        "peak_tree_rss_mb": rounded(peaks["rss"] / 2**20) if peaks["rss"] else None,
        "elapsed_s": rounded(elapsed),
    }


def corpus(work: Path, utterances: int) -> tuple[Path, dict]:
    """A generated corpus of ``utterances`` short utterances (cached in ``work``)."""
    folder = work / f"short-{utterances}" / "corpus"
    marker = folder / ".done"
    if marker.is_file():
        return folder, {"utterances": utterances, "audio_s": float(marker.read_text())}
    start = time.perf_counter()
    info = generate_corpus(folder, utterances, seed=0, min_s=MIN_S, max_s=MAX_S)
    marker.write_text(f"{info['audio_s']}")
    print(f"generated {utterances} utterances in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return folder, info


def write_params(root: Path, corpus_dir: Path, num_jobs: int | None = None) -> Path:
    """The repository's params with ``prepare:`` pointed at ``corpus_dir`` (and ``features.num_jobs`` set)."""
    params = repo_params()
    params["prepare"].update(
        corpus="folder", corpus_dir=str(corpus_dir), splits={"train": "train", "dev": "dev", "test": "test"}
    )
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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv)
    sizes = SIZES["quick" if args.quick else "full"]
    small, large = sizes
    features = repo_params().get("features", {})
    num_jobs = 1 if args.quick else None  # quick: no extraction workers to start, so it stays short
    with workdir(args.workdir) as work:
        emit({"benchmark": "machine", **machine()})
        base = {}
        for stage in STAGES:
            base[stage] = measure(f"stages.{stage}", ["--help"], work / f"baseline-{stage}.log")
            emit(
                {
                    "benchmark": "stage_memory_baseline",
                    "stage": stage,
                    "command": f"python -m stages.{stage} --help",
                    **base[stage],
                }
            )
        corpora = {n: corpus(work, n) for n in sizes}
        params = {n: write_params(folder.parent, folder, num_jobs) for n, (folder, _) in corpora.items()}
        figures: dict[tuple[str, int], dict] = {}
        # Stage by stage, each record printed when measured: a run cut short still has prepare at both sizes.
        for stage in STAGES:
            for n in sizes:
                folder, info = corpora[n]
                print(f"{stage}: {n} utterances", file=sys.stderr)
                module, stage_args = stage_argv(stage, folder.parent, params[n])
                figures[stage, n] = measure(module, stage_args, folder.parent / f"{stage}.log")
                emit(
                    {
                        "benchmark": "stage_memory",
                        "stage": stage,
                        "utterances": n,
                        "audio_s": rounded(info["audio_s"]),
                        **figures[stage, n],
                    }
                )
        scaling = {
            "benchmark": "stage_memory_scaling",
            "utterances": [small, large],
            "utterance_ratio": large / small,
            "features_num_jobs": num_jobs or features.get("num_jobs"),
            "features_on_the_fly": features.get("on_the_fly"),
        }
        for stage in STAGES:
            lo, hi = figures[stage, small], figures[stage, large]
            scaling[stage] = {
                "baseline_rss_mb": base[stage]["peak_rss_mb"],
                "baseline_pss_mb": base[stage]["peak_tree_pss_mb"],
                "peak_rss_mb": [lo["peak_rss_mb"], hi["peak_rss_mb"]],
                "rss_ratio": rounded(ratio(hi["peak_rss_mb"], lo["peak_rss_mb"])),
                "rss_above_baseline_mb": [rounded(f["peak_rss_mb"] - base[stage]["peak_rss_mb"]) for f in (lo, hi)],
                "mb_per_1000_utts": rounded((hi["peak_rss_mb"] - lo["peak_rss_mb"]) * 1000 / (large - small)),
                "peak_tree_pss_mb": [lo["peak_tree_pss_mb"], hi["peak_tree_pss_mb"]],
                "tree_pss_ratio": rounded(ratio(hi["peak_tree_pss_mb"] or 0, lo["peak_tree_pss_mb"] or 0)),
                "elapsed_s": [lo["elapsed_s"], hi["elapsed_s"]],
                "elapsed_ratio": rounded(ratio(hi["elapsed_s"], lo["elapsed_s"])),
            }
        emit(scaling)


if __name__ == "__main__":
    if sys.argv[1:2] == [CHILD_FLAG]:
        child(Path(sys.argv[2]), sys.argv[3], sys.argv[4:])
    else:
        main()
