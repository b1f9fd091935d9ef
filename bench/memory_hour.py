"""The train stage as users run it, for an hour: its memory against step, one run per precision, side by side.

``python -m bench.memory_hour --data RUN [--minutes 60] [--precisions fp32 bf16] [--train JSON] [--plot PNG]``

``RUN`` is a folder holding ``params.yaml``, ``fbank/`` and ``lang/``, as ``python -m bench.stage_scale`` leaves
``W/run-spoken-<hours>``; ``--quick`` uses the shipped yesno corpus instead. Each precision trains in a run
folder of its own (``W/memory-<precision>``), all at once (one torch thread each by default), launched as
``dvc repro`` launches the stage and stopped by SIGTERM after ``--minutes``. The params are ``RUN``'s with the
repository's own run settings put back (validation, threads, the ``run:`` section with its data workers and
malloc: what a user gets), ``--train`` on top. The tree's memory is read every 5 s.

Records ``memory_hour`` per precision, from the readings taken while it trained (before the SIGTERM):
``memory_by_minute`` (``[minute, last step logged, highest tree RSS MB, highest tree PSS MB]``), ``windows`` (per
10 minutes: steps, median and highest RSS), the verdict :func:`levelled`, and ``rss_by_step`` (every reading as
``[step, tree RSS MB]``). ``--plot`` draws RSS against step for every run (matplotlib).
"""

from __future__ import annotations

import json
import shutil
import statistics
import threading
from pathlib import Path

import yaml

from asrflow.params import flatten, with_overrides
from bench.common import emit, load_average, machine, parse_args, workdir
from bench.stage_scale import by_minute
from bench.startup import launch, metric_points
from tests.support.corpora import params_for, yesno_data
from tests.support.processes import MemoryReading
from tests.support.repo import repo_params

#: The run settings put back from the repository's params.yaml: what a user's run has.
USER_SETTINGS = ("train.checkpoint.validate_every_steps", "train.optim.num_threads")
#: Memory counts as levelled when, after the first ``SETTLE_MIN`` minutes, every window's median RSS is within
#: ``SPREAD`` of their mean and the fitted trend over those minutes moves it by at most ``TREND`` of it.
SETTLE_MIN, WINDOW_MIN, SPREAD, TREND = 10, 10, 0.03, 0.02


def user_params(data: Path, precision: str, train: dict, quick: bool) -> dict:
    """``data``'s params (yesno: the repository's) with :data:`USER_SETTINGS` and ``run:`` as shipped,
    ``precision``, epochs enough to outlast the run, and ``train`` (dotted keys) on top."""
    shipped = repo_params()
    params = params_for(data, shipped) if quick else yaml.safe_load((data / "params.yaml").read_text())
    params["run"] = shipped["run"]  # data workers, malloc: how a user's run executes
    flat = flatten(shipped)
    restored = {key: flat[key] for key in USER_SETTINGS}
    if quick:  # yesno's few steps: validate and checkpoint often enough to be seen
        restored |= {"train.checkpoint.validate_every_steps": 5, "train.checkpoint.checkpoint_every_steps": 5}
    overrides = restored | {"train.optim.precision": precision, "train.optim.epochs": 1000} | train
    return with_overrides(params, overrides, "bench.memory_hour")


