"""Transcribing recordings of any length in overlapping windows, with memory that does not grow with the length.

A recording longer than one window (``--chunk-s``, :data:`CHUNK_S`) is never held whole. Windows of ``chunk_s``
seconds start every ``chunk_s - overlap_s`` seconds (a multiple of the encoder's 40 ms output frame); each is read
from the file on its own (``soundfile.read`` with ``start`` and ``frames``), averaged to mono, resampled whole to
the model's rate, turned into fbank, normalised with the bundle's global CMVN and run through the encoder alone.
Of each window's output frames only its central part is kept: the overlap with a neighbour is split in the
middle, each half going to the window whose centre is nearer, so every kept frame had at least ``overlap_s / 2``
seconds of audio on either side. The kept frames, in the recording's timeline, form one stream of CTC
log-probabilities.

The stream is decoded in segments cut at frames whose best token is the blank: within the buffered frames (at
most :data:`SEGMENT_WINDOWS` windows' worth before a cut is looked for) the cut falls in the middle of the
longest run of blank frames in the buffer's second half, so it usually lies in a pause. Greedy decoding of the
segments is exactly greedy decoding of the whole stream (a blank frame separates repeats); beam search (and its
LM) restarts at each cut, which lies between words. Only the current window and the buffered segment are in
memory, so peak memory is bounded by the window length, not the recording's. Word times are placed on each
segment by CTC forced alignment (:mod:`asrflow.decoding.timing`) and shifted by the segment's start, so they are
in the recording's timeline; segments of words are split at pauses over the whole recording.

Files that ``soundfile`` cannot open (formats only Lhotse's other backends read) and files no longer than one
window are decoded whole, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

#: Default window length, seconds (``asrflow transcribe --chunk-s``).
CHUNK_S = 30.0
#: Default overlap of consecutive windows, seconds (``--overlap-s``); each window keeps half of it.
OVERLAP_S = 4.0
#: Windows' worth of kept frames buffered before a cut between segments is looked for.
SEGMENT_WINDOWS = 2


@dataclass(frozen=True, kw_only=True)
class WindowPlan:
    """Where the windows of one recording lie, in its native samples and in encoder output frames."""

    rate: int  # the file's sampling rate, Hz
    samples: int  # the file's length at that rate
    window_frames: int  # output frames per window
    step_frames: int  # output frames between consecutive windows' starts
    frame_s: float  # seconds per output frame

    @property
    def count(self) -> int:
        """Number of windows: the last one reaches the end of the recording."""
        duration = self.samples / self.rate
        window, step = self.window_frames * self.frame_s, self.step_frames * self.frame_s
        return 1 + max(0, int(np.ceil((duration - window) / step - 1e-9)))

    def sample_range(self, index: int) -> tuple[int, int]:
        """``[start, stop)`` native samples of window ``index``."""
        start = round(index * self.step_frames * self.frame_s * self.rate)
        stop = round((index * self.step_frames + self.window_frames) * self.frame_s * self.rate)
        return start, min(stop, self.samples)

    def kept_frames(self, index: int, out_frames: int) -> tuple[int, int]:
        """``[first, stop)`` of window ``index``'s ``out_frames`` output frames kept (local indices)."""
        half = (self.window_frames - self.step_frames) // 2
        first = 0 if index == 0 else half
        stop = out_frames if index == self.count - 1 else min(out_frames, self.step_frames + half)
        return first, stop


def plan_windows(path: str, frame_s: float, chunk_s: float, overlap_s: float) -> WindowPlan | None:
    """The windows of the audio file at ``path``, or ``None`` when it is no longer than ``chunk_s`` or soundfile
    cannot open it (such files are decoded whole)."""
    import soundfile as sf

    if not overlap_s < chunk_s:
        raise ValueError(f"the overlap ({overlap_s} s) must be shorter than the window ({chunk_s} s)")
    try:
        info = sf.info(path)
    except Exception:
        return None
    if info.frames <= 0 or info.frames / info.samplerate <= chunk_s:
        return None
    window_frames = max(2, round(chunk_s / frame_s))
    overlap_frames = 2 * round(overlap_s / frame_s / 2)
    step_frames = max(1, window_frames - overlap_frames)
    return WindowPlan(
        rate=info.samplerate, samples=info.frames, window_frames=window_frames, step_frames=step_frames, frame_s=frame_s
    )


