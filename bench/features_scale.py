"""The features stage at 5 and 50 hours: peak memory of its process tree, and speed.

Generated cut manifests (:func:`asrflow.testing.corpora.write_segment_manifests`: segments of 2-7 s,
each of its own length, cut at random offsets out of a few generated 16 kHz FLAC
recordings, so the audio on disk stays small whatever the hours) are extracted by the
real stage, as the pipeline runs it, with params.yaml's ``features:`` section at 16 kHz
and 80 bins (``num_jobs: 0``: one process per core on these sizes)::

    python -m stages.features --params P --manifests M --out F

Figures per size (:func:`bench.memory.measure`): ``peak_tree_pss_mb`` (the stage and its
workers, shared pages split), ``peak_rss_mb`` (the stage's own process), ``elapsed_s``, and
``audio_s_per_s_per_core`` = audio seconds / elapsed / cores. ``scaling``: the ratio of the
large to the small peak (goal <= 1.10) and the growth in MB per hour of audio.

``profile`` (``--profile N``, on the first N train cuts of the small size; no sizes are run
then): where the time goes, in this process at one torch thread, each figure in audio
seconds per second of one core, the variants interleaved twice: ``before`` (the stage's
former per-cut path: ``to_mono_at_rate(cut).compute_and_store_features``), ``after``
(``_cut_with_features``: downmix and resample the samples, extract, store), and the parts
of ``after``: ``load_audio`` (decode, downmix, resample), ``fbank`` (Lhotse's ``Fbank``),
``lilcom_write`` (compress and write), and ``read_back`` (the CMVN pass that reads every
train feature matrix again).

Usage: ``python -m bench.features_scale [--quick] [--workdir DIR] [--hours SMALL LARGE] [--profile N]``
(5 and 50 hours; 0.1 and 0.4 hours with ``--quick``).
"""

from __future__ import annotations

import shutil
import sys

import yaml

from asrflow.testing.corpora import write_segment_manifests
from asrflow.testing.repo import repo_params
from bench.common import emit, load_average, machine, parse_args, ratio, rounded, workdir
from bench.memory import measure

#: Hours of audio compared, per mode.
HOURS = {"full": (5.0, 50.0), "quick": (0.1, 0.4)}
#: Cut lengths, seconds (a spoken sentence).
MIN_S, MAX_S = 2.0, 7.0