def windows(rows: list[list], minutes: int = WINDOW_MIN) -> list[dict]:
    """Per ``minutes`` of :func:`by_minute` rows: first and last step, median and highest of the minutes'
    highest tree RSS (MB)."""
    grouped: dict[int, list[list]] = {}
    for row in rows:
        grouped.setdefault(row[0] // minutes, []).append(row)
    return [
        {
            "minutes": [index * minutes, index * minutes + minutes - 1],
            "steps": [group[0][1], group[-1][1]],
            "rss_median_mb": statistics.median(row[2] for row in group),
            "rss_highest_mb": max(row[2] for row in group),
        }
        for index, group in sorted(grouped.items())
    ]


def levelled(rows: list[list]) -> dict:
    """Whether the tree's RSS levelled off within :data:`SETTLE_MIN` minutes and stayed level: the windows after
    it (:func:`windows`) and a least-squares line through the minutes' highest RSS after it.

    ``spread``: the largest distance of a window's median from the windows' mean, as a share of it;
    ``trend_mb_per_10_min``: the line's slope; ``trend_share``: how far the line moves over those minutes, as a
    share of the mean. ``None`` when fewer than two windows follow the settling time."""
    after = [row for row in rows if row[0] >= SETTLE_MIN]
    settled = windows(after)
    if len(settled) < 2:
        return {"levelled": None, "why": f"fewer than two {WINDOW_MIN}-minute windows after minute {SETTLE_MIN}"}
    medians = [window["rss_median_mb"] for window in settled]
    mean = statistics.fmean(medians)
    spread = max(abs(median - mean) for median in medians) / mean
    slope, _ = statistics.linear_regression([row[0] for row in after], [row[2] for row in after])
    trend_share = abs(slope) * (after[-1][0] - after[0][0]) / mean
    return {
        "levelled": spread <= SPREAD and trend_share <= TREND,
        "criterion": f"after minute {SETTLE_MIN}: window medians within {SPREAD:.0%} of their mean, "
        f"fitted trend over those minutes at most {TREND:.0%}",
        "spread": spread,
        "trend_mb_per_10_min": slope * 10,
        "trend_share": trend_share,
    }


def rss_by_step(samples: list[MemoryReading], stamps: list[tuple[float, int]]) -> list[tuple[int, float]]:
    """``(last step logged, tree RSS MB)`` of every memory reading, from steps' times ``(s, step)``."""
    found, index, step = [], 0, 0
    for at, rss, *_ in samples:
        while index < len(stamps) and stamps[index][0] <= at:
            step, index = stamps[index][1], index + 1
        found.append((step, rss / 2**20))
    return found


def plot(curves: dict[str, list[tuple[int, float]]], path: Path, title: str) -> None:
    """Tree RSS (MB) against optimizer step, one line per run, to the PNG ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(8, 4.5), dpi=100)
    for name, points in curves.items():
        axes.plot([step for step, _ in points], [mb for _, mb in points], label=name, linewidth=0.8)
    axes.set(xlabel="optimizer step", ylabel="train stage's tree RSS (MB)", title=title)
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    pyplot.close(figure)


def run_one(run_dir: Path, data: Path, params: dict, minutes: float) -> dict:
    """The train stage in a fresh ``run_dir`` for ``minutes``: what :func:`bench.startup.launch` returns, with
    ``stamps`` (``(s after launch, step)`` of each logged train loss) and ``losses`` (step -> train loss)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    (run_dir / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    found = launch(run_dir, data, stop_when=minutes * 60, log=run_dir / "train.log", timeout_s=minutes * 60 + 900)
    points = metric_points(run_dir / "mlflow.db", "train/loss")
    stamps = sorted((at - found["started"], step) for step, (at, _) in points.items())
    return found | {"stamps": stamps, "losses": {step: loss for step, (_, loss) in points.items()}}


def main(argv: list[str] | None = None) -> list[dict]:
    def configure(parser) -> None:
        parser.add_argument("--data", type=Path, help="run folder with params.yaml, fbank/, lang/ (not with --quick)")
        parser.add_argument("--minutes", type=float, default=60.0, help="training time per run (default: 60)")
        parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], help="one run each, side by side")
        parser.add_argument("--train", type=json.loads, default={}, help="params overrides as JSON, dotted keys")
        parser.add_argument("--plot", type=Path, help="write RSS against step here (PNG)")

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    if not args.quick and args.data is None:
        raise SystemExit("bench.memory_hour: --data RUN is needed (a folder bench.stage_scale left), or --quick")
    minutes = 0.4 if args.quick else args.minutes
    records = [emit({"benchmark": "machine", **machine(), "load_before": load_average()})]
    with workdir(args.workdir) as work:
        data = yesno_data(work) if args.quick else args.data.resolve()
        runs: dict[str, dict] = {}

        def run(precision: str) -> None:
            params = user_params(data, precision, args.train, args.quick)
            runs[precision] = run_one(work / f"memory-{precision}", data, params, minutes)

        threads = [threading.Thread(target=run, args=(p,), name=f"memory-{p}") for p in args.precisions]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        missing = [p for p in args.precisions if p not in runs]
        if missing:
            raise RuntimeError(f"bench.memory_hour: the run(s) {missing} failed; their train.log is in {work}")
        curves = {}
        for precision, found in runs.items():
            training = [sample for sample in found["samples"] if sample[0] < minutes * 60]  # not its way out
            rows, curves[precision] = by_minute(training, found["stamps"]), rss_by_step(training, found["stamps"])
            record = {"benchmark": "memory_hour", "precision": precision, "data": str(data), "minutes": minutes}
            record |= {"steps": found["stamps"][-1][1] if found["stamps"] else 0, "exit_code": found["exit_code"]}
            record |= {"peak_tree_rss_mb": max(row[2] for row in rows), "peak_tree_pss_mb": found["peak_tree_pss_mb"]}
            record |= {"windows": windows(rows), **levelled(rows), "memory_by_minute": rows}
            record |= {"rss_by_step": curves[precision]}  # what --plot draws
            records.append(emit(record | {"load_after": load_average()}))
        if args.plot:
            plot(curves, args.plot, f"train stage, {minutes:g} min per precision, side by side")
    return records


if __name__ == "__main__":
    main()
