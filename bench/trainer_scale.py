"""The train stage at scale: a million cuts (set-up, first step, memory, step and checkpoint cost), or RSS over time.

``python -m bench.trainer_scale [--quick] [--workdir W] [--cuts N ...] [--steps S]``: a generated corpus's
train cuts repeated under new ids to N cuts, the stage launched twice per size (``first`` builds the node's
line store, ``again`` reuses it) and stopped after step S. Record ``trainer_scale``: per launch
``first_step_s``, ``peak_tree_pss_mb``, ``step_s`` and ``checkpoint_s`` (median excess of the step after a
checkpoint); the temporary folder's size; in process, the plan's size and a checkpoint's plan-position cost.

``python -m bench.trainer_scale --minutes M [--utterances N] [--max-duration S] [--code DIR --label NAME
[--env K=V,...]] ...``: the stage of each checkout side by side on N utterances of 1-15 s, SIGTERM after M
minutes; each second its RSS, RssAnon and last logged step into ``W/rss-<label>.csv``. Record
``rss_over_time``: RSS at 1, 5, 10, ... minutes, the peak, the slope (MB/min) over the second half.
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import signal
import statistics
import threading
import time
from pathlib import Path

from asrflow.testing.corpora import generated_data
from asrflow.testing.repo import REPO
from bench.common import emit, load_average, parse_args, rounded, workdir
from bench.startup import launch, metric_points, start_train, write_params

CUTS = {"full": [100_000, 1_000_000], "quick": [2_000]}
CHECKPOINT_EVERY = 5
#: The step-log line (``step_log`` in checkouts before the training/ layout).
STEP = re.compile(r"\[asrflow\.training\.(?:monitoring|step_log)\] step (\d+) epoch")


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
    excess = rounded(statistics.median(after) - step) if after else None
    return {"step_s": rounded(step), "checkpoint_s": excess, "steps_timed": len(gaps)}


def launch_until(run_dir: Path, data: Path, steps: int, *, tmp: Path, name: str) -> dict:
    """The train stage on ``data`` until step ``steps`` (``TMPDIR`` = ``tmp``): marks, peak PSS, step costs."""
    shutil.rmtree(run_dir / "exp", ignore_errors=True)
    (run_dir / "mlflow.db").unlink(missing_ok=True)
    stop_when = f"[asrflow.training.monitoring] step {steps} epoch"
    result = launch(
        run_dir, data, stop_when=stop_when, log=run_dir / "train.log", timeout_s=1800, extra_env={"TMPDIR": str(tmp)}
    )
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
    return {"plan_s": rounded(plan_s), "plan_bytes": plan_bytes, "position_state_first_s": rounded(first)} | {
        "position_state_s": rounded(later)
    }


def status_mb(pid: int, field: str) -> float | None:
    """``field`` of ``/proc/<pid>/status`` (``VmRSS``, ``RssAnon``) in MB; None once the process is gone."""
    try:
        line = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith(field))
        return int(line.split()[1]) / 1024
    except (OSError, StopIteration):
        return None


def rss_run(label: str, code: Path, data: Path, *, work: Path, minutes: float, train: dict, extra: dict) -> dict:
    """One stage run of ``minutes``, sampled each second into ``rss-<label>.csv``; its summary."""
    run_dir = work / f"run-{label}"
    run_dir.mkdir(parents=True, exist_ok=True)
    write_params(run_dir, train, code=code, data=data)
    process = start_train(run_dir, data, log=work / f"train-{label}.log", code=code, extra_env=extra, poll_s=None)
    rows, step = [], 0
    while process.process.poll() is None and time.time() - process.started < minutes * 60:
        time.sleep(1.0)
        step = max([step, *(int(found) for found in STEP.findall(process.log()))])
        rss, anon = status_mb(process.pid, "VmRSS:"), status_mb(process.pid, "RssAnon:")
        if rss is not None and anon is not None:
            rows.append((time.time() - process.started, step, rss, anon))
    process.process.send_signal(signal.SIGTERM)
    exit_code = process.wait(300)
    csv = work / f"rss-{label}.csv"
    csv.write_text(
        "seconds,step,rss_mb,rss_anon_mb\n" + "".join(f"{t:.1f},{s},{r:.1f},{a:.1f}\n" for t, s, r, a in rows)
    )
    at = {}
    for mark in [1, *range(5, int(minutes) + 1, 5)]:
        before = [row for row in rows if row[0] <= mark * 60]
        if before:
            at[f"{mark}min"] = {"step": before[-1][1], "rss_mb": round(before[-1][2], 1)}
    late = rows[len(rows) // 2 :]
    slope = (
        statistics.linear_regression([r[0] / 60 for r in late], [r[2] for r in late]).slope if len(late) > 2 else None
    )
    record = {"label": label, "code": str(code), "env": extra, "exit_code": exit_code, "csv": str(csv), "rss_at": at}
    record |= {"peak_rss_mb": round(max(row[2] for row in rows), 1) if rows else None, "steps": step}
    return record | {"slope_second_half_mb_per_min": rounded(slope, 2) if slope is not None else None}


def over_time(args, work: Path) -> list[dict]:
    """``rss_run`` for every ``--code``, side by side."""
    minutes = 1.0 if args.quick else args.minutes
    codes = args.code or [REPO]
    labels = args.label or [path.name for path in codes]
    envs = [
        {} if text == "-" else dict(pair.split("=", 1) for pair in text.split(","))
        for text in args.env or ["-"] * len(codes)
    ]
    train = {"epochs": 10_000, "max_duration_s": args.max_duration, "precision": "auto", "num_workers": 0}
    data = generated_data(work, 200 if args.quick else args.utterances, dev_utterances=40)
    load_before, results = load_average(), {}

    def one(label: str, code: Path, extra: dict) -> None:
        results[label] = rss_run(label, code, data, work=work, minutes=minutes, train=train, extra=extra)

    threads = [threading.Thread(target=one, args=case) for case in zip(labels, codes, envs, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    facts = {"minutes": minutes, "utterances": args.utterances, "max_duration_s": args.max_duration}
    facts |= {"load_before": load_before, "load_after": load_average()}
    return [emit({"benchmark": "rss_over_time", **results[label], **facts}) for label in labels]


def main(argv: list[str] | None = None) -> list[dict]:
    def configure(parser) -> None:
        add = parser.add_argument
        add("--cuts", type=int, action="append", help="corpus sizes (default: 10^5 and 10^6)")
        add("--steps", type=int, default=20, help="a multiple of 10 (the step log)")
        add("--minutes", type=float, help="RSS over time: run this long instead")
        add("--utterances", type=int, default=2000, help="RSS over time: generated utterances")
        add("--max-duration", type=float, default=60.0, help="RSS over time: train.data.max_duration_s")
        add("--code", type=Path, action="append", help="RSS over time: checkouts to run side by side")
        add("--label", action="append", help="RSS over time: a name per --code")
        add("--env", action="append", help="RSS over time: per --code, extra environment K=V[,K=V] ('-': none)")

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    records = []
    with workdir(args.workdir) as work:
        if args.minutes:
            return over_time(args, work)
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
            record = {"benchmark": "trainer_scale", "cuts": count, "launches": launches}
            record |= {
                "temp_folder_mb": rounded(store_mb),
                "temp_folder_entries": sorted(p.name for p in tmp.iterdir()),
            }
            record |= {**in_process_costs(data, tmp), "load_before": load_before, "load_after": load_average()}
            records.append(emit(record))
    return records


if __name__ == "__main__":
    main()
