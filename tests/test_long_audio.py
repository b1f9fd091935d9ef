"""``asrflow transcribe`` on recordings longer than one window (issue 58 item 1): decoded in overlapping windows
whose seams are resolved on the CTC frames (:mod:`asrflow.serving.chunking`).

The long recording joins yesno test files (8 words each, about 6 s) with a second of low noise between them.
With ``--chunk-s 10`` windows start every 8 s, so seams fall inside words; the chunked transcript's WER against
the joined references must stay within 0.5 points of decoding the same audio whole.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from asrflow.decoding.ctc import greedy_decode
from asrflow.serving import chunking
from asrflow.serving.cli import CHUNK_S, OVERLAP_S, main
from tests.support.trained_model import split_files

FILES = 20
GAP_S = 1.0
#: Small windows so that many seams fall inside words.
CHUNK = ["--chunk-s", "10", "--overlap-s", "2"]
#: A window longer than the recording: decoded whole, as before chunking.
WHOLE = ["--chunk-s", "100000"]
#: WER points chunked decoding may lose against whole decoding (issue 58).
MAX_WER_LOSS = 0.5
#: A seam this close (seconds) to a word's aligned span falls in the word's sound.
NEAR_WORD_S = 0.2


@pytest.fixture(scope="module")
def long_audio(yesno_model, yesno_data, tmp_path_factory) -> tuple[Path, Path, str, float]:
    """``(model, long.wav, joined reference, duration s)``."""
    folder = tmp_path_factory.mktemp("long")
    shutil.copy(yesno_model, folder / "model.pt")
    rng = np.random.default_rng(0)
    pieces, refs, rate = [], [], 8000
    for path, text in split_files(yesno_data)[:FILES]:
        audio, rate = sf.read(path, dtype="float32")
        if pieces:
            pieces.append(rng.normal(0, audio[: rate // 2].std(), int(GAP_S * rate)).astype(np.float32))
        pieces.append(audio)
        refs.append(text)
    audio = np.concatenate(pieces)
    sf.write(folder / "long.wav", audio, rate)
    return folder / "model.pt", folder / "long.wav", " ".join(refs), len(audio) / rate


def _transcribe(capsys, model: Path, audio: Path, *options: str) -> dict:
    code = main(["transcribe", "--model", str(model), "--output", "json", *options, str(audio)])
    out, err = capsys.readouterr()
    assert code == 0, err
    (line,) = out.splitlines()
    return json.loads(line)


def _wer(ref: str, hyp: str) -> float:
    """WER in points of ``hyp`` against ``ref``, by asrflow's own scorer (kaldialign's alignment)."""
    from asrflow.evaluation.metrics import score_corpus

    return 100.0 * score_corpus({"recording": ref}, {"recording": hyp}).wer


@pytest.mark.parametrize("decoder", ["greedy", "beam"])
def test_chunked_wer_is_within_half_a_point_of_whole(long_audio, capsys, decoder):
    model, audio, ref, duration = long_audio
    whole = _transcribe(capsys, model, audio, "--decoder", decoder, *WHOLE)
    chunked = _transcribe(capsys, model, audio, "--decoder", decoder, *CHUNK)
    # the seams (every 8 s, the kept halves meeting 1 s into each overlap) fall in words: CTC places a word on
    # its spike (a few frames), so a seam within NEAR_WORD_S of its aligned span is taken to cut its sound
    seams = [9.0 + 8.0 * k for k in range(int(duration // 8))]
    near = [s for s in seams if any(w["start"] - NEAR_WORD_S < s < w["end"] + NEAR_WORD_S for w in whole["words"])]
    assert len(near) >= 5, (seams, whole["words"])
    whole_wer, chunked_wer = _wer(ref, whole["text"]), _wer(ref, chunked["text"])
    print(f"{decoder}: WER whole {whole_wer:.2f}, chunked {chunked_wer:.2f}, {len(near)} seams in words")
    assert whole_wer < 20, whole["text"]  # the model works: the comparison means something
    assert chunked_wer <= whole_wer + MAX_WER_LOSS, (chunked["text"], whole["text"])


def test_word_times_are_in_the_recordings_timeline(long_audio, capsys):
    model, audio, ref, duration = long_audio
    whole = _transcribe(capsys, model, audio, *WHOLE)
    chunked = _transcribe(capsys, model, audio, *CHUNK)
    words = chunked["words"]
    assert " ".join(word["word"] for word in words) == chunked["text"]
    starts = [word["start"] for word in words]
    assert starts == sorted(starts) and all(w["start"] < w["end"] for w in words)
    assert all(a["end"] <= b["start"] for a, b in zip(words, words[1:], strict=False))
    assert starts[0] >= 0 and words[-1]["end"] <= duration + 0.04
    assert words[-1]["end"] > duration - 8  # the last window's words are at the end, not near its own start
    # the same words at the same times as decoding whole: each within 0.1 s
    assert [w["word"] for w in words] == [w["word"] for w in whole["words"]]
    errors = [abs(a["start"] - b["start"]) for a, b in zip(words, whole["words"], strict=True)]
    assert max(errors) < 0.1, errors
    # one segment per joined file (the gaps are longer than the segments' pause)
    assert len(chunked["segments"]) == len(whole["segments"])


def test_a_file_shorter_than_a_window_gives_todays_transcript(long_audio, yesno_data, capsys):
    model, _, _, _ = long_audio
    short = split_files(yesno_data)[0][0]
    assert sf.info(str(short)).duration < CHUNK_S
    default = _transcribe(capsys, model, short)
    chunk_none = _transcribe(capsys, model, short, *WHOLE)
    assert default == chunk_none
    assert chunking.plan_windows(str(short), 0.04, CHUNK_S, OVERLAP_S) is None
    # and a window shorter than the file does chunk it
    assert chunking.plan_windows(str(short), 0.04, 2.0, 0.5) is not None


def test_a_long_file_is_never_read_whole(long_audio, capsys, monkeypatch):
    model, audio, _, duration = long_audio
    reads: list[int] = []
    real_read = sf.read

    def counted(path, frames=-1, start=0, **kwargs):
        reads.append(frames)
        return real_read(path, frames=frames, start=start, **kwargs)

    monkeypatch.setattr(sf, "read", counted)
    monkeypatch.setattr("lhotse.Recording.from_file", None)  # nor opened by Lhotse (which loads it whole)
    _transcribe(capsys, model, audio, *CHUNK)
    assert len(reads) >= duration // 8
    assert all(0 < frames <= 10 * 8000 for frames in reads), reads


def test_kept_frames_tile_the_recording():
    plan = chunking.WindowPlan(rate=8000, samples=8000 * 95, window_frames=250, step_frames=200, frame_s=0.04)
    assert plan.count == 12  # 10 s windows every 8 s: the twelfth starts at 88 s and reaches 95 s
    plan = chunking.WindowPlan(rate=8000, samples=8000 * 41, window_frames=250, step_frames=200, frame_s=0.04)
    total = 41 * 25
    kept = []
    for index in range(plan.count):
        start, stop = plan.sample_range(index)
        out_frames = (stop - start) // 320
        first, last = plan.kept_frames(index, out_frames)
        kept += range(index * plan.step_frames + first, index * plan.step_frames + last)
    assert kept == list(range(total))
    assert plan.sample_range(plan.count - 1)[1] == plan.samples


def test_segments_decode_greedily_as_the_whole_stream():
    torch.manual_seed(0)
    frames = torch.randn(3000, 6) * 2
    frames[::7, 0] += 6  # blanks often enough to cut at
    scores = frames.log_softmax(-1)
    windows = iter(scores.split(137))
    ids: list[int] = []
    starts = []
    for start, part in chunking.segment_scores(windows, 400, blank=0):
        starts.append(start)
        ids += greedy_decode(part.unsqueeze(0), torch.tensor([len(part)]))[0]
    assert len(starts) > 3
    assert ids == greedy_decode(scores.unsqueeze(0), torch.tensor([len(scores)]))[0]


def test_defaults_and_bad_overlap(capsys, tmp_path):
    assert (CHUNK_S, OVERLAP_S) == (chunking.CHUNK_S, chunking.OVERLAP_S)
    audio = tmp_path / "a.wav"
    sf.write(audio, np.zeros(8000, dtype=np.float32), 8000)
    code = main(["transcribe", "--model", str(tmp_path / "m.pt"), "--chunk-s", "2", "--overlap-s", "2", str(audio)])
    assert code == 2
    assert "--overlap-s" in capsys.readouterr().err
