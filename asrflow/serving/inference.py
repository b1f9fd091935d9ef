"""Running a model bundle on cuts or audio files: fbank, normalisation, encoder log-probs."""

from __future__ import annotations

import torch
from lhotse import CutSet, Recording
from lhotse.dataset import OnTheFlyFeatures
from lhotse.dataset.collation import collate_features

from asrflow.data.audio import to_mono
from asrflow.errors import AsrflowError
from asrflow.serving.bundle import Bundle


def cut_features(bundle: Bundle, cuts: CutSet) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised fbank (N, T, F) and lengths (N,) for cuts: stored features, else computed."""
    if all(cut.has_features for cut in cuts):
        features, lengths = collate_features(cuts)
    else:
        resampled = CutSet.from_cuts(
            cut.resample(bundle.features.sampling_rate) if cut.sampling_rate != bundle.features.sampling_rate else cut
            for cut in cuts
        )
        features, lengths = OnTheFlyFeatures(bundle.features.extractor())(resampled)
    return bundle.mvn(features), lengths


@torch.no_grad()
def log_probs(bundle: Bundle, features: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Encoder output on the CPU: log-probabilities (N, T', V) and valid lengths (N,) in 40 ms frames. The
    encoder runs on the device its bundle was loaded to (fp32 there too); the decoders read CPU tensors."""
    device = bundle.model.head.weight.device
    scores, out_lens = bundle.model(features.to(device), lengths.to(device))
    return scores.cpu(), out_lens.cpu()


def audio_cut(path: str):
    """A mono cut of a whole audio file (any format and rate Lhotse reads).

    Raises :class:`AsrflowError` naming the file when it cannot be read.
    """
    try:
        recording = Recording.from_file(path)
        cut = to_mono(recording.to_cut())
        if cut.duration <= 0:
            raise ValueError("it holds no audio")
        cut.load_audio()  # fail here, with the file's name, rather than inside a batch
        return cut
    except AsrflowError:
        raise
    except Exception as error:
        raise AsrflowError(f"{path}: cannot read audio ({error}); check the file or convert it to WAV/FLAC") from None
