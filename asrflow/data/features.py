"""Fbank feature extraction with Lhotse, and global mean/variance statistics.

Every cut is resampled to ``sampling_rate`` and gets ``num_mel_bins``-dimensional log-mel
filterbank features (frames every ``frame_shift_s`` seconds), stored with Lhotse's
``LilcomChunkyWriter``. The global statistics (per-bin mean and standard deviation over the
train split) are written as JSON and applied by :class:`lhotse.dataset.GlobalMVN`.

Memory stays bounded on long corpora: cuts are read lazily from the manifests, streamed
through extraction into per-job manifests, and the statistics are accumulated in one
streaming pass; nothing holds a whole split.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import json
import logging
import multiprocessing
import os
import shutil
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from lhotse import CutSet, Fbank, FbankConfig, LilcomChunkyWriter
from lhotse.cut import Cut
from lhotse.cut.set import null_result_on_audio_loading_error
from lhotse.dataset import GlobalMVN
from lhotse.features.base import compute_global_stats
from lhotse.lazy import Dillable, LazySlicer

from asrflow.data.audio import to_mono_at_rate
from asrflow.data.manifests import SPLITS, cuts_path, load_cuts
from asrflow.errors import AsrflowError
from asrflow.files import atomic_path
from asrflow.logs import progress
from asrflow.params import check_at_least, check_positive

logger = logging.getLogger("asrflow.features")

CMVN_FILE = "cmvn.json"
#: The FeatureConfig a features folder was computed with (JSON), written beside its cuts.
CONFIG_FILE = "config.json"
#: FeatureConfig fields that shape the features a model sees (the others only say how they were computed).
SHAPING_FIELDS = ("sampling_rate", "num_mel_bins", "frame_shift_s", "frame_length_s")
#: Seconds of audio in a split that justify one more feature-extraction process: one
#: process extracts about 850 audio seconds per second, and starting one (a fresh Python
#: importing torch and Lhotse) costs about 2.5 s (bench/RESULTS.md, features).
AUDIO_S_PER_JOB = 3600.0
#: Fewest mel bins the fbank extractor accepts (it asserts more than 3).
MIN_MEL_BINS = 4
#: Inside the output's temporary folder: per-job cut manifests, removed before it is renamed.
STAGING_DIR = ".staging"


@dataclass(frozen=True, kw_only=True)
class FeatureConfig:
    """The ``features:`` section of params.yaml."""

    sampling_rate: int = 16000
    num_mel_bins: int = 80
    frame_shift_s: float = 0.01
    frame_length_s: float = 0.025
    num_jobs: int = 0
    on_the_fly: bool = False

    def __post_init__(self) -> None:
        check_positive(self, "features", "sampling_rate", "frame_shift_s", "frame_length_s")
        check_at_least(self, "features", MIN_MEL_BINS, "num_mel_bins")
        check_at_least(self, "features", 0, "num_jobs")

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


def compute_features(manifests_dir: str | Path, output_dir: str | Path, config: FeatureConfig) -> dict[str, int]:
    """Compute fbank for train/dev/test cuts of ``manifests_dir`` into ``output_dir``.

    Writes ``{split}_cuts.jsonl.gz`` (cuts pointing at ``output_dir/{split}_feats``),
    and ``cmvn.json`` from the train split. With ``on_the_fly`` the cuts are written
    without features and the statistics are computed from up to 1,000 train cuts.
    The whole folder appears at once. Returns the number of cuts per split.

    Cuts are streamed (read lazily, a few at a time, and written as they are done), so
    memory does not grow with the corpus; the statistics are accumulated in one pass.

    Extraction runs at one torch thread here as in the spawned workers: its operations
    (resampling, fbank of one utterance) are too small to share, and on a busy machine
    two threads spin against each other (measured 5x slower with 2 threads, load 7).
    """
    output_dir = Path(output_dir)
    counts: dict[str, int] = {}
    with one_torch_thread(), atomic_path(output_dir) as tmp_dir, ExtractionWorkers() as workers:
        tmp_dir.mkdir(parents=True)
        for split in SPLITS:
            counts[split] = _split_features(
                manifests_dir, split, tmp_dir=tmp_dir, final_dir=output_dir, config=config, workers=workers
            )
        (tmp_dir / CONFIG_FILE).write_text(json.dumps(asdict(config), indent=1) + "\n")
    return counts


def check_same_features(config: FeatureConfig, features_dir: str | Path) -> None:
    """Refuse to train with ``config`` on features computed with other settings.

    The model's input size and frame rate come from ``config`` (params.yaml's ``features``
    section); features computed at another rate or bin count would fail deep inside the
    model, or worse, train on the wrong frame rate. A folder without :data:`CONFIG_FILE`
    (written by older versions) is not checked.

    Raises:
        AsrflowError: naming each differing key, its two values and what to do.
    """
    path = Path(features_dir) / CONFIG_FILE
    if not path.is_file():
        return
    computed = json.loads(path.read_text())
    differing = [
        f"features.{key} = {getattr(config, key)!r} but {computed[key]!r} there"
        for key in SHAPING_FIELDS
        if key in computed and computed[key] != getattr(config, key)
    ]
    if differing:
        raise AsrflowError(
            f"the features in {Path(features_dir)} were computed with other settings than params.yaml's: "
            f"{'; '.join(differing)}. Run the features stage again (dvc repro, or snakemake), or give "
            "the params those features were computed with"
        )


class ExtractionWorkers:
    """Spawned extraction processes (one torch thread each), started on first use and shared
    by every split: starting one costs seconds, so it is done once per stage, not per split."""

    def __init__(self) -> None:
        self._executor: ProcessPoolExecutor | None = None

    def executor(self, num_jobs: int) -> ProcessPoolExecutor:
        """The pool, started with ``num_jobs`` processes if it is not running yet."""
        if self._executor is None:
            context = multiprocessing.get_context("spawn")
            self._executor = ProcessPoolExecutor(num_jobs, mp_context=context, initializer=_single_thread)
        return self._executor

    def __enter__(self) -> ExtractionWorkers:
        return self

    def __exit__(self, *exc_info) -> None:
        if self._executor is not None:
            self._executor.shutdown()


def _split_features(
    manifests_dir: str | Path,
    split: str,
    *,
    tmp_dir: Path,
    final_dir: Path,
    config: FeatureConfig,
    workers: ExtractionWorkers,
) -> int:
    """Features (or, ``on_the_fly``, only the mono, resampled cuts) of one split into ``tmp_dir``.

    Returns the number of cuts read (cuts whose audio cannot be read are dropped and logged).
    """
    cuts = load_cuts(manifests_dir, split).map(functools.partial(to_mono_at_rate, sampling_rate=config.sampling_rate))
    count = _count_sorted(cuts, manifests_dir, split)
    if count == 0:
        logger.warning("split %s is empty", split)
        if split == "train":
            raise AsrflowError("the train split has no cuts: check data/manifests/rejected.jsonl")
    staging = tmp_dir / STAGING_DIR
    if count and not config.on_the_fly:
        cuts = _extract(
            cuts,
            count,
            config=config,
            storage_path=tmp_dir / f"{split}_feats",
            staging=staging / split,
            split=split,
            workers=workers,
        )
    if split == "train":
        save_cmvn(_train_statistics(cuts, config), tmp_dir / CMVN_FILE)
    if not config.on_the_fly:
        cuts = cuts.map(functools.partial(_relocate_features, tmp_dir=tmp_dir, final_dir=final_dir))
    cuts.to_file(cuts_path(tmp_dir, split))
    shutil.rmtree(staging, ignore_errors=True)
    return count


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, as taskset or a batch scheduler set it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def resolve_jobs(config: FeatureConfig, cuts: CutSet) -> int:
    """Feature-extraction processes for one split: ``features.num_jobs``, or with ``0``
    :func:`jobs_for` over all :func:`available_cores`."""
    return config.num_jobs or jobs_for(cuts, available_cores())


def jobs_for(cuts: CutSet, cores: int) -> int:
    """With ``features.num_jobs: 0``, the processes worth starting for a split:
    ``max(1, min(cores, floor(audio seconds / AUDIO_S_PER_JOB)))``.

    One process per hour of audio, so a split of at least ``cores`` hours uses every core.
    Spawning a worker costs seconds (it imports torch and Lhotse), more than half an hour
    of audio takes to extract on one core.
    """
    total = sum(cut.duration for cut in cuts)
    return max(1, min(cores, int(total // AUDIO_S_PER_JOB)))


def _single_thread() -> None:
    torch.set_num_threads(1)


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch at one intra-op thread inside the block, the previous count after it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _extract(
    cuts: CutSet,
    count: int,
    *,
    config: FeatureConfig,
    storage_path: Path,
    staging: Path,
    split: str,
    workers: ExtractionWorkers,
) -> CutSet:
    """Fbank of ``cuts`` into Lhotse storage at ``storage_path``; the cuts with features, lazily.

    With one job the features go to ``<storage_path>.lca``; with ``n`` jobs, job ``k`` takes
    every ``n``-th cut from the ``k``-th on (``LazySlicer``) into
    ``<storage_path>/feats-<k>.lca``. The result lists the cuts in id order (the order of the
    input, which :func:`_count_sorted` checked), merged from the jobs' manifests: the same
    manifest whatever the number of jobs or the order they finish in (only the storage
    paths differ). Each job writes its cuts to a manifest under
    ``staging`` as it goes, in the shared ``workers``. Dropped cuts are reported.
    One job shows a progress bar over the ``count`` cuts (a log line now and then off a terminal).
    """
    num_jobs = resolve_jobs(config, cuts)
    logger.info("%s: fbank for %d cuts with %d job(s)", split, count, num_jobs)
    staging.mkdir(parents=True)
    extractor = config.extractor()
    if num_jobs == 1:
        parts = [staging / "cuts.jsonl.gz"]
        lost = _extract_part(progress(cuts, f"fbank ({split})", total=count), extractor, storage_path, parts[0])
    else:
        storage_path.mkdir()
        parts = [staging / f"cuts-{k}.jsonl.gz" for k in range(num_jobs)]
        executor = workers.executor(num_jobs)
        futures = [
            executor.submit(
                _extract_part, CutSet(LazySlicer(cuts, k=k, n=num_jobs)), extractor, storage_path / f"feats-{k}", part
            )
            for k, part in enumerate(parts)
        ]
        lost = [cut_id for future in futures for cut_id in future.result()]
    if lost:
        logger.warning(
            "%s: %d cut(s) dropped because their audio could not be read: %s",
            split,
            len(lost),
            ", ".join(sorted(lost)[:10]),
        )
    return CutSet(LazyMergeById([CutSet.from_jsonl_lazy(part).data for part in parts]))


class LazyMergeById(Dillable):
    """A lazy manifest that merges manifests each sorted by cut id into one sorted by id.

    Re-iterable (each iteration reads the parts again), constant memory.
    """

    def __init__(self, parts: list) -> None:
        self.parts = parts

    def __iter__(self):
        return heapq.merge(*self.parts, key=lambda cut: cut.id)

    def __len__(self) -> int:
        return sum(len(part) for part in self.parts)


def _count_sorted(cuts: CutSet, manifests_dir: str | Path, split: str) -> int:
    """The number of ``cuts``, checking that they come in id order (as the prepare stage writes them).

    Raises:
        AsrflowError: two cuts out of order (a manifest not written by the prepare stage).
    """
    count, previous = 0, None
    for cut in cuts:
        if previous is not None and cut.id <= previous:
            raise AsrflowError(
                f"{cuts_path(manifests_dir, split)}: cut {cut.id!r} comes after {previous!r}; the features "
                "stage needs the cuts sorted by id, each id once (as the prepare stage writes them): re-run prepare"
            )
        previous = cut.id
        count += 1
    return count


def _extract_part(cuts: Iterable[Cut], extractor: Fbank, storage_path: Path, manifest: Path) -> list[str]:
    """Fbank of ``cuts``, one at a time, into ``storage_path`` and their cuts into ``manifest``.

    Returns the ids of the cuts dropped because their audio could not be read.
    """
    lost = []
    with LilcomChunkyWriter(storage_path) as storage, CutSet.open_writer(manifest) as writer:
        for cut in cuts:
            done = null_result_on_audio_loading_error(cut.compute_and_store_features)(
                extractor=extractor, storage=storage
            )
            if done is None:
                lost.append(cut.id)
            else:
                writer.write(done)
    return lost


def _relocate_features(cut, tmp_dir: Path, final_dir: Path):
    """``cut`` with its feature storage pointing at ``final_dir`` where it said ``tmp_dir``."""
    relative = Path(cut.features.storage_path).relative_to(tmp_dir)
    cut.features.storage_path = str(final_dir / relative)
    return cut


def _train_statistics(cuts: CutSet, config: FeatureConfig) -> GlobalMVN:
    """Per-bin mean and std over the train cuts (stored, or computed for up to 1,000 cuts), in one pass."""
    if config.on_the_fly:
        return GlobalMVN.from_cuts(cuts, max_cuts=1000, extractor=config.extractor())
    features = (cut.features for cut in cuts)
    first = next(features, None)
    if first is None:
        raise AsrflowError("no train cut's audio could be read, so there are no features: check the train audio")
    stats = compute_global_stats(itertools.chain([first], features))
    return cmvn_from_dict({name: value.tolist() for name, value in stats.items()})
