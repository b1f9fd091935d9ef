"""Feature extraction speed: audio seconds per wall second, one worker against all cores.

``python -m bench.features_speed [--quick] [--workdir DIR]``: ``compute_features`` on generated manifests at one
thread per process with ``num_jobs`` 1, one per core and 0. Record ``features_speed``: ``audio_s_per_s``,
``speedup`` (all cores / one). (The same audio at 8, 16 and 44.1 kHz, ``input_rates``, is at commit a7dff9b.)
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

from bench.common import emit, parse_args, ratio, workdir
from tests.support.corpora import folder_corpus, generate_corpus, torch_threads
from tests.support.repo import repo_params

#: Utterances of the generated corpus per mode (1-15 s each: about 32 and 2 minutes).
UTTERANCES = {"full": 240, "quick": 15}
#: Times the train split's cuts are listed (new ids, same audio): more audio, no generation cost.
TRAIN_REPEATS = {"full": 4, "quick": 1}


def manifests(work: Path, utterances: int, train_repeats: int) -> tuple[Path, float]:
    """Prepared manifests of a generated corpus (train cuts listed ``train_repeats`` times), and its audio seconds."""
    from lhotse import CutSet

    from asrflow.data.manifests import cuts_path, load_cuts
    from asrflow.data.prepare.corpus import prepare_corpus

    root = work / f"features-speed-{utterances}"
    shutil.rmtree(root, ignore_errors=True)
    generate_corpus(root / "corpus", utterances, seed=1)
    prepare_corpus(folder_corpus(root / "corpus"), root / "manifests", seed=42)
    train = load_cuts(root / "manifests", "train").to_eager()
    repeated = CutSet.from_cuts(cut.with_id(f"{cut.id}-r{r}") for r in range(train_repeats) for cut in train)
    repeated.to_file(cuts_path(root / "manifests", "train"))
    audio = sum(cut.duration for split in ("train", "dev", "test") for cut in load_cuts(root / "manifests", split))
    return root, audio


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(__doc__.splitlines()[0], argv)
    import torch

    from asrflow.data.features.config import FeatureConfig
    from asrflow.data.features.extract import compute_features
    from asrflow.params import build_config

    mode = "quick" if args.quick else "full"
    config = build_config(FeatureConfig, repo_params().get("features"), "features")
    with workdir(args.workdir) as work:
        root, audio = manifests(work, UTTERANCES[mode], TRAIN_REPEATS[mode])
        cores, default_threads = len(os.sched_getaffinity(0)), torch.get_num_threads()
        variants = {"one_worker": (1, 1), "all_cores": (cores, 1), "default": (0, 1)}
        seconds = {}
        for name, (num_jobs, thread_count) in {**variants, "one_worker_default_threads": (1, None)}.items():
            shutil.rmtree(root / "fbank", ignore_errors=True)
            with torch_threads(thread_count):
                start = time.perf_counter()
                compute_features(root / "manifests", root / "fbank", replace(config, num_jobs=num_jobs))
                seconds[name] = time.perf_counter() - start
        rates = {name: audio / s for name, s in seconds.items()}
        record = {"benchmark": "features_speed", "mode": mode, "utterances": UTTERANCES[mode], "audio_s": audio}
        record |= {"cores": cores, "torch_threads_default": default_threads, "baseline": "one_worker"}
        record |= {"audio_s_per_s": rates, "wall_s": seconds, "speedup": ratio(rates["all_cores"], rates["one_worker"])}
        record |= {"default_vs_one_worker": ratio(rates["default"], rates["one_worker"])}
        record |= {"one_thread_vs_default_threads": ratio(rates["one_worker"], rates["one_worker_default_threads"])}
        record |= {"settings": {"sampling_rate": config.sampling_rate, "num_mel_bins": config.num_mel_bins}}
        shutil.rmtree(root, ignore_errors=True)
        return [emit(record)]


if __name__ == "__main__":
    main()
