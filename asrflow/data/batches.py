"""Batches for training: a deterministic plan per epoch, and the dataset that fills it.

The plan of an epoch is the list of batches (an :class:`~asrflow.data.index.EpochPlan`: cut
positions and batch bounds, read as lists of cut ids) that
:func:`asrflow.data.index.plan_epoch_index` makes for ``(seed, epoch)`` from the cuts' ids
and durations only: a full permutation of the id-sorted cuts (global shuffle, independent
of the manifest's order on disk), bucketed by duration. Materialising it costs the same at
any position, so a resume jumps straight to batch ``k`` instead of replaying the epoch
through the data pipeline.

Cuts come either as a Lhotse ``CutSet`` held in memory (small corpora) or as a
:class:`~asrflow.data.index.CutIndex` (compact arrays; workers read a batch's cuts from
its line store), which is what keeps a million-utterance corpus out of every process.

Optimizer step ``s`` of an epoch consumes the ``accum_grad * world_size`` consecutive
planned batches starting at ``s * accum_grad * world_size``; rank ``r`` takes micro-batch
``j`` at offset ``j * world_size + r``. Trailing batches that cannot fill a whole step are
dropped (rank 0 logs how many, once per epoch), so every rank runs the same number of steps
and no collective waits.

Augmentation randomness is drawn from a generator seeded by ``(seed, epoch, batch index)``,
so a batch is the same whichever data worker builds it and whenever it is built.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torchaudio
from lhotse import CutSet
from lhotse.dataset import GlobalMVN, OnTheFlyFeatures
from lhotse.dataset.collation import collate_features

from asrflow.data.index import CorpusMix, CutIndex, EpochPlan, plan_epoch_index
from asrflow.data.manifests import cut_text
from asrflow.tokenizer import Tokenizer

logger = logging.getLogger("asrflow.batches")


@dataclass(frozen=True, kw_only=True)
class BatchItem:
    """One micro-batch to build: where it sits in training, and which cuts it holds."""

    epoch: int
    step_in_epoch: int
    micro_index: int
    batch_index: int  # position in the epoch's global plan
    cut_ids: tuple[str, ...]
    step_cut_ids: tuple[str, ...]  # every cut of this optimizer step, all micro-batches and ranks


def as_index(cuts: CutSet | CutIndex) -> CutIndex:
    """``cuts`` as a :class:`CutIndex` (a ``CutSet`` is indexed in memory)."""
    return cuts if isinstance(cuts, CutIndex) else CutIndex.from_cuts(cuts)


def plan_epoch(
    cuts: CutSet | CutIndex,
    epoch: int,
    *,
    seed: int,
    max_duration_s: float,
    num_buckets: int,
    mix: CorpusMix | None = None,
) -> EpochPlan:
    """The global batches of ``epoch``; identical on every rank and for any order of ``cuts``
    (see :func:`asrflow.data.index.plan_positions`); ``mix`` weighs several corpora
    (:func:`asrflow.data.index.mix_positions`)."""
    return plan_epoch_index(
        as_index(cuts), epoch, seed=seed, max_duration_s=max_duration_s, num_buckets=num_buckets, mix=mix
    )


def plan_digest(plan: EpochPlan) -> str:
    """A short hash of a plan, stored in checkpoints to check a resume sees the same batches
    (computed once per plan: see :attr:`EpochPlan.digest`)."""
    return plan.digest


def steps_in_plan(plan: EpochPlan, accum_grad: int, world_size: int) -> int:
    """Whole optimizer steps the plan holds."""
    return len(plan) // (accum_grad * world_size)


def dropped_batches(plan: EpochPlan, accum_grad: int, world_size: int) -> int:
    """Trailing batches of the plan that cannot fill a whole optimizer step (not trained this epoch)."""
    return len(plan) - steps_in_plan(plan, accum_grad, world_size) * accum_grad * world_size


def rank_items(
    plan: EpochPlan, epoch: int, *, start_step: int, accum_grad: int, world_size: int, rank: int
) -> Iterator[BatchItem]:
    """This rank's micro-batches from optimizer step ``start_step`` to the end of the epoch, made
    as they are drawn (an epoch's items are never all held)."""
    group = accum_grad * world_size
    for step in range(start_step, steps_in_plan(plan, accum_grad, world_size)):
        step_cut_ids = tuple(plan.index.id_list(plan.batch_positions(step * group, (step + 1) * group)))
        for micro in range(accum_grad):
            index = step * group + micro * world_size + rank
            yield BatchItem(
                epoch=epoch,
                step_in_epoch=step,
                micro_index=micro,
                batch_index=index,
                cut_ids=tuple(plan[index]),
                step_cut_ids=step_cut_ids,
            )


def batch_seed(seed: int, epoch: int, batch_index: int) -> int:
    """A 63-bit seed for one batch's augmentation."""
    return int(np.random.SeedSequence([seed, epoch, batch_index]).generate_state(2, np.uint64)[0] >> 1)


#: Speed perturbation factors, drawn uniformly per utterance (1.1 plays it faster: fewer frames).
SPEED_FACTORS = (0.9, 1.0, 1.1)


@dataclass(frozen=True, kw_only=True)
class AugmentConfig:
    """SpecAugment and waveform augmentation settings (see params.yaml ``train:``)."""

    spec_augment: bool = True
    num_freq_masks: int = 2
    freq_mask_width: int = 15
    num_time_masks: int = 2
    time_mask_ratio: float = 0.05
    speed_perturb: bool = False
    noise_snr_db: tuple[float, float] = (10.0, 20.0)


def spec_augment(features: torch.Tensor, lengths: torch.Tensor, config: AugmentConfig) -> torch.Tensor:
    """Frequency and time masking with torchaudio, drawing from the current torch RNG.

    Args:
        features: (N, T, F) normalised fbank.
        lengths: (N,) valid frames; time masks stay inside them.
    Returns:
        (N, T, F) masked copy (masked values are 0, the normalised mean).
    """
    out = features.clone()
    freq_mask = torchaudio.transforms.FrequencyMasking(config.freq_mask_width)
    for n in range(out.size(0)):
        valid = int(lengths[n])
        spec = out[n, :valid].transpose(0, 1).unsqueeze(0)  # (1, F, T)
        for _ in range(config.num_freq_masks):
            spec = freq_mask(spec)
        width = max(1, int(config.time_mask_ratio * valid))
        time_mask = torchaudio.transforms.TimeMasking(width)
        for _ in range(config.num_time_masks):
            spec = time_mask(spec)
        out[n, :valid] = spec.squeeze(0).transpose(0, 1)
    return out


class AsrBatchDataset(torch.utils.data.Dataset):
    """Builds a padded batch for a :class:`BatchItem`; runs inside data workers.

    Returns a dict:
        features (N, T, F) float32, normalised; feature_lens (N,) frames;
        targets (N, U) int64 padded with 0; target_lens (N,); cut_ids; durations (N,) seconds;
        padding_ratio: padded frames / all frames of the batch;
        step_tokens: target tokens of the whole optimizer step (all micro-batches and ranks),
            counted for the step's first micro-batch only (``micro_index`` 0; the train loop
            reads it there); ``-1`` in the others, which do not re-tokenise the step.

    ``cuts``: a ``CutSet`` (held in memory and pickled into each worker) or a
    :class:`CutIndex` (each worker reads a batch's cuts from the index's line store).
    """

    def __init__(
        self,
        cuts: CutSet | CutIndex,
        tokenizer: Tokenizer,
        mvn: GlobalMVN,
        *,
        seed: int,
        augment: AugmentConfig | None = None,
        extractor=None,
        noise_cuts: CutSet | None = None,
    ):
        self.cuts = as_index(cuts)
        self.tokenizer = tokenizer
        self.mvn = mvn
        self.seed = seed
        self.augment = augment
        self.extractor = extractor
        # Sorted by id: the noise drawn for a batch must not depend on the order a folder was listed in.
        self.noise_cuts = sorted(noise_cuts, key=lambda cut: cut.id) if noise_cuts is not None else []

    def __len__(self) -> int:
        return len(self.cuts)

    def __getitem__(self, item: BatchItem) -> dict:
        cut_seed = batch_seed(self.seed, item.epoch, item.batch_index)
        rng = random.Random(cut_seed)
        cuts = self.cuts.cuts(item.cut_ids)
        if self.extractor is not None:
            cuts = [self._waveform_augment(cut, rng) for cut in cuts]
            features, feature_lens = OnTheFlyFeatures(self.extractor)(CutSet.from_cuts(cuts))
        else:
            features, feature_lens = collate_features(CutSet.from_cuts(cuts))  # (N, T, F), (N,)
        features = self.mvn(features)
        if self.augment is not None and self.augment.spec_augment:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(cut_seed)
                features = spec_augment(features, feature_lens, self.augment)
        token_ids = [self.tokenizer.encode(cut_text(cut)) for cut in cuts]
        target_lens = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64)
        targets = torch.zeros(len(token_ids), max(1, int(target_lens.max())), dtype=torch.int64)
        for n, ids in enumerate(token_ids):
            targets[n, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        total = features.size(0) * features.size(1)
        return {
            "features": features,
            "feature_lens": feature_lens,
            "targets": targets,
            "target_lens": target_lens,
            "cut_ids": list(item.cut_ids),
            "durations": torch.tensor([cut.duration for cut in cuts], dtype=torch.float64),
            "padding_ratio": 1.0 - float(feature_lens.sum()) / total,
            "step_tokens": self._step_tokens(item, cuts, target_lens),
            "item": item,
        }

    def _step_tokens(self, item: BatchItem, cuts: list, target_lens: torch.Tensor) -> int:
        """Target tokens of ``item``'s whole optimizer step (micro-batch 0 only, else -1)."""
        if item.micro_index != 0:
            return -1
        own = set(item.cut_ids)
        others = [cut_id for cut_id in item.step_cut_ids if cut_id not in own]
        return int(target_lens.sum()) + sum(len(self.tokenizer.encode(cut_text(cut))) for cut in self.cuts.cuts(others))

    def _waveform_augment(self, cut, rng: random.Random):
        """Speed perturbation and noise mixing (on-the-fly features only), drawn from ``rng``."""
        if self.augment is not None and self.augment.speed_perturb:
            factor = rng.choice(SPEED_FACTORS)
            if factor != 1.0:
                cut = cut.perturb_speed(factor)
        if self.noise_cuts:
            cut = self._mix_noise(cut, rng)
        return cut

    def _mix_noise(self, cut, rng: random.Random):
        """Noise over the whole of ``cut`` at an SNR drawn from ``noise_snr_db``; same duration as ``cut``.

        A longer noise is cut at a random offset; a shorter one is repeated (as Lhotse's
        ``CutSet.mix`` does), so the utterance is neither lengthened nor only partly noisy.
        """
        noise = rng.choice(self.noise_cuts)
        low, high = self.augment.noise_snr_db if self.augment else (10.0, 20.0)
        snr = rng.uniform(low, high)
        if noise.duration > cut.duration:
            noise = noise.truncate(offset=rng.uniform(0.0, noise.duration - cut.duration), duration=cut.duration)
        mixed, covered = cut, 0.0
        while covered < cut.duration:
            mixed = mixed.mix(noise, offset_other_by=covered, snr=snr, allow_padding=True)
            covered = round(covered + noise.duration, 8)
        return mixed.truncate(duration=cut.duration)


#: Epoch plans :class:`TrainingBatches` keeps.
PLAN_CACHE_SIZE = 2


class TrainingBatches:
    """This rank's micro-batches from ``(start_epoch, start_step)`` to the last epoch.

    Iterable, so one ``DataLoader`` (and one set of workers) serves the whole run; each
    epoch's plan is made when the loader first reaches it. ``mix`` weighs several corpora.
    """

    def __init__(
        self,
        cuts: CutSet | CutIndex,
        *,
        seed: int,
        max_duration_s: float,
        num_buckets: int,
        accum_grad: int,
        world_size: int,
        rank: int,
        start_epoch: int,
        start_step: int,
        num_epochs: int,
        mix: CorpusMix | None = None,
    ):
        self.cuts = as_index(cuts)
        self.mix = mix
        self.seed = seed
        self.max_duration_s = max_duration_s
        self.num_buckets = num_buckets
        self.accum_grad = accum_grad
        self.world_size = world_size
        self.rank = rank
        self.start_epoch = start_epoch
        self.start_step = start_step
        self.num_epochs = num_epochs
        self._cached: dict[int, EpochPlan] = {}

    def start_at(self, epoch: int, step: int) -> None:
        """Make the next iteration begin at optimizer step ``step`` of ``epoch`` (a resume or a rollback)."""
        self.start_epoch, self.start_step = epoch, step

    def plan(self, epoch: int) -> EpochPlan:
        """The global plan of ``epoch`` (the two latest are cached: a checkpoint of the
        previous epoch's end and the loader's current epoch do not rebuild each other's)."""
        if epoch not in self._cached:
            if len(self._cached) >= PLAN_CACHE_SIZE:
                del self._cached[next(iter(self._cached))]
            self._cached[epoch] = plan_epoch(
                self.cuts,
                epoch,
                seed=self.seed,
                max_duration_s=self.max_duration_s,
                num_buckets=self.num_buckets,
                mix=self.mix,
            )
        return self._cached[epoch]

    def __iter__(self) -> Iterator[BatchItem]:
        for epoch in range(self.start_epoch, self.num_epochs):
            start = self.start_step if epoch == self.start_epoch else 0
            plan = self.plan(epoch)
            self._log_dropped(epoch, plan)
            yield from rank_items(
                plan, epoch, start_step=start, accum_grad=self.accum_grad, world_size=self.world_size, rank=self.rank
            )

    def _log_dropped(self, epoch: int, plan: EpochPlan) -> None:
        """Rank 0 says how many trailing batches ``epoch`` drops (none: nothing logged)."""
        dropped = dropped_batches(plan, self.accum_grad, self.world_size)
        if dropped and self.rank == 0:
            logger.info(
                "epoch %d: %d of %d planned batches dropped (they cannot fill a whole step of "
                "accum_grad %d x %d processes)",
                epoch,
                dropped,
                len(plan),
                self.accum_grad,
                self.world_size,
            )
