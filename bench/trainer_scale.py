"""The train stage at scale: a million cuts (set-up, first step, memory, step and checkpoint cost).

``python -m bench.trainer_scale [--quick] [--workdir W] [--cuts N ...] [--steps S]``: a generated corpus's
train cuts repeated under new ids to N cuts, the stage launched twice per size (``first`` builds the node's
line store, ``again`` reuses it) and stopped after step S. Record ``trainer_scale``: per launch
``first_step_s``, ``peak_tree_pss_mb``, ``step_s`` and ``checkpoint_s`` (median excess of the step after a
checkpoint); the temporary folder's size; in process, the plan's size and a checkpoint's plan-position cost.
"""

from __future__ import annotations

import gzip
import os
import shutil
import statistics
import time
from pathlib import Path

from asrflow.testing.corpora import generated_data
from bench.common import emit, load_average, parse_args, workdir
from bench.startup import STEP_LINE, launch, metric_points, write_params

CUTS = {"full": [100_000, 1_000_000], "quick": [2_000]}
CHECKPOINT_EVERY = 5


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
    result = launch(run_dir, data, stop_when=stop_when, log=run_dir / "train.log", timeout_s=1800, extra_env=tmpdir)
    db = run_dir / f"mlflow-{name}.db"  # a copy under its own name: MLflow keeps one engine per store URI
    shutil.copy(run_dir / "mlflow.db", db)
    return {"first_step_s": result["marks"].get("first_step"), **result, **step_times(db)}


def in_process_costs(data: Path, tmp: Path) -> dict:
    """Plan size and a checkpoint's plan-position state cost over the data's shared index."""
    from asrflow.data.batches import TrainingBatches
    from asrflow.data.index import shared_index
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


def main(argv: list[str] | None = None) -> list[dict]:
    def configure(parser) -> None:
        add = parser.add_argument
        add("--cuts", type=int, action="append", help="corpus sizes (default: 10^5 and 10^6)")
        add("--steps", type=int, default=20, help="a multiple of 10 (the step log)")

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    records = []
    with workdir(args.workdir) as work:
        source = generated_data(work, 200, dev_utterances=40)
        train = {"epochs": 1, "max_duration_s": 60.0, "num_workers": 0, "checkpoint_every_steps": CHECKPOINT_EVERY}
        for count in args.cuts or CUTS["quick" if args.quick else "full"]:
            data = grow_corpus(source, work / f"grown-{count}", count)
            tmp, run_dir = work / f"tmp-{count}", work / f"run-{count}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            run_dir.mkdir(exist_ok=True)
            write_params(run_dir, {**train, "validate_every_steps": 100_000}, data=data)
            load_before, steps = load_average(), 10 if args.quick else args.steps
            launches = {name: launch_until(run_dir, data, steps, tmp=tmp, name=name) for name in ("first", "again")}
            store_mb = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()) / 2**20
            record = {"benchmark": "trainer_scale", "cuts": count, "launches": launches, "temp_folder_mb": store_mb}
            record |= {"temp_folder_entries": sorted(p.name for p in tmp.iterdir())}
            record |= {**in_process_costs(data, tmp), "load_before": load_before, "load_after": load_average()}
            records.append(emit(record))
    return records


if __name__ == "__main__":
    main()
