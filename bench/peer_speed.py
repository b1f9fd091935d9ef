"""Training speed against a real peer: asrflow and SpeechBrain side by side, same data, same model size.

For each corpus (a generated corpus of utterances of 1-15 s, and the shipped yesno corpus;
features precomputed) this trains, one after the other in the same run:

* **asrflow**: the real :class:`asrflow.training.trainer.Trainer` in a process of its own
  (``python -m bench.peer_speed --side asrflow ...``), as the train stage runs it: MLflow
  recording into a throw-away SQLite store, ``train.num_workers`` data workers, SpecAugment,
  guards, scheduler; checkpoints as params.yaml says.
* **SpeechBrain** (``speechbrain==1.1.2``, installed by this benchmark with ``pip install
  --target`` into ``bench/.peer/``, never a dependency of asrflow): its Conformer-CTC as its
  LibriSpeech CTC recipes build it (``ConvolutionFrontEnd`` of two stride-2 blocks with 64
  and 32 channels, ``TransformerASR`` with ``encoder_module="conformer"``, no decoder, a
  linear CTC head), with d_model, heads, feed-forward width, layers and kernel size from
  params.yaml's ``train:`` section, in a process of its own with SpeechBrain and torch
  only. Its loop is forward, ``log_softmax``, ``ctc_loss``, backward, gradient clipping,
  AdamW with asrflow's learning-rate schedule.

Both see exactly the same batches: the parent writes asrflow's planned, augmented
batches (same seed, same duration budget and buckets, so the same padding) to disk, one
file per step, and the SpeechBrain process reads each with ``torch.load`` (its "data
loader"; reading a batch takes about a millisecond). Both run in fp32.

Figures (record ``peer_speed``, one per corpus):

* ``asrflow.audio_s_per_s`` / ``speechbrain.audio_s_per_s``: audio seconds of steps 2..N /
  wall seconds from the end of step 1 to the end of step N, over one whole epoch of the
  generated corpus and 30 of yesno; ``ratio`` = asrflow / SpeechBrain (goal >= 1.5 on the
  generated corpus). Without ``--quick`` each side trains twice, alternating (asrflow,
  SpeechBrain, asrflow, SpeechBrain), and the faster run of each is reported
  (``audio_s_per_s_of_each_run`` has both): on a shared machine the faster run is the one
  other work disturbed least;
* ``start_to_first_step_s``: from launching the process (before Python starts) to the end
  of its first optimizer step: imports, set-up, MLflow, worker spawn, first batch;
* ``peak_tree_pss_mb``: the largest summed proportional set size of the process and all
  its children (data workers), polled every second with psutil (a poll reads each
  process's smaps_rollup, about 40 ms of CPU: 4x a second took a sixth of a core);
* ``flops_per_audio_s``: model FLOPs (``torch.utils.flop_counter``) of one forward + backward
  of the first batch / its audio seconds, with ``flops_by_part`` (front end, attention,
  convolution module, feed-forward, CTC head, other);
* ``dev_loss``: per-token CTC loss (nats) on the dev split after the same number of epochs;
* ``params``: trainable parameters (they must agree within 10 %, ``params_ratio``).

Thread and worker settings: without ``--quick``, each side first runs a few steps of
the generated corpus at each candidate setting (asrflow: torch threads x data workers;
SpeechBrain: torch threads, no workers, as its recipes run features precomputed), and
the fastest by median step rate over the second half of its 20 steps
(``median_step_audio_s_per_s``: one slow step from a load spike does not decide, and
asrflow's MLflow run, which opens in the background during its first steps, is done) is
used for the figures (``settings_sweep`` lists every candidate). The sweep goes over all
candidates twice, and each candidate's faster round counts: a load spike that slows one
candidate's whole run does not decide the pick either.

A peer that cannot be installed is reported as ``"status": "peer unavailable"`` with the
reason, and no ratio; ``--quick`` still exits 0 then.

Usage: ``python -m bench.peer_speed [--quick] [--workdir DIR] [--epochs N] [--corpora generated yesno]
[--params FILE] [--settings 2x0 2x0]`` (``--settings``: each side's THREADSxWORKERS instead of the
sweep, for re-measuring at settings a sweep on a busy machine did not pick).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from asrflow.testing.corpora import data_features, generated_data, yesno_data
from asrflow.testing.repo import REPO
from bench.common import emit, machine, parse_args, ratio, rounded, workdir

#: The peer, pinned, and what ``pip install --target`` puts into PEER_DIR (no torch: the venv's).
PEER_VERSION = "1.1.2"
#: ``ASRFLOW_PEER_REQUIREMENT`` replaces the pinned requirement (the tests name one that cannot install).
PEER_PACKAGES = (
    os.environ.get("ASRFLOW_PEER_REQUIREMENT", f"speechbrain=={PEER_VERSION}"),
    "hyperpyyaml",
    "ruamel.yaml",
    "joblib",
    "huggingface_hub",
)
PEER_DIR = REPO / "bench" / ".peer" / PEER_PACKAGES[0].replace("==", "-")

#: Utterances of the generated corpus (2 % of them dev), per mode.
GENERATED = {"full": 2000, "quick": 60}
#: (corpus, epochs, steps: None = every step of the epochs) per mode.
PLANS = {"full": [("generated", 1, None), ("yesno", 30, None)], "quick": [("generated", 1, None)]}
#: Timed runs per side and corpus, alternating asrflow and SpeechBrain; each side's fastest is reported.
REPEATS = {"full": 2, "quick": 1}
#: The --quick model (only checks that the benchmark runs).
TINY_MODEL = {"d_model": 32, "num_heads": 2, "ffn_dim": 64, "num_layers": 1, "conv_kernel_size": 7}
#: Candidate settings: asrflow (num_threads, num_workers); SpeechBrain num_threads.
ASRFLOW_CANDIDATES = [(1, 2), (1, 0), (2, 0), (2, 1)]
PEER_CANDIDATES = [1, 2]
#: Steps per candidate in the settings sweep, and rounds over all candidates (each candidate's best round counts).
SWEEP_STEPS = 20
SWEEP_ROUNDS = 2
#: Seconds between two PSS polls of a training process tree.
PSS_POLL_S = 1.0

SIDES = ("asrflow", "speechbrain")


# =========================================================================== the parent
def install_peer() -> str | None:
    """Install the pinned SpeechBrain into PEER_DIR (once); None when it imports, else why not."""
    marker = PEER_DIR / ".installed"
    if not marker.is_file():
        shutil.rmtree(PEER_DIR, ignore_errors=True)
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(PEER_DIR), *PEER_PACKAGES],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            return f"pip install {' '.join(PEER_PACKAGES)} failed: {done.stderr.strip().splitlines()[-1:]}"
    check = subprocess.run(
        [sys.executable, "-c", "import speechbrain; print(speechbrain.__version__)"],
        env=peer_env(),
        capture_output=True,
        text=True,
    )
    if check.returncode != 0 or check.stdout.strip() != PEER_VERSION:
        return f"speechbrain {PEER_VERSION} does not import: {(check.stderr.strip().splitlines() or ['?'])[-1]}"
    marker.write_text(PEER_VERSION)
    return None


def peer_env() -> dict[str, str]:
    """The environment of the SpeechBrain process: the venv's torch plus PEER_DIR."""
    return {**os.environ, "PYTHONPATH": str(PEER_DIR)}


