"""Run every benchmark once: ``python -m bench.run_all [--quick] [--output FILE]``.

Prints each benchmark's records as it runs and a ``summary`` (every goal, whether it was met), and writes them to
``bench/results.json`` (with ``--quick`` only to ``--output``). The benchmarks share one work folder.
"""

from __future__ import annotations

import importlib
import json
import logging
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

from bench.common import emit, load_average, machine, parse_args, workdir
from tests.support.repo import REPO

#: In-process benchmarks, in the order they run: (name, module and its options).
MODULES = [
    ("train_throughput", "bench.train_throughput"),  # also prints matmul_fp32 and data_wait
    ("cpu_precision", "bench.train_throughput --precisions"),  # what precision auto picks on this CPU
    ("features_speed", "bench.features_speed"),
    ("decode_rtf", "bench.decode_rtf"),
    ("pipeline_overhead", "bench.pipeline_overhead"),
    ("scale", "bench.scale"),  # also prints padding
    ("startup", "bench.startup"),  # the train stage launched as a process: start-up and memory
    ("peer_speed", "bench.peer_speed"),  # trains SpeechBrain beside asrflow, in processes of their own
]
DEFAULT_OUTPUT = REPO / "bench" / "results.json"

logger = logging.getLogger("bench.run_all")  # its import path (run as __main__)


def run_module(name: str, command: str, args: list[str]) -> list[dict]:
    """``main`` of ``command``'s module with its options and ``args``; a failure becomes a ``failed`` record."""
    import torch

    threads, (module, *options) = torch.get_num_threads(), command.split()
    try:
        return list(importlib.import_module(module).main([*options, *args]))
    except (Exception, SystemExit) as error:  # one broken benchmark must not stop the others
        traceback.print_exc()
        return [emit({"benchmark": name, "status": f"failed: {type(error).__name__}: {error}"[:500]})]
    finally:
        torch.set_num_threads(threads)


def gpu_bf16() -> list[dict]:
    """The GPU item: measured by ``python -m bench.gpu_checks`` on a machine with CUDA, not here."""
    import torch

    where = f"{torch.cuda.get_device_name(0)} present" if torch.cuda.is_available() else "no GPU here"
    return [emit({"benchmark": "gpu_bf16", "status": f"not measured: {where}; run python -m bench.gpu_checks"})]


def summary(records: list[dict]) -> dict:
    """Every goal and whether it was met, and every record that was not measured."""
    keys = ("benchmark", "corpus", "goal", "meets_goal")
    goals = [{key: record[key] for key in keys if key in record} for record in records if "goal" in record]
    problems = [{"benchmark": r["benchmark"], "status": r["status"]} for r in records if r.get("status") != "ok"]
    return {"benchmark": "summary", "goals": goals, "not_ok": problems}


def main(argv: list[str] | None = None) -> dict:
    def configure(parser) -> None:
        parser.add_argument("--output", type=Path, help=f"results file (default: {DEFAULT_OUTPUT.relative_to(REPO)})")

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    output, mode = args.output or (None if args.quick else DEFAULT_OUTPUT), "quick" if args.quick else "full"
    started, start, wall = datetime.now(UTC), time.perf_counter(), {}
    records = [emit({"benchmark": "machine", **machine()})]
    with workdir(args.workdir) as work:
        common = ["--workdir", str(work), *(["--quick"] if args.quick else [])]
        for name, module in MODULES:
            tic = time.perf_counter()
            records += run_module(name, module, common)
            wall[name] = round(time.perf_counter() - tic, 1)
            logger.info("bench %s done in %.1f s", name, wall[name])
        records += gpu_bf16()
    records.append(emit(summary(records)))
    result = {"command": "python -m bench.run_all" + (" --quick" if args.quick else ""), "mode": mode}
    result |= {"started_utc": started.strftime("%Y-%m-%d %H:%M:%S"), "wall_s": round(time.perf_counter() - start, 1)}
    result |= {"wall_s_by_benchmark": wall, "load_average_at_end": load_average(), "records": records}
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=1) + "\n")
        logger.info("results written to %s", output)
    logger.info("all benchmarks done in %.1f s", result["wall_s"])
    return result


if __name__ == "__main__":
    main()
