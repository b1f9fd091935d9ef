"""Audio helpers shared by the features stage, noise loading and inference."""

from __future__ import annotations


def to_mono(cut):
    """A one-channel cut: the average of the cut's channels (Lhotse's downmix sums them).

    Averaging keeps the level of a file whose channels carry the same signal, so a stereo
    copy of a recording gives the same features as the mono original.
    """
    channels = cut.num_channels or 1
    if channels <= 1:
        return cut
    return cut.to_mono(mono_downmix=True).perturb_volume(1.0 / channels)


def to_mono_at_rate(cut, sampling_rate: int):
    """:func:`to_mono`, then resampled to ``sampling_rate`` (Hz) when it has another rate."""
    cut = to_mono(cut)
    if cut.sampling_rate != sampling_rate:
        cut = cut.resample(sampling_rate)
    return cut
