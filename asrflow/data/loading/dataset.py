"""The training dataset: builds the padded batch of one planned micro-batch
(:class:`~asrflow.data.loading.planner.BatchItem`) inside a data worker.

Cuts come either as a Lhotse ``CutSet`` held in memory (small corpora) or as a
:class:`~asrflow.data.loading.cut_index.CutIndex` (compact arrays; workers read a batch's cuts
from its line store), which is what keeps a million-utterance corpus out of every process.

Augmentation randomness (:mod:`asrflow.data.loading.augment`) is drawn from a generator seeded
by ``(seed, epoch, batch index)`` (:func:`batch_seed`), so a batch is the same whichever data
worker builds it and whenever it is built.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from lhotse import CutSet
from lhotse.dataset import GlobalMVN, OnTheFlyFeatures
from lhotse.dataset.collation import collate_features

from asrflow.data.audio import native_resampling
from asrflow.data.loading.augment import spec_augment, waveform_augment
from asrflow.data.loading.config import DataConfig
from asrflow.data.loading.cut_index import CutIndex, as_index
from asrflow.data.loading.planner import BatchItem, padded_frames
from asrflow.data.manifests import cut_text
from asrflow.tokenizer import Tokenizer


def batch_seed(seed: int, epoch: int, batch_index: int) -> int:
    """A 63-bit seed for one batch's augmentation."""
    return int(np.random.SeedSequence([seed, epoch, batch_index]).generate_state(2, np.uint64)[0] >> 1)


def pad_frames(features: torch.Tensor, multiple: int) -> torch.Tensor:
    """``features`` (N, T, F) with zero frames appended up to the next multiple of ``multiple`` frames."""
    extra = padded_frames(features.size(1), multiple) - features.size(1)
    return torch.nn.functional.pad(features, (0, 0, 0, extra)) if extra else features


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
    ``pad_frames_to``: the frame axis T is padded to a multiple of it (``train.data.pad_frames_to``).
    """

    def __init__(
        self,
        cuts: CutSet | CutIndex,
        tokenizer: Tokenizer,
        mvn: GlobalMVN,
        *,
        seed: int,
        augment: DataConfig | None = None,
        extractor=None,
        noise_cuts: CutSet | None = None,
        pad_frames_to: int = 1,
    ):
        self.cuts = as_index(cuts)
        self.tokenizer = tokenizer
        self.mvn = mvn
        self.seed = seed
        self.augment = augment
        self.extractor = extractor
        self.pad_frames_to = pad_frames_to
        # Sorted by id: the noise drawn for a batch must not depend on the order a folder was listed in.
        self.noise_cuts = sorted(noise_cuts, key=lambda cut: cut.id) if noise_cuts is not None else []

    def __len__(self) -> int:
        return len(self.cuts)

    def __getitem__(self, item: BatchItem) -> dict:
        cut_seed = batch_seed(self.seed, item.epoch, item.batch_index)
        rng = random.Random(cut_seed)
        cuts = self.cuts.cuts(item.cut_ids)
        if self.extractor is not None:
            with native_resampling():  # the audio (and noise) loads and resamples here
                cuts = [waveform_augment(cut, rng, self.augment, self.noise_cuts) for cut in cuts]
                features, feature_lens = OnTheFlyFeatures(self.extractor)(CutSet.from_cuts(cuts))
        else:
            features, feature_lens = collate_features(CutSet.from_cuts(cuts))  # (N, T, F), (N,)
        features = pad_frames(self.mvn(features), self.pad_frames_to)
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
