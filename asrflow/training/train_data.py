"""Everything training reads: the tokenizer, CMVN, CTC-feasible cuts, batch plan, datasets and data loader.

Built from a run's settings by :func:`asrflow.training.parts.build_train_data`, which the Trainer, the
benchmarks and the tests all call.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from lhotse.dataset import GlobalMVN

from asrflow.allocator import release_free_memory
from asrflow.data.features.cmvn import CMVN_FILE, load_cmvn
from asrflow.data.features.config import FeatureConfig, check_same_features
from asrflow.data.loading.augment import SPEED_FACTORS
from asrflow.data.loading.config import DataConfig
from asrflow.data.loading.ctc_filter import filter_ctc_feasible, filter_ctc_feasible_index
from asrflow.data.loading.cut_index import CutIndex, data_digest
from asrflow.data.loading.dataset import AsrBatchDataset
from asrflow.data.loading.index_store import shared_index
from asrflow.data.loading.planner import CorpusMix, TrainingBatches, steps_in_plan
from asrflow.data.loading.worker_server import start_worker_server
from asrflow.data.loading.workers import init_worker, pack_batch
from asrflow.data.manifests import corpus_of_ids, cuts_path, list_corpora, load_cuts
from asrflow.errors import AsrflowError
from asrflow.tokenizer import MODEL_FILE, Tokenizer
from asrflow.training.distributed import DistInfo
from asrflow.training.fingerprint import file_digest
from asrflow.training.validation import dev_batches, dev_loss

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class TrainData:
    """The tokenizer, normalisation, train batch plan and dev batches of one run.

    Attributes:
        tokenizer: SentencePiece model of ``lang_dir``.
        mvn: global mean/variance normalisation from the features stage's CMVN stats.
        cmvn_path: the stats file (copied into the model bundle).
        batches: this rank's micro-batches over every epoch (a plan per epoch).
        dataset: builds a train batch for a :class:`~asrflow.data.loading.planner.BatchItem`.
        dev_dataset: the same without augmentation, over the dev cuts.
        dev_batches: dev cut ids packed by duration (every rank holds all of them).
        num_train, num_dev: utterances kept; removed_for_ctc: train utterances too short for their transcript.
        digest: hash of the tokenizer, the train cuts' content (not where their features are stored, which
            depends on the number of extraction jobs) and CMVN (part of the resume fingerprint).
    """

    tokenizer: Tokenizer
    mvn: GlobalMVN
    cmvn_path: Path
    batches: TrainingBatches
    dataset: AsrBatchDataset
    dev_dataset: AsrBatchDataset
    dev_batches: list[tuple[str, ...]]
    num_train: int
    num_dev: int
    removed_for_ctc: int
    digest: str
    num_workers: int
    mp_start_method: str
    seed: int
    #: The manifests read, by MLflow dataset context (``train``, and ``dev`` when there is one).
    manifests: dict[str, Path]
    _open: Iterator[dict] | None = field(default=None, init=False, repr=False)

    @classmethod
    def build(
        cls,
        config: DataConfig,
        features: FeatureConfig,
        *,
        epochs: int,
        accum_grad: int,
        num_workers: int,
        mp_start_method: str,
        seed: int,
        fbank_dir: Path,
        lang_dir: Path,
        dist: DistInfo | None = None,
    ) -> TrainData:
        """Read the features and tokenizer stages' outputs and make this rank's data: ``config`` is the
        ``train.data`` section, ``epochs`` and ``accum_grad`` are ``train.optim``'s, ``num_workers`` data-loading
        processes started with ``mp_start_method``."""
        check_same_features(features, fbank_dir)
        tokenizer_path = Path(lang_dir) / MODEL_FILE
        if not tokenizer_path.is_file():
            raise AsrflowError(f"{tokenizer_path} not found: run the tokenizer stage first")
        tokenizer = Tokenizer(tokenizer_path)
        cmvn_path = Path(fbank_dir) / CMVN_FILE
        mvn = load_cmvn(cmvn_path)
        full_index, train_cuts, removed = _train_cuts(
            config, features, fbank_dir=fbank_dir, tokenizer=tokenizer, tokenizer_path=tokenizer_path
        )
        dev_cuts, _ = filter_ctc_feasible(load_cuts(fbank_dir, "dev").to_eager(), tokenizer, features.frame_shift_s)
        dist = dist or DistInfo()
        plan = dict(seed=seed, accum_grad=accum_grad, world_size=dist.world_size, rank=dist.rank, num_epochs=epochs)
        batches = _training_batches(train_cuts, config, features, fbank_dir, **plan)
        extractor = features.extractor() if features.on_the_fly else None
        noise = _noise_cuts(config, features)
        logger.info("train data ready: %d train cuts, %d dev cuts", len(train_cuts), len(dev_cuts))
        if num_workers and mp_start_method == "forkserver":
            start_worker_server()
        datasets = dict(seed=seed, extractor=extractor, pad_frames_to=config.pad_frames_to)
        return cls(
            tokenizer=tokenizer,
            mvn=mvn,
            cmvn_path=cmvn_path,
            batches=batches,
            dataset=AsrBatchDataset(train_cuts, tokenizer, mvn, augment=config, noise_cuts=noise, **datasets),
            dev_dataset=AsrBatchDataset(dev_cuts, tokenizer, mvn, augment=None, **datasets),
            dev_batches=dev_batches(dev_cuts, config.max_duration_s, config.pad_frames_to, features.frame_shift_s),
            num_train=len(train_cuts),
            num_dev=len(dev_cuts),
            removed_for_ctc=len(removed),
            digest=data_digest(full_index, tokenizer_path, cmvn_path),
            num_workers=num_workers,
            mp_start_method=mp_start_method,
            seed=seed,
            manifests={
                split: cuts_path(fbank_dir, split)
                for split in ("train", "dev")
                if cuts_path(fbank_dir, split).is_file()
            },
        )

    def dev_loss(self, model: torch.nn.Module, **options) -> float:
        """Per-token dev loss of ``model`` (see :func:`asrflow.training.validation.dev_loss` for ``options``:
        precision, dist, device, beat)."""
        return dev_loss(model, self.dev_dataset, self.dev_batches, **options)

    def steps_per_epoch(self, epoch: int) -> int:
        """Optimizer steps ``epoch`` holds on every rank."""
        return steps_in_plan(self.batches.plan(epoch), self.batches.accum_grad, self.batches.world_size)

    def loader(self, epoch: int, step_in_epoch: int) -> torch.utils.data.DataLoader:
        """This rank's batches from optimizer step ``step_in_epoch`` of ``epoch`` to the end of training.

        Yields packed batches (see :func:`asrflow.data.loading.workers.unpack_batch`), built by
        ``num_workers`` processes started with ``mp_start_method`` (0: in this process).
        """
        self.batches.start_at(epoch, step_in_epoch)
        workers = self.num_workers
        return torch.utils.data.DataLoader(
            self.dataset,
            sampler=self.batches,
            batch_size=None,
            collate_fn=pack_batch,
            num_workers=workers,
            multiprocessing_context=self.mp_start_method if workers else None,
            worker_init_fn=init_worker if workers else None,
            prefetch_factor=4 if workers else None,
            # Its own generator: iter() draws the workers' base seed from it, not from the global torch
            # RNG, which a resume restores from the checkpoint and a draw here would shift (exact resume).
            generator=torch.Generator().manual_seed(self.seed),
        )

    def open(self, epoch: int, step_in_epoch: int) -> Iterator[dict]:
        """Start :meth:`loader` at that position (its data workers start now, in the background) and return
        its iterator; the loader opened before is closed."""
        self.close()
        self._open = iter(self.loader(epoch, step_in_epoch))
        return _handed_over(self._open, epoch, step_in_epoch)

    def close(self) -> None:
        """Shut the open loader's data workers down. Not left to garbage collection: an exception's traceback
        keeps the iterator alive, and a worker still running holds the process at exit."""
        iterator, self._open = self._open, None
        shut_down_workers(iterator)


def shut_down_workers(iterator: Iterator | None) -> None:
    """Shut the data workers of a ``DataLoader`` iterator down now (nothing for an iterator without workers,
    or ``None``). A worker that crashes while exiting (native code holding a live thread aborts at exit) took
    no batch with it: that is logged as a warning, not raised, and any worker still alive is terminated."""
    shutdown = getattr(iterator, "_shutdown_workers", None)  # what DataLoader's own __del__ calls
    if shutdown is None:
        return
    try:
        shutdown()
    except RuntimeError as error:  # DataLoader's SIGCHLD handler: "worker killed by signal"
        logger.warning("a data worker ended abnormally while shutting down, after its last batch: %s", error)
        for worker in getattr(iterator, "_workers", []):
            if worker.is_alive():
                worker.terminate()


#: Free heap pages go back to the system every this many batches (see :mod:`asrflow.allocator`).
RELEASE_EVERY_BATCHES = 10


def _handed_over(batches: Iterator[dict], epoch: int, step_in_epoch: int) -> Iterator[dict]:
    """``batches``, logging when the first one is handed over (bench.startup reads the line) and
    returning the heap's free pages now and then: batches of ever-new shapes leave holes in it."""
    for count, batch in enumerate(batches):
        if count == 0:
            logger.info("first batch of epoch %d from step %d handed over", epoch, step_in_epoch)
        elif count % RELEASE_EVERY_BATCHES == 0:
            release_free_memory()
        yield batch


