"""Start-up and memory of the train stage, launched as ``dvc repro`` and Snakemake launch it.

``python -m bench.startup [--quick] [--workdir W] [--repeat N] [--parts startup,workers] [--code DIR]``

``startup``: launch to the end of step 1 on yesno (median of ``--repeat``) for a fresh run with a new or an
existing ``mlflow.db`` and a resumed one, with a breakdown from the stage's log (:data:`MARKERS`).
``startup_workers``: ``num_workers`` x ``num_threads`` one launch each: first step, audio s/s from the run's
MLflow points, data wait, peak PSS of the process tree.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import statistics
import sys
from datetime import datetime
from pathlib import Path

from asrflow.testing.corpora import generated_data, params_for, yesno_data
from asrflow.testing.processes import ChildProcess
from asrflow.testing.repo import REPO, repo_params
from asrflow.training.outcome import Outcome, exit_code
from bench.common import emit, load_average, parse_args, rounded, workdir

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
#: The workers part per mode: generated utterances, steps (x 10: the step log), (workers, threads) settings.
GENERATED, STEPS = {"full": 2000, "quick": 40}, {"full": 20, "quick": 10}
SETTINGS = {"full": [(w, t) for w in (0, 1, 2) for t in (1, 2)], "quick": [(0, 1)]}
GOAL_S, GOAL_PSS_MB = 5.0, 2000.0
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


def write_params(run_dir: Path, train: dict, code: Path = REPO, data: Path | None = None) -> Path:
    """params.yaml of the repository ``code`` with ``train`` keys overridden, in ``run_dir``;
    with ``data``, its features section is the one ``data`` was computed with."""
    import yaml

    from asrflow.params import load_params
    from asrflow.training.config import set_train_keys

    params = load_params(code / "params.yaml") if code != REPO else repo_params()
    if data is not None:
        params = params_for(data, params)
    set_train_keys(params, train)
    path = run_dir / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def start_train(
    run_dir: Path, data: Path, *, log: Path, code: Path = REPO, extra_env=None, poll_s: float | None = 0.25
):
    """The train stage of checkout ``code`` on ``data`` in ``run_dir``, as a :class:`ChildProcess` (polling its
    tree's memory every ``poll_s``)."""
    command = [sys.executable, "-m", "stages.train", "--params", "params.yaml"]
    command += ["--fbank", str(data / "fbank"), "--lang", str(data / "lang"), "--exp", "exp"]
    env = {key: value for key, value in os.environ.items() if key not in UNSET}
    env |= {"PYTHONPATH": str(code), "PYTHONUNBUFFERED": "1"}
    return ChildProcess(command, log_path=log, env={**env, **(extra_env or {})}, cwd=run_dir, memory_poll_s=poll_s)


def launch(run_dir: Path, data: Path, *, stop_when: str, log: Path, timeout_s: float = 600.0, **start) -> dict:
    """:func:`start_train` until ``stop_when`` is logged, then SIGTERM (the step in flight is saved: exit 75).
    Returns the marks (seconds after launch), the exit code and the process tree's peak PSS in MB."""
    process = start_train(run_dir, data, log=log, **start)
    with contextlib.suppress(RuntimeError):  # it ended first: its exit code tells
        process.wait_for(stop_when, timeout_s)
        process.process.send_signal(signal.SIGTERM)
    status = process.wait(timeout_s)
    if status not in (0, exit_code(Outcome.STOPPED)):
        raise RuntimeError(f"train stage exited {status} in {run_dir}; log {log}:\n{process.tail(15)}")
    marks = {name: round(at - process.started, 3) for name, at in log_marks(process.log()).items()}
    return {"marks": marks, "exit_code": status, "peak_tree_pss_mb": rounded(process.peak_pss / 2**20)}


def metric_points(db: Path, key: str) -> dict[int, tuple[float, float]]:
    """Step -> (unix seconds, value) of ``key`` in the one run of the MLflow store ``db``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db.resolve()}")
    run = client.search_runs([e.experiment_id for e in client.search_experiments()])[0]
    return {m.step: (m.timestamp / 1000, m.value) for m in client.get_metric_history(run.info.run_id, key)}


def throughput(run_dir: Path) -> dict:
    """Audio s/s over steps 2..N of the run in ``run_dir/mlflow.db`` and over their second half (after MLflow's
    start in the background), and the median share of a step spent waiting for its batch."""
    rates = metric_points(run_dir / "mlflow.db", "train/audio_s_per_s")
    waits = [v for step, (_, v) in metric_points(run_dir / "mlflow.db", "train/data_wait_fraction").items() if step > 1]
    steps = sorted(rates)
    if len(steps) < 5:
        return {"audio_s_per_s": None, "steps": len(steps)}

    def rate(window: list[int]) -> float:
        audio = sum(rates[s][1] * (rates[s][0] - rates[p][0]) for p, s in zip(window, window[1:], strict=False))
        return rounded(audio / (rates[window[-1]][0] - rates[window[0]][0]))

    return {
        "audio_s_per_s": rate(steps),
        "audio_s_per_s_second_half": rate(steps[len(steps) // 2 :]),
        "data_wait_fraction_median": rounded(statistics.median(waits)),
        "steps": len(steps),
    }


def _median_marks(results: list[dict]) -> dict[str, float | None]:
    names = sorted({name for result in results for name in result["marks"]}, key=list(MARKERS).index)
    values = {name: [r["marks"][name] for r in results if name in r["marks"]] for name in names}
    return {name: rounded(statistics.median(v)) if len(v) == len(results) else None for name, v in values.items()}


def measure_startup(work: Path, repeat: int, code: Path = REPO) -> list[dict]:
    """The three start-up cases on yesno with the train stage of checkout ``code``, interleaved, ``repeat`` each."""
    data, root = yesno_data(work), work / ("startup-runs" if code == REPO else f"startup-runs-{code.name}")
    shutil.rmtree(root, ignore_errors=True)
    results: dict[str, list[dict]] = {"fresh_new_db": [], "fresh_existing_db": [], "resumed": []}
    for round_ in range(repeat):
        run_dir = root / f"round{round_}"
        run_dir.mkdir(parents=True)
        write_params(run_dir, {"epochs": 100}, code)
        for case in ("fresh_new_db", "resumed", "fresh_existing_db"):
            if case == "fresh_existing_db":
                shutil.rmtree(run_dir / "exp")
            stop = "[asrflow.progress] step "  # the progress line after this process's first step
            results[case].append(launch(run_dir, data, stop_when=stop, log=run_dir / f"{case}.log", code=code))
    records = []
    for case, runs in results.items():
        first_step = [r["marks"].get("first_step") for r in runs]
        median = statistics.median(first_step) if all(first_step) else None
        record = {"benchmark": "startup", "case": case, "corpus": "yesno", "code": str(code)}
        record |= {"launch_to_first_step_s": median and rounded(median), "runs_s": first_step}
        record |= {"breakdown_median_s": _median_marks(runs), "goal": "launch to the end of step 1 <= 5 s (median)"}
        record |= {"peak_tree_pss_mb": rounded(statistics.median(r["peak_tree_pss_mb"] for r in runs))}
        records.append(
            emit({**record, "meets_goal": bool(median and median <= GOAL_S), "load_average": load_average()})
        )
    return records


def measure_workers(work: Path, *, quick: bool, corpora: list[str], settings: list | None, train: dict) -> list[dict]:
    """``settings`` (num_workers, num_threads) one launch each per corpus; ``train``: more ``train:`` overrides."""
    mode, records = "quick" if quick else "full", []
    for corpus in corpora:
        data = yesno_data(work) if corpus == "yesno" else generated_data(work, GENERATED[mode])
        for workers, threads in settings or SETTINGS[mode]:
            suffix = "".join(f"-{key}{value}" for key, value in train.items())
            run_dir = work / "startup-workers" / f"{corpus}-w{workers}-t{threads}{suffix}"
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            write_params(run_dir, {"epochs": 100, **train, "num_workers": workers, "num_threads": threads}, data=data)
            result = launch(run_dir, data, stop_when=STEP_LINE.format(STEPS[mode]), log=run_dir / "train.log")
            name = f"generated-{GENERATED[mode]}" if corpus == "generated" else corpus
            record = {"benchmark": "startup_workers", "corpus": name, "num_workers": workers, "num_threads": threads}
            record |= {**train, "launch_to_first_step_s": result["marks"].get("first_step"), **throughput(run_dir)}
            record["peak_tree_pss_mb"] = pss = result["peak_tree_pss_mb"]
            if corpus == "generated":
                record |= {"goal": "peak PSS <= 2000 MB", "meets_goal": pss <= GOAL_PSS_MB}
            records.append(emit({**record, "load_average": load_average()}))
    return records


def main(argv: list[str] | None = None) -> list[dict]:
    def configure(parser: argparse.ArgumentParser) -> None:
        add = parser.add_argument
        add("--repeat", type=int, help="launches per start-up case (default 3; quick 1)")
        add("--parts", default="startup,workers", help="startup, workers or both (default: both)")
        add("--settings", help="workers: num_workers/num_threads pairs, e.g. 0/1,2/1 (default: 0,1,2 x 1,2)")
        add("--max-duration-s", type=float, help="workers: train.data.max_duration_s (default: params.yaml)")
        add("--code", type=Path, action="append", default=[], help="also time another checkout's start-up cases")
        add("--corpora", help="corpora of the workers part (default: generated,yesno; quick: yesno)")

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    parts, records = args.parts.split(","), []
    with workdir(args.workdir) as work:
        if "startup" in parts:
            for code in [REPO, *(path.resolve() for path in args.code)]:
                records += measure_startup(work, args.repeat or (1 if args.quick else 3), code)
        if "workers" in parts:
            corpora = (args.corpora or ("yesno" if args.quick else "generated,yesno")).split(",")
            settings = [tuple(int(x) for x in pair.split("/")) for pair in (args.settings or "").split(",") if pair]
            train = {} if args.max_duration_s is None else {"max_duration_s": args.max_duration_s}
            records += measure_workers(work, quick=args.quick, corpora=corpora, settings=settings, train=train)
    return records


if __name__ == "__main__":
    main()
