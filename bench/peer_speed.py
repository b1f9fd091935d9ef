"""Training speed against a real peer: asrflow and SpeechBrain side by side, same batches, same model size.

``python -m bench.peer_speed [--quick] [--workdir W] [--epochs N | --steps N] [--corpora ...] [--precision P]
[--settings A S] [--loop bare|whole]``: asrflow's planned batches dumped (:mod:`bench.peer.batches`), then each side
trains in a process of its own, alternating (:mod:`bench.peer.asrflow_side`, :mod:`bench.peer.speechbrain_side`,
SpeechBrain installed by :mod:`bench.peer.install`), fp32 or bf16, at swept settings (:mod:`bench.peer.sweep`), each
on a CUDA GPU when there is one. ``--loop whole`` trains SpeechBrain with its own whole loop instead of on the dumped
batches: its ``Brain`` and data pipeline from the audio (:mod:`bench.peer.speechbrain_recipe`), batches of the same
seconds drawn by its own sampler, as many steps. Record ``peer_speed`` per corpus: per side audio s/s, start to
first step, peak tree PSS and GPU memory, FLOPs and dev loss (bare loop), params; ``ratio`` asrflow / peer.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from bench.common import emit, machine, parse_args, ratio, train_settings, workdir
from bench.peer.batches import cached_batches, dump_batches
from bench.peer.install import PEER_VERSION, install_peer, peer_env
from bench.peer.side import audio_rate, run_child
from bench.peer.sweep import SWEEP_STEPS, median_step_rate, sweep
from bench.peer_accuracy import speechbrain_inputs, speechbrain_options
from bench.startup import log_marks
from tests.support.corpora import generated_data, yesno_data
from tests.support.repo import REPO

#: Utterances of the generated corpus (2 % of them dev), per mode.
GENERATED = {"full": 2000, "quick": 60}
#: (corpus, epochs, steps: None = every step of the epochs) per mode.
PLANS = {"full": [("generated", 1, None), ("yesno", 30, None)], "quick": [("generated", 1, None)]}
#: Timed runs per side and corpus, alternating asrflow and SpeechBrain; each side's fastest is reported.
REPEATS = {"full": 2, "quick": 1}
SIDES = ("asrflow", "speechbrain")
#: Minutes SpeechBrain's whole loop may train before its step count is reached (a bound, never reached in practice).
WHOLE_LOOP_MINUTES = 60.0


def run_side(side: str, options: dict, log: Path, *, module: str | None = None) -> dict:
    """One side's training process (``module``, default ``bench.peer.<side>_side``): its report, with the process
    tree's peak PSS."""
    env = peer_env() if side == "speechbrain" else dict(os.environ)
    env |= {"PYTHONUNBUFFERED": "1", "GIT_PYTHON_REFRESH": "quiet", "MLFLOW_DISABLE_TELEMETRY": "true"}
    return run_child(module or f"bench.peer.{side}_side", options, log, env)


def speechbrain_whole_loop(params: dict, files: dict, *, steps: int, workers: int, log: Path) -> dict:
    """SpeechBrain's whole loop (:mod:`bench.peer.speechbrain_recipe`) for ``steps`` steps at ``params``' shape,
    batch seconds, optimizer and precision, ``workers`` data-loader processes, no decoding: its report in the bare
    loop's form (``steps`` as each step's end time and audio seconds)."""
    import torch

    options = speechbrain_options(params, files, WHOLE_LOOP_MINUTES) | {"max_steps": steps, "decode": False}
    options |= {"num_workers": workers, "device": "cuda" if torch.cuda.is_available() else "cpu"}
    found = run_side("speechbrain", options, log, module="bench.peer.speechbrain_recipe")
    optim = options["optim"]
    found["settings"] = {"num_threads": optim["num_threads"], "num_workers": workers, "precision": optim["precision"]}
    return found | {"steps": found.pop("step_times"), "dev_loss": None}


def start_marks(log: Path, launched: float) -> dict[str, float]:
    """Seconds from ``launched`` (unix s) to each start-up mark of :data:`bench.startup.MARKERS` found in the
    Trainer's ``log``: data ready, model built, first batch handed over, first step, MLflow run open."""
    marks = log_marks(log.read_text(errors="replace"))
    return {mark: round(at - launched, 2) for mark, at in sorted(marks.items(), key=lambda item: item[1])}


