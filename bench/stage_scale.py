"""The five stages on spoken corpora of 5, 15 and 50 hours: wall time and peak memory of each.

``python -m bench.stage_scale --hours 5 15 50 --workdir DIR [--steps 30] [--seed 0] [--voices 100]``

For each size, a spoken corpus (:mod:`asrflow.testing.spoken_corpus`: espeak-ng voices, 16 kHz
FLAC, split by voice; synthetic speech, for scale figures only) is synthesized once into
``DIR`` (cached by size, seed, voices and word list), then the stages run as the pipeline runs
them, each a new process from the repository root, with a params file that is params.yaml
pointed at the corpus (``corpus: folder``) with presets/real-corpus.yaml's features (16 kHz,
80 bins, every core), a BPE tokenizer of :data:`VOCAB_SIZE` pieces, and ``train``
:data:`TRAIN` (a real corpus's batch)::

    python -m stages.prepare   --params P --out M
    python -m stages.features  --params P --manifests M --out F
    python -m stages.tokenizer --params P --manifests M --out L
    python -m stages.train     --params P --fbank F --lang L --exp E    (stopped after --steps steps)
    python -m stages.evaluate  --params P --model E/model.pt --fbank F --out E/eval

Figures per stage and size: ``elapsed_s`` (wall) and ``peak_tree_pss_mb`` (the largest summed
proportional set size of the stage and all its workers, polled; prepare, features, tokenizer
and evaluate under :func:`bench.memory.measure`, which also gives the stage process' own
``peak_rss_mb``). Train runs as :func:`bench.startup.launch` runs it (cwd = the run folder,
its own ``mlflow.db``) and is stopped with SIGTERM once step ``--steps`` is logged (it saves a
checkpoint and exits 75): ``launch_to_first_step_s`` (start to the end of the first step),
then again resumed from that checkpoint to its first step (``resumed_launch_to_first_step_s``).
Nothing bounds training by steps in params, so evaluate decodes the test split with a bundle
made here from the interrupted run's last checkpoint (its WER means nothing: a few steps).

At the largest size, the no-op time of ``snakemake --cores all`` and ``dvc repro`` over the
data stages (prepare, features, tokenizer: the ones whose inputs grow with the corpus) in a
copy of the repository pointed at the corpus, its data folders linked to this run's outputs
(``snakemake --touch`` and ``dvc commit`` first record them as up to date).

One JSON record per stage and size (``benchmark: stage_scale``), one per tool (``stage_scale_noop``),
each with the load average: throughput figures are only as good as the machine is quiet.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import yaml

from asrflow.testing.corpora import data_features, generated_features
from asrflow.testing.repo import copy_repo, repo_params
from bench.common import emit, load_average, machine, parse_args, timed_run, tool
from bench.common import rounded as _rounded
from bench.memory import measure
from bench.startup import _STEP_LINE, launch

VOCAB_SIZE = 300
#: ``train`` overrides: SIGTERM ends training, so epochs only has to outlast ``--steps``.
TRAIN = {"epochs": 1000, "max_duration_s": 120.0, "num_workers": 0, "validate_every_steps": 0}
FIRST_STEP = "[asrflow.progress] step "


def corpus(work: Path, hours: float, seed: int, voices: int) -> Path:
    """The spoken corpus of ``hours`` hours (synthesized on first use, then reused from ``work``)."""
    from asrflow.testing import spoken_corpus

    words = hashlib.sha256(spoken_corpus.WORDS.read_bytes()).hexdigest()[:8]
    folder = work / f"spoken-{hours:g}h-seed{seed}-voices{voices}-{words}"
    if (folder / spoken_corpus.INFO_FILE).is_file():
        return folder
    start = time.perf_counter()
    info = spoken_corpus.generate(folder, hours=hours, seed=seed, voices=voices, progress=True)
    emit(
        {
            "benchmark": "stage_scale_corpus",
            "hours": hours,
            "utterances": info.utterances,
            "audio_s": info.audio_s,
            "synthesis_s": _rounded(time.perf_counter() - start),
            "jobs": len(os.sched_getaffinity(0)),
            "load_average": load_average(),
        }
    )
    return folder


def write_params(root: Path, corpus_dir: Path) -> Path:
    """params.yaml in ``root``: the repository's, pointed at ``corpus_dir``, with a 16 kHz corpus's settings."""
    from asrflow.training.config import set_train_keys

    params = repo_params()
    params["prepare"].update(
        corpus="folder", corpus_dir=str(corpus_dir), splits={"train": "train", "dev": "dev", "test": "test"}
    )
    params["features"] = generated_features()
    params["tokenizer"].update(model_type="bpe", vocab_size=VOCAB_SIZE)
    set_train_keys(params, TRAIN)
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def bundle_from_checkpoint(root: Path) -> Path:
    """``root/exp/model.pt`` from the newest checkpoint in ``root/exp/checkpoints`` (what the train stage would
    write at its end, without averaging)."""
    from asrflow.data.features import CMVN_FILE, cmvn_stats, load_cmvn
    from asrflow.params import load_params
    from asrflow.serving.bundle import save_bundle
    from asrflow.tokenizer import MODEL_FILE, Tokenizer
    from asrflow.training import checkpoint as ckpt
    from asrflow.training.config import load_train_config

    state, _ = ckpt.load_latest(root / "exp" / "checkpoints")
    tokenizer = Tokenizer(root / "lang" / MODEL_FILE)
    features = data_features(root)
    config = load_train_config(load_params(root / "params.yaml"))
    path = root / "exp" / "model.pt"
    save_bundle(
        path,
        model_state=state["model"],
        model_config=config.model(features.num_mel_bins, tokenizer.vocab_size),
        tokenizer=tokenizer,
        features=features,
        cmvn=cmvn_stats(load_cmvn(root / "fbank" / CMVN_FILE)),
        run_id=None,
        info={"made_by": "bench.stage_scale from the last checkpoint"},
    )
    return path


def run_stages(root: Path, corpus_dir: Path, hours: float, steps: int) -> list[dict]:
    """The five stages on ``corpus_dir`` in the fresh run folder ``root``; one record each."""
    from asrflow.testing.spoken_corpus import read_info

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    params = str(write_params(root, corpus_dir))
    info = read_info(corpus_dir)
    manifests, fbank, lang, exp = (str(root / name) for name in ("manifests", "fbank", "lang", "exp"))
    base = {"benchmark": "stage_scale", "hours": hours, "utterances": info.utterances, "audio_s": info.audio_s}
    records = []
    commands = {
        "prepare": ["--params", params, "--out", manifests],
        "features": ["--params", params, "--manifests", manifests, "--out", fbank],
        "tokenizer": ["--params", params, "--manifests", manifests, "--out", lang],
    }
    for stage, argv in commands.items():
        figures = measure(f"stages.{stage}", argv, root / f"{stage}.log")
        records.append(emit({**base, "stage": stage, **figures, "load_average": load_average()}))

    start = time.perf_counter()
    fresh = launch(root, root, stop_when=_STEP_LINE.format(steps), log=root / "train.log", timeout_s=3600)
    elapsed = time.perf_counter() - start
    resumed = launch(root, root, stop_when=FIRST_STEP, log=root / "train-resumed.log", timeout_s=600)
    records.append(
        emit(
            {
                **base,
                "stage": "train",
                "steps": steps,
                "elapsed_s": _rounded(elapsed),
                "peak_tree_pss_mb": fresh["peak_tree_pss_mb"],
                "launch_to_first_step_s": fresh["marks"].get("first_step"),
                "breakdown_s": fresh["marks"],
                "resumed_launch_to_first_step_s": resumed["marks"].get("first_step"),
                "resumed_peak_tree_pss_mb": resumed["peak_tree_pss_mb"],
                "exit_codes": [fresh["exit_code"], resumed["exit_code"]],
                "load_average": load_average(),
            }
        )
    )

    model = bundle_from_checkpoint(root)
    argv = ["--params", params, "--model", str(model), "--fbank", fbank, "--out", str(Path(exp) / "eval")]
    figures = measure("stages.evaluate", argv, root / "evaluate.log")
    records.append(emit({**base, "stage": "evaluate", **figures, "load_average": load_average()}))
    return records


def noop_tools(work: Path, root: Path, hours: float, repeats: int = 3) -> list[dict]:
    """No-op ``snakemake`` and ``dvc repro`` over the data stages, in a repository copy whose data folders link to
    the outputs in ``root``."""
    env = {**os.environ, "GIT_PYTHON_REFRESH": "quiet", "DVC_NO_ANALYTICS": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    repo = work / "noop-copy"
    shutil.rmtree(repo, ignore_errors=True)
    copy_repo(repo)
    shutil.copyfile(root / "params.yaml", repo / "params.yaml")
    for name in ("manifests", "fbank", "lang"):
        shutil.copytree(root / name, repo / "data" / name, copy_function=os.link)
    targets = ["data/manifests", "data/fbank", "data/lang"]
    snakemake, dvc = tool("snakemake"), tool("dvc")
    timed_run([snakemake, "--cores", "all", "--touch", *targets], repo, env)
    timed_run([dvc, "init", "--no-scm", "-q"], repo, env)
    commit_s, _ = timed_run([dvc, "commit", "-f", "-q", "prepare", "features", "tokenizer"], repo, env)
    tools = {
        "snakemake": ([snakemake, "--cores", "all", *targets], lambda out: "Nothing to be done" in out),
        "dvc": ([dvc, "repro", "tokenizer"], lambda out: "Running stage" not in out),
    }
    records = []
    for name, (command, idle) in tools.items():
        runs = [timed_run(command, repo, env) for _ in range(repeats)]
        nothing = all(idle(out) for _, out in runs)
        times = sorted(elapsed for elapsed, _ in runs)
        records.append(
            emit(
                {
                    "benchmark": "stage_scale_noop",
                    "status": "ok" if nothing else "failed: the no-op run did work",
                    "hours": hours,
                    "tool": name,
                    "command": " ".join([Path(command[0]).name, *command[1:]]),
                    "noop_s": _rounded(times[len(times) // 2]),
                    "noop_s_all": [_rounded(t) for t in times],
                    "dvc_commit_s": _rounded(commit_s),
                    "load_average": load_average(),
                }
            )
        )
    shutil.rmtree(repo, ignore_errors=True)
    return records


def main(argv: list[str] | None = None) -> list[dict]:
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--hours", type=float, nargs="+", default=[5.0, 15.0, 50.0], help="corpus sizes (hours)")
        parser.add_argument("--steps", type=int, default=30, help="train steps before SIGTERM (a multiple of 10)")
        parser.add_argument("--seed", type=int, default=0, help="corpus seed")
        parser.add_argument("--voices", type=int, default=100, help="corpus voices")
        parser.add_argument("--no-noop", action="store_true", help="skip the no-op snakemake / dvc timing")

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    if args.workdir is None:
        raise SystemExit("--workdir is required (the corpora are cached there)")
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    records = [emit({"benchmark": "machine", **machine(), "train_overrides": TRAIN, "vocab_size": VOCAB_SIZE})]
    for hours in args.hours:
        folder = corpus(work, hours, args.seed, args.voices)
        records += run_stages(work / f"run-{hours:g}h", folder, hours, args.steps)
    if not args.no_noop:
        largest = max(args.hours)
        records += noop_tools(work, work / f"run-{largest:g}h", largest)
    return records


if __name__ == "__main__":
    main()
