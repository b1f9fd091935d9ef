"""Running a model bundle on cuts or audio files: reading audio, fbank, normalisation, encoder log-probs,
transcripts. ``asrflow transcribe`` and the MLflow pyfunc read and decode audio files with these."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from lhotse import CutSet, Recording
from lhotse.dataset import OnTheFlyFeatures
from lhotse.dataset.collation import collate_features

from asrflow.data.audio import native_resampling, to_mono
from asrflow.errors import AsrflowError, first_line
from asrflow.serving.bundle import Bundle

#: Shorter audio cannot fill the encoder's two stride-2 convolutions; it is refused, naming the file.
MIN_DURATION_S = 0.1


def cut_features(bundle: Bundle, cuts: CutSet) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised fbank (N, T, F) and lengths (N,) for cuts: stored features, else computed."""
    if all(cut.has_features for cut in cuts):
        features, lengths = collate_features(cuts)
    else:
        resampled = CutSet.from_cuts(
            cut.resample(bundle.features.sampling_rate) if cut.sampling_rate != bundle.features.sampling_rate else cut
            for cut in cuts
        )
        with native_resampling():
            features, lengths = OnTheFlyFeatures(bundle.features.extractor())(resampled)
    return bundle.mvn(features), lengths


@torch.no_grad()
def log_probs(bundle: Bundle, features: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Encoder output on the CPU: log-probabilities (N, T', V) and valid lengths (N,) in 40 ms frames. The
    encoder runs on the device its bundle was loaded to (fp32 there too); the decoders read CPU tensors."""
    device = bundle.model.head.weight.device
    scores, out_lens = bundle.model(features.to(device), lengths.to(device))
    return scores.cpu(), out_lens.cpu()


def transcripts(bundle: Bundle, cuts: list, decode: Callable) -> list[str]:
    """The transcript of each cut, in order, decoded together in one batch with ``decode`` (a
    :data:`asrflow.decoding.ctc.Decoder`)."""
    features, lengths = cut_features(bundle, CutSet.from_cuts(cuts))  # (N, T, F), (N,)
    scores, out_lens = log_probs(bundle, features, lengths)  # (N, T', V), (N,)
    return [" ".join(bundle.tokenizer.decode(ids).split()) for ids in decode(scores, out_lens)]


def timed_transcripts(bundle: Bundle, cuts: list, decode: Callable, max_pause_s: float | None = None) -> list[dict]:
    """Per cut, in order: ``{text, words: [{word, start, end}], segments: [{start, end, text}]}`` (seconds), the
    words placed by CTC forced alignment of the decoded tokens (:mod:`asrflow.decoding.timing`); segments split
    at pauses over ``max_pause_s`` (default :data:`asrflow.decoding.timing.MAX_PAUSE_S`)."""
    from asrflow.decoding.timing import MAX_PAUSE_S, output_frame_seconds, timed_transcript
    from asrflow.tokenizer import BLANK_ID

    features, lengths = cut_features(bundle, CutSet.from_cuts(cuts))  # (N, T, F), (N,)
    scores, out_lens = log_probs(bundle, features, lengths)  # (N, T', V), (N,)
    tokenizer = bundle.tokenizer
    frame_s = output_frame_seconds(bundle.features.frame_shift_s)
    return [
        timed_transcript(
            scores[n, : int(out_lens[n])],
            ids,
            pieces=tokenizer.pieces,
            frame_s=frame_s,
            text=" ".join(tokenizer.decode(ids).split()),
            blank=BLANK_ID,
            text_of=tokenizer.decode,
            max_pause_s=MAX_PAUSE_S if max_pause_s is None else max_pause_s,
        )
        for n, ids in enumerate(decode(scores, out_lens))
    ]


def _not_audio(path: str) -> str | None:
    """Why ``path`` is certainly not an audio file (checked before Lhotse opens it, whose reports are long)."""
    file = Path(path)
    if not file.exists():
        return "no such file; check the path (a relative one is read from the current folder)"
    if file.is_dir():
        return "is a folder, not an audio file; name the audio files in it"
    if file.stat().st_size == 0:
        return "the file is empty (0 bytes); write it again or leave it out"
    return None


def _cannot_read(path: str, error: Exception) -> str:
    """``error`` (often Lhotse's multi-line report of every audio backend tried) as one line naming ``path``."""
    reason = re.search(r"LibsndfileError'>: Error opening .*?: (.+)", str(error))
    reason = reason.group(1).strip().rstrip(".") if reason else first_line(error)
    return f"{path}: cannot read audio ({reason}); check the file or convert it to WAV/FLAC"


def audio_cut(path: str):
    """A mono cut of a whole audio file (any format and rate Lhotse reads), its samples checked readable.

    Raises:
        AsrflowError: one line naming the file, why, and what to do: it is missing, a folder, empty, not
            audio Lhotse reads, or shorter than :data:`MIN_DURATION_S`.
    """
    reason = _not_audio(path)
    if reason:
        raise AsrflowError(f"{path}: {reason}")
    try:
        cut = to_mono(Recording.from_file(path).to_cut())
        if cut.duration <= 0:
            raise ValueError("it holds no audio")
        cut.load_audio()  # fail here, with the file's name, rather than inside a batch
    except Exception as error:
        raise AsrflowError(_cannot_read(path, error)) from None
    if cut.duration < MIN_DURATION_S:
        raise AsrflowError(
            f"{path}: too short to transcribe ({cut.duration:.3f} s of audio; at least {MIN_DURATION_S} s is "
            "needed); leave it out or pad it"
        )
    return cut


def read_audio(paths: Sequence[str]) -> Iterator[tuple[object | None, str | None]]:
    """Per path, in order: ``(cut, None)`` when :func:`audio_cut` reads it, else ``(None, its one-line message)``.
    Cut ids are ``input-<index>``: files of the same name in different folders stay apart."""
    for index, path in enumerate(paths):
        try:
            yield audio_cut(path).with_id(f"input-{index}"), None
        except AsrflowError as error:
            yield None, str(error)
