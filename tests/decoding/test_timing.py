"""Word and segment times from CTC alignments on hand-built log-probabilities (known frames -> known seconds),
and the SubRip / WebVTT writers."""

from __future__ import annotations

import pytest
import torch

from asrflow.decoding import greedy_decode, prefix_beam_search
from asrflow.decoding.timing import output_frame_seconds, segments_of, timed_transcript, token_spans, word_times
from asrflow.serving.subtitles import render_transcript, subtitle_timestamp, to_srt, to_vtt

WORD_TOKENS = ["<blk>", "<unk>", "\u2581YES", "\u2581NO"]
CHAR_TOKENS = ["<blk>", "<unk>", "\u2581", "Y", "E", "S", "N", "O", "\u2581N"]
FRAME_S = 0.04


def peaked(best: list[int], vocab: int, p: float = 0.9) -> torch.Tensor:
    """``(T, vocab)`` log-probs whose frame ``t`` gives ``best[t]`` probability ``p``."""
    probs = torch.full((len(best), vocab), (1 - p) / (vocab - 1))
    probs[torch.arange(len(best)), torch.tensor(best)] = p
    return probs.log()


def test_the_output_frame_is_the_shift_times_the_subsampling():
    assert output_frame_seconds(0.01) == pytest.approx(0.04)
    assert output_frame_seconds(0.02) == pytest.approx(0.08)


def test_spans_are_the_runs_of_the_argmax_path():
    #       frame: 0  1  2  3  4  5  6  7  8  9
    frames = [0, 2, 2, 2, 0, 0, 3, 0, 3, 3]
    log_probs = peaked(frames, vocab=4)
    ids = greedy_decode(log_probs.unsqueeze(0), torch.tensor([10]))[0]
    assert ids == [2, 3, 3]
    assert token_spans(log_probs, ids) == [(2, 1, 4), (3, 6, 7), (3, 8, 10)]
    assert token_spans(log_probs, []) == []


def test_beam_search_tokens_are_aligned_where_they_are_likely():
    frames = [0, 0, 0, 3, 3, 0, 0, 2, 0, 0, 0, 0]
    log_probs = peaked(frames, vocab=4)
    ids = prefix_beam_search(log_probs.unsqueeze(0), torch.tensor([12]), beam_size=4)[0]
    assert ids == [3, 2]
    assert token_spans(log_probs, ids) == [(3, 3, 5), (2, 7, 8)]


def test_tokens_that_cannot_fit_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        token_spans(peaked([0, 2], vocab=4), [2, 2, 2])


def test_word_times_in_seconds_from_frames():
    spans = [(2, 1, 4), (3, 6, 7), (3, 8, 10)]
    assert word_times(spans, WORD_TOKENS, FRAME_S) == [
        {"word": "YES", "start": 0.04, "end": 0.16},
        {"word": "NO", "start": 0.24, "end": 0.28},
        {"word": "NO", "start": 0.32, "end": 0.4},
    ]


def test_a_word_of_several_pieces_starts_at_its_first_and_ends_at_its_last():
    # "▁ Y E S ▁N O": two words; a lone ▁ piece begins a word too
    spans = [(2, 5, 6), (3, 6, 8), (4, 9, 10), (5, 12, 15), (8, 40, 42), (7, 43, 50)]
    words = word_times(spans, CHAR_TOKENS, FRAME_S)
    assert words == [{"word": "YES", "start": 0.2, "end": 0.6}, {"word": "NO", "start": 1.6, "end": 2.0}]
    assert word_times(spans, CHAR_TOKENS, FRAME_S, text_of=lambda ids: "w" * len(ids))[0]["word"] == "wwww"
    # pieces before the first ▁ still form a word; a word that decodes to nothing is left out
    assert word_times([(3, 0, 1), (2, 4, 5)], CHAR_TOKENS, FRAME_S) == [{"word": "Y", "start": 0.0, "end": 0.04}]


