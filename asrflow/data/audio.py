"""Audio helpers shared by the features stage, noise loading and inference."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from lhotse.augmentation.torchaudio import Resample


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch at one intra-op thread inside the block, the previous count after it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextmanager
def native_resampling() -> Iterator[None]:
    """A block in which audio is resampled without oneDNN, at one torch thread; wrap every place that loads
    audio at another rate (or speed-perturbs it).

    Lhotse resamples with a strided 1-D convolution over the whole file. On the CPU, PyTorch gives that to
    oneDNN, which builds (and caches, with its buffers) a primitive for every input length it meets: files
    all differ in length, so a process that resamples a corpus grows with the number of files, and runs
    slower than PyTorch's own convolution, which keeps nothing (bench/RESULTS.md#resampling). PyTorch's own
    kernels can round differently at another thread count, so the block runs at one, as data workers do: the
    same audio gives the same samples in a worker and in the training process.
    Only the block is affected: a model run beside it keeps oneDNN and its threads.
    """
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        with one_torch_thread():
            yield
    finally:
        torch.backends.mkldnn.enabled = enabled


def to_mono(cut):
    """A one-channel cut: the average of the cut's channels (Lhotse's downmix sums them).

    Averaging keeps the level of a file whose channels carry the same signal, so a stereo
    copy of a recording gives the same features as the mono original. The downmixed audio
    is held in memory (a cut that cannot be written to a manifest): for manifests, keep the
    cut as it is and downmix its samples with :func:`mono_samples`.
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


def mono_samples(cut, sampling_rate: int) -> np.ndarray:
    """The audio of ``cut`` as one channel at ``sampling_rate`` Hz: float32, shape ``(1, samples)``.

    Channels are averaged (as :func:`to_mono` does) before resampling, so a stereo file is
    resampled once, with the resampler Lhotse uses for ``cut.resample(sampling_rate)``.
    """
    audio = cut.load_audio()  # (channels, samples) at cut.sampling_rate
    if audio.ndim == 1:
        audio = audio[np.newaxis]
    if audio.shape[0] > 1:
        audio = audio.mean(axis=0, keepdims=True, dtype=np.float32)
    if cut.sampling_rate != sampling_rate:
        with native_resampling():
            audio = Resample(cut.sampling_rate, sampling_rate)(audio)
    return np.ascontiguousarray(audio, dtype=np.float32)
