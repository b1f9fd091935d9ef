"""Transcripts with times as SubRip (``.srt``) and WebVTT (``.vtt``) subtitles, and as JSON.

Written by hand: no subtitle library is a dependency, and the two formats as used here
are a few lines each (numbered cues with ``HH:MM:SS,mmm --> HH:MM:SS,mmm`` for SubRip; a
``WEBVTT`` header and ``HH:MM:SS.mmm`` cues for WebVTT), not worth a new dependency.
One cue per segment (:func:`asrflow.decoding.timing.segments_of`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

#: What ``asrflow transcribe --output`` writes, and the file suffix of each with ``--out``.
OUTPUT_SUFFIXES = {"text": ".txt", "json": ".json", "srt": ".srt", "vtt": ".vtt"}


def subtitle_timestamp(seconds: float, separator: str = ",") -> str:
    """``HH:MM:SS<separator>mmm`` of ``seconds`` (``,`` for SubRip, ``.`` for WebVTT); negative times are 0."""
    millis = max(0, round(seconds * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"


def to_srt(segments: Sequence[dict]) -> str:
    """SubRip text: one numbered cue per ``{start, end, text}`` segment, cues separated by a blank line."""
    cues = [
        f"{number}\n{subtitle_timestamp(seg['start'])} --> {subtitle_timestamp(seg['end'])}\n{seg['text']}\n"
        for number, seg in enumerate(segments, start=1)
    ]
    return "\n".join(cues)


def to_vtt(segments: Sequence[dict]) -> str:
    """WebVTT text: the ``WEBVTT`` header, then one cue per ``{start, end, text}`` segment."""
    cues = [
        f"{subtitle_timestamp(seg['start'], '.')} --> {subtitle_timestamp(seg['end'], '.')}\n{seg['text']}\n"
        for seg in segments
    ]
    return "\n".join(["WEBVTT\n", *cues])


def render_transcript(transcript: dict, output: str, path: str) -> str:
    """``transcript`` (``{text, words, segments}``) of audio ``path`` as ``output`` (a key of
    :data:`OUTPUT_SUFFIXES`): the text line, one JSON object (with ``path``), or subtitles."""
    if output == "text":
        return transcript["text"] + "\n"
    if output == "json":
        return json.dumps({"path": path, **transcript}, ensure_ascii=False) + "\n"
    if output == "srt":
        return to_srt(transcript["segments"])
    if output == "vtt":
        return to_vtt(transcript["segments"])
    raise ValueError(f"unknown output {output!r}; use one of {', '.join(OUTPUT_SUFFIXES)}")