def configs(quick: bool, epochs: int, params_file: Path):
    """``params_file`` and its TrainConfig (tiny model with ``quick``; ``epochs``). The features
    are those each corpus was computed with (:func:`bench.common.data_features`)."""
    from asrflow.params import load_params
    from asrflow.training.config import load_train_config

    params = load_params(params_file)
    train = load_train_config(params)
    train = replace(
        train,
        epochs=epochs,
        nproc_per_node=1,
        nnodes=1,
        precision="fp32",
        validate_every_steps=0,
        average_last=1,
        **(TINY_MODEL if quick else {}),
    )
    return params, train


def dump_batches(data: Path, out: Path, config, features, *, seed: int, max_steps: int | None) -> dict:
    """Write asrflow's planned training batches (one ``step-<k>.pt`` each) and the dev batches.

    Returns ``{"steps", "vocab_size"}``.
    """
    from dataclasses import replace

    import torch

    from asrflow.data.batches import BatchItem
    from asrflow.training.train_data import TrainData

    out.mkdir(parents=True, exist_ok=True)
    train_data = TrainData.build(
        replace(config, accum_grad=1), features, seed=seed, fbank_dir=data / "fbank", lang_dir=data / "lang"
    )
    keys = ("features", "feature_lens", "targets", "target_lens", "durations", "step_tokens")
    steps = 0
    for item in train_data.batches:
        batch = train_data.dataset[item]
        torch.save({key: batch[key] for key in keys}, out / f"step-{steps}.pt")
        steps += 1
        if max_steps is not None and steps >= max_steps:
            break
    for index, ids in enumerate(train_data.dev_batches):
        batch = train_data.dev_dataset[
            BatchItem(epoch=0, step_in_epoch=0, micro_index=0, batch_index=index, cut_ids=ids, step_cut_ids=ids)
        ]
        torch.save({key: batch[key] for key in keys}, out / f"dev-{index}.pt")
    tokenizer = train_data.tokenizer
    return {"steps": steps, "vocab_size": tokenizer.vocab_size}


