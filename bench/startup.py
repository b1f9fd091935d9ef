"""The train stage launched as ``dvc repro`` and Snakemake launch it: start-up, and at scale.

``python -m bench.startup [--quick] [--workdir W] [--parts startup,scale] [--repeat N] [--cuts N ...] [--steps S]``.
``startup`` (record ``startup``): launch to the end of step 1 on yesno (median of ``--repeat``) for a fresh run
with a new or an existing ``mlflow.db`` and a resumed one, with a breakdown from the stage's log (:data:`MARKERS`).
``scale`` (``trainer_scale``, not by default): a generated corpus's train cuts repeated to N cuts, two launches
(the first builds the node's line store, the second reuses it) stopped after step S: first step, peak PSS,
``step_s``, ``checkpoint_s`` (excess of the step after a checkpoint), the temporary folder's size; in process, the
plan's size and a checkpoint's plan-position cost. (The ``workers`` part, ``num_workers`` x ``num_threads``, is at
commit a7dff9b.)
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import os
import re
import shutil
import signal
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

from asrflow.training.outcome import Outcome, exit_code
from bench.common import emit, load_average, parse_args, workdir
from tests.support.corpora import generated_data, params_for, yesno_data
from tests.support.processes import ChildProcess
from tests.support.repo import REPO, repo_params

#: Log markers of the breakdown: name -> (logger, text the message starts with or holds).
MARKERS = {
    "imports": ("stages.train", "train stage started"),
    "data": ("asrflow.training.train_data", "train data ready"),
    "model": ("asrflow.training.trainer", "model: "),
    "mlflow_ready": ("asrflow.tracking.run", "MLflow run "),
    "first_batch": ("asrflow.training.train_data", "first batch"),
    "first_step": ("asrflow.progress", "step "),
}
_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ (?:\[rank \S+\] )?\[([^\]]+)\] (.*)$", re.MULTILINE)
#: The step-log line of optimizer step N (every 10 steps; asrflow.training.monitoring).
STEP_LINE = "[asrflow.training.monitoring] step {} epoch"
GOAL_S = 5.0
#: The scale part: corpus sizes per mode; a checkpoint every this many steps.
CUTS, CHECKPOINT_EVERY = {"full": [100_000, 1_000_000], "quick": [2_000]}, 5
#: Environment a tool or test may set that the launched stage must not see.
UNSET = {"MLFLOW_TRACKING_URI", "ASRFLOW_PROGRESS_FD", "ASRFLOW_LOG_FILE", "MALLOC_ARENA_MAX", "DVC_STAGE"}
UNSET.add("DVC_EXP_NAME")


def log_marks(text: str, markers: dict[str, tuple[str, str]] = MARKERS) -> dict[str, float]:
    """Unix time of the first log line of each ``markers`` entry (name -> (logger, text it starts with or holds))."""
    found: dict[str, float] = {}
    for stamp, name, message in _LINE.findall(text):
        for mark, (logger, needle) in markers.items():
            if mark not in found and name == logger and (message.startswith(needle) or needle in message):
                found[mark] = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return found


def write_params(run_dir: Path, train: dict, data: Path) -> None:
    """params.yaml in ``run_dir``: the repository's with ``train`` (dotted keys: ``{"train.optim.epochs": 100}``)
    overridden and ``data``'s features section."""
    import yaml

    from asrflow.params import with_overrides

    params = with_overrides(params_for(data, repo_params()), train, "bench.startup")
    (run_dir / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def launch(run_dir: Path, data: Path, *, stop_when: str | float, log: Path, timeout_s: float = 600.0, env=None) -> dict:
    """The train stage on ``data`` in ``run_dir`` (``env`` added) until ``stop_when`` is logged (or, a number, that
    many seconds), then SIGTERM (the step in flight is saved: exit 75). Returns the marks (seconds after launch), the
    exit code, the tree's peak PSS, and when timed its memory readings (:attr:`ChildProcess.memory_samples`)."""
    command = [sys.executable, "-m", "stages.train", "--params", "params.yaml"]
    command += ["--fbank", str(data / "fbank"), "--lang", str(data / "lang"), "--exp", "exp"]
    env = {key: value for key, value in os.environ.items() if key not in UNSET} | (env or {})
    env |= {"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    timed = not isinstance(stop_when, str)
    process = ChildProcess(command, log_path=log, env=env, cwd=run_dir, memory_poll_s=5.0 if timed else 0.25)
    with contextlib.suppress(RuntimeError):  # it ended first: its exit code tells
        process.wait_at_most(stop_when) if timed else process.wait_for(stop_when, timeout_s)
        process.process.send_signal(signal.SIGTERM)
    status = process.wait(timeout_s)
    if status not in (0, exit_code(Outcome.STOPPED)):
        raise RuntimeError(f"train stage exited {status} in {run_dir}; log {log}:\n{process.tail(15)}")
    marks = {name: at - process.started for name, at in log_marks(process.log()).items()}
    result = {"marks": marks, "exit_code": status, "peak_tree_pss_mb": process.peak_pss / 2**20}
    return result | ({"samples": process.memory_samples, "started": process.started} if timed else {})


def metric_points(db: Path, key: str) -> dict[int, tuple[float, float]]:
    """Step -> (unix seconds, value) of ``key`` in the one run of the MLflow store ``db``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db.resolve()}")
    run = client.search_runs([e.experiment_id for e in client.search_experiments()])[0]
    return {m.step: (m.timestamp / 1000, m.value) for m in client.get_metric_history(run.info.run_id, key)}


def _median_marks(results: list[dict]) -> dict[str, float | None]:
    names = sorted({name for result in results for name in result["marks"]}, key=list(MARKERS).index)
    values = {name: [r["marks"][name] for r in results if name in r["marks"]] for name in names}
    return {name: statistics.median(v) if len(v) == len(results) else None for name, v in values.items()}


def measure_startup(work: Path, repeat: int) -> list[dict]:
    """The three start-up cases on yesno, interleaved, ``repeat`` each."""
    data, root = yesno_data(work), work / "startup-runs"
    shutil.rmtree(root, ignore_errors=True)
    results: dict[str, list[dict]] = {"fresh_new_db": [], "fresh_existing_db": [], "resumed": []}
    for round_ in range(repeat):
        run_dir = root / f"round{round_}"
        run_dir.mkdir(parents=True)
        write_params(run_dir, {"train.optim.epochs": 100}, data)
        for case in ("fresh_new_db", "resumed", "fresh_existing_db"):
            if case == "fresh_existing_db":
                shutil.rmtree(run_dir / "exp")
            stop = "[asrflow.progress] step "  # the progress line after this process's first step
            results[case].append(launch(run_dir, data, stop_when=stop, log=run_dir / f"{case}.log"))
    records = []
    for case, runs in results.items():
        first_step = [r["marks"].get("first_step") for r in runs]
        median = statistics.median(first_step) if all(first_step) else None
        record = {"benchmark": "startup", "case": case, "corpus": "yesno", "launch_to_first_step_s": median}
        record |= {"runs_s": first_step, "breakdown_median_s": _median_marks(runs)}
        record |= {
            "goal": "launch to the end of step 1 <= 5 s (median)",
            "meets_goal": bool(median and median <= GOAL_S),
        }
        record |= {"peak_tree_pss_mb": statistics.median(r["peak_tree_pss_mb"] for r in runs)}
        records.append(emit({**record, "load_average": load_average()}))
    return records


def grow_corpus(source: Path, target: Path, count: int) -> Path:
    """``source`` (``fbank/``, ``lang/``) with its train manifest repeated to ``count`` cuts."""
    import orjson

    from asrflow.data.manifests import cuts_path

    if (target / "done").is_file():
        return target
    shutil.rmtree(target, ignore_errors=True)
    (target / "fbank").mkdir(parents=True)
    shutil.copytree(source / "lang", target / "lang")
    for name in os.listdir(source / "fbank"):
        if not name.startswith("train_cuts"):
            (target / "fbank" / name).symlink_to(source / "fbank" / name)
    with gzip.open(cuts_path(source / "fbank", "train"), "rb") as handle:
        entries = [orjson.loads(line) for line in handle if line.strip()]
    with gzip.open(cuts_path(target / "fbank", "train"), "wb", compresslevel=1) as out:
        for i in range(count):
            entry = dict(entries[i % len(entries)])
            entry["id"] = f"{i:07d}-{entry['id']}"
            entry["supervisions"] = [{**s, "id": entry["id"]} for s in entry["supervisions"]]
            out.write(orjson.dumps(entry) + b"\n")
    (target / "done").touch()
    return target


def step_times(db: Path) -> dict:
    """Median step wall time and median checkpoint excess, from the ``train/loss`` points in ``db``."""
    stamps = {step: at for step, (at, _) in metric_points(db, "train/loss").items()}
    steps = sorted(stamps)
    gaps = {s: stamps[s] - stamps[p] for p, s in zip(steps, steps[1:], strict=False) if s == p + 1 and p > 1}
    after = [gap for s, gap in gaps.items() if (s - 1) % CHECKPOINT_EVERY == 0]
    plain = [gap for s, gap in gaps.items() if (s - 1) % CHECKPOINT_EVERY != 0]
    if not plain:
        return {"step_s": None, "checkpoint_s": None}
    step = statistics.median(plain)
    excess = statistics.median(after) - step if after else None
    return {"step_s": step, "checkpoint_s": excess, "steps_timed": len(gaps)}


def launch_until(run_dir: Path, data: Path, steps: int, *, tmp: Path, name: str) -> dict:
    """The train stage on ``data`` until step ``steps`` (``TMPDIR`` = ``tmp``): marks, peak PSS, step costs."""
    shutil.rmtree(run_dir / "exp", ignore_errors=True)
    (run_dir / "mlflow.db").unlink(missing_ok=True)
    stop_when, tmpdir = STEP_LINE.format(steps), {"TMPDIR": str(tmp)}
    result = launch(run_dir, data, stop_when=stop_when, log=run_dir / "train.log", timeout_s=1800, env=tmpdir)
    db = run_dir / f"mlflow-{name}.db"  # a copy under its own name: MLflow keeps one engine per store URI
    shutil.copy(run_dir / "mlflow.db", db)
    return {"first_step_s": result["marks"].get("first_step"), **result, **step_times(db)}


def in_process_costs(data: Path, tmp: Path) -> dict:
    """Plan size and a checkpoint's plan-position state cost over the data's shared index."""
    from asrflow.data.loading.index_store import shared_index
    from asrflow.data.loading.planner import TrainingBatches
    from asrflow.data.manifests import cuts_path
    from asrflow.training.run_state import PlanPosition

    index = shared_index(cuts_path(data / "fbank", "train"), tmp)
    shape = {"max_duration_s": 60.0, "num_buckets": 30, "accum_grad": 1, "world_size": 1, "rank": 0}
    batches = TrainingBatches(index, seed=42, start_epoch=0, start_step=0, num_epochs=1, **shape)
    start = time.perf_counter()
    plan = batches.plan(0)
    plan_s, position = time.perf_counter() - start, PlanPosition(batches, 1)
    start = time.perf_counter()
    position.state_dict()
    first, start = time.perf_counter() - start, time.perf_counter()
    for _ in range(100):
        position.state_dict()
    later = (time.perf_counter() - start) / 100
    plan_bytes = int(plan.positions.nbytes + plan.bounds.nbytes)
    return {"plan_s": plan_s, "plan_bytes": plan_bytes, "position_state_first_s": first, "position_state_s": later}


def measure_scale(work: Path, counts: list[int], steps: int) -> list[dict]:
    """The ``scale`` part: one ``trainer_scale`` record per corpus size in ``counts``."""
    records, source = [], generated_data(work, 200, dev_utterances=40)
    train = {"train.optim.epochs": 1, "train.data.max_duration_s": 60.0, "run.num_workers": 0}
    train |= {"train.checkpoint.checkpoint_every_steps": CHECKPOINT_EVERY}
    for count in counts:
        data = grow_corpus(source, work / f"grown-{count}", count)
        tmp, run_dir = work / f"tmp-{count}", work / f"run-{count}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        run_dir.mkdir(exist_ok=True)
        write_params(run_dir, {**train, "train.checkpoint.validate_every_steps": 100_000}, data)
        load_before = load_average()
        launches = {name: launch_until(run_dir, data, steps, tmp=tmp, name=name) for name in ("first", "again")}
        store_mb = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()) / 2**20
        record = {"benchmark": "trainer_scale", "cuts": count, "launches": launches, "temp_folder_mb": store_mb}
        record |= {"temp_folder_entries": sorted(p.name for p in tmp.iterdir())}
        record |= {**in_process_costs(data, tmp), "load_before": load_before, "load_after": load_average()}
        records.append(emit(record))
    return records


def main(argv: list[str] | None = None) -> list[dict]:
    def configure(parser: argparse.ArgumentParser) -> None:
        add = parser.add_argument
        add("--parts", default="startup", help="startup, scale (default: startup)")
        add("--repeat", type=int, help="startup: launches per case (default 3; quick 1)")
        add("--cuts", type=int, action="append", help="scale: corpus sizes (default: 10^5 and 10^6)")
        add("--steps", type=int, default=20, help="scale: steps per launch, a multiple of 10 (the step log)")

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    parts, records, mode = args.parts.split(","), [], "quick" if args.quick else "full"
    with workdir(args.workdir) as work:
        if "startup" in parts:
            records += measure_startup(work, args.repeat or (1 if args.quick else 3))
        if "scale" in parts:
            records += measure_scale(work, args.cuts or CUTS[mode], 10 if args.quick else args.steps)
    return records


if __name__ == "__main__":
    main()
