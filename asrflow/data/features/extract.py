"""The ``features`` stage: fbank feature extraction with Lhotse, into Lhotse storage.

Every cut is resampled to ``sampling_rate`` and gets ``num_mel_bins``-dimensional log-mel
filterbank features (frames every ``frame_shift_s`` seconds), stored with Lhotse's
``LilcomChunkyWriter``. The global statistics (per-bin mean and standard deviation over the
train split) are written as JSON (:mod:`asrflow.data.features.cmvn`).

Memory stays bounded on long corpora: cuts are read lazily from the manifests, streamed
through extraction into per-job manifests, and the statistics are accumulated in one
streaming pass; nothing holds a whole split.

A multi-channel cut (prepare's ``channel: mix``) is written as it came, pointing at its
file and channels; its features are those of the average of its channels, downmixed when
they are extracted (:func:`asrflow.data.audio.mono_samples`). Before anything is written,
the features' size is estimated and compared with the free space
(:mod:`asrflow.data.features.disk_space`).
"""

from __future__ import annotations

import functools
import heapq
import json
import logging
import multiprocessing
import os
import shutil
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch
from lhotse import CutSet, Fbank, LilcomChunkyWriter
from lhotse.cut import Cut
from lhotse.cut.set import null_result_on_audio_loading_error
from lhotse.lazy import Dillable, LazySlicer
from lhotse.utils import fastcopy

from asrflow.cores import available_cores
from asrflow.data.audio import mono_samples, one_torch_thread
from asrflow.data.features.cmvn import CMVN_FILE, save_cmvn, train_statistics
from asrflow.data.features.config import CONFIG_FILE, FeatureConfig
from asrflow.data.features.disk_space import SplitScan, check_disk_space, disk_margin, estimate_bytes, scan_split
from asrflow.data.manifests import cuts_path, list_corpora, list_test_sets, load_cuts, split_names, write_test_set_list
from asrflow.errors import AsrflowError
from asrflow.files import atomic_path
from asrflow.logs import progress
from asrflow.process_lifetime import die_with_parent

logger = logging.getLogger(__name__)

#: Seconds of audio in a split that justify one more feature-extraction process: a process's
#: start (a fresh Python importing torch and Lhotse) must be small next to the time it then
#: extracts for (one process's rate and start: bench/RESULTS.md#features-speed).
AUDIO_S_PER_JOB = 3600.0
#: Fewest mel bins the fbank extractor accepts (it asserts more than 3).
MIN_MEL_BINS = 4
#: Inside the output's temporary folder: per-job cut manifests, removed before it is renamed.
STAGING_DIR = ".staging"


def compute_features(
    manifests_dir: str | Path, output_dir: str | Path, config: FeatureConfig, *, free_bytes: int | None = None
) -> dict[str, int]:
    """Compute fbank for the train, dev and every test set's cuts of ``manifests_dir`` into ``output_dir``.

    Writes ``{split}_cuts.jsonl.gz`` (cuts pointing at ``output_dir/{split}_feats``),
    ``cmvn.json`` from the train split, and the lists of test sets and corpora as ``manifests_dir``
    has them (:func:`asrflow.data.manifests.list_test_sets`). With ``on_the_fly`` the cuts are written
    without features and the statistics are computed from up to 1,000 train cuts.
    The whole folder appears at once. Returns the number of cuts per split.

    Cuts are streamed (read lazily, a few at a time, and written as they are done), so
    memory does not grow with the corpus; the statistics are accumulated in one pass.

    Extraction runs at one torch thread here as in the spawned workers: its operations
    (resampling, fbank of one utterance) are too small to share, and on a busy machine
    two threads spin against each other (bench/RESULTS.md#features-speed).

    ``free_bytes`` stands for the free space of ``output_dir``'s disk (default: asked of the disk).

    Raises:
        AsrflowError: a manifest missing or unsorted, an empty train split, multi-channel
            cuts with ``on_the_fly``, or features that would not fit the free space
            (checked before anything is written).
    """
    output_dir = Path(output_dir)
    scans = {split: scan_split(manifests_dir, split) for split in split_names(manifests_dir)}
    if scans["train"].count == 0:
        raise AsrflowError("the train split has no cuts: check data/manifests/rejected.jsonl")
    if config.on_the_fly:
        _refuse_multichannel_on_the_fly(scans, manifests_dir)
    else:
        check_disk_space(
            output_dir, estimate_bytes(scans.values(), config), free_bytes=free_bytes, margin=disk_margin()
        )
    with one_torch_thread(), atomic_path(output_dir) as tmp_dir, ExtractionWorkers() as workers:
        tmp_dir.mkdir(parents=True)
        write_test_set_list(tmp_dir, list_test_sets(manifests_dir), list_corpora(manifests_dir))
        for split in scans:
            _split_features(
                manifests_dir,
                split,
                scans[split],
                tmp_dir=tmp_dir,
                final_dir=output_dir,
                config=config,
                workers=workers,
            )
        (tmp_dir / CONFIG_FILE).write_text(json.dumps(asdict(config), indent=1) + "\n")
    return {split: scan.count for split, scan in scans.items()}


