"""Feature extraction speed: audio seconds per wall second, one worker vs all cores.

Runs :func:`asrflow.data.features.compute_features` (fbank for train/dev/test, stored with
Lhotse's ``LilcomChunkyWriter``, plus the CMVN statistics) on the same generated manifests
(utterances of 1-15 s, some minutes in all) with params.yaml's ``features:`` section and:

* ``one_worker`` (baseline): ``num_jobs: 1``, torch threads as a fresh process has them;
* ``all_cores`` (figure): ``num_jobs: 0`` (one extraction process per core, spawned);
* ``one_worker_1_thread`` and ``all_cores_1_thread``: the same with one torch/OpenMP
  thread per process (``torch.set_num_threads(1)``; ``OMP_NUM_THREADS=1`` for spawned
  workers), to show what thread oversubscription costs on a small, busy machine.

``speedup`` = all_cores / one_worker audio seconds per second; ``speedup_1_thread`` the
same for the one-thread variants. Wall time includes starting the worker processes.

Usage: ``python -m bench.features_speed [--quick] [--workdir DIR]``.
"""

from __future__ import annotations

import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from bench.common import emit, generate_corpus, parse_args, ratio, repo_params, rounded, workdir

#: Utterances of the generated corpus per mode (1-15 s each: about 10 and 2 minutes).
UTTERANCES = {"full": 75, "quick": 15}


@contextmanager
def threads(count: int | None):
    """``count`` torch threads here and OpenMP threads in spawned workers (None: unchanged)."""
    import torch

    previous, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    if count:
        torch.set_num_threads(count)
        os.environ["OMP_NUM_THREADS"] = str(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)  # compute_features sets 1 thread when it spawns workers
        if env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env


def manifests(work: Path, utterances: int) -> tuple[Path, float]:
    """Prepared manifests of a generated corpus, and its audio seconds."""
    from asrflow.data.manifests import load_cuts
    from asrflow.data.prepare import PrepareConfig, prepare_corpus

    root = work / f"features-speed-{utterances}"
    shutil.rmtree(root, ignore_errors=True)
    generate_corpus(root / "corpus", utterances, seed=1)
    prepare_corpus(
        PrepareConfig(corpus="folder", corpus_dir=str(root / "corpus"),
                      splits={"train": "train", "dev": "dev", "test": "test"}),
        root / "manifests", seed=42,
    )
    audio = sum(cut.duration for split in ("train", "dev", "test") for cut in load_cuts(root / "manifests", split))
    return root, audio


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(__doc__.splitlines()[0], argv)
    import torch

    from asrflow.data.features import FeatureConfig, compute_features
    from asrflow.params import build_config

    mode = "quick" if args.quick else "full"
    config = build_config(FeatureConfig, repo_params().get("features"), "features")
    with workdir(args.workdir) as work:
        root, audio = manifests(work, UTTERANCES[mode])
        variants = [("one_worker", 1, None), ("all_cores", 0, None),
                    ("one_worker_1_thread", 1, 1), ("all_cores_1_thread", 0, 1)]
        rates, seconds = {}, {}
        default_threads = torch.get_num_threads()
        for name, num_jobs, thread_count in variants:
            out = root / f"fbank-{name}"
            shutil.rmtree(out, ignore_errors=True)
            with threads(thread_count):
                start = time.perf_counter()
                compute_features(root / "manifests", out, replace(config, num_jobs=num_jobs))
                seconds[name] = time.perf_counter() - start
            rates[name] = audio / seconds[name]
            shutil.rmtree(out, ignore_errors=True)
        speedup = ratio(rates["all_cores"], rates["one_worker"])
        return [emit({
            "benchmark": "features_speed",
            "mode": mode,
            "utterances": UTTERANCES[mode],
            "audio_s": rounded(audio),
            "cores": os.cpu_count(),
            "torch_threads_default": default_threads,
            "audio_s_per_s": {name: rounded(rate) for name, rate in rates.items()},
            "wall_s": {name: rounded(s) for name, s in seconds.items()},
            "baseline": "one_worker",
            "speedup": rounded(speedup),
            "speedup_1_thread": rounded(ratio(rates["all_cores_1_thread"], rates["one_worker_1_thread"])),
            "one_thread_vs_default_one_worker": rounded(ratio(rates["one_worker_1_thread"], rates["one_worker"])),
            "settings": {"sampling_rate": config.sampling_rate, "num_mel_bins": config.num_mel_bins},
        })]


if __name__ == "__main__":
    main()