def corpus_mix(index: CutIndex, corpora: list[str], weights: dict[str, float]) -> CorpusMix | None:
    """How each epoch weighs the named ``corpora`` of the train cuts ``index`` (``None``: every cut once,
    as with one corpus; all weights 1 plan the same epochs).

    Raises:
        AsrflowError: ``weights`` names a corpus the features folder does not hold.
    """
    unknown = sorted(set(weights) - set(corpora))
    if unknown:
        held = f"the corpora are {', '.join(corpora)}" if corpora else "there is one corpus, unnamed"
        raise AsrflowError(
            f"params.yaml: train.data.corpus_weights names {', '.join(unknown)}, but {held}; "
            "name corpora of prepare.corpora"
        )
    if all(weights.get(name, 1.0) == 1.0 for name in corpora):
        return None
    mix = CorpusMix(
        corpus_of=corpus_of_ids(index.ids, corpora),
        weights=tuple(float(weights.get(name, 1.0)) for name in corpora),
        names=tuple(corpora),
    )
    shares = zip(corpora, mix.weights, mix.counts(), mix.epoch_counts(), strict=True)
    logger.info(
        "corpus mix per epoch: %s",
        ", ".join(f"{name} {taken} of {count} cuts (weight {weight:g})" for name, weight, count, taken in shares),
    )
    return mix


