"""Fbank feature extraction with Lhotse, and global mean/variance statistics.

Every cut is resampled to ``sampling_rate`` and gets ``num_mel_bins``-dimensional log-mel
filterbank features (frames every ``frame_shift_s`` seconds), stored with Lhotse's
``LilcomChunkyWriter``. The global statistics (per-bin mean and standard deviation over the
train split) are written as JSON and applied by :class:`lhotse.dataset.GlobalMVN`.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from lhotse import CutSet, Fbank, FbankConfig, LilcomChunkyWriter
from lhotse.dataset import GlobalMVN

from asrflow.data.audio import to_mono
from asrflow.data.manifests import SPLITS, cuts_path, load_cuts
from asrflow.errors import AsrflowError
from asrflow.io import atomic_path

logger = logging.getLogger("asrflow.features")

CMVN_FILE = "cmvn.json"
#: Seconds of audio that justify one more feature-extraction process.
AUDIO_S_PER_JOB = 600.0


@dataclass(frozen=True)
class FeatureConfig:
    """The ``features:`` section of params.yaml."""

    sampling_rate: int = 16000
    num_mel_bins: int = 80
    frame_shift_s: float = 0.01
    frame_length_s: float = 0.025
    num_jobs: int = 0
    on_the_fly: bool = False

    def extractor(self) -> Fbank:
        """The Lhotse fbank extractor these settings describe."""
        return Fbank(
            FbankConfig(
                sampling_rate=self.sampling_rate,
                num_mel_bins=self.num_mel_bins,
                frame_shift=self.frame_shift_s,
                frame_length=self.frame_length_s,
            )
        )


def cmvn_stats(mvn: GlobalMVN) -> dict[str, list[float]]:
    """``norm_means`` / ``norm_stds``, each a list of ``num_mel_bins`` floats."""
    return {name: value.tolist() for name, value in mvn.state_dict().items()}


def save_cmvn(mvn: GlobalMVN, path: Path) -> None:
    """Write :func:`cmvn_stats` as JSON."""
    path.write_text(json.dumps(cmvn_stats(mvn), indent=1) + "\n")


def load_cmvn(path: str | Path) -> GlobalMVN:
    """Read statistics written by :func:`save_cmvn` into a ``GlobalMVN`` module."""
    return cmvn_from_dict(json.loads(Path(path).read_text()))


def cmvn_from_dict(stats: dict[str, list[float]]) -> GlobalMVN:
    """Build a ``GlobalMVN`` from the statistics dict kept inside a model bundle."""
    tensors = {name: torch.tensor(value, dtype=torch.float32) for name, value in stats.items()}
    mvn = GlobalMVN(tensors["norm_means"].numel())
    mvn.load_state_dict(tensors)
    return mvn


def _prepare_cuts(cuts: CutSet, config: FeatureConfig) -> CutSet:
    """Resample every cut to the target rate and average its channels into one (eager)."""
    out = []
    for cut in cuts:
        cut = to_mono(cut)
        if cut.sampling_rate != config.sampling_rate:
            cut = cut.resample(config.sampling_rate)
        out.append(cut)
    return CutSet.from_cuts(out)


def compute_features(
    manifests_dir: str | Path, output_dir: str | Path, config: FeatureConfig
) -> dict[str, int]:
    """Compute fbank for train/dev/test cuts of ``manifests_dir`` into ``output_dir``.

    Writes ``{split}_cuts.jsonl.gz`` (cuts pointing at ``output_dir/{split}_feats``),
    and ``cmvn.json`` from the train split. With ``on_the_fly`` the cuts are written
    without features and the statistics are computed from up to 1,000 train cuts.
    The whole folder appears at once. Returns the number of cuts per split.
    """
    output_dir = Path(output_dir)
    auto_jobs = config.num_jobs == 0
    num_jobs = config.num_jobs or os.cpu_count() or 1
    extractor = config.extractor()
    counts: dict[str, int] = {}
    with atomic_path(output_dir) as tmp_dir:
        tmp_dir.mkdir(parents=True)
        for split in SPLITS:
            cuts = _prepare_cuts(load_cuts(manifests_dir, split), config)
            counts[split] = len(cuts)
            if len(cuts) == 0:
                logger.warning("split %s is empty", split)
            if split == "train" and len(cuts) == 0:
                raise AsrflowError("the train split has no cuts: check data/manifests/rejected.jsonl")
            if len(cuts) and not config.on_the_fly:
                jobs = jobs_for(cuts, num_jobs) if auto_jobs else num_jobs
                cuts = _extract(cuts, extractor, tmp_dir / f"{split}_feats", jobs, split)
            if split == "train":
                save_cmvn(_train_statistics(cuts, config), tmp_dir / CMVN_FILE)
            if not config.on_the_fly:
                cuts = _relocate_features(cuts, tmp_dir, output_dir)
            cuts.to_file(cuts_path(tmp_dir, split))
        (tmp_dir / "config.json").write_text(json.dumps(asdict(config), indent=1) + "\n")
    return counts


def jobs_for(cuts: CutSet, requested: int) -> int:
    """With ``features.num_jobs: 0``, the processes worth starting: one per ``AUDIO_S_PER_JOB``
    of audio, at most ``requested`` (the cores).

    Spawning a worker costs seconds (it imports torch and Lhotse), more than a few minutes
    of audio take to extract on one core.
    """
    total = sum(cut.duration for cut in cuts)
    return max(1, min(requested, int(total // AUDIO_S_PER_JOB)))


def _single_thread() -> None:
    torch.set_num_threads(1)


def _extract(cuts: CutSet, extractor: Fbank, storage_path: Path, num_jobs: int, split: str) -> CutSet:
    """Fbank into Lhotse storage; workers run one torch thread each. Dropped cuts are reported."""
    logger.info("%s: fbank for %d cuts with %d job(s)", split, len(cuts), num_jobs)
    executor = (
        ProcessPoolExecutor(num_jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_single_thread)
        if num_jobs > 1
        else None
    )
    try:
        done = cuts.compute_and_store_features(
            extractor=extractor,
            storage_path=storage_path,
            num_jobs=num_jobs,
            executor=executor,
            storage_type=LilcomChunkyWriter,
        ).to_eager()
    finally:
        if executor is not None:
            executor.shutdown()
    lost = sorted(set(cuts.ids) - set(done.ids))
    if lost:
        logger.warning(
            "%s: %d cut(s) dropped because their audio could not be read: %s", split, len(lost), ", ".join(lost[:10])
        )
    return done


def _relocate_features(cuts: CutSet, tmp_dir: Path, final_dir: Path) -> CutSet:
    """Point the cuts' feature storage at ``final_dir`` where it said ``tmp_dir``."""
    relocated = []
    for cut in cuts:
        relative = Path(cut.features.storage_path).relative_to(tmp_dir)
        cut.features.storage_path = str(final_dir / relative)
        relocated.append(cut)
    return CutSet.from_cuts(relocated)


def _train_statistics(cuts: CutSet, config: FeatureConfig) -> GlobalMVN:
    """Per-bin mean and std over the train cuts (stored, or computed for up to 1,000 cuts)."""
    if config.on_the_fly:
        return GlobalMVN.from_cuts(cuts, max_cuts=1000, extractor=config.extractor())
    return GlobalMVN.from_cuts(cuts)