def _tree_pss(pid: int) -> int:
    """Summed PSS in bytes of ``pid`` and its descendants."""
    import psutil

    total = 0
    try:
        processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return 0
    for process in processes:
        with contextlib.suppress(psutil.Error):
            total += process.memory_full_info().pss
    return total


def run_side(side: str, options: dict, log: Path) -> dict:
    """Launch one training process; its report plus the process tree's peak PSS.

    Raises:
        RuntimeError: the process failed (its log is named).
    """
    report = log.with_suffix(".json")
    report.unlink(missing_ok=True)
    env = peer_env() if side == "speechbrain" else {**os.environ}
    env.update({"PYTHONUNBUFFERED": "1", "GIT_PYTHON_REFRESH": "quiet", "MLFLOW_DISABLE_TELEMETRY": "true"})
    launched = time.time()
    command = [
        sys.executable,
        "-m",
        "bench.peer_speed",
        "--side",
        side,
        "--report",
        str(report),
        "--launched",
        repr(launched),
        "--options",
        json.dumps(options),
    ]
    peak = [0]
    done = threading.Event()
    with log.open("w") as handle:
        process = subprocess.Popen(command, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, env=env)

        def poll() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], _tree_pss(process.pid))
                done.wait(PSS_POLL_S)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        code = process.wait()
        done.set()
        poller.join()
    if code != 0 or not report.is_file():
        tail = "\n".join(log.read_text().splitlines()[-20:])
        raise RuntimeError(f"{side} training exited {code}; log {log}:\n{tail}")
    result = json.loads(report.read_text())
    result["peak_tree_pss_mb"] = rounded(peak[0] / 2**20)
    return result


