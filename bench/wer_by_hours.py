"""How WER grows with data: the same model for the same wall time on more hours of one corpus, one test split.

``python -m bench.wer_by_hours --data RUN --hours 5 15 25 [--minutes 30] [--train JSON] [--plot PNG] [--quick]
[--workdir W]``; ``--plot PNG --plot-records FILE ...`` draws the plot from records of runs made apart.

``RUN`` is a folder holding ``params.yaml``, ``fbank/`` and ``lang/``, as ``python -m bench.stage_scale`` leaves
``W/run-spoken-<hours>``; ``--quick`` uses the shipped yesno corpus for a few seconds per size. Per size ``H``, a
run folder ``W/hours-<H>`` whose ``fbank/`` holds a seeded random draw of ``RUN``'s train utterances adding up to
``H`` hours (whole utterances, drawn from every training voice, as the smaller corpora of
``asrflow.generate.spoken_corpus`` have every voice too) and links to every other file of ``RUN``'s ``fbank/``: the
stored features, the dev and test splits and the CMVN statistics. The tokenizer is ``RUN``'s. So the sizes differ in
the train utterances alone. Each size is trained by the train stage as users run it for ``--minutes``
(:mod:`bench.accuracy_at_time`, ``RUN``'s params with ``--train`` on top), one after another, then scored on
``RUN``'s test split with its newest checkpoint.

Records ``wer_by_hours`` per size: the hours asked and drawn, utterances, steps, epochs reached, the last train
loss, test ``wer`` and ``cer``, and the training tree's peak PSS. ``--plot`` draws WER and CER against hours.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import yaml

from asrflow.params import with_overrides
from bench.accuracy_at_time import score_run, train_for
from bench.common import emit, load_average, machine, parse_args, workdir
from tests.support.corpora import params_for, yesno_data
from tests.support.repo import repo_params

TRAIN_CUTS = "train_cuts.jsonl.gz"
#: The sizes ``--quick`` draws from yesno's train split (about 3 minutes of audio), in hours.
QUICK_HOURS = (0.02, 0.04)
EPOCHS = 1000  # more than any run reaches in its minutes: the deadline ends it, not the schedule
PROGRESS = re.compile(r"step (\d+)/(\d+) ")


def draw_hours(fbank: Path, hours: float, out: Path, seed: int = 0) -> dict:
    """``out`` as ``fbank`` with a train split of ``hours``: a seeded random draw of ``fbank``'s train cuts, taken
    until their durations add up to at least ``hours`` (the last utterance drawn may pass it by its own length);
    every other entry of ``fbank`` is linked, not copied. Returns the hours drawn and the utterances.

    Raises:
        ValueError: ``hours`` is more than ``fbank``'s train split holds.
    """
    from lhotse import CutSet

    cuts = list(CutSet.from_file(fbank / TRAIN_CUTS))
    available = sum(cut.duration for cut in cuts) / 3600
    if hours > available:
        raise ValueError(f"{fbank / TRAIN_CUTS} holds {available:.2f} h of train audio, fewer than the {hours} h asked")
    random.Random(seed).shuffle(cuts)
    drawn, seconds = [], 0.0
    for cut in cuts:
        if seconds >= hours * 3600:
            break
        drawn.append(cut)
        seconds += cut.duration
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for entry in fbank.iterdir():
        if entry.name != TRAIN_CUTS:
            (out / entry.name).symlink_to(entry.resolve())
    CutSet.from_cuts(drawn).to_file(out / TRAIN_CUTS)
    return {"hours_drawn": seconds / 3600, "utterances": len(drawn)}


def epochs_reached(log: Path, steps: int) -> float | None:
    """Passes over the train split that ``steps`` optimizer steps make, from the stage's progress line in ``log``
    (``step S/T``: ``T`` steps for :data:`EPOCHS` epochs); None without one."""
    found = PROGRESS.search(log.read_text()) if log.is_file() else None
    return steps / (int(found[2]) / EPOCHS) if found else None


def plot(records: list[dict], path: Path, title: str) -> None:
    """Test WER and CER (%) against the hours trained on, one line each, to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    hours = [record["hours_drawn"] for record in records]
    figure, axes = pyplot.subplots(figsize=(6, 4), dpi=100)
    for key in ("wer", "cer"):
        axes.plot(hours, [100 * record[key] for record in records], marker="o", label=f"test {key.upper()}")
    for record in records:
        if record.get("epochs") is not None:
            axes.annotate(
                f"{record['epochs']:.1f} epochs",
                (record["hours_drawn"], 100 * record["cer"]),
                fontsize=8,
                textcoords="offset points",
                xytext=(0, -14),
                ha="center",
            )
    axes.set(xlabel="hours of training audio", ylabel="%", title=title, xscale="log")
    axes.minorticks_off()
    axes.margins(x=0.1)
    axes.set_xticks(hours, [f"{h:g}" for h in hours])
    axes.set_ylim(bottom=0)
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)


