"""Augmentation in AsrBatchDataset: SpecAugment, speed perturbation and noise mixing.

Every random choice of a batch is drawn from a seed made of ``(seed, epoch, batch index)``,
so a batch is the same however often, in whichever dataset instance and in whichever data
worker it is built; and each augmentation really changes what the model sees.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import soundfile as sf
import torch
from lhotse import CutSet
from lhotse.dataset.collation import collate_features
from lhotse.utils import compute_num_frames

from asrflow.data.features.cmvn import load_cmvn
from asrflow.data.loading.augment import waveform_augment
from asrflow.data.loading.config import DataConfig
from asrflow.data.loading.dataset import AsrBatchDataset
from asrflow.data.loading.noise import load_noise_cuts
from asrflow.data.loading.planner import BatchItem
from asrflow.data.loading.workers import init_worker, pack_batch, unpack_batch
from asrflow.data.manifests import load_cuts
from asrflow.tokenizer import MODEL_FILE, Tokenizer
from tests.support.corpora import feature_config
from tests.support.repo import repo_config

SEED = 42
SPEEDS = (0.9, 1.0, 1.1)


def augment_config(**changes) -> DataConfig:
    """params.yaml's ``train.data`` section (the augmentation settings users get), with ``changes``."""
    return repo_config(DataConfig, "train.data", **changes)


SPEC = augment_config(spec_augment=True)
NO_SPEC = augment_config(spec_augment=False)


def item(cut_ids, batch_index: int, epoch: int = 1) -> BatchItem:
    """A micro-batch of ``cut_ids`` at ``batch_index`` of ``epoch``."""
    cut_ids = tuple(cut_ids)
    return BatchItem(
        epoch=epoch,
        step_in_epoch=batch_index,
        micro_index=0,
        batch_index=batch_index,
        cut_ids=cut_ids,
        step_cut_ids=cut_ids,
    )