def _train_cuts(
    config: DataConfig, features: FeatureConfig, *, fbank_dir: Path, tokenizer: Tokenizer, tokenizer_path: Path
):
    """The train cuts as a compact index (ids, durations, offsets into the node's one uncompressed copy of the
    manifest, shared by its ranks and runs: no process, data workers included, holds every cut), before and
    after dropping those too short for their transcript (at the fastest speed perturbation); and the dropped."""
    max_speed = max(SPEED_FACTORS) if config.speed_perturb else 1.0
    full_index = shared_index(cuts_path(fbank_dir, "train"))
    train_cuts, removed = filter_ctc_feasible_index(
        full_index, tokenizer, features.frame_shift_s, max_speed, cache_key=file_digest(tokenizer_path)
    )
    train_cuts.store_owner = full_index.store_owner  # the store stays held as long as the index that reads it
    if len(train_cuts) == 0:
        raise AsrflowError("no train utterance is long enough for its transcript; check the data")
    return full_index, train_cuts, removed


def _training_batches(
    train_cuts: CutIndex, config: DataConfig, features: FeatureConfig, fbank_dir: Path, **plan
) -> TrainingBatches:
    """This rank's plan over every epoch (``plan``: seed, accum_grad, world_size, rank, num_epochs), bucketed
    by duration as ``train.data`` asks, with the corpora mixed by ``train.data.corpus_weights``."""
    return TrainingBatches(
        train_cuts,
        max_duration_s=config.max_duration_s,
        num_buckets=config.num_buckets,
        start_epoch=0,
        start_step=0,
        mix=corpus_mix(train_cuts, list_corpora(fbank_dir), config.corpus_weights),
        pad_frames_to=config.pad_frames_to,
        frame_shift_s=features.frame_shift_s,
        **plan,
    )


def _noise_cuts(config: DataConfig, features: FeatureConfig):
    """Noise cuts for augmentation from ``train.data.noise_dir`` (see :mod:`asrflow.data.loading.noise`), or None."""
    if not config.noise_dir:
        return None
    if not features.on_the_fly:
        raise AsrflowError("train.data.noise_dir needs features.on_the_fly: true (noise is mixed into audio)")
    from asrflow.data.loading.noise import load_noise_cuts

    return load_noise_cuts(config.noise_dir, features.sampling_rate)