def _window_audio(path: str, plan: WindowPlan, index: int, rate: int) -> torch.Tensor:
    """Window ``index`` of ``path`` as mono float32 ``(1, samples)`` at ``rate`` Hz."""
    import soundfile as sf

    from asrflow.data.audio import native_resampling

    start, stop = plan.sample_range(index)
    audio = sf.read(path, frames=stop - start, start=start, dtype="float32", always_2d=True)[0]  # (S, C)
    mono = torch.from_numpy(audio.mean(axis=1, dtype=np.float32)).unsqueeze(0)  # (1, S)
    if plan.rate != rate:
        from lhotse.augmentation.torchaudio import Resample

        with native_resampling():
            mono = torch.as_tensor(Resample(plan.rate, rate)(mono.numpy(), plan.rate))
    return mono


def window_scores(bundle, path: str, plan: WindowPlan) -> Iterator[torch.Tensor]:
    """The kept log-probabilities ``(T_k, V)`` of each window of ``path`` in turn; concatenated, they are the
    recording's frames in order."""
    from asrflow.serving.inference import log_probs

    extractor = bundle.features.extractor()
    rate = bundle.features.sampling_rate
    for index in range(plan.count):
        audio = _window_audio(path, plan, index, rate)
        features = torch.as_tensor(extractor.extract(audio.numpy(), rate)).unsqueeze(0)  # (1, T, F)
        features = bundle.mvn(features)
        scores, out_lens = log_probs(bundle, features, torch.tensor([features.shape[1]]))  # (1, T', V), (1,)
        first, stop = plan.kept_frames(index, int(out_lens[0]))
        yield scores[0, first:stop]


def blank_cut(scores: torch.Tensor, blank: int) -> int | None:
    """Where to cut ``scores`` ``(T, V)`` between two segments: the frame after the middle of the longest run of
    frames whose best token is ``blank`` in the second half (else anywhere); ``None`` without a blank frame."""
    is_blank = np.r_[0, (scores.argmax(dim=-1) == blank).numpy().astype(np.int8), 0]
    edges = np.flatnonzero(np.diff(is_blank)).reshape(-1, 2)  # [start, stop) of each run of blank frames
    if len(edges) == 0:
        return None
    middles = (edges[:, 0] + edges[:, 1] - 1) // 2
    late = middles >= len(scores) // 2
    candidates = edges[late] if late.any() else edges
    start, stop = candidates[int(np.argmax(candidates[:, 1] - candidates[:, 0]))]
    return int((start + stop - 1) // 2 + 1)


def segment_scores(windows: Iterator[torch.Tensor], limit: int, blank: int) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first frame, log-probs (T, V))`` of consecutive segments of the stream ``windows``, each cut by
    :func:`blank_cut` once over ``limit`` frames are buffered (or at the end)."""
    buffered: list[torch.Tensor] = []
    start = 0
    for scores in windows:
        buffered.append(scores)
        if sum(len(part) for part in buffered) < limit:
            continue
        joined = torch.cat(buffered)
        cut = blank_cut(joined, blank)
        if cut is None or cut >= len(joined):
            buffered = [joined]
            continue
        yield start, joined[:cut]
        start += cut
        buffered = [joined[cut:]]
    if buffered and sum(len(part) for part in buffered):
        yield start, torch.cat(buffered)


def chunked_transcript(
    bundle,
    path: str,
    plan: WindowPlan,
    decode: Callable,
    *,
    max_pause_s: float | None = None,
) -> str | dict:
    """The transcript of the long file ``path`` decoded window by window (see the module): its text, or with
    ``max_pause_s`` set ``{text, words, segments}`` with times in the recording's timeline."""
    from asrflow.decoding.timing import segments_of, token_spans, word_times
    from asrflow.tokenizer import BLANK_ID

    tokenizer = bundle.tokenizer
    limit = SEGMENT_WINDOWS * plan.step_frames
    texts: list[str] = []
    words: list[dict] = []
    for start, scores in segment_scores(window_scores(bundle, path, plan), limit, BLANK_ID):
        ids = decode(scores.unsqueeze(0), torch.tensor([len(scores)]))[0]
        texts.append(" ".join(tokenizer.decode(ids).split()))
        if max_pause_s is not None:
            spans = [(token, first + start, stop + start) for token, first, stop in token_spans(scores, ids, BLANK_ID)]
            words += word_times(spans, tokenizer.pieces, plan.frame_s, tokenizer.decode)
    text = " ".join(part for part in texts if part)
    if max_pause_s is None:
        return text
    return {"text": text, "words": words, "segments": segments_of(words, max_pause_s)}