def test_times_are_rounded_to_the_millisecond():
    assert word_times([(2, 3, 7)], WORD_TOKENS, 1 / 30) == [{"word": "YES", "start": 0.1, "end": 0.233}]


def test_segments_split_at_long_pauses_only():
    words = [
        {"word": "YES", "start": 0.1, "end": 0.5},
        {"word": "NO", "start": 0.9, "end": 1.2},  # 0.4 s pause: same segment
        {"word": "NO", "start": 1.8, "end": 2.0},  # 0.6 s pause: a new one
    ]
    assert segments_of(words, max_pause_s=0.5) == [
        {"start": 0.1, "end": 1.2, "text": "YES NO"},
        {"start": 1.8, "end": 2.0, "text": "NO"},
    ]
    assert segments_of(words, max_pause_s=1.0) == [{"start": 0.1, "end": 2.0, "text": "YES NO NO"}]
    assert segments_of([]) == []


def test_timed_transcript_end_to_end_on_known_frames():
    frames = [0] * 5 + [2, 2, 2] + [0] * 5 + [3, 3] + [0] * 20 + [3] + [0] * 3
    log_probs = peaked(frames, vocab=4)
    ids = greedy_decode(log_probs.unsqueeze(0), torch.tensor([len(frames)]))[0]
    result = timed_transcript(log_probs, ids, pieces=WORD_TOKENS, frame_s=FRAME_S, text="YES NO NO")
    assert result["words"] == [
        {"word": "YES", "start": 0.2, "end": 0.32},
        {"word": "NO", "start": 0.52, "end": 0.6},
        {"word": "NO", "start": 1.4, "end": 1.44},
    ]
    assert result["segments"] == [
        {"start": 0.2, "end": 0.6, "text": "YES NO"},
        {"start": 1.4, "end": 1.44, "text": "NO"},
    ]
    assert result["text"] == "YES NO NO"


@pytest.mark.parametrize(
    ("seconds", "srt", "vtt"),
    [
        (0.0, "00:00:00,000", "00:00:00.000"),
        (1.2345, "00:00:01,234", "00:00:01.234"),  # as a float, 1.2345 is 1.23449...: 1234 ms
        (61.5, "00:01:01,500", "00:01:01.500"),
        (3723.004, "01:02:03,004", "01:02:03.004"),
        (-0.01, "00:00:00,000", "00:00:00.000"),
    ],
)
def test_timestamps(seconds, srt, vtt):
    assert subtitle_timestamp(seconds) == srt
    assert subtitle_timestamp(seconds, ".") == vtt


SEGMENTS = [{"start": 0.2, "end": 1.25, "text": "YES NO"}, {"start": 62.0, "end": 63.5, "text": "NO"}]


def test_srt_cues_are_numbered_and_separated():
    assert to_srt(SEGMENTS) == ("1\n00:00:00,200 --> 00:00:01,250\nYES NO\n\n2\n00:01:02,000 --> 00:01:03,500\nNO\n")
    assert to_srt([]) == ""


def test_vtt_has_its_header_and_dotted_times():
    assert to_vtt(SEGMENTS) == "WEBVTT\n\n00:00:00.200 --> 00:00:01.250\nYES NO\n\n00:01:02.000 --> 00:01:03.500\nNO\n"
    assert to_vtt([]) == "WEBVTT\n"


def test_render_each_output():
    transcript = {"text": "YES NO", "words": [], "segments": SEGMENTS[:1]}
    assert render_transcript(transcript, "text", "a.wav") == "YES NO\n"
    assert render_transcript(transcript, "json", "a.wav").startswith('{"path": "a.wav", "text": "YES NO"')
    assert render_transcript(transcript, "srt", "a.wav") == to_srt(SEGMENTS[:1])
    assert render_transcript(transcript, "vtt", "a.wav") == to_vtt(SEGMENTS[:1])
    with pytest.raises(ValueError, match="unknown output"):
        render_transcript(transcript, "ass", "a.wav")