def summary(result: dict) -> dict:
    """The printed figures of one side."""
    steps = result["steps"]
    figures = {
        "audio_s_per_s": audio_rate(steps),
        "median_step_audio_s_per_s": median_step_rate(steps),
        "steps": len(steps),
    }
    figures["start_to_first_step_s"] = steps[0]["t"] - result["launched"]
    keys = ("peak_tree_pss_mb", "peak_gpu_mb", "flops_per_audio_s", "flops_by_part", "dev_loss", "params", "settings")
    return figures | {key: result.get(key) for key in keys}


def measure(
    corpus, data, work, *, quick, epochs, max_steps, peer_problem, settings, params_file, precision, loop, repeats
):
    """One corpus: the record to print, and the settings used (from the sweep, when one ran)."""
    from asrflow.presets import preset_params
    from tests.support.repo import repo_params

    params = preset_params(repo_params(), params_file)  # a whole params file, or a preset of the keys it changes
    fixed = {"train.optim.epochs": epochs, "train.optim.precision": precision, "train.optim.average_last": 1}
    fixed |= {"train.checkpoint.validate_every_steps": 0}

    def settings_of(changes: dict):
        """The TrainingSettings of ``params`` on ``data`` with ``fixed`` and ``changes`` (dotted keys)."""
        return train_settings(params, quick=quick, data=data, overrides=fixed | changes)

    ours = settings_of({})
    whole = loop == "whole" and peer_problem is None
    written = 1 if whole else None  # the whole loop reads its own audio: asrflow's FLOP count needs one batch
    dump = lambda out: dump_batches(data, out, ours, max_steps=max_steps, written_steps=written)  # noqa: E731
    name = f"{corpus}-{epochs}-{max_steps}" + ("-first" if whole else "")
    batches, info = cached_batches(work, name, params_file, data=data, dump=dump)
    files = speechbrain_inputs(data, work / f"speechbrain-csv-{corpus}")[0] if whole else {}

    def train(side: str, threads: int, workers: int, *, name: str, steps: int | None, dev: bool) -> dict:
        """``side`` trained in a process of its own; it rebuilds its settings from the params it is given."""
        shutil.rmtree(work / name, ignore_errors=True)  # a fresh run, never a resumed one
        given = settings_of({"train.optim.num_threads": threads, "run.num_workers": workers})
        if side == "speechbrain" and whole:
            log = work / f"{name}.log"
            return summary(
                speechbrain_whole_loop(
                    given.params, files, steps=min(steps or info["steps"], info["steps"]), workers=workers, log=log
                )
            )
        options = {"data": str(data), "batches": str(batches), "exp": str(work / name), "seed": given.seed, "dev": dev}
        options |= {"vocab_size": info["vocab_size"], "params": given.params, "max_steps": steps}
        found = run_side(side, options, work / f"{name}.log")
        return summary(found) | {"start_marks_s": start_marks(work / f"{name}.log", found["launched"])}

    sweep_figures = None
    if settings is None and not quick:

        def rate(side: str, t: int, w: int, name: str) -> float:
            return train(side, t, w, name=name, steps=SWEEP_STEPS, dev=False)["median_step_audio_s_per_s"]

        settings, sweep_figures = sweep(rate, peer=peer_problem is None)
    if settings is None:  # --quick: the shipped settings, and the peer at 2 threads
        shipped = {"num_threads": ours.train.optim.num_threads, "num_workers": ours.run.num_workers}
        settings = {"asrflow": shipped, "speechbrain": {"num_threads": 2, "num_workers": 0}}
    record: dict = {"benchmark": "peer_speed", "corpus": corpus, "params_file": params_file.name, "epochs": epochs}
    record["loop"] = loop
    record |= {"steps_per_run": info["steps"], "max_steps": max_steps}
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for repeat in range(repeats):
        for side in SIDES if peer_problem is None else SIDES[:1]:
            threads, workers = settings[side]["num_threads"], settings[side]["num_workers"]
            runs[side].append(
                train(side, threads, workers, name=f"peer-{side}-{corpus}-{repeat}", steps=max_steps, dev=True)
            )
    for side, found in runs.items():
        if found:
            record[side] = max(found, key=lambda r: r["audio_s_per_s"] or 0)
            record[side]["audio_s_per_s_of_each_run"] = [r["audio_s_per_s"] for r in found]
    if peer_problem is not None:
        return {**record, "status": "peer unavailable", "reason": peer_problem}, settings
    a, s = record["asrflow"], record["speechbrain"]
    speed, size = ratio(a["audio_s_per_s"], s["audio_s_per_s"]), ratio(a["params"], s["params"])
    record |= {"ratio": speed, "params_ratio": size, "peer": f"speechbrain {PEER_VERSION}"}
    record["memory_ratio"] = ratio(a["peak_tree_pss_mb"], s["peak_tree_pss_mb"])  # peak tree PSS; issue 24: <= 0.8
    if a["peak_gpu_mb"] and s["peak_gpu_mb"]:
        record["gpu_memory_ratio"] = ratio(a["peak_gpu_mb"], s["peak_gpu_mb"])
    if whole:  # issue 33 item 5, on the device at hand; no dev loss (SpeechBrain's loop decodes instead)
        memory = record.get("gpu_memory_ratio", record["memory_ratio"])
        record |= {"goal": "ratio >= 1.5 at <= 0.7x the memory", "meets_goal": speed >= 1.5 and memory <= 0.7}
    else:
        no_worse = a["dev_loss"] <= s["dev_loss"]
        record |= {"dev_loss_no_worse": no_worse}
        record |= {"goal": "ratio >= 1.5 on the generated corpus, dev loss no worse, params within 10 %"}
        record["meets_goal"] = speed >= 1.5 and no_worse and abs(size - 1) <= 0.1
    if sweep_figures is not None:
        record["settings_sweep"] = sweep_figures
    return record, settings


