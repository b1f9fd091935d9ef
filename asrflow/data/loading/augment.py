"""Training-time augmentation: SpecAugment on the features, speed perturbation and noise mixing
on the waveform (on-the-fly features only). Every draw comes from the generator the caller
gives (seeded per batch by :func:`asrflow.data.loading.dataset.batch_seed`), so a batch is the
same whichever data worker builds it and whenever it is built."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch
import torchaudio
from lhotse.cut import Cut

from asrflow.data.loading.config import DataConfig

#: Speed perturbation factors, drawn uniformly per utterance (1.1 plays it faster: fewer frames).
SPEED_FACTORS = (0.9, 1.0, 1.1)


def spec_augment(features: torch.Tensor, lengths: torch.Tensor, config: DataConfig) -> torch.Tensor:
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


def waveform_augment(cut: Cut, rng: random.Random, config: DataConfig | None, noise_cuts: Sequence[Cut]) -> Cut:
    """Speed perturbation (``config.speed_perturb``) and noise mixing (when there is noise) of one
    cut, drawn from ``rng``, for on-the-fly features."""
    if cut.has_features:
        # Features are computed from the audio here; Lhotse would detach stored ones, warning for every cut.
        cut = cut.drop_features()
    if config is not None and config.speed_perturb:
        factor = rng.choice(SPEED_FACTORS)
        if factor != 1.0:
            cut = cut.perturb_speed(factor)
    if noise_cuts:
        cut = mix_noise(cut, noise_cuts, config.noise_snr_db, rng)
    return cut


def mix_noise(cut: Cut, noise_cuts: Sequence[Cut], snr_db: Sequence[float], rng: random.Random) -> Cut:
    """A noise from ``noise_cuts`` over the whole of ``cut`` at an SNR drawn from ``snr_db`` (``[low, high]`` dB);
    same duration as ``cut``.

    A longer noise is cut at a random offset; a shorter one is repeated (as Lhotse's
    ``CutSet.mix`` does), so the utterance is neither lengthened nor only partly noisy.
    """
    noise = rng.choice(noise_cuts)
    low, high = snr_db
    snr = rng.uniform(low, high)
    if noise.duration > cut.duration:
        noise = noise.truncate(offset=rng.uniform(0.0, noise.duration - cut.duration), duration=cut.duration)
    mixed, covered = cut, 0.0
    while covered < cut.duration:
        mixed = mixed.mix(noise, offset_other_by=covered, snr=snr, allow_padding=True)
        covered = round(covered + noise.duration, 8)
    return mixed.truncate(duration=cut.duration)
