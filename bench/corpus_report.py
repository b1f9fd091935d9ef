"""``asrflow corpus`` over many tiny files: seconds and peak memory (issue 55: 100,000 files in at most 60 s,
flat memory).

``python -m bench.corpus_report [--quick] [--workdir W] [--files N ...]``. For each N (default 25,000 and
100,000; ``--quick``: 500 and 2,000), a folder corpus of N WAVs of :data:`FILE_S` seconds and one ``train.tsv``
is generated (kept in ``--workdir`` for a rerun), then ``asrflow corpus`` runs over it in a child process:
record ``corpus_report`` per N with the wall seconds, files per second and the child's peak RSS (MiB); flat
memory shows as the same peak RSS at every N.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf

from bench.common import emit, machine, parse_args, workdir
from tests.support.repo import REPO

#: Seconds of audio per generated file, over prepare's min_duration_s (0.1 s).
FILE_S = 0.2
RATE = 16000
#: The issue's goal for 100,000 files.
GOAL_S = 60.0


def tiny_corpus(folder: Path, files: int) -> Path:
    """``folder`` holding ``files`` WAVs (in sub-folders of 1,000) and their ``train.tsv`` (reused when complete)."""
    tsv = folder / "train.tsv"
    if tsv.is_file() and sum(1 for _ in tsv.open()) == files:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    samples = (0.1 * np.sin(np.arange(int(FILE_S * RATE)) * 0.05)).astype(np.float32)
    with open(tsv.with_suffix(".part"), "w") as lines:
        for index in range(files):
            relative = Path(f"d{index // 1000:03d}") / f"u{index:06d}.wav"
            (folder / relative.parent).mkdir(exist_ok=True)
            sf.write(folder / relative, samples, RATE, subtype="PCM_16")
            lines.write(f"{relative.as_posix()}\tWORD NUMBER {index % 97} HERE\n")
    tsv.with_suffix(".part").rename(tsv)
    return folder


def time_report(folder: Path) -> dict:
    """One ``asrflow corpus`` run over ``folder`` in a child process: seconds, its own peak RSS
    (``os.wait4``'s usage of that child), and the report's ``items:`` line."""
    command = [sys.executable, "-m", "asrflow.cli", "corpus", str(folder), "--params", str(REPO / "params.yaml")]
    with tempfile.TemporaryFile("w+") as out:
        start = time.perf_counter()
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read()
    items = next((line.strip() for line in text.splitlines() if line.strip().startswith("items:")), "")
    return {
        "returncode": child.returncode,
        "seconds": seconds,
        "peak_rss_mib": usage.ru_maxrss / 1024,
        "items_line": items or text[-300:],
    }


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--files", type=int, nargs="+", help="corpus sizes (default 25000 100000; --quick 500 2000)")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv, _configure)
    sizes = args.files or ([500, 2000] if args.quick else [25_000, 100_000])
    here = machine()
    with workdir(args.workdir) as work:
        for files in sorted(sizes):
            folder = tiny_corpus(work / f"tiny_{files}", files)
            figures = time_report(folder)
            emit(
                {
                    "benchmark": "corpus_report",
                    "status": "ok" if figures["returncode"] == 0 else "failed",
                    "files": files,
                    "file_s": FILE_S,
                    **figures,
                    "files_per_s": files / figures["seconds"],
                    "goal_s_per_100k": GOAL_S,
                    "projected_s_per_100k": figures["seconds"] * 100_000 / files,
                    "machine": here,
                }
            )


if __name__ == "__main__":
    main(sys.argv[1:])
