"""Word and segment times from a CTC alignment.

A decoder (:mod:`asrflow.decoding.ctc`) gives the token ids of an utterance; this module
places them in time. :func:`token_spans` aligns those ids to the encoder's frames with
CTC forced alignment (Viterbi, ``torchaudio.functional.forced_align``): the most probable
frame-by-frame path that collapses to exactly those ids. For the greedy decoder that path
is the per-frame argmax itself; for beam search (with or without an LM) it places the
chosen hypothesis' tokens, so every decoder gets times the same way. torchaudio's
``ctc_decoder`` reports one frame per token (``timesteps``), where the alignment gives a
token's whole run of frames, which is what a word's end needs.

Each token spans ``[start, end)`` frames: the first frame the path emits it and the frame
after its run (repeats of it before the next blank or other token). A word begins at a
piece starting with ``▁`` (SentencePiece's word boundary) and runs to its last piece's
end. Frame ``t`` is at ``t * frame_s`` seconds, ``frame_s`` being the feature frame shift
times the encoder's subsampling (:func:`output_frame_seconds`; 40 ms for 10 ms fbank).
Segments split the words at pauses longer than ``max_pause_s``. Times are seconds,
rounded to the millisecond.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from asrflow.decoding.ctc import WORD_BOUNDARY

#: A pause between two words longer than this (seconds) starts a new segment.
MAX_PAUSE_S = 0.5


def output_frame_seconds(frame_shift_s: float) -> float:
    """Seconds per encoder output frame: ``frame_shift_s`` times the encoder's subsampling factor, read off
    :func:`asrflow.model.conformer_ctc.subsampled_lengths` on a long input."""
    from asrflow.model.conformer_ctc import subsampled_lengths

    frames = 100_000
    factor = round(frames / int(subsampled_lengths(torch.tensor(frames))))
    return frame_shift_s * factor


def token_spans(log_probs: Tensor, ids: Sequence[int], blank: int = 0) -> list[tuple[int, int, int]]:
    """``(token, start frame, end frame)`` of each of ``ids`` on one utterance's ``log_probs`` ``(T, V)``
    (valid frames only); ``end`` is exclusive. Empty for no ids.

    Raises:
        ValueError: the ids cannot be aligned to ``T`` frames (too many tokens and repeats for them).
    """
    if not ids:
        return []
    from torchaudio.functional import forced_align

    frames = log_probs.detach().to("cpu", torch.float32).unsqueeze(0)  # (1, T, V)
    targets = torch.tensor([list(ids)], dtype=torch.int32)  # (1, L)
    try:
        path, _ = forced_align(frames, targets, blank=blank)  # (1, T)
    except RuntimeError as error:
        raise ValueError(f"{len(ids)} tokens do not fit in {frames.shape[1]} frames: {error}") from None
    return _runs(path[0].tolist(), list(ids), blank)


def _runs(path: list[int], ids: list[int], blank: int) -> list[tuple[int, int, int]]:
    """The span of each of ``ids`` along a CTC ``path`` (one label per frame) that collapses to them."""
    spans: list[tuple[int, int, int]] = []
    previous = blank
    for frame, label in enumerate(path):
        if label != blank and label == previous:
            token, start, _ = spans[-1]
            spans[-1] = (token, start, frame + 1)
        elif label != blank:
            spans.append((label, frame, frame + 1))
        previous = label
    if [token for token, _, _ in spans] != ids:
        raise ValueError(f"the alignment path gives tokens {[t for t, _, _ in spans]}, not {ids}")
    return spans


def word_times(
    spans: Sequence[tuple[int, int, int]],
    pieces: Sequence[str],
    frame_s: float,
    text_of: Callable[[list[int]], str] | None = None,
) -> list[dict]:
    """``[{word, start, end}]`` (seconds) from :func:`token_spans`.

    A piece starting with ``▁`` begins a word (so does the first piece); ``text_of`` turns a word's ids into
    its text (e.g. :meth:`asrflow.tokenizer.Tokenizer.decode`), by default its pieces joined without ``▁``.
    """
    groups: list[list[tuple[int, int, int]]] = []
    for span in spans:
        if not groups or pieces[span[0]].startswith(WORD_BOUNDARY):
            groups.append([])
        groups[-1].append(span)
    words = []
    for group in groups:
        ids = [token for token, _, _ in group]
        text = text_of(ids) if text_of else "".join(pieces[i] for i in ids).replace(WORD_BOUNDARY, "")
        text = " ".join(text.split())
        if not text:  # a lone "▁" piece, or one that decodes to nothing
            continue
        words.append({"word": text, "start": round(group[0][1] * frame_s, 3), "end": round(group[-1][2] * frame_s, 3)})
    return words


def segments_of(words: Sequence[dict], max_pause_s: float = MAX_PAUSE_S) -> list[dict]:
    """``[{start, end, text}]``: consecutive words, split where the pause between one word's end and the next
    one's start exceeds ``max_pause_s``. No words, no segments."""
    segments: list[dict] = []
    for word in words:
        if segments and word["start"] - segments[-1]["end"] <= max_pause_s:
            segments[-1]["end"] = word["end"]
            segments[-1]["text"] += " " + word["word"]
        else:
            segments.append({"start": word["start"], "end": word["end"], "text": word["word"]})
    return segments


def timed_transcript(
    log_probs: Tensor,
    ids: Sequence[int],
    *,
    pieces: Sequence[str],
    frame_s: float,
    text: str,
    blank: int = 0,
    text_of: Callable[[list[int]], str] | None = None,
    max_pause_s: float = MAX_PAUSE_S,
) -> dict:
    """``{text, words, segments}`` of one utterance: its decoded ``ids`` on its valid ``log_probs`` ``(T, V)``,
    ``text`` being the transcript the caller already made of them."""
    words = word_times(token_spans(log_probs, ids, blank), pieces, frame_s, text_of)
    return {"text": text, "words": words, "segments": segments_of(words, max_pause_s)}
