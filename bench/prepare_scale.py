"""The prepare stage at scale: wall time, utterances/s and peak memory as the corpus grows.

Two corpus shapes, built in code (no download), each prepared by the real stage in its own
process (``python -m stages.prepare --params P --out M``, under :func:`bench.memory`'s
wrapper, so the figures are the stage's own high-water mark and its process tree's PSS):

* ``folder``: a ``corpus: folder`` corpus of N utterances (``--folder-sizes``, default
  2,000 and 20,000): 16 kHz FLAC files, each a copy of one of 8 synthesized utterances of
  0.8-2 s (tone-burst words in noise, :func:`asrflow.testing.corpora.synth_utterance`), 105 speakers
  in the TSV's third column, 2 % dev and 2 % test named in their own TSVs;
* ``kaldi``: a Kaldi data folder of N segments (``--kaldi-sizes``, default 10^5 and 10^6)
  over 10 recordings of 300 s (FLAC tones), 0.5-2 s segments at random times (they may
  overlap), 200 speakers in ``utt2spk``, dev and test carved from train (by speaker).

``--in-process`` instead calls :func:`asrflow.data.prepare.prepare_corpus` in this process
(the ``--repo`` given must then be this checkout or come first on ``PYTHONPATH``) and
reports ``cpu_s`` (``time.process_time()``, every thread) and ``utterances_per_cpu_s``:
on a loaded machine CPU time, unlike wall time, still compares two versions.

Per run: ``elapsed_s``, ``utterances_per_s`` (input utterances / elapsed, process start
included), ``peak_rss_mb`` (VmHWM), ``peak_tree_pss_mb``; the stage's ``--help`` run gives
the import-only baseline. ``--repo DIR`` runs the stage of another checkout (e.g. the code
before a change, from ``git archive``), with this script's corpora.

Usage: ``python -m bench.prepare_scale [--quick] [--workdir DIR] [--repo DIR]
[--folder-sizes 2000 20000] [--kaldi-sizes 100000 1000000]``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import yaml

from asrflow.testing.corpora import SAMPLING_RATE, synth_utterance
from asrflow.testing.processes import ChildProcess
from asrflow.testing.repo import REPO, repo_params
from bench.common import emit, load_average, rounded, workdir
from bench.memory import CHILD_FLAG

SIZES = {"full": ((2000, 20000), (100_000, 1_000_000)), "quick": ((200, 800), (2000, 8000))}
TEMPLATES = 8
SPEAKERS = {"folder": 105, "kaldi": 200}
KALDI_RECORDINGS, KALDI_RECORDING_S = 10, 300.0


def folder_corpus(root: Path, count: int) -> Path:
    """A ``corpus: folder`` corpus of ``count`` utterances (cached under ``root``)."""
    import numpy as np
    import soundfile as sf

    folder = root / f"folder-{count}"
    if (folder / ".done").is_file():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "audio").mkdir(parents=True)
    rng = np.random.default_rng(0)
    templates = []
    for index in range(TEMPLATES):
        audio, text = synth_utterance(rng, 0.8 + 1.2 * index / (TEMPLATES - 1))
        path = root / f"template-{index}.flac"
        sf.write(path, audio, SAMPLING_RATE)
        templates.append((path, text))
    lines: dict[str, list[str]] = {"train": [], "dev": [], "test": []}
    for index in range(count):
        template, text = templates[index % TEMPLATES]
        name = f"audio/{index // 1000:04d}/utt{index:07d}.flac"
        (folder / name).parent.mkdir(exist_ok=True)
        shutil.copyfile(template, folder / name)
        split = "dev" if index % 50 == 0 else "test" if index % 50 == 1 else "train"
        lines[split].append(f"{name}\t{text}\tspk{index % SPEAKERS['folder']:03d}")
    for split, rows in lines.items():
        (folder / f"{split}.tsv").write_text("\n".join(rows) + "\n")
    (folder / ".done").touch()
    return folder


def kaldi_corpus(root: Path, count: int) -> Path:
    """A Kaldi data folder ``train/`` of ``count`` segments over a few long recordings (cached)."""
    import numpy as np
    import soundfile as sf

    folder = root / f"kaldi-{count}"
    if (folder / ".done").is_file():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    data = folder / "train"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    t = np.arange(int(KALDI_RECORDING_S * SAMPLING_RATE), dtype=np.float32) / SAMPLING_RATE
    with open(data / "wav.scp", "w") as scp:
        for rec in range(KALDI_RECORDINGS):
            sf.write(folder / f"rec{rec:02d}.flac", 0.1 * np.sin(2 * np.pi * (200 + 20 * rec) * t), SAMPLING_RATE)
            scp.write(f"rec{rec:02d} rec{rec:02d}.flac\n")
    words = ["YES", "NO", "MAYBE", "HELLO", "WORLD", "AGAIN"]
    starts = rng.uniform(0, KALDI_RECORDING_S - 2.5, count)
    lengths = rng.uniform(0.5, 2.0, count)
    with open(data / "segments", "w") as seg, open(data / "text", "w") as txt, open(data / "utt2spk", "w") as spk:
        for index in range(count):
            speaker = f"spk{index % SPEAKERS['kaldi']:03d}"
            utt = f"{speaker}-{index:08d}"
            seg.write(
                f"{utt} rec{index % KALDI_RECORDINGS:02d} {starts[index]:.2f} {starts[index] + lengths[index]:.2f}\n"
            )
            txt.write(f"{utt} {words[index % 6]} {words[(index // 6) % 6]}\n")
            spk.write(f"{utt} {speaker}\n")
    (folder / ".done").touch()
    return folder


def write_params(path: Path, kind: str, corpus: Path) -> Path:
    """The repository's params with ``prepare:`` pointed at ``corpus``."""
    params = repo_params()
    if kind == "folder":
        params["prepare"].update(
            corpus="folder", corpus_dir=str(corpus), splits={"train": "train", "dev": "dev", "test": "test"}
        )
    else:
        params["prepare"].update(
            corpus="kaldi", corpus_dir=str(corpus), splits={"train": "train", "dev": None, "test": None}
        )
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def measure(repo: Path, argv: list[str], log_path: Path) -> dict:
    """Run ``python -m stages.prepare argv`` in ``repo`` under bench.memory's wrapper; its peaks and time."""
    report = log_path.with_suffix(".memory.json")
    report.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(repo), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "bench.memory", CHILD_FLAG, str(report), "stages.prepare", *argv]
    start = time.perf_counter()
    process = ChildProcess(command, log_path=log_path, env=env, cwd=repo, memory_poll_s=0.25)
    code = process.wait()
    elapsed, peak_pss = time.perf_counter() - start, process.peak_pss
    if code != 0 or not report.is_file():
        raise RuntimeError(f"prepare exited {code}; log {log_path}:\n{process.tail(10)}")
    return {
        "elapsed_s": rounded(elapsed),
        "peak_rss_mb": rounded(json.loads(report.read_text())["vm_hwm_kb"] / 1024),
        "peak_tree_pss_mb": rounded(peak_pss / 2**20),
    }