def write_noise(folder, seed: int = 0) -> None:
    """Two noise files at 16 kHz: one shorter and one longer than the test utterances (2 s)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name, seconds in (("hum.wav", 0.7), ("babble.wav", 4.0)):
        t = np.arange(int(seconds * 16000)) / 16000
        audio = 0.2 * np.sin(2 * np.pi * 120 * t) + rng.normal(0.0, 0.1, t.size)
        sf.write(folder / name, audio.astype(np.float32), 16000)


def noise_cuts(folder) -> CutSet:
    """The noise as training loads it (``train.data.noise_dir``)."""
    return load_noise_cuts(folder, 16000)


@pytest.fixture(scope="module")
def stored(yesno_data):
    """Train cuts with stored fbank, the tokenizer and the CMVN statistics."""
    cuts = load_cuts(yesno_data / "fbank", "train").to_eager()
    return cuts, Tokenizer(yesno_data / "lang" / MODEL_FILE), load_cmvn(yesno_data / "fbank" / "cmvn.json")


@pytest.fixture(scope="module")
def raw(yesno_data, tmp_path_factory):
    """Train cuts without features (16 kHz, cut to 2 s to keep extraction quick), and noise cuts."""
    cuts = CutSet.from_cuts(
        cut.resample(16000).truncate(duration=2.0, preserve_id=True)
        for cut in load_cuts(yesno_data / "manifests", "train").subset(first=6)
    )
    folder = tmp_path_factory.mktemp("noise")
    write_noise(folder)
    tokenizer = Tokenizer(yesno_data / "lang" / MODEL_FILE)
    return cuts, tokenizer, load_cmvn(yesno_data / "fbank" / "cmvn.json"), noise_cuts(folder)


def spec_dataset(stored, augment: DataConfig | None = SPEC) -> AsrBatchDataset:
    cuts, tokenizer, mvn = stored
    return AsrBatchDataset(cuts, tokenizer, mvn, seed=SEED, augment=augment)


def otf_dataset(raw, augment: DataConfig | None, noise: bool, reverse_noise: bool = False) -> AsrBatchDataset:
    cuts, tokenizer, mvn, noise_set = raw
    noise_list = list(noise_set)[::-1] if reverse_noise else list(noise_set)
    return AsrBatchDataset(
        cuts,
        tokenizer,
        mvn,
        seed=SEED,
        augment=augment,
        extractor=feature_config().extractor(),
        noise_cuts=CutSet.from_cuts(noise_list) if noise else None,
    )


def ids(cuts, n: int = 3) -> list[str]:
    return [cut.id for cut in cuts][:n]


# ----------------------------------------------------------------------------- SpecAugment
def test_spec_augment_is_the_same_for_the_same_batch(stored):
    batch = item(ids(stored[0]), batch_index=5)
    first = spec_dataset(stored)
    rng_before = torch.random.get_rng_state()
    a = first[batch]["features"]
    b = first[batch]["features"]
    c = spec_dataset(stored)[batch]["features"]  # another instance, as in another worker
    assert torch.equal(a, b) and torch.equal(a, c)
    # The global torch RNG (dropout, initialisation) is left as it was.
    assert torch.equal(torch.random.get_rng_state(), rng_before)


def test_spec_augment_differs_between_batches(stored):
    dataset = spec_dataset(stored)
    cut_ids = ids(stored[0])
    base = dataset[item(cut_ids, batch_index=5)]["features"]
    assert not torch.equal(base, dataset[item(cut_ids, batch_index=6)]["features"])
    assert not torch.equal(base, dataset[item(cut_ids, batch_index=5, epoch=2)]["features"])
    other_seed = AsrBatchDataset(*stored, seed=SEED + 1, augment=SPEC)
    assert not torch.equal(base, other_seed[item(cut_ids, batch_index=5)]["features"])


def test_spec_augment_zeroes_bands_and_nothing_else(stored):
    cut_ids = ids(stored[0])
    plain = spec_dataset(stored, None)[item(cut_ids, 5)]
    masked = spec_dataset(stored)[item(cut_ids, 5)]
    x, y, lens = plain["features"], masked["features"], plain["feature_lens"]  # (N, T, F), (N,)
    assert torch.equal(lens, masked["feature_lens"])
    # Every value is either kept or set to 0 (the normalised mean).
    assert bool(((y == x) | (y == 0)).all())
    assert int((y != x).sum()) > 0
    freq_bands = time_bands = 0
    for n, valid in enumerate(lens.tolist()):
        zero = y[n, :valid] == 0  # (T, F)
        freq_bands += int(zero.all(dim=0).sum())
        time_bands += int(zero.all(dim=1).sum())
        assert torch.equal(y[n, valid:], x[n, valid:])  # padding untouched
    assert freq_bands > 0, "no mel bin was masked over a whole utterance"
    assert time_bands > 0, "no frame was masked over all mel bins"


@pytest.mark.parametrize("augment", [None, augment_config(spec_augment=False)], ids=["none", "disabled"])
def test_without_spec_augment_features_are_the_normalised_input(stored, augment):
    cuts, _, mvn = stored
    cut_ids = ids(cuts)
    expected, expected_lens = collate_features(CutSet.from_cuts(cuts[i] for i in cut_ids))
    batch = spec_dataset(stored, augment)[item(cut_ids, 5)]
    assert torch.equal(batch["feature_lens"], expected_lens)
    assert torch.equal(batch["features"], mvn(expected))


@pytest.mark.slow
def test_data_workers_build_the_same_batches(raw):
    """Two spawned workers (as in training) give exactly what the main process gives."""
    dataset = otf_dataset(raw, augment_config(speed_perturb=True), noise=True)
    cut_ids = ids(raw[0], 6)
    items = [item(cut_ids[i : i + 2], batch_index=i) for i in range(0, 6, 2)]

    def build(workers: int) -> list[dict]:
        loader = torch.utils.data.DataLoader(
            dataset,
            sampler=items,
            batch_size=None,
            collate_fn=pack_batch,
            num_workers=workers,
            multiprocessing_context="spawn" if workers else None,
            worker_init_fn=init_worker if workers else None,
        )
        return [unpack_batch(batch) for batch in loader]

    main, workers = build(0), build(2)
    assert [b["item"] for b in workers] == items
    for a, b in zip(main, workers, strict=True):
        for key in ("features", "feature_lens", "targets", "target_lens", "durations"):
            assert torch.equal(a[key], b[key]), key
            assert a[key].dtype == b[key].dtype == dataset[a["item"]][key].dtype, key


# ----------------------------------------------------------------------------- waveform augmentation
def test_speed_and_noise_are_the_same_for_the_same_batch(raw):
    augment = augment_config(spec_augment=False, speed_perturb=True)
    batch = item(ids(raw[0]), batch_index=3)
    first = otf_dataset(raw, augment, noise=True)
    a, b = first[batch], first[batch]
    # Another instance, given the noise files in another order (as another folder listing might).
    c = otf_dataset(raw, augment, noise=True, reverse_noise=True)[batch]
    for other in (b, c):
        assert torch.equal(a["feature_lens"], other["feature_lens"])
        assert torch.equal(a["features"], other["features"])


def test_speed_perturbation_changes_frames_and_features(raw):
    cuts = raw[0]
    plain = otf_dataset(raw, NO_SPEC, noise=False)
    fast_slow = otf_dataset(raw, augment_config(spec_augment=False, speed_perturb=True), noise=False)
    cut_ids = ids(cuts)

    def frames(cut_id: str, factor: float) -> int:
        cut = cuts[cut_id] if factor == 1.0 else cuts[cut_id].perturb_speed(factor)
        return compute_num_frames(cut.duration, 0.01, 16000)

    changed = 0
    for index in range(4):
        base = plain[item(cut_ids, index)]
        out = fast_slow[item(cut_ids, index)]
        assert base["feature_lens"].tolist() == [frames(i, 1.0) for i in cut_ids]
        for cut_id, length in zip(cut_ids, out["feature_lens"].tolist(), strict=True):
            possible = {factor: frames(cut_id, factor) for factor in SPEEDS}
            assert possible[0.9] > possible[1.0] > possible[1.1]
            assert length in possible.values()
            changed += length != possible[1.0]
        if not torch.equal(base["feature_lens"], out["feature_lens"]):
            assert not torch.equal(base["features"], out["features"])
    assert changed > 0, "no utterance was sped up or slowed down in 4 batches"


def test_noise_mixing_changes_features_not_lengths(raw):
    cut_ids = ids(raw[0])
    base = otf_dataset(raw, NO_SPEC, noise=False)[item(cut_ids, 3)]
    noisy = otf_dataset(raw, NO_SPEC, noise=True)[item(cut_ids, 3)]
    # The noise covers the whole utterance (longer noise cut, shorter noise repeated): same length.
    assert torch.equal(noisy["feature_lens"], base["feature_lens"])
    for n, valid in enumerate(base["feature_lens"].tolist()):
        x, y = base["features"][n, :valid], noisy["features"][n, :valid]  # (T, F)
        assert torch.isfinite(y).all()
        # Changed at the start and at the end of every utterance.
        assert not torch.equal(x[:20], y[:20]) and not torch.equal(x[-20:], y[-20:])
    other = otf_dataset(raw, NO_SPEC, noise=True)[item(cut_ids, 4)]
    assert not torch.equal(noisy["features"], other["features"])  # another batch, other noise/SNR


def test_pad_frames_to_pads_the_frame_axis_with_zeros_and_keeps_the_lengths(stored):
    cuts, tokenizer, mvn = stored
    cut_ids = ids(cuts, 3)
    plain = AsrBatchDataset(cuts, tokenizer, mvn, seed=0)[item(cut_ids, 0)]
    padded = AsrBatchDataset(cuts, tokenizer, mvn, seed=0, pad_frames_to=64)[item(cut_ids, 0)]
    frames = plain["features"].shape[1]
    assert frames % 64 != 0  # the test pads something
    assert padded["features"].shape == (3, frames + (-frames % 64), plain["features"].shape[2])
    assert torch.equal(padded["features"][:, :frames], plain["features"])
    assert not padded["features"][:, frames:].any()
    assert torch.equal(padded["feature_lens"], plain["feature_lens"])
    assert padded["padding_ratio"] > plain["padding_ratio"]


def test_waveform_augment_drops_stored_features_without_a_warning_per_cut(stored, caplog):
    """On-the-fly features over cuts that also reference stored fbank: speed perturbation of the audio,
    the stored features dropped first (Lhotse would otherwise warn once for every cut)."""
    cuts, _, _ = stored
    with caplog.at_level(logging.WARNING):
        perturbed = [
            waveform_augment(cut, random.Random(seed), augment_config(speed_perturb=True), [])
            for seed, cut in enumerate(cuts.subset(first=8))
        ]
    assert not caplog.records
    assert not any(cut.has_features for cut in perturbed)
    assert {round(cut.duration / original.duration, 2) for cut, original in zip(perturbed, cuts, strict=False)} != {1.0}