def median_step_rate(steps: list[dict]) -> float | None:
    """Median over the second half of the steps of one step's audio seconds / its wall seconds.

    The second half: robust to a load spike, and past asrflow's start, where MLflow opens its
    run in a background thread of the training process during the first ~10-15 steps.
    """
    half = steps[len(steps) // 2 - 1 :] if len(steps) > 2 else steps
    rates = sorted(b["audio_s"] / (b["t"] - a["t"]) for a, b in zip(half, half[1:], strict=False) if b["t"] > a["t"])
    return rates[len(rates) // 2] if rates else None


def summary(result: dict) -> dict:
    """The printed figures of one side."""
    steps = result["steps"]
    timed = steps[1:]
    audio = sum(s["audio_s"] for s in timed)
    wall = steps[-1]["t"] - steps[0]["t"] if len(steps) > 1 else math.nan
    median = median_step_rate(steps)
    return {
        "audio_s_per_s": rounded(audio / wall) if timed else None,
        "median_step_audio_s_per_s": rounded(median) if median is not None else None,
        "steps": len(steps),
        "start_to_first_step_s": rounded(steps[0]["t"] - result["launched"]),
        "peak_tree_pss_mb": result["peak_tree_pss_mb"],
        "flops_per_audio_s": rounded(result["flops_per_audio_s"]),
        "flops_by_part": {k: rounded(v) for k, v in result["flops_by_part"].items()},
        "dev_loss": rounded(result["dev_loss"]) if result.get("dev_loss") is not None else None,
        "params": result["params"],
        "settings": result["settings"],
    }


def sweep(
    data: Path,
    batches: Path,
    work: Path,
    config,
    *,
    features,
    params_file: Path,
    seed: int,
    vocab_size: int,
    peer: bool,
) -> tuple[dict, dict]:
    """Run a few steps at each candidate setting, every candidate once per round (:data:`SWEEP_ROUNDS`);
    the fastest asrflow and SpeechBrain settings by each candidate's best round, and every figure.

    Rounds, not one longer run per candidate: on a shared machine a load spike lands on one
    candidate's run and would decide the pick (one round once chose 1 thread for SpeechBrain,
    which a second thread made 1.49x faster in other runs); the round a candidate was disturbed
    least is its figure.
    """
    candidates = [("asrflow", threads, workers) for threads, workers in ASRFLOW_CANDIDATES]
    candidates += [("speechbrain", threads, 0) for threads in PEER_CANDIDATES] if peer else []
    rates: dict[tuple, list] = {candidate: [] for candidate in candidates}
    for round_index, candidate in ((r, c) for r in range(SWEEP_ROUNDS) for c in candidates):
        side, threads, workers = candidate
        name = f"sweep-{side}-{threads}-{workers}-round{round_index}"  # each round keeps its own log
        options = side_options(
            side,
            data,
            batches,
            work / name,
            config=config,
            features=features,
            params_file=params_file,
            seed=seed,
            vocab_size=vocab_size,
            threads=threads,
            workers=workers,
            max_steps=SWEEP_STEPS,
        )
        rates[candidate].append(summary(run_side(side, options, work / f"{name}.log"))["median_step_audio_s_per_s"])
    return pick_settings(rates)


def pick_settings(rates: dict[tuple[str, int, int], list[float | None]]) -> tuple[dict, dict]:
    """``(side, threads, workers)`` -> the rate of each round (None: no figure) => each side's fastest
    setting by its best round, and the sweep's figures per side."""
    figures: dict[str, list] = {"asrflow": [], "speechbrain": []}
    for (side, threads, workers), found in rates.items():
        row = {"num_threads": threads, "num_workers": workers, "audio_s_per_s": max(r or 0 for r in found)}
        figures[side].append({**row, "audio_s_per_s_of_each_round": found})
    best = {side: max(rows, key=lambda r: r["audio_s_per_s"]) for side, rows in figures.items() if rows}
    return best, figures


def side_options(
    side: str,
    data: Path,
    batches: Path,
    exp: Path,
    *,
    config,
    features,
    params_file: Path,
    seed: int,
    vocab_size: int,
    threads: int,
    workers: int,
    max_steps: int | None,
    dev: bool = False,
) -> dict:
    """What one training process needs (JSON); ``dev``: compute the dev loss at the end."""
    from dataclasses import asdict

    shutil.rmtree(exp, ignore_errors=True)
    return {
        "data": str(data),
        "batches": str(batches),
        "exp": str(exp),
        "seed": seed,
        "vocab_size": vocab_size,
        "config": {**asdict(replace(config, num_threads=threads, num_workers=workers))},
        "max_steps": max_steps,
        "side": side,
        "dev": dev,
        "features": asdict(features),
        "params_file": str(params_file),
    }


def measure(
    corpus: str,
    data: Path,
    work: Path,
    *,
    quick: bool,
    epochs: int,
    max_steps: int | None,
    peer_problem: str | None,
    settings: dict | None,
    params_file: Path,
) -> tuple[dict, dict | None]:
    """One corpus: the record to print, and the settings chosen (from the sweep, when one ran)."""
    params, config = configs(quick, epochs, params_file)
    features = data_features(data)  # generated: a 16 kHz corpus's; yesno: params.yaml's
    seed = int(params.get("seed", 0))
    # Cached per params content and data folder: a changed params.yaml never reuses stale batches.
    key = hashlib.sha256(params_file.read_bytes() + str(data).encode()).hexdigest()[:10]
    batches = work / f"peer-batches-{corpus}-{epochs}-{max_steps}-{key}"
    if not (batches / ".done").is_file():
        shutil.rmtree(batches, ignore_errors=True)
        info = dump_batches(data, batches, config, features, seed=seed, max_steps=max_steps)
        (batches / ".done").write_text(json.dumps(info))
    info = json.loads((batches / ".done").read_text())
    sweep_figures = None
    if settings is None and not quick:
        settings, sweep_figures = sweep(
            data,
            batches,
            work,
            config,
            features=features,
            params_file=params_file,
            seed=seed,
            vocab_size=info["vocab_size"],
            peer=peer_problem is None,
        )
    if settings is None:  # --quick: the shipped settings, and the peer at 2 threads
        settings = {
            "asrflow": {"num_threads": config.num_threads, "num_workers": config.num_workers},
            "speechbrain": {"num_threads": 2, "num_workers": 0},
        }
    record: dict = {
        "benchmark": "peer_speed",
        "corpus": corpus,
        "params_file": params_file.name,
        "epochs": epochs,
        "steps_per_run": info["steps"],
        "max_steps": max_steps,
    }
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for repeat, side in ((r, side) for r in range(REPEATS["quick" if quick else "full"]) for side in SIDES):
        if side == "speechbrain" and peer_problem is not None:
            continue
        chosen = settings[side]
        options = side_options(
            side,
            data,
            batches,
            work / f"peer-{side}-{corpus}-{repeat}",
            config=config,
            features=features,
            params_file=params_file,
            seed=seed,
            vocab_size=info["vocab_size"],
            threads=chosen["num_threads"],
            workers=chosen["num_workers"],
            max_steps=max_steps,
            dev=True,
        )
        runs[side].append(summary(run_side(side, options, work / f"peer-{side}-{corpus}-{repeat}.log")))
    sides = {side: max(found, key=lambda r: r["audio_s_per_s"] or 0) for side, found in runs.items() if found}
    for side, found in runs.items():
        if found:
            sides[side]["audio_s_per_s_of_each_run"] = [r["audio_s_per_s"] for r in found]
    record["asrflow"] = sides["asrflow"]
    if peer_problem is not None:
        record.update({"status": "peer unavailable", "reason": peer_problem})
        return record, settings
    record["speechbrain"] = sides["speechbrain"]
    a, s = sides["asrflow"], sides["speechbrain"]
    record.update(
        {
            "ratio": rounded(ratio(a["audio_s_per_s"], s["audio_s_per_s"])),
            "params_ratio": rounded(ratio(a["params"], s["params"])),
            "dev_loss_no_worse": a["dev_loss"] <= s["dev_loss"],
            "goal": "ratio >= 1.5 on the generated corpus, dev loss no worse, params within 10 %",
            "meets_goal": (
                ratio(a["audio_s_per_s"], s["audio_s_per_s"]) >= 1.5
                and a["dev_loss"] <= s["dev_loss"]
                and abs(ratio(a["params"], s["params"]) - 1) <= 0.1
            ),
            "peer": f"speechbrain {PEER_VERSION}",
        }
    )
    if sweep_figures is not None:
        record["settings_sweep"] = sweep_figures
    return record, settings


def fixed_settings(values: list[str]) -> dict:
    """``["2x0", "1x0"]`` -> each side's ``num_threads`` and ``num_workers``."""
    settings = {}
    for side, value in zip(SIDES, values, strict=True):
        threads, _, workers = value.partition("x")
        if not (threads.isdigit() and workers.isdigit() and int(threads) > 0):
            raise SystemExit(f"--settings {value}: give THREADSxWORKERS, e.g. 2x0")
        settings[side] = {"num_threads": int(threads), "num_workers": int(workers)}
    return settings


def main(argv: list[str] | None = None) -> list[dict]:
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--epochs",
            type=int,
            default=None,
            help="epochs per corpus, every step of them (default: 30 steps of generated, 30 epochs of yesno)",
        )
        parser.add_argument(
            "--corpora",
            nargs="+",
            choices=("generated", "yesno"),
            default=None,
            help="measure only these corpora (default: both; --quick: generated)",
        )
        parser.add_argument(
            "--params",
            type=Path,
            default=REPO / "params.yaml",
            help="the params file whose train: section shapes both models (default: params.yaml; "
            "e.g. presets/real-corpus.yaml)",
        )

        parser.add_argument(
            "--settings",
            nargs=2,
            metavar=("ASRFLOW", "SPEECHBRAIN"),
            default=None,
            help="THREADSxWORKERS of each side, e.g. 2x0 2x0: no sweep (default: sweep and take the fastest)",
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
            if args.epochs:
                epochs, max_steps = args.epochs, None
            data = (
                yesno_data(work)
                if corpus == "yesno"
                else generated_data(work, GENERATED[mode], dev_utterances=40 if not args.quick else 4)
            )
            try:
                record, settings = measure(
                    corpus,
                    data,
                    work,
                    quick=args.quick,
                    epochs=epochs,
                    max_steps=max_steps,
                    peer_problem=peer_problem,
                    settings=settings,
                    params_file=args.params,
                )
            except RuntimeError as error:
                record = {"benchmark": "peer_speed", "corpus": corpus, "status": "failed", "reason": str(error)}
            out.append(emit({**record, "mode": mode}))
    if not args.quick and any(r.get("status") not in ("ok", None) for r in out):
        sys.exit(1)
    return out


# =========================================================================== the children
def _parts(counts: dict[str, dict]) -> dict[str, float]:
    """FLOPs per model part from ``FlopCounterMode.get_flop_counts()`` (module path -> op -> FLOPs)."""
    names = {
        "front_end": ("subsampling", "cnn", "custom_src_module"),
        "attention": ("self_attn", "mha_layer"),
        "convolution": ("conv_module", "convolution_module"),
        "feed_forward": ("ffn1", "ffn2", "ffn_module1", "ffn_module2"),
        "ctc_head": ("head", "ctc_lin"),
    }
    parts = dict.fromkeys(names, 0.0)
    total = sum(counts.get("Global", {}).values())
    for path, ops in counts.items():
        leaf = path.rsplit(".", 1)[-1]
        for part, keys in names.items():
            if leaf in keys:
                parts[part] += sum(ops.values())
    parts["other"] = total - sum(parts.values())
    return parts


def _flops(forward_backward, audio_s: float) -> tuple[float, dict]:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        forward_backward()
    parts = _parts(counter.get_flop_counts())
    return counter.get_total_flops() / audio_s, {k: v / audio_s for k, v in parts.items()}


def child_asrflow(options: dict, launched: float) -> dict:
    """Train with the real Trainer; per-step end times, FLOPs, dev loss."""
    import torch

    from asrflow.data.features import FeatureConfig
    from asrflow.params import load_params
    from asrflow.training.config import TrainConfig, TrainPaths
    from asrflow.training.distributed import DistInfo
    from asrflow.training.observers import TrainObserver
    from asrflow.training.step import ctc_loss_sum
    from asrflow.training.trainer import Trainer

    params = load_params(options["params_file"])
    config = TrainConfig(**options["config"])
    features = FeatureConfig(**options["features"])
    data, exp = Path(options["data"]), Path(options["exp"])
    steps: list[dict] = []
    max_steps = options["max_steps"]

    class Timing(TrainObserver):
        def after_step(self, run, result):
            steps.append({"t": time.time(), "audio_s": result.audio_seconds})
            if max_steps is not None and len(steps) >= max_steps - 1:
                run.stop.request()

    paths = TrainPaths.under(exp, fbank_dir=data / "fbank", lang_dir=data / "lang")
    trainer = Trainer(
        config,
        features,
        seed=options["seed"],
        all_params=params,
        paths=paths,
        tracking_uri=f"sqlite:///{exp / 'mlflow.db'}",
        observers=[Timing()],
    )
    trainer.run()  # returns when finished or stopped
    model = trainer.model
    loss = None
    if options["dev"]:
        loss = trainer.data.dev_loss(model, precision=trainer.precision, dist=DistInfo(), device=torch.device("cpu"))
    batch = torch.load(Path(options["batches"]) / "step-0.pt", weights_only=True)
    model.train()

    def forward_backward():
        log_probs, out_lens = model(batch["features"], batch["feature_lens"])
        ctc_loss_sum(log_probs, out_lens, batch).backward()

    flops, parts = _flops(forward_backward, float(batch["durations"].sum()))
    return {
        "steps": steps,
        "launched": launched,
        "dev_loss": loss,
        "flops_per_audio_s": flops,
        "flops_by_part": parts,
        "params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "settings": {"num_threads": config.num_threads, "num_workers": config.num_workers, "precision": "fp32"},
    }


def _speechbrain_model(config: dict, input_dim: int, vocab_size: int):
    """SpeechBrain's Conformer-CTC of asrflow's shape, as its LibriSpeech CTC recipes build it."""
    import torch
    from speechbrain.lobes.models.convolution import ConvolutionFrontEnd
    from speechbrain.lobes.models.transformer.TransformerASR import TransformerASR

    cnn = ConvolutionFrontEnd(
        input_shape=(8, 10, input_dim),
        num_blocks=2,
        num_layers_per_block=1,
        out_channels=(64, 32),
        kernel_sizes=(3, 3),
        strides=(2, 2),
        residuals=(False, False),
    )
    freq = cnn(torch.zeros(1, 16, input_dim)).shape[-2:]  # (F', C)
    transformer = TransformerASR(
        input_size=freq[0] * freq[1],
        tgt_vocab=vocab_size,
        d_model=config["d_model"],
        nhead=config["num_heads"],
        num_encoder_layers=config["num_layers"],
        num_decoder_layers=0,
        d_ffn=config["ffn_dim"],
        dropout=config["dropout"],
        activation=torch.nn.GELU,
        encoder_module="conformer",
        attention_type="regularMHA",
        normalize_before=True,
        causal=False,
        kernel_size=config["conv_kernel_size"],
    )

    class SpeechBrainCtc(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cnn, self.transformer = cnn, transformer
            self.ctc_lin = torch.nn.Linear(config["d_model"], vocab_size)

        def forward(self, features, feature_lens):
            """(N, T, F) fbank, (N,) frames -> (N, T', V) log-probabilities, (N,) output frames."""
            x = self.cnn(features)  # (N, T', F', C), flattened by the transformer
            relative = feature_lens.float() / features.shape[1]
            encoded = self.transformer.encode(x, relative)  # (N, T', D)
            log_probs = self.ctc_lin(encoded).log_softmax(-1)
            out_lens = torch.clamp((relative * log_probs.shape[1]).round().long(), 1, log_probs.shape[1])
            return log_probs, out_lens

    return SpeechBrainCtc()


def child_speechbrain(options: dict, launched: float) -> dict:
    """Train SpeechBrain's model on the dumped batches; per-step end times, FLOPs, dev loss."""
    import torch
    import torch.nn.functional as F

    config = options["config"]
    torch.set_num_threads(config["num_threads"])
    torch.manual_seed(options["seed"])
    folder = Path(options["batches"])
    first = torch.load(folder / "step-0.pt", weights_only=True)
    model = _speechbrain_model(config, first["features"].shape[-1], options["vocab_size"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=config["weight_decay"])
    warmup = config["warmup_steps"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min((step + 1) / warmup, (warmup / (step + 1)) ** 0.5) if warmup else 1.0
    )

    def loss_sum(batch):
        log_probs, out_lens = model(batch["features"], batch["feature_lens"])
        return F.ctc_loss(
            log_probs.transpose(0, 1),
            batch["targets"],
            out_lens,
            batch["target_lens"],
            blank=0,
            reduction="sum",
            zero_infinity=True,
        )

    steps: list[dict] = []
    total = len(list(folder.glob("step-*.pt")))
    limit = total if options["max_steps"] is None else min(total, options["max_steps"])
    model.train()
    for index in range(limit):
        batch = first if index == 0 else torch.load(folder / f"step-{index}.pt", weights_only=True)
        optimizer.zero_grad(set_to_none=True)
        (loss_sum(batch) / max(int(batch["step_tokens"]), 1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config["max_grad_norm"])
        optimizer.step()
        scheduler.step()
        steps.append({"t": time.time(), "audio_s": float(batch["durations"].sum())})
    loss = None
    if options["dev"]:
        model.eval()
        total_loss, tokens = 0.0, 0.0
        with torch.no_grad():
            for path in sorted(folder.glob("dev-*.pt")):
                batch = torch.load(path, weights_only=True)
                total_loss += float(loss_sum(batch))
                tokens += float(batch["target_lens"].sum())
        loss = total_loss / max(tokens, 1.0)
        model.train()
    flops, parts = _flops(lambda: loss_sum(first).backward(), float(first["durations"].sum()))
    return {
        "steps": steps,
        "launched": launched,
        "dev_loss": loss,
        "flops_per_audio_s": flops,
        "flops_by_part": parts,
        "params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "settings": {"num_threads": config["num_threads"], "num_workers": 0, "precision": "fp32"},
    }


def child(argv: list[str]) -> None:
    """``--side`` mode: train one side and write its report."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", choices=SIDES, required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--launched", type=float, required=True)
    parser.add_argument("--options", required=True)
    args = parser.parse_args(argv)
    options = json.loads(args.options)
    run = child_asrflow if args.side == "asrflow" else child_speechbrain
    args.report.write_text(json.dumps(run(options, args.launched)))


if __name__ == "__main__":
    if "--side" in sys.argv[1:]:
        child(sys.argv[1:])
    else:
        main()
