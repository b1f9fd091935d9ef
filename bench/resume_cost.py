"""Resume cost: seconds from launch to the first resumed step, by position in the epoch.

``python -m bench.resume_cost [--quick] [--workdir DIR] [--rounds N]``: yesno's train cuts replicated to ~650
batches an epoch, one run resumed from checkpoints at 10/50/90 % (each a training process of
:mod:`asrflow.testing.train_entry`), against a fresh start. Record ``resume_cost``: wall and trainer-CPU seconds
to the first step per position, their spread, and ``replay_estimate_s`` (what replaying the batches would add).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from asrflow.testing.corpora import prepare_yesno, torch_threads
from asrflow.testing.mlflow_store import fresh_mlflow_store
from asrflow.testing.tiny_config import tiny_train_config
from asrflow.testing.train_entry import TrainingProcess
from bench.common import emit, load_average, parse_args
from bench.startup import log_marks

POSITIONS = (0.1, 0.5, 0.9)


def build_corpus(root: Path, replicas: int) -> Path:
    """yesno prepared into ``root``, its train cuts listed ``replicas`` times under new ids (no more features)."""
    from lhotse import CutSet

    from asrflow.data.manifests import cuts_path, load_cuts

    prepare_yesno(root)
    train = load_cuts(root / "fbank", "train").to_eager()
    many = CutSet.from_cuts(cut.with_id(f"{cut.id}-r{r:03d}") for r in range(replicas) for cut in train)
    many.to_file(cuts_path(root / "fbank", "train"))
    return root


def batch_costs(data: Path, max_duration_s: float, num_buckets: int, count: int = 30) -> tuple[int, float]:
    """Batches in an epoch, and the CPU seconds to build one (features, CMVN, SpecAugment, targets) in one process."""
    from asrflow.data.features import FeatureConfig
    from asrflow.training.config import TrainConfig
    from asrflow.training.train_data import TrainData

    with torch_threads(1):
        config = TrainConfig(max_duration_s=max_duration_s, num_buckets=num_buckets, epochs=1)
        train_data = TrainData.build(config, FeatureConfig(), seed=42, fbank_dir=data / "fbank", lang_dir=data / "lang")
        items = list(train_data.batches)
        train_data.dataset[items[0]]  # warm-up
        began = time.process_time()
        for item in items[1 : count + 1]:
            train_data.dataset[item]
        return len(items), (time.process_time() - began) / len(items[1 : count + 1])


#: Log marks of a resume (:func:`bench.startup.log_marks`).
MARKS = {
    "decision": ("asrflow.training.trainer", "resuming from"),
    "fresh": ("asrflow.training.trainer", "starting a fresh run"),
    "mlflow": ("asrflow.tracking.run", "MLflow run "),
}


def time_first_step(data: Path, exp: Path, *, overrides: dict, uri: str, first: int, stop: int, log: Path) -> dict:
    """Launch training in ``exp``, time its first step (``first``), SIGKILL it after step ``stop``."""
    process = TrainingProcess(data, exp, overrides, log_path=log, pause_after_step=stop, tracking_uri=uri)
    process.wait_paused(timeout=400)
    process.kill()
    steps = {step: (at, cpu) for step, at, cpu in process.steps()}
    assert min(steps) == first, f"expected step {first} first, got {sorted(steps)}:\n{process.log()}"
    (at, cpu), marks = steps[first], log_marks(process.log(), MARKS)
    decision = marks.get("decision", marks.get("fresh"))
    return {
        "first_step_s": at - process.started,
        "main_process_cpu_s": cpu,
        "to_resume_decision_s": decision and decision - process.started,
        "decision_to_first_step_s": decision and at - decision,
        "to_mlflow_open_s": marks["mlflow"] - process.started if "mlflow" in marks else None,
    }


def clone_run(source: Path, target: Path, upto_step: int) -> str:
    """A copy of the run in ``source`` (exp + MLflow store) cut back to its checkpoint at ``upto_step``."""
    from asrflow.training.checkpoint import list_checkpoints, step_of

    shutil.copytree(source / "exp" / "checkpoints", target / "exp" / "checkpoints")
    for path in list_checkpoints(target / "exp" / "checkpoints"):
        if step_of(path) > upto_step:
            path.unlink()
    (target / "exp" / "checkpoints" / "best.pt").unlink(missing_ok=True)
    shutil.copyfile(source / "mlflow.db", target / "mlflow.db")
    uri = f"sqlite:///{(target / 'mlflow.db').resolve()}"
    # The store's one run as a crash after that checkpoint leaves it: RUNNING, points flushed through
    # ``upto_step`` (the later ones stay in the table; the resume trusts the watermark tag, not them).
    from mlflow.tracking import MlflowClient

    from asrflow.tracking.run import LOGGED_THROUGH_TAG

    client = MlflowClient(tracking_uri=uri)
    run_id = client.search_runs([e.experiment_id for e in client.search_experiments()])[0].info.run_id
    client.update_run(run_id, status="RUNNING")
    client.set_tag(run_id, LOGGED_THROUGH_TAG, str(upto_step))
    return uri


def _spread(values) -> float:
    values = list(values)
    return (max(values) - min(values)) / statistics.fmean(values)


def main(argv: list[str] | None = None) -> list[dict]:
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--rounds", type=int, help="launches per position, interleaved, medians (2; quick: 1)")

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    rounds, began = args.rounds or (1 if args.quick else 2), time.perf_counter()
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    # A new folder every time: runs found in a reused one would be resumed, not started.
    workdir = Path(tempfile.mkdtemp(prefix="resume-cost-", dir=args.workdir))
    replicas, workers = (4, 0) if args.quick else (100, 2)
    try:
        data = build_corpus(workdir / "data", replicas)
        base = {"epochs": 1, "num_workers": workers, "validate_every_steps": 0, "keep_last": 100, "average_last": 1}
        config = tiny_train_config(**base)
        steps, batch_cpu_s = batch_costs(data, config.max_duration_s, config.num_buckets)
        every = max(2, round(steps / 10))  # >= 2: step 1 is never a checkpoint step
        positions = {f"{round(f * 100)}%": every * max(1, round(f * steps / every)) for f in POSITIONS}
        overrides = {**base, "checkpoint_every_steps": every}
        runs: dict[str, list[dict]] = {name: [] for name in ["fresh", *positions]}
        for round_index in range(rounds):
            for name in runs:  # interleaved, so a burst of load hits every position alike
                target = workdir / f"{name.rstrip('%')}-{round_index}"
                if name == "fresh":  # the first fresh run trains past the last position: its checkpoints are resumed
                    uri, first = fresh_mlflow_store(target), 1
                    stop = max(positions.values()) + 1 if round_index == 0 else 1
                else:
                    uri = clone_run(workdir / "fresh-0", target, positions[name])
                    first = stop = positions[name] + 1
                where = {"overrides": overrides, "uri": uri, "log": target / "train.log"}
                runs[name].append(time_first_step(data, target / "exp", first=first, stop=stop, **where))
            logging.getLogger(__name__).info("round %d done after %.1f s", round_index + 1, time.perf_counter() - began)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)

    def median(key: str, names=tuple(positions)) -> dict[str, float]:
        return {name: statistics.median(run[key] for run in runs[name]) for name in names}

    wall, cpu, after = median("first_step_s"), median("main_process_cpu_s"), median("decision_to_first_step_s")
    fresh = median("first_step_s", ["fresh"])["fresh"]
    result = {"benchmark": "resume_cost", "quick": args.quick, "rounds": rounds, "train_cuts": 27 * replicas}
    result |= {"batches_per_epoch": steps, "num_workers": workers, "checkpoint_step": positions}
    result |= {
        "resume_first_step_s": wall,
        "spread": _spread(wall.values()),
        "baseline_fresh_start_first_step_s": fresh,
    }
    result["ratio_to_fresh_start"] = {name: value / fresh for name, value in wall.items()}
    result |= {
        "main_process_cpu_s": {**cpu, **median("main_process_cpu_s", ["fresh"])},
        "cpu_spread": _spread(cpu.values()),
    }
    result |= {"decision_to_first_step_s": after, "decision_to_first_step_spread": _spread(after.values())}
    result["replay_estimate_s"] = {name: step * batch_cpu_s for name, step in positions.items()}
    result |= {"runs": runs, "load_average": load_average(), "total_s": time.perf_counter() - began}
    result["note"] = (
        "wall and trainer-CPU seconds from launch to the end of the first resumed step; "
        "replay_estimate_s: what replaying the skipped batches would add"
    )
    return [emit(result)]


if __name__ == "__main__":
    main()