def manifests_for(work, hours: float):
    """Manifests of ``hours`` of audio (98 % train, 1 % dev, 1 % test); the folder and the audio seconds."""
    cuts = int(hours * 3600 / ((MIN_S + MAX_S) / 2))
    folder = work / f"manifests-{hours:g}h"
    split = {"train": cuts - 2 * max(1, cuts // 100), "dev": max(1, cuts // 100), "test": max(1, cuts // 100)}
    audio_s = write_segment_manifests(
        folder, work / "audio", split, min_s=MIN_S, max_s=MAX_S, recordings=16, recording_s=120.0
    )
    return folder, audio_s


def profile(manifests, cuts: int) -> dict:
    """Audio seconds per second of one core of the per-cut paths and parts (see the module docstring)."""
    import itertools
    import tempfile
    import time

    import torch
    from lhotse import LilcomChunkyWriter
    from lhotse.features.base import compute_global_stats, store_feature_array

    from asrflow.data.audio import mono_samples, to_mono_at_rate
    from asrflow.data.features import FeatureConfig, _cut_with_features, one_torch_thread
    from asrflow.data.manifests import load_cuts

    chosen = list(itertools.islice(load_cuts(manifests, "train"), cuts))
    audio_s = sum(cut.duration for cut in chosen)
    extractor = FeatureConfig().extractor()
    seconds = dict.fromkeys(("before", "after", "load_audio", "fbank", "lilcom_write", "read_back"), 0.0)
    with one_torch_thread(), tempfile.TemporaryDirectory() as tmp:
        torch.set_num_threads(1)
        for round_ in range(2):
            for variant in ("before", "after"):
                start = time.perf_counter()
                with LilcomChunkyWriter(f"{tmp}/{variant}-{round_}") as storage:
                    done = [
                        to_mono_at_rate(cut, 16000).compute_and_store_features(extractor=extractor, storage=storage)
                        if variant == "before"
                        else _cut_with_features(cut, extractor, storage)
                        for cut in chosen
                    ]
                seconds[variant] += time.perf_counter() - start
            with LilcomChunkyWriter(f"{tmp}/parts-{round_}") as storage:
                for cut in chosen:
                    start = time.perf_counter()
                    samples = mono_samples(cut, 16000)
                    loaded = time.perf_counter()
                    features = extractor.extract(samples, 16000)
                    extracted = time.perf_counter()
                    store_feature_array(features, storage)
                    seconds["load_audio"] += loaded - start
                    seconds["fbank"] += extracted - loaded
                    seconds["lilcom_write"] += time.perf_counter() - extracted
            start = time.perf_counter()
            compute_global_stats([cut.features for cut in done])
            seconds["read_back"] += time.perf_counter() - start
    return {
        "benchmark": "features_profile",
        "cuts": len(chosen),
        "audio_s": rounded(audio_s),
        "audio_s_per_s_one_core": {name: rounded(2 * audio_s / value) for name, value in seconds.items()},
        "after_vs_before": rounded(seconds["before"] / seconds["after"]),
        "load_average": load_average(),
    }


def main(argv: list[str] | None = None) -> None:
    import os

    def configure(parser) -> None:
        parser.add_argument("--hours", type=float, nargs=2, metavar=("SMALL", "LARGE"), help="the two sizes, hours")
        parser.add_argument("--profile", type=int, metavar="N", help="only profile the per-cut path on N cuts")

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    sizes = tuple(args.hours) if args.hours else HOURS["quick" if args.quick else "full"]
    cores = len(os.sched_getaffinity(0))
    with workdir(args.workdir) as work:
        emit({"benchmark": "machine", **machine()})
        features = {**repo_params().get("features", {}), "sampling_rate": 16000, "num_mel_bins": 80, "num_jobs": 0}
        params = work / "params.yaml"
        params.write_text(yaml.safe_dump({"features": features}))
        if args.profile:
            emit(profile(manifests_for(work, sizes[0])[0], args.profile))
            return
        figures = {}
        for hours in sizes:
            folder, audio_s = manifests_for(work, hours)
            out = work / f"fbank-{hours:g}h"
            shutil.rmtree(out, ignore_errors=True)
            print(f"features: {hours:g} h", file=sys.stderr)
            argv_ = ["--params", str(params), "--manifests", str(folder), "--out", str(out)]
            load_before = load_average()
            figures[hours] = measure("stages.features", argv_, work / f"features-{hours:g}h.log")
            shutil.rmtree(out, ignore_errors=True)
            emit(
                {
                    "benchmark": "features_scale",
                    "hours": hours,
                    "audio_s": rounded(audio_s),
                    "command": "python -m stages.features " + " ".join(argv_),
                    **figures[hours],
                    "audio_s_per_s_per_core": rounded(audio_s / figures[hours]["elapsed_s"] / cores),
                    "load_before": load_before,
                    "load_after": load_average(),
                }
            )
        small, large = sizes
        lo, hi = figures[small], figures[large]
        emit(
            {
                "benchmark": "features_scale_scaling",
                "hours": [small, large],
                "tree_pss_ratio": rounded(ratio(hi["peak_tree_pss_mb"] or 0, lo["peak_tree_pss_mb"] or 0)),
                "tree_pss_mb_per_hour": rounded(
                    ((hi["peak_tree_pss_mb"] or 0) - (lo["peak_tree_pss_mb"] or 0)) / (large - small)
                ),
                "rss_ratio": rounded(ratio(hi["peak_rss_mb"], lo["peak_rss_mb"])),
            }
        )


if __name__ == "__main__":
    main()