def fixed_settings(values: list[str]) -> dict:
    """``["2x0", "1x0"]`` -> each side's ``num_threads`` and ``num_workers``."""
    pairs = [value.partition("x")[::2] for value in values]
    if not all(t.isdigit() and w.isdigit() and int(t) > 0 for t, w in pairs):
        raise SystemExit(f"--settings {' '.join(values)}: give THREADSxWORKERS each, e.g. 2x0 2x0")
    return {side: {"num_threads": int(t), "num_workers": int(w)} for side, (t, w) in zip(SIDES, pairs, strict=True)}


def main(argv: list[str] | None = None) -> list[dict]:
    def configure(parser: argparse.ArgumentParser) -> None:
        add = parser.add_argument
        add("--epochs", type=int, help="epochs per corpus (default: 1 of generated, 30 of yesno)")
        add("--steps", type=int, help="only the first N steps of each run (default: all the epochs')")
        add("--corpora", nargs="+", choices=("generated", "yesno"), help="only these (default: both; quick: generated)")
        add(
            "--params",
            type=Path,
            default=REPO / "params.yaml",
            help="its train: section shapes both models (a whole "
            "params file, or a preset of the keys it changes in params.yaml)",
        )
        add("--precision", choices=("fp32", "bf16"), default="fp32", help="both sides (bf16: autocast on the device)")
        add("--settings", nargs=2, metavar=("ASRFLOW", "SPEECHBRAIN"), help="THREADSxWORKERS each (2x0 2x0): no sweep")
        add("--repeats", type=int, help="timed runs per side, alternating (default: 2; with --quick: 1)")
        add(
            "--loop",
            choices=("bare", "whole"),
            default="bare",
            help="SpeechBrain's loop: on the dumped batches, or "
            "its own Brain and data pipeline from the audio (default: bare)",
        )

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    mode = "quick" if args.quick else "full"
    out = []
    peer_problem = install_peer()
    with workdir(args.workdir) as work:
        out.append(emit({"benchmark": "machine", **machine()}))
        settings = fixed_settings(args.settings) if args.settings else None
        for corpus, epochs, max_steps in PLANS[mode]:
            if args.corpora and corpus not in args.corpora:
                continue
            epochs, max_steps = (args.epochs, None) if args.epochs else (epochs, args.steps or max_steps)
            dev = 4 if args.quick else 40
            data = yesno_data(work) if corpus == "yesno" else generated_data(work, GENERATED[mode], dev_utterances=dev)
            options = {"quick": args.quick, "epochs": epochs, "max_steps": max_steps, "params_file": args.params}
            options |= {"precision": args.precision, "loop": args.loop, "repeats": args.repeats or REPEATS[mode]}
            try:
                record, settings = measure(corpus, data, work, peer_problem=peer_problem, settings=settings, **options)
            except RuntimeError as error:
                record = {"benchmark": "peer_speed", "corpus": corpus, "status": "failed", "reason": str(error)}
            out.append(emit({**record, "mode": mode}))
    if not args.quick and any(r.get("status") not in ("ok", None) for r in out):
        sys.exit(1)
    return out


if __name__ == "__main__":
    main()
