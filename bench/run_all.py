"""Run every benchmark once: ``python -m bench.run_all [--quick] [--output FILE]``.

Prints one JSON object per measured figure group (each with ``benchmark`` and ``status``)
as the benchmarks run, then a ``summary`` object with every goal and whether it was met,
and writes everything to ``bench/results.json`` (full mode; with ``--quick`` only where
``--output`` says). The benchmarks share one work folder (generated data is built once)
and run one after the other, in this process, so they do not disturb each other's
timings; ``bench/resume_cost.py`` runs as its own process, and is reported as skipped if
it is missing or failed. ``--quick`` uses small sizes: it checks that everything runs,
its figures mean little.

The figures are wall-clock measurements on a possibly shared machine: each benchmark
measures its baseline in the same run and reports the ratio, which is what to compare.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import subprocess
import sys
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

from asrflow.testing.repo import REPO
from bench.common import emit, load_average, machine, workdir

#: In-process benchmarks, in the order they run: (name, module).
MODULES = [
    ("padding", "bench.padding"),
    ("train_throughput", "bench.train_throughput"),  # also prints matmul_fp32 and data_wait
    ("cpu_precision", "bench.cpu_precision"),  # fp32 / bf16 / fp16 steps: what precision auto picks on this CPU
    ("features_speed", "bench.features_speed"),
    ("decode_rtf", "bench.decode_rtf"),
    ("pipeline_overhead", "bench.pipeline_overhead"),
    ("scale", "bench.scale"),
    ("startup", "bench.startup"),  # the train stage launched as a process: start-up, workers, memory
    ("peer_speed", "bench.peer_speed"),  # trains SpeechBrain beside asrflow, in processes of their own
]
#: Benchmarks written as separate scripts: (name, module, time limit in s for full, quick).
EXTERNAL = [("resume", "bench.resume_cost", 900, 150)]
DEFAULT_OUTPUT = REPO / "bench" / "results.json"

logger = logging.getLogger("bench.run_all")  # its import path (run as __main__)


def run_module(name: str, module: str, args: list[str]) -> list[dict]:
    """Import ``module`` and call its ``main(args)``; a failure becomes a ``failed`` record."""
    import torch

    threads = torch.get_num_threads()
    try:
        return list(importlib.import_module(module).main(args))
    except (Exception, SystemExit) as error:  # one broken benchmark must not stop the others
        traceback.print_exc()
        return [emit({"benchmark": name, "status": f"failed: {type(error).__name__}: {error}"[:500]})]
    finally:
        torch.set_num_threads(threads)


def _json_objects(text: str) -> list[dict]:
    """The JSON objects printed on stdout: the whole text as one (indented) object, or one per line."""
    try:
        value = json.loads(text)
        return [value] if isinstance(value, dict) else []
    except json.JSONDecodeError:
        pass
    records = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                records.append(value)
    return records


def run_external(name: str, module: str, args: list[str], limit_s: float) -> list[dict]:
    """Run ``python -m module`` with ``args`` (fewer if it refuses them); pass its JSON lines on."""
    path = REPO / Path(*module.split(".")).with_suffix(".py")
    if not path.is_file():
        return [emit({"benchmark": name, "status": f"skipped: {path.relative_to(REPO)} is missing"})]
    attempts = [args, [a for a in args if a == "--quick"], []]
    done = None
    for attempt in dict.fromkeys(tuple(a) for a in attempts):
        try:
            done = subprocess.run(
                [sys.executable, "-m", module, *attempt], cwd=REPO, capture_output=True, text=True, timeout=limit_s
            )
        except subprocess.TimeoutExpired:
            return [emit({"benchmark": name, "status": f"failed: no result within {limit_s:.0f} s"})]
        if not (done.returncode == 2 and "unrecognized arguments" in done.stderr):
            break
    sys.stderr.write(done.stderr[-5000:])
    records = _json_objects(done.stdout)
    if done.returncode != 0 or not records:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return [emit({"benchmark": name, "status": f"failed: exit {done.returncode}: {tail}"[:500]})]
    return [emit({"benchmark": record.get("benchmark", name), **record}) for record in records]


def gpu_bf16() -> list[dict]:
    """The GPU bf16 throughput/MFU item: only measurable where a GPU is present."""
    import torch

    if not torch.cuda.is_available():
        return [emit({"benchmark": "gpu_bf16", "status": "not measured: no GPU lent to this task"})]
    return [
        emit(
            {
                "benchmark": "gpu_bf16",
                "status": f"not measured: {torch.cuda.get_device_name(0)} present, "
                "but the bf16 benchmark is not written yet",
            }
        )
    ]


def summary(records: list[dict]) -> dict:
    """Every goal and whether it was met, and every record that was not measured."""
    goals = [
        {key: record[key] for key in ("benchmark", "corpus", "goal", "meets_goal") if key in record}
        for record in records
        if "goal" in record
    ]
    problems = [{"benchmark": r["benchmark"], "status": r["status"]} for r in records if r.get("status") != "ok"]
    return {"benchmark": "summary", "goals": goals, "not_ok": problems}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: checks that every benchmark runs")
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help=f"results file (default: {DEFAULT_OUTPUT.relative_to(REPO)}; none with --quick)",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="shared data folder (default: temporary)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    output = args.output or (None if args.quick else DEFAULT_OUTPUT)
    mode = "quick" if args.quick else "full"
    started = datetime.now(UTC)
    start = time.perf_counter()
    records = [emit({"benchmark": "machine", **machine()})]
    wall = {}
    with workdir(args.workdir) as work:
        common = ["--workdir", str(work), *(["--quick"] if args.quick else [])]
        for name, module in MODULES:
            tic = time.perf_counter()
            records += run_module(name, module, common)
            wall[name] = round(time.perf_counter() - tic, 1)
            logger.info("bench %s done in %.1f s", name, wall[name])
        for name, module, full_limit, quick_limit in EXTERNAL:
            tic = time.perf_counter()
            own = ["--workdir", str(work / name), *(["--quick"] if args.quick else [])]
            records += run_external(name, module, own, quick_limit if args.quick else full_limit)
            wall[name] = round(time.perf_counter() - tic, 1)
        records += gpu_bf16()
    records.append(emit(summary(records)))
    result = {
        "command": "python -m bench.run_all" + (" --quick" if args.quick else ""),
        "mode": mode,
        "started_utc": started.strftime("%Y-%m-%d %H:%M:%S"),
        "wall_s": round(time.perf_counter() - start, 1),
        "wall_s_by_benchmark": wall,
        "load_average_at_end": load_average(),
        "records": records,
    }
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=1) + "\n")
        logger.info("results written to %s", output)
    logger.info("all benchmarks done in %.1f s", result["wall_s"])
    return result


if __name__ == "__main__":
    main()
