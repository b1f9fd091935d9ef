"""Feature extraction speed: audio seconds per wall second, one worker against all cores.

``python -m bench.features_speed [--quick] [--workdir DIR] [--profile N]``: ``compute_features`` on generated
manifests at one thread per process with ``num_jobs`` 1, one per core and 0 (``speedup`` = all cores / one), and
the same audio at 8, 16 and 44.1 kHz (``input_rates``, ``seconds_vs_16k``). ``--profile N``: only where one
cut's time goes (the former and the current per-cut path, and the parts of the current) on N 2-7 s cuts.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

from asrflow.testing.corpora import folder_corpus, generate_corpus, torch_threads, write_segment_manifests
from asrflow.testing.repo import repo_params
from bench.common import emit, parse_args, ratio, rounded, workdir

#: Utterances of the generated corpus per mode (1-15 s each: about 32 and 2 minutes).
UTTERANCES = {"full": 240, "quick": 15}
#: Times the train split's cuts are listed (new ids, same audio): more audio, no generation cost.
TRAIN_REPEATS = {"full": 4, "quick": 1}
#: Input sampling rates compared (Hz); the features are at params.yaml's rate (16 kHz).
INPUT_RATES = (16000, 8000, 44100)


def corpus_at_rate(source: Path, destination: Path, rate: int) -> None:
    """A copy of the generated ``corpus: folder`` corpus at ``source`` with every WAV resampled to ``rate``."""
    import soundfile as sf
    import torch
    import torchaudio

    shutil.rmtree(destination, ignore_errors=True)
    (destination / "wav").mkdir(parents=True)
    for tsv in source.glob("*.tsv"):
        shutil.copy(tsv, destination / tsv.name)
    for wav in sorted((source / "wav").glob("*.wav")):
        audio, native = sf.read(wav, dtype="float32")
        out = audio if rate == native else torchaudio.functional.resample(torch.from_numpy(audio), native, rate).numpy()
        sf.write(destination / "wav" / wav.name, out, rate, subtype="PCM_16")


def input_rates(work: Path, utterances: int, config) -> dict:
    """Stage seconds for the same audio at each of :data:`INPUT_RATES` (see the module docstring)."""
    from asrflow.data.features import compute_features
    from asrflow.data.prepare import prepare_corpus

    root = work / f"features-rates-{utterances}"
    shutil.rmtree(root, ignore_errors=True)
    generate_corpus(root / "corpus-16000", utterances, seed=2)
    audio = 0.0
    for rate in INPUT_RATES:
        if rate != 16000:
            corpus_at_rate(root / "corpus-16000", root / f"corpus-{rate}", rate)
        summary = prepare_corpus(folder_corpus(root / f"corpus-{rate}"), root / f"manifests-{rate}", seed=42)
        audio = summary.total_hours * 3600
    seconds = {rate: float("inf") for rate in INPUT_RATES}
    with torch_threads(1):
        for _ in range(2):
            for rate in INPUT_RATES:
                out = root / f"fbank-{rate}"
                shutil.rmtree(out, ignore_errors=True)
                start = time.perf_counter()
                compute_features(root / f"manifests-{rate}", out, replace(config, num_jobs=1))
                seconds[rate] = min(seconds[rate], time.perf_counter() - start)
    shutil.rmtree(root, ignore_errors=True)
    return {
        "audio_s": rounded(audio),
        "wall_s": {str(rate): rounded(s) for rate, s in seconds.items()},
        "audio_s_per_s": {str(rate): rounded(audio / s) for rate, s in seconds.items()},
        "baseline": "16000",
        "seconds_vs_16k": {str(rate): rounded(ratio(s, seconds[16000])) for rate, s in seconds.items()},
        "goal": "<= 1.5",
    }


def manifests(work: Path, utterances: int, train_repeats: int) -> tuple[Path, float]:
    """Prepared manifests of a generated corpus (train cuts listed ``train_repeats`` times), and its audio seconds."""
    from lhotse import CutSet

    from asrflow.data.manifests import cuts_path, load_cuts
    from asrflow.data.prepare import prepare_corpus

    root = work / f"features-speed-{utterances}"
    shutil.rmtree(root, ignore_errors=True)
    generate_corpus(root / "corpus", utterances, seed=1)
    prepare_corpus(folder_corpus(root / "corpus"), root / "manifests", seed=42)
    train = load_cuts(root / "manifests", "train").to_eager()
    CutSet.from_cuts(cut.with_id(f"{cut.id}-r{r}") for r in range(train_repeats) for cut in train).to_file(
        cuts_path(root / "manifests", "train")
    )
    audio = sum(cut.duration for split in ("train", "dev", "test") for cut in load_cuts(root / "manifests", split))
    return root, audio


def profile(work: Path, cuts: int) -> dict:
    """Audio seconds per second of one core of the former per-cut path (``to_mono_at_rate`` and Lhotse's
    ``compute_and_store_features``), the current one (``_cut_with_features``) and its parts, twice interleaved."""
    import itertools
    import tempfile

    from lhotse import LilcomChunkyWriter
    from lhotse.features.base import compute_global_stats, store_feature_array

    from asrflow.data.audio import mono_samples, to_mono_at_rate
    from asrflow.data.features import FeatureConfig, _cut_with_features
    from asrflow.data.manifests import load_cuts

    split = {"train": cuts, "dev": 1, "test": 1}
    write_segment_manifests(
        work / "profile", work / "audio", split, min_s=2.0, max_s=7.0, recordings=16, recording_s=120
    )
    chosen = list(itertools.islice(load_cuts(work / "profile", "train"), cuts))
    extractor, seconds = (
        FeatureConfig().extractor(),
        dict.fromkeys(("before", "after", "load_audio", "fbank", "lilcom_write", "read_back"), 0.0),
    )
    with torch_threads(1), tempfile.TemporaryDirectory() as tmp:
        for round_ in range(2):
            for variant in ("before", "after"):
                start = time.perf_counter()
                with LilcomChunkyWriter(f"{tmp}/{variant}-{round_}") as storage:
                    if variant == "before":
                        done = [
                            to_mono_at_rate(c, 16000).compute_and_store_features(extractor, storage) for c in chosen
                        ]
                    else:
                        done = [_cut_with_features(cut, extractor, storage) for cut in chosen]
                seconds[variant] += time.perf_counter() - start
            with LilcomChunkyWriter(f"{tmp}/parts-{round_}") as storage:
                for cut in chosen:
                    marks = [time.perf_counter()]
                    samples = mono_samples(cut, 16000)
                    marks.append(time.perf_counter())
                    features = extractor.extract(samples, 16000)
                    marks.append(time.perf_counter())
                    store_feature_array(features, storage)
                    marks.append(time.perf_counter())
                    for name, a, b in zip(("load_audio", "fbank", "lilcom_write"), marks, marks[1:], strict=False):
                        seconds[name] += b - a
            start = time.perf_counter()
            compute_global_stats([cut.features for cut in done])
            seconds["read_back"] += time.perf_counter() - start
    audio_s = sum(cut.duration for cut in chosen)
    rates = {name: rounded(2 * audio_s / value) for name, value in seconds.items()}
    record = {"benchmark": "features_profile", "cuts": len(chosen), "audio_s": rounded(audio_s)}
    return record | {"audio_s_per_s_one_core": rates, "after_vs_before": rounded(seconds["before"] / seconds["after"])}


def main(argv: list[str] | None = None) -> list[dict]:
    def configure(parser) -> None:
        parser.add_argument("--profile", type=int, metavar="N", help="only where one cut's time goes, on N cuts")

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    import torch

    from asrflow.data.features import FeatureConfig, compute_features
    from asrflow.params import build_config

    mode = "quick" if args.quick else "full"
    config = build_config(FeatureConfig, repo_params().get("features"), "features")
    with workdir(args.workdir) as work:
        if args.profile:
            return [emit(profile(work, args.profile))]
        root, audio = manifests(work, UTTERANCES[mode], TRAIN_REPEATS[mode])
        cores = len(os.sched_getaffinity(0))
        variants = [
            ("one_worker", 1, 1),
            ("all_cores", cores, 1),
            ("default", 0, 1),
            ("one_worker_default_threads", 1, None),
        ]
        rates, seconds = {}, {}
        default_threads = torch.get_num_threads()
        for name, num_jobs, thread_count in variants:
            out = root / f"fbank-{name}"
            shutil.rmtree(out, ignore_errors=True)
            with torch_threads(thread_count):
                start = time.perf_counter()
                compute_features(root / "manifests", out, replace(config, num_jobs=num_jobs))
                seconds[name] = time.perf_counter() - start
            rates[name] = audio / seconds[name]
            shutil.rmtree(out, ignore_errors=True)
        speedup = ratio(rates["all_cores"], rates["one_worker"])
        by_rate = input_rates(work, UTTERANCES[mode], config)
        record = {
            "benchmark": "features_speed",
            "mode": mode,
            "utterances": UTTERANCES[mode],
            "audio_s": rounded(audio),
        }
        record |= {"cores": cores, "torch_threads_default": default_threads, "baseline": "one_worker"}
        return [
            emit(
                {
                    **record,
                    "audio_s_per_s": {name: rounded(rate) for name, rate in rates.items()},
                    "wall_s": {name: rounded(s) for name, s in seconds.items()},
                    "speedup": rounded(speedup),
                    "default_vs_one_worker": rounded(ratio(rates["default"], rates["one_worker"])),
                    "one_thread_vs_default_threads": rounded(
                        ratio(rates["one_worker"], rates["one_worker_default_threads"])
                    ),
                    "input_rates": by_rate,
                    "settings": {"sampling_rate": config.sampling_rate, "num_mel_bins": config.num_mel_bins},
                }
            )
        ]


if __name__ == "__main__":
    main()
