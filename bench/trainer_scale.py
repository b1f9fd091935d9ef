"""The real train stage on a million utterances: set-up to the first step, peak memory, step and
checkpoint cost, at 10^5 and 10^6 cuts (figures side by side in one run).

``python -m bench.trainer_scale [--quick] [--workdir W] [--cuts N ...] [--steps S]``

Each corpus is the train manifest of a small generated corpus (features, tokenizer, CMVN and
dev split included) with every cut repeated under new ids until it holds ``N`` cuts: real
Lhotse entries pointing at real (shared) feature arrays, so the trainer reads, plans and
trains on them as on a real corpus. The stage (``python -m stages.train``, 1 thread, no data
workers, ``TMPDIR`` inside the work folder) is launched twice per size on fresh ``exp/``
folders: ``first`` builds the node's line store, ``again`` reuses it (a second run on the
same data, or another rank). Each launch is stopped by SIGTERM after step ``S`` is logged.

Per launch: ``first_step_s`` (launch to the end of the first step, from the log's marks as in
``bench.startup``), ``peak_tree_pss_mb`` (the process tree's peak PSS, polled every 0.25 s),
``step_s`` (median wall time of a step, from the run's MLflow points) and ``checkpoint_s``
(median excess of the steps right after a checkpoint, ``checkpoint_every_steps`` 5). Per
size: ``store_mb`` (the temporary folder's size after both launches: one store),
and in process, over the same index, the plan's size and the cost of a checkpoint's plan
position state (first call, once per epoch, and later calls).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

from asrflow.testing.corpora import generated_data
from bench.common import emit, load_average, parse_args, rounded, workdir
from bench.startup import launch, write_params

CUTS = {"full": [100_000, 1_000_000], "quick": [2_000]}
CHECKPOINT_EVERY = 5


def grow_corpus(source: Path, target: Path, count: int) -> Path:
    """``source`` (``fbank/``, ``lang/``) with its train manifest repeated to ``count`` cuts."""
    import gzip

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
    """Median step wall time and median checkpoint excess, from the ``train/loss`` points in ``db``
    (a copy under its own name: MLflow keeps one engine per store URI, open on the first file)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db.resolve()}")
    run = client.search_runs([e.experiment_id for e in client.search_experiments()])[0]
    stamps = {m.step: m.timestamp / 1000 for m in client.get_metric_history(run.info.run_id, "train/loss")}
    steps = sorted(stamps)
    gaps = {s: stamps[s] - stamps[p] for p, s in zip(steps, steps[1:], strict=False) if s == p + 1 and p > 1}
    after = [gap for s, gap in gaps.items() if (s - 1) % CHECKPOINT_EVERY == 0]
    plain = [gap for s, gap in gaps.items() if (s - 1) % CHECKPOINT_EVERY != 0]
    if not plain:
        return {"step_s": None, "checkpoint_s": None}
    step = statistics.median(plain)
    return {
        "step_s": rounded(step),
        "checkpoint_s": rounded(statistics.median(after) - step) if after else None,
        "steps_timed": len(gaps),
    }


def launch_until(run_dir: Path, data: Path, steps: int, *, tmp: Path, name: str) -> dict:
    """The train stage on ``data`` until step ``steps`` is logged (``bench.startup.launch``, with
    ``TMPDIR`` = ``tmp``): marks, peak PSS of the process tree, step and checkpoint costs."""
    shutil.rmtree(run_dir / "exp", ignore_errors=True)
    (run_dir / "mlflow.db").unlink(missing_ok=True)
    stop_when = f"[asrflow.training.monitoring] step {steps} epoch"  # the step log line (every 10 steps)
    result = launch(
        run_dir, data, stop_when=stop_when, log=run_dir / "train.log", timeout_s=1800, extra_env={"TMPDIR": str(tmp)}
    )
    db = run_dir / f"mlflow-{name}.db"
    shutil.copy(run_dir / "mlflow.db", db)
    return {"first_step_s": result["marks"].get("first_step"), **result, **step_times(db)}


def in_process_costs(data: Path, tmp: Path) -> dict:
    """Plan size and a checkpoint's plan-position state cost over the data's shared index."""
    from asrflow.data.batches import TrainingBatches
    from asrflow.data.index import shared_index
    from asrflow.data.manifests import cuts_path
    from asrflow.training.run_state import PlanPosition

    index = shared_index(cuts_path(data / "fbank", "train"), tmp)
    batches = TrainingBatches(
        index,
        seed=42,
        max_duration_s=60.0,
        num_buckets=30,
        accum_grad=1,
        world_size=1,
        rank=0,
        start_epoch=0,
        start_step=0,
        num_epochs=1,
    )
    start = time.perf_counter()
    plan = batches.plan(0)
    plan_s = time.perf_counter() - start
    position = PlanPosition(batches, 1)
    start = time.perf_counter()
    position.state_dict()
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(100):
        position.state_dict()
    later = (time.perf_counter() - start) / 100
    return {
        "plan_s": rounded(plan_s),
        "plan_bytes": int(plan.positions.nbytes + plan.bounds.nbytes),
        "position_state_first_s": rounded(first),
        "position_state_s": rounded(later),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--cuts", type=int, action="append", help="corpus sizes (default: 10^5 and 10^6)")
        parser.add_argument("--steps", type=int, default=20, help="a multiple of 10 (the step log)")

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    sizes = args.cuts or CUTS["quick" if args.quick else "full"]
    steps = 10 if args.quick else args.steps
    train = {
        "epochs": 1,
        "max_duration_s": 60.0,
        "num_workers": 0,
        "checkpoint_every_steps": CHECKPOINT_EVERY,
        "validate_every_steps": 100_000,
    }
    records = []
    with workdir(args.workdir) as work:
        source = generated_data(work, 200, dev_utterances=40)
        for count in sizes:
            data = grow_corpus(source, work / f"grown-{count}", count)
            tmp = work / f"tmp-{count}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            run_dir = work / f"run-{count}"
            run_dir.mkdir(exist_ok=True)
            write_params(run_dir, train, data=data)
            load_before = load_average()
            launches = {name: launch_until(run_dir, data, steps, tmp=tmp, name=name) for name in ("first", "again")}
            store_mb = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()) / 2**20
            records.append(
                emit(
                    {
                        "benchmark": "trainer_scale",
                        "cuts": count,
                        "launches": launches,
                        "temp_folder_mb": rounded(store_mb),
                        "temp_folder_entries": sorted(p.name for p in tmp.iterdir()),
                        **in_process_costs(data, tmp),
                        "load_before": load_before,
                        "load_after": load_average(),
                    }
                )
            )
    return records


if __name__ == "__main__":
    main()