def in_process(params: Path, out: Path) -> dict:
    """Prepare in this process; wall and CPU seconds (all threads)."""
    from asrflow.data.prepare import PrepareConfig, prepare_corpus

    config = PrepareConfig.from_section(yaml.safe_load(params.read_text())["prepare"])
    wall, cpu = time.perf_counter(), time.process_time()
    summary = prepare_corpus(config, out, seed=0)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {
        "elapsed_s": rounded(wall),
        "cpu_s": rounded(cpu),
        "utterances_per_cpu_s": rounded(summary.items_total / cpu),
    }


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--repo", type=Path, default=REPO)
    parser.add_argument("--folder-sizes", type=int, nargs="*")
    parser.add_argument("--kaldi-sizes", type=int, nargs="*")
    parser.add_argument("--in-process", action="store_true")
    args = parser.parse_args(argv)
    folder_sizes, kaldi_sizes = SIZES["quick" if args.quick else "full"]
    folder_sizes = folder_sizes if args.folder_sizes is None else args.folder_sizes
    kaldi_sizes = kaldi_sizes if args.kaldi_sizes is None else args.kaldi_sizes
    repo = args.repo.resolve()
    with workdir(args.workdir) as work:
        if not args.in_process:
            base = measure(repo, ["--help"], work / "help.log")
            emit({"benchmark": "prepare_scale_baseline", "repo": str(repo), **base})
        for kind, sizes, build in (("folder", folder_sizes, folder_corpus), ("kaldi", kaldi_sizes, kaldi_corpus)):
            for count in sizes:
                corpus = build(work, count)
                params = write_params(work / f"params-{kind}-{count}.yaml", kind, corpus)
                out = work / f"manifests-{kind}-{count}"
                argv = ["--params", str(params), "--out", str(out)]
                load = load_average()
                if args.in_process:
                    figures = in_process(params, out)
                else:
                    figures = measure(repo, argv, work / f"prepare-{kind}-{count}.log")
                emit(
                    {
                        "benchmark": "prepare_scale",
                        "repo": str(repo),
                        "corpus": kind,
                        "utterances": count,
                        "utterances_per_s": rounded(count / figures["elapsed_s"]),
                        "load_average_before": load,
                        "command": f"python -m stages.prepare {' '.join(argv)}",
                        **figures,
                    }
                )
                shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