def main(argv: list[str] | None = None) -> list[dict]:
    def configure(parser) -> None:
        parser.add_argument("--data", type=Path, help="run folder with params.yaml, fbank/, lang/ (not with --quick)")
        parser.add_argument("--hours", type=float, nargs="+", help="train hours to draw, one run each (ascending)")
        parser.add_argument("--minutes", type=float, default=30.0, help="training time per size (default: 30)")
        parser.add_argument("--train", type=json.loads, default={}, help="params overrides as JSON, dotted keys")
        parser.add_argument("--seed", type=int, default=0, help="seed of the draw of train utterances (default: 0)")
        parser.add_argument("--plot", type=Path, help="write test WER and CER against hours here (PNG)")
        parser.add_argument(
            "--plot-records",
            type=Path,
            nargs="+",
            help="only draw --plot from these files' wer_by_hours records (sizes run apart, e.g. one a core)",
        )

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    if args.plot_records:
        if not args.plot:
            raise SystemExit("bench.wer_by_hours: --plot-records draws --plot PNG; name it")
        lines = [line for path in args.plot_records for line in path.read_text().splitlines() if line.startswith("{")]
        sizes = sorted(
            (r for r in map(json.loads, lines) if r["benchmark"] == "wer_by_hours"), key=lambda r: r["hours"]
        )
        plot(sizes, args.plot, f"{sizes[0]['minutes']:g} min of training per size")
        return sizes
    if not args.quick and (args.data is None or not args.hours):
        raise SystemExit("bench.wer_by_hours: --data RUN and --hours H [H ...] are needed, or --quick")
    minutes = 0.3 if args.quick else args.minutes
    records = [emit({"benchmark": "machine", **machine(), "load_before": load_average()})]
    sizes = []
    with workdir(args.workdir) as work:
        data = yesno_data(work) if args.quick else args.data.resolve()
        base = params_for(data, repo_params()) if args.quick else yaml.safe_load((data / "params.yaml").read_text())
        params = with_overrides(base, args.train | {"train.optim.epochs": EPOCHS}, "--train")
        for hours in sorted(args.hours or QUICK_HOURS):
            subset = work / f"hours-{hours:g}"
            drawn = draw_hours(data / "fbank", hours, subset / "fbank", args.seed)
            (subset / "lang").unlink(missing_ok=True)
            (subset / "lang").symlink_to(data / "lang")
            run_dir = work / f"hours-{hours:g}-run"
            record = {"benchmark": "wer_by_hours", "hours": hours, **drawn, "minutes": minutes, "data": str(data)}
            record |= {"overrides": args.train, "seed": args.seed, "load_before": load_average()}
            record |= train_for(run_dir, subset, params, minutes) | score_run(run_dir, data)
            record["epochs"] = epochs_reached(run_dir / "train.log", record["steps"])
            sizes.append(emit(record | {"load_after": load_average()}))
    if args.plot:
        plot(sizes, args.plot, f"{minutes:g} min of training per size")
    return records + sizes


if __name__ == "__main__":
    main()
