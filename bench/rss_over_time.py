"""Trainer memory over time: RSS of the train stage against step, for a given wall time.

``python -m bench.rss_over_time [--minutes M] [--utterances N] [--workdir W] [--code DIR ...]
[--label NAME ...] [--max-duration S]``

Launches ``python -m stages.train`` (as ``bench.startup`` does) on a generated corpus of
``N`` utterances of 1-15 s (so batch shapes vary from step to step), with 40 dev
utterances (dev evaluation every ``train.checkpoint.validate_every_steps``), precision ``auto`` and
enough epochs to outlast ``M`` minutes, then stops it with SIGTERM. Every second it records
the training process's RSS (``/proc/<pid>/status`` ``VmRSS``) and the last optimizer step
its log names. With ``--code`` given several times (e.g. a checkout of the main branch and
this one), those runs go side by side, started together, each with its own run folder.

Writes ``<workdir>/rss-<label>.csv`` (``seconds,step,rss_mb,rss_anon_mb``) and prints one JSON line per
run (``benchmark: rss_over_time``): RSS at 1, 5, 10, 15, ... minutes, the peak, and the
slope (MB per minute, least squares) over the second half of the run, with the load average.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from asrflow.testing.corpora import generated_data
from asrflow.testing.repo import REPO
from bench.common import emit, load_average, parse_args, rounded, workdir
from bench.startup import write_params

#: The step-log line (every 10 optimizer steps; ``step_log`` in checkouts before the training/ layout).
_STEP = re.compile(r"\[asrflow\.training\.(?:monitoring|step_log)\] step (\d+) epoch")
DEV_UTTERANCES = 40


def rss_mb(pid: int, field: str = "VmRSS") -> float | None:
    """``field`` of ``/proc/<pid>/status`` (VmRSS; RssAnon: without file-backed pages, which the
    kernel may drop and map again) in MB, None once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def slope_mb_per_min(rows: list[tuple[float, int, float]]) -> float | None:
    """Least-squares slope of RSS (MB) against time (minutes) over the second half of ``rows``."""
    half = rows[len(rows) // 2 :]
    if len(half) < 3:
        return None
    xs = [row[0] / 60 for row in half]
    ys = [row[2] for row in half]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread if spread else None


def summarise(rows: list[tuple[float, int, float]], minutes: float) -> dict:
    """RSS at 1, 5, 10, ... minutes (the last sample before each), the peak, steps and the late slope."""
    marks = [1, *range(5, int(minutes) + 1, 5)]
    at = {}
    for mark in marks:
        before = [row for row in rows if row[0] <= mark * 60]
        if before:
            at[f"{mark}min"] = {"step": before[-1][1], "rss_mb": round(before[-1][2], 1)}
    return {
        "rss_at": at,
        "peak_rss_mb": round(max(row[2] for row in rows), 1) if rows else None,
        "steps": rows[-1][1] if rows else 0,
        "slope_second_half_mb_per_min": rounded(slope_mb_per_min(rows) or 0.0, 2),
    }


def _environment(text: str) -> dict[str, str]:
    """``K=V,K=V`` as a dict (``-``: empty)."""
    return {} if text == "-" else dict(pair.split("=", 1) for pair in text.split(","))


def run(label: str, code: Path, data: Path, *, work: Path, minutes: float, train: dict, extra: dict[str, str]) -> dict:
    """One stage run of ``minutes``: samples RSS each second, writes the CSV, returns the summary."""
    run_dir = work / f"run-{label}"
    run_dir.mkdir(parents=True, exist_ok=True)
    write_params(run_dir, train, code=code, data=data)
    command = [sys.executable, "-m", "stages.train", "--params", "params.yaml"]
    command += ["--fbank", str(data / "fbank"), "--lang", str(data / "lang"), "--exp", "exp"]
    env = {**os.environ, "PYTHONPATH": str(code), "PYTHONUNBUFFERED": "1"}
    for name in ("MLFLOW_TRACKING_URI", "ASRFLOW_PROGRESS_FD", "ASRFLOW_LOG_FILE", "MALLOC_ARENA_MAX"):
        env.pop(name, None)
    env.update(extra)
    log = work / f"train-{label}.log"
    rows: list[tuple[float, int, float]] = []
    anon: list[float] = []
    with log.open("w") as handle:
        began = time.time()
        process = subprocess.Popen(command, cwd=run_dir, env=env, stdout=handle, stderr=subprocess.STDOUT)
        step = 0
        with log.open() as reader:
            while process.poll() is None:
                time.sleep(1.0)
                for match in _STEP.finditer(reader.read()):
                    step = int(match.group(1))
                rss, rss_anon = rss_mb(process.pid), rss_mb(process.pid, "RssAnon")
                if rss is not None and rss_anon is not None:
                    rows.append((time.time() - began, step, rss))
                    anon.append(rss_anon)
                if time.time() - began > minutes * 60:
                    process.send_signal(signal.SIGTERM)
                    break
        code_ = process.wait(timeout=300)
    csv = work / f"rss-{label}.csv"
    lines = (f"{t:.1f},{s},{r:.1f},{a:.1f}\n" for (t, s, r), a in zip(rows, anon, strict=True))
    csv.write_text("seconds,step,rss_mb,rss_anon_mb\n" + "".join(lines))
    return {
        "label": label,
        "code": str(code),
        "env": extra,
        "exit_code": code_,
        "csv": str(csv),
        **summarise(rows, minutes),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--minutes", type=float, default=20.0)
        parser.add_argument("--utterances", type=int, default=2000)
        parser.add_argument("--max-duration", type=float, default=60.0, help="train.data.max_duration_s")
        parser.add_argument("--code", type=Path, action="append", help="checkouts to run side by side")
        parser.add_argument("--label", action="append", help="a name per --code")
        parser.add_argument("--env", action="append", help="per --code: extra environment, K=V[,K=V] ('-': none)")

    args = parse_args(__doc__, argv, configure)
    minutes = 1.0 if args.quick else args.minutes
    codes = args.code or [REPO]
    labels = args.label or [path.name for path in codes]
    envs = [_environment(text) for text in (args.env or ["-"] * len(codes))]
    train = {"epochs": 10_000, "max_duration_s": args.max_duration, "precision": "auto", "num_workers": 0}
    with workdir(args.workdir) as work:
        data = generated_data(work, 200 if args.quick else args.utterances, dev_utterances=DEV_UTTERANCES)
        load_before = load_average()
        results: dict[str, dict] = {}

        def one(label: str, code: Path, extra: dict[str, str]) -> None:
            results[label] = run(label, code, data, work=work, minutes=minutes, train=train, extra=extra)

        threads = [threading.Thread(target=one, args=case) for case in zip(labels, codes, envs, strict=True)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return [
            emit(
                {
                    "benchmark": "rss_over_time",
                    **results[label],
                    "minutes": minutes,
                    "utterances": args.utterances,
                    "max_duration_s": args.max_duration,
                    "load_before": load_before,
                    "load_after": load_average(),
                }
            )
            for label in labels
        ]


if __name__ == "__main__":
    main()