def _refuse_multichannel_on_the_fly(scans: dict[str, SplitScan], manifests_dir: str | Path) -> None:
    """On-the-fly features read each cut's audio as it is: a multi-channel cut would give per-channel features.

    Raises:
        AsrflowError: naming the splits with multi-channel cuts and the two ways out.
    """
    found = [f"{split} {scan.multichannel}" for split, scan in scans.items() if scan.multichannel]
    if found:
        raise AsrflowError(
            f"{manifests_dir} has multi-channel cuts ({', '.join(found)}) and features.on_the_fly is true: "
            "on-the-fly features need one channel; set prepare.channel to a channel index, or "
            "features.on_the_fly: false (precomputed features downmix the channels)"
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
            self._executor = ProcessPoolExecutor(
                num_jobs, mp_context=context, initializer=_init_worker, initargs=(os.getpid(),)
            )
        return self._executor

    def __enter__(self) -> ExtractionWorkers:
        return self

    def __exit__(self, *exc_info) -> None:
        if self._executor is not None:
            self._executor.shutdown()


def _split_features(
    manifests_dir: str | Path,
    split: str,
    scan: SplitScan,
    *,
    tmp_dir: Path,
    final_dir: Path,
    config: FeatureConfig,
    workers: ExtractionWorkers,
) -> int:
    """Features (or, ``on_the_fly``, only the cuts at the feature rate) of one split into ``tmp_dir``.

    Cuts whose audio cannot be read are dropped and logged.
    """
    cuts = load_cuts(manifests_dir, split)
    staging = tmp_dir / STAGING_DIR
    if config.on_the_fly:
        cuts = cuts.map(functools.partial(_at_rate, sampling_rate=config.sampling_rate))
    elif scan.count:
        cuts = _extract(
            cuts,
            scan,
            config=config,
            storage_path=tmp_dir / f"{split}_feats",
            staging=staging / split,
            split=split,
            workers=workers,
        )
    if split == "train":
        save_cmvn(train_statistics(cuts, config), tmp_dir / CMVN_FILE)
    if not config.on_the_fly:
        cuts = cuts.map(functools.partial(_relocate_features, tmp_dir=tmp_dir, final_dir=final_dir))
    cuts_path(tmp_dir, split).parent.mkdir(parents=True, exist_ok=True)
    cuts.to_file(cuts_path(tmp_dir, split))
    shutil.rmtree(staging, ignore_errors=True)


def _at_rate(cut: Cut, sampling_rate: int) -> Cut:
    """``cut`` resampled lazily to ``sampling_rate`` (Hz) when it has another rate (its manifest stays on file)."""
    return cut if cut.sampling_rate == sampling_rate else cut.resample(sampling_rate)


def resolve_jobs(config: FeatureConfig, audio_s: float) -> int:
    """Feature-extraction processes for a split of ``audio_s`` seconds: ``features.num_jobs``, or
    with ``0`` :func:`jobs_for` over all :func:`available_cores`."""
    return config.num_jobs or jobs_for(audio_s, available_cores())


def jobs_for(audio_s: float, cores: int) -> int:
    """With ``features.num_jobs: 0``, the processes worth starting for a split of ``audio_s`` seconds:
    ``max(1, min(cores, floor(audio_s / AUDIO_S_PER_JOB)))``.

    One process per hour of audio, so a split of at least ``cores`` hours uses every core.
    Spawning a worker costs seconds (it imports torch and Lhotse), more than half an hour
    of audio takes to extract on one core.
    """
    return max(1, min(cores, int(audio_s // AUDIO_S_PER_JOB)))


def _init_worker(stage_pid: int) -> None:
    """One torch thread; and on Linux, die with the stage (a killed stage leaves no worker writing).

    The stage may have died while this process was starting (before the death signal was
    asked for): then it ends here.
    """
    torch.set_num_threads(1)
    die_with_parent()
    if os.getppid() != stage_pid:
        os._exit(1)


def _extract(
    cuts: CutSet,
    scan: SplitScan,
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
    input, which :func:`scan_split` checked), merged from the jobs' manifests: the same
    manifest whatever the number of jobs or the order they finish in (only the storage
    paths differ). Each job writes its cuts to a manifest under
    ``staging`` as it goes, in the shared ``workers``. Dropped cuts are reported.
    One job shows a progress bar over the split's cuts (a log line now and then off a terminal).
    """
    num_jobs = resolve_jobs(config, scan.audio_s)
    logger.info("%s: fbank for %d cuts with %d job(s)", split, scan.count, num_jobs)
    staging.mkdir(parents=True)
    storage_path.parent.mkdir(parents=True, exist_ok=True)
    extractor = config.extractor()
    if num_jobs == 1:
        parts = [staging / "cuts.jsonl.gz"]
        lost = _extract_part(progress(cuts, f"fbank ({split})", total=scan.count), extractor, storage_path, parts[0])
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


def _extract_part(cuts: Iterable[Cut], extractor: Fbank, storage_path: Path, manifest: Path) -> list[str]:
    """Fbank of ``cuts``, one at a time, into ``storage_path`` and their cuts into ``manifest``.

    Returns the ids of the cuts dropped because their audio could not be read.
    """
    lost = []
    extract = null_result_on_audio_loading_error(_cut_with_features)
    with LilcomChunkyWriter(storage_path) as storage, CutSet.open_writer(manifest) as writer:
        for cut in cuts:
            done = extract(cut, extractor, storage)
            if done is None:
                lost.append(cut.id)
            else:
                writer.write(done)
    return lost


def _cut_with_features(cut: Cut, extractor: Fbank, storage: LilcomChunkyWriter) -> Cut:
    """``cut`` at the extractor's rate with the features of its channels' average attached.

    The cut keeps its recording and channels (a ``MultiCut`` stays one); its audio is resampled
    lazily (``cut.resample``), so it loads at the rate its features were computed at.
    """
    rate = extractor.config.sampling_rate
    features = extractor.extract_from_samples_and_store(
        samples=mono_samples(cut, rate), storage=storage, sampling_rate=rate, offset=cut.start, channel=cut.channel
    )
    return fastcopy(_at_rate(cut, rate), features=features)


def _relocate_features(cut, tmp_dir: Path, final_dir: Path):
    """``cut`` with its feature storage pointing at ``final_dir`` where it said ``tmp_dir``."""
    relative = Path(cut.features.storage_path).relative_to(tmp_dir)
    cut.features.storage_path = str(final_dir / relative)
    return cut
