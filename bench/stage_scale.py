"""The stages as the pipeline runs them, on corpora of growing size: wall time and peak memory of each.

``python -m bench.stage_scale [--corpus KIND] [--sizes N ...] [--workdir W] [--quick] [--repo R] [--in-process]``
``python -m bench.stage_scale --noop-only W/run-spoken-<hours>`` (the no-op timing alone, on a run it left)

KIND, its sizes, and its stages (corpora cached in ``W``): ``spoken`` (hours of espeak-ng speech: all five
stages, train stopped by SIGTERM after ``--steps`` and resumed, evaluate with its last checkpoint; then the
no-op ``snakemake --cores all`` and ``dvc repro`` of the whole pipeline at the largest size), ``folder``
(utterances copied from 8) and ``kaldi`` (segments of 10 long recordings): prepare; ``segments`` (hours of
2-7 s cuts of 16 recordings): features. ``--repo`` runs another checkout's stages; ``--in-process`` runs
prepare here (CPU s).

Records: ``stage_scale`` per stage and size (``elapsed_s``; ``peak_rss_mb``, the stage's ``VmHWM``;
``peak_tree_pss_mb``, it and its workers), ``stage_scale_baseline`` (the stage's ``--help``),
``stage_scale_growth`` (largest size against smallest), ``stage_scale_noop_pipeline`` (the data stages' alone,
``stage_scale_noop``, are at commit 130738e). Method: bench/RESULTS.md#stages-at-size.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import yaml

from bench.common import (
    emit,
    load_average,
    machine,
    noop_runs,
    parse_args,
    ratio,
    timed_run,
    workdir,
    write_bundle,
)
from bench.startup import STEP_LINE, launch, metric_points
from tests.support import corpora
from tests.support.processes import MemoryReading
from tests.support.repo import REPO, copy_repo, repo_params
from tests.support.stage_memory import stage_peaks

#: Per corpus: (sizes, quick sizes, the stages run).
KINDS = {
    "spoken": ((5.0, 15.0, 50.0), (0.02,), ("prepare", "features", "tokenizer", "train", "evaluate")),
    "folder": ((2000, 20000), (200, 800), ("prepare",)),
    "kaldi": ((100_000, 1_000_000), (2000, 8000), ("prepare",)),
    "segments": ((5.0, 50.0), (0.1, 0.4), ("features",)),
}
VOCAB_SIZE = 300
#: params.yaml overrides (dotted keys) of the spoken corpus: SIGTERM ends training, so epochs only has to outlast
#: ``--steps``; SpecAugment on, as for any corpus of hours (params.yaml has it off for yesno).
TRAIN = {
    "train.optim.epochs": 1000,
    "train.data.spec_augment": True,
    "train.data.max_duration_s": 120.0,
    "run.num_workers": 0,
    "train.checkpoint.validate_every_steps": 0,
}


def corpus(kind: str, size: float, work: Path, args) -> tuple[Path, dict]:
    """The corpus (``segments``: its manifests) of ``size``, built once into ``work``; its utterances and audio."""
    if kind == "spoken":
        from asrflow.generate import spoken_corpus

        words = hashlib.sha256(spoken_corpus.WORDS.read_bytes()).hexdigest()[:8]
        folder = work / f"spoken-{size:g}h-seed{args.seed}-voices{args.voices}-{words}"
        if not (folder / spoken_corpus.INFO_FILE).is_file():
            start = time.perf_counter()
            spoken_corpus.generate(folder, hours=size, seed=args.seed, voices=args.voices, progress=True)
            emit({"benchmark": "stage_scale_corpus", "hours": size, "synthesis_s": time.perf_counter() - start})
        info = spoken_corpus.read_info(folder)
        return folder, {"utterances": info.utterances, "audio_s": info.audio_s}
    if kind == "segments":
        cuts = int(size * 3600 / 4.5)
        split = {"train": cuts - 2 * max(1, cuts // 100), "dev": max(1, cuts // 100), "test": max(1, cuts // 100)}
        folder = work / f"manifests-{size:g}h"
        shape = {"min_s": 2.0, "max_s": 7.0, "recordings": 16, "recording_s": 120.0}
        audio_s = corpora.write_segment_manifests(folder, work / "audio", split, **shape)
        return folder, {"utterances": cuts, "audio_s": audio_s}
    build = corpora.copied_folder_corpus if kind == "folder" else corpora.kaldi_corpus
    return build(work, int(size)), {"utterances": int(size)}


def write_params(root: Path, kind: str, corpus_dir: Path, train_keys: dict) -> Path:
    """params.yaml in ``root``: the repository's, pointed at ``corpus_dir``, with 16 kHz features (spoken: with
    :data:`TRAIN` and ``train_keys``, dotted keys such as ``train.model.num_layers``)."""
    from asrflow.params import with_overrides

    params = repo_params()
    splits = {"train": "train", "dev": None if kind == "kaldi" else "dev", "test": None if kind == "kaldi" else "test"}
    params["prepare"].update(corpus="kaldi" if kind == "kaldi" else "folder", corpus_dir=str(corpus_dir), splits=splits)
    params["features"] = corpora.generated_features()
    if kind == "spoken":
        params["tokenizer"].update(model_type="bpe", vocab_size=VOCAB_SIZE)
        params = with_overrides(params, TRAIN | train_keys, "bench.stage_scale --train")
    root.mkdir(parents=True, exist_ok=True)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return root / "params.yaml"


def in_process(params: Path, out: Path) -> dict:
    """Prepare in this process: wall and CPU seconds (every thread), utterances per CPU second."""
    from asrflow.data.prepare.config import PrepareConfig
    from asrflow.data.prepare.corpus import prepare_corpus

    config = PrepareConfig.from_section(yaml.safe_load(params.read_text())["prepare"])
    wall, cpu = time.perf_counter(), time.process_time()
    summary = prepare_corpus(config, out, seed=0)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"elapsed_s": wall, "cpu_s": cpu, "utterances_per_cpu_s": summary.items_total / cpu}


def bundle_from_checkpoint(root: Path, data: Path | None = None, made_by: str = "bench.stage_scale") -> Path:
    """``root/exp/model.pt`` from the newest checkpoint (what the train stage writes at its end, not averaged), over
    ``data``'s ``fbank/`` and ``lang/`` (default: ``root``'s), its ``made_by`` naming the bench."""
    from asrflow.params import load_params
    from asrflow.training import checkpoint as ckpt

    state, _ = ckpt.load_latest(root / "exp" / "checkpoints")
    params, made_by = load_params(root / "params.yaml"), f"{made_by} from the last checkpoint"
    return write_bundle(root / "exp" / "model.pt", data or root, params, state["model"], made_by=made_by)


def by_minute(samples: list[MemoryReading], stamps: list[tuple[float, int]]) -> list[list]:
    """``[minute, last step logged by its end, highest tree RSS MB, highest tree PSS MB]`` per minute of the run,
    from memory readings and steps' times ``(s, step)``."""
    rows: dict[int, list] = {}
    for at, rss, pss, _ in samples:
        minute, top = int(at // 60), rows.get(int(at // 60), [0, 0, 0.0, 0.0])
        step = max([0] + [step for t, step in stamps if t <= at])
        rows[minute] = [minute, step, max(top[2], rss / 2**20), max(top[3], pss / 2**20)]
    return list(rows.values())


def train(root: Path, steps: int, minutes: float | None) -> dict:
    """The train stage until step ``steps`` (or for ``minutes``: then its memory by minute), then resumed to its
    first step; its figures."""
    start = time.perf_counter()
    stop = minutes * 60 if minutes else STEP_LINE.format(steps)
    fresh = launch(root, root, stop_when=stop, log=root / "train.log", timeout_s=3600)
    elapsed = time.perf_counter() - start
    record = {"steps": steps, "elapsed_s": elapsed, "peak_tree_pss_mb": fresh["peak_tree_pss_mb"]}
    if minutes:
        points = metric_points(root / "mlflow.db", "train/loss")
        stamps = sorted((at - fresh["started"], step) for step, (at, _) in points.items())
        record |= {"steps": stamps[-1][1], "memory_by_minute": by_minute(fresh["samples"], stamps)}
    resumed = launch(root, root, stop_when="[asrflow.progress] step ", log=root / "resumed.log", timeout_s=600)
    record |= {"launch_to_first_step_s": fresh["marks"].get("first_step"), "breakdown_s": fresh["marks"]}
    record |= {"resumed_launch_to_first_step_s": resumed["marks"].get("first_step")}
    record |= {"resumed_peak_tree_pss_mb": resumed["peak_tree_pss_mb"]}
    return record | {"exit_codes": [fresh["exit_code"], resumed["exit_code"]]}


def run_stages(kind: str, size: float, work: Path, args) -> dict[str, dict]:
    """Every stage of ``kind`` on the corpus of ``size`` in a fresh run folder; one record each."""
    folder, facts = corpus(kind, size, work, args)
    root = work / f"run-{kind}-{size:g}"
    shutil.rmtree(root, ignore_errors=True)
    params = str(write_params(root, kind, folder, args.train))
    manifests, fbank, lang = (folder if kind == "segments" else root / "manifests"), root / "fbank", root / "lang"
    argv = {
        "prepare": ["--params", params, "--out", str(manifests)],
        "features": ["--params", params, "--manifests", str(manifests), "--out", str(fbank)],
        "tokenizer": ["--params", params, "--manifests", str(manifests), "--out", str(lang)],
        "evaluate": ["--params", params, "--model", str(root / "exp" / "model.pt"), "--fbank", str(fbank)],
    }
    base = {"benchmark": "stage_scale", "corpus": kind, "size": size, **facts}
    figures = {}
    for stage in KINDS[kind][2]:
        load = load_average()
        if stage == "train":
            found = train(root, args.steps, args.minutes)
        elif stage == "prepare" and args.in_process:
            found = in_process(Path(params), manifests)
        else:
            extra = ["--out", str(root / "exp" / "eval")] if stage == "evaluate" else []
            if stage == "evaluate":
                bundle_from_checkpoint(root)
            found = stage_peaks(f"stages.{stage}", argv[stage] + extra, root / f"{stage}.log", repo=args.repo)
            if stage == "evaluate" and args.minutes:  # a model trained that long: its error rates mean something
                found |= {key: json.loads((root / "exp/eval/metrics.json").read_text())[key] for key in ("wer", "cer")}
        rates = {"utterances_per_s": facts["utterances"] / found["elapsed_s"]}
        if facts.get("audio_s"):
            rates["audio_s_per_s_per_core"] = facts["audio_s"] / found["elapsed_s"] / len(os.sched_getaffinity(0))
        rates |= {"load_before": load, "load_after": load_average()}
        figures[stage] = emit({**base, "stage": stage, **found, **rates})
    if kind != "spoken":  # only the stage's outputs are large; the corpus stays cached
        shutil.rmtree(root, ignore_errors=True)
    return figures


def growth(stage: str, sizes: list[float], figures: dict, baseline: dict) -> dict:
    """How a stage's peaks and time grow from the smallest size to the largest."""
    lo, hi = figures[min(sizes)][stage], figures[max(sizes)][stage]
    record = {"benchmark": "stage_scale_growth", "stage": stage, "sizes": [min(sizes), max(sizes)]}
    for key, short in (("peak_rss_mb", "rss"), ("peak_tree_pss_mb", "tree_pss"), ("elapsed_s", "elapsed")):
        if lo.get(key) and hi.get(key):
            record[key] = [lo[key], hi[key]]
            record[f"{short}_ratio"] = ratio(hi[key], lo[key])
            record[f"{short}_growth_per_unit"] = (hi[key] - lo[key]) / (max(sizes) - min(sizes))
    if stage in baseline and lo.get("peak_rss_mb"):
        record["rss_above_baseline_mb"] = [f["peak_rss_mb"] - baseline[stage]["peak_rss_mb"] for f in (lo, hi)]
    return record


#: What the whole pipeline's no-op run needs in place, besides ``data/``: the train and evaluate stages' outputs.
EXP_OUTPUTS = ("model.pt", "checkpoints", "plots/train_loss.csv", "eval")


def noop(work: Path, root: Path, size: float) -> list[dict]:
    """No-op ``snakemake --cores all`` and ``dvc repro`` of the whole pipeline (every stage) in a repository copy
    whose outputs are ``root``'s, hard-linked: both tools check every stage and must find nothing to do."""
    from tests.support.repo import tool_env

    repo = work / "noop-copy"
    shutil.rmtree(repo, ignore_errors=True)
    copy_repo(repo)
    shutil.copyfile(root / "params.yaml", repo / "params.yaml")
    for name in ("manifests", "fbank", "lang"):
        shutil.copytree(root / name, repo / "data" / name, copy_function=os.link)
    placeholder = _link_exp(root / "exp", repo / "exp")
    env = tool_env(repo)
    timed_run(["snakemake", "--cores", "all", "--touch"], repo, env)  # writes the corpus listing DVC records
    timed_run(["dvc", "init", "--no-scm", "-q"], repo, env)
    commit_s, _ = timed_run(["dvc", "commit", "-f", "-q"], repo, env)
    timed_run(["snakemake", "--cores", "all", "--touch"], repo, env)  # again: DVC rewrote what it cached
    found = noop_runs(repo, {"snakemake": ["snakemake", "--cores", "all"], "dvc": ["dvc", "repro"]}, 3)
    shutil.rmtree(repo, ignore_errors=True)
    base = {"benchmark": "stage_scale_noop_pipeline", "size": size, "dvc_commit_s": commit_s}
    return [emit(base | record | {"train_loss_csv_written_here": placeholder}) for record in found]


def _link_exp(source: Path, target: Path) -> bool:
    """Hard-link :data:`EXP_OUTPUTS` from ``source`` into ``target``. A run stopped by SIGTERM has no loss table
    (the train stage writes it when it ends): then one is written from the MLflow store beside ``source``, and
    True returned."""
    from bench.startup import metric_points

    for name in EXP_OUTPUTS:
        origin, copy = source / name, target / name
        copy.parent.mkdir(parents=True, exist_ok=True)
        if origin.is_dir():
            shutil.copytree(origin, copy, copy_function=os.link)
        elif origin.is_file():
            os.link(origin, copy)
    table = target / "plots" / "train_loss.csv"
    if table.is_file():
        return False
    points = metric_points(source.parent / "mlflow.db", "train/loss")
    table.write_text("step,loss\n" + "".join(f"{step},{loss}\n" for step, (_, loss) in sorted(points.items())))
    return True


def main(argv: list[str] | None = None) -> list[dict]:
    def configure(parser) -> None:
        parser.add_argument("--corpus", choices=KINDS, default="spoken", help="corpus kind (default: spoken)")
        parser.add_argument("--sizes", type=float, nargs="+", help="hours (spoken, segments) or utterances")
        parser.add_argument("--repo", type=Path, default=REPO, help="run this checkout's stages (default: this one)")
        parser.add_argument("--in-process", action="store_true", help="prepare in this process: its CPU seconds")
        parser.add_argument("--steps", type=int, default=30, help="spoken: train steps before SIGTERM (x 10)")
        parser.add_argument("--seed", type=int, default=0, help="spoken: corpus seed")
        parser.add_argument("--voices", type=int, default=100, help="spoken: corpus voices")
        parser.add_argument("--minutes", type=float, help="spoken: train this long instead (memory by minute, WER)")
        parser.add_argument(
            "--train",
            type=json.loads,
            default={},
            help='spoken: params overrides as JSON, dotted ({"train.model.num_layers": 6})',
        )
        parser.add_argument("--no-noop", action="store_true", help="spoken: skip the no-op snakemake / dvc timing")
        parser.add_argument(
            "--noop-only", type=Path, metavar="RUN", help="spoken: only the no-op timing, on a run folder this left"
        )

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    args.repo = args.repo.resolve()
    if args.noop_only:
        size = float(args.noop_only.name.rsplit("-", 1)[-1])
        with workdir(args.workdir) as work:
            return [emit({"benchmark": "machine", **machine()}), *noop(work, args.noop_only.resolve(), size)]
    kind, sizes = args.corpus, args.sizes or KINDS[args.corpus][1 if args.quick else 0]
    records = [emit({"benchmark": "machine", **machine(), "corpus": kind, "repo": args.repo})]
    with workdir(args.workdir) as work:
        baseline = {}
        for stage in () if args.in_process else [s for s in KINDS[kind][2] if s != "train"]:
            baseline[stage] = stage_peaks(f"stages.{stage}", ["--help"], work / f"help-{stage}.log", repo=args.repo)
            records.append(emit({"benchmark": "stage_scale_baseline", "stage": stage, **baseline[stage]}))
        figures = {size: run_stages(kind, size, work, args) for size in sizes}
        records += [record for by_stage in figures.values() for record in by_stage.values()]
        if len(sizes) > 1:
            records += [emit(growth(stage, sizes, figures, baseline)) for stage in KINDS[kind][2]]
        if kind == "spoken" and not args.no_noop:
            records += noop(work, work / f"run-spoken-{max(sizes):g}", max(sizes))
    return records


if __name__ == "__main__":
    main()
