"""``asrflow transcribe --output json|srt|vtt``: word times on audio whose word boundaries are known.

The audio joins held-out yesno files (8 words each) with known stretches of low noise between them, so a
word's true start is its file's offset in the join plus the word's onset in the file. The onsets come from
the file's energy (10 ms frames, smoothed, above the midpoint between the noise floor and the loudest
frames; yesno words are separated by clear pauses); a file where that does not find exactly 8 words is
not used. The model is the session's yesno model (tests.support.trained_model).
"""

from __future__ import annotations

import difflib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from asrflow.serving.cli import main
from tests.support.trained_model import split_files

#: Mean absolute error of the recognised words' starts allowed, in seconds (issue 58).
MAX_MEAN_START_ERROR_S = 0.1
#: Noise between the joined files, seconds: longer than a segment's pause, so each file is a segment.
GAP_S = 1.5
FILES = 3


def word_onsets(audio: np.ndarray, rate: int) -> list[float]:
    """Start (seconds) of each stretch of speech in ``audio``, found by energy."""
    hop = rate // 100
    count = len(audio) // hop
    energy = (audio[: count * hop].reshape(count, hop) ** 2).mean(axis=1)
    level = 10 * np.log10(np.convolve(energy, np.ones(3) / 3, mode="same") + 1e-10)
    floor, loud = np.percentile(level, 10), np.percentile(level, 99)
    speech = np.r_[0, (level > floor + 0.5 * (loud - floor)).astype(int), 0]
    regions: list[list[int]] = []
    for start, end in np.flatnonzero(np.diff(speech)).reshape(-1, 2):
        if regions and start - regions[-1][1] < 8:  # a dip shorter than 80 ms stays inside the word
            regions[-1][1] = end
        else:
            regions.append([start, end])
    return [start / 100 for start, end in regions if end - start >= 10]


@pytest.fixture(scope="module")
def joined(yesno_model, yesno_data, tmp_path_factory) -> tuple[Path, Path, list[tuple[str, float]]]:
    """``(model, joined.wav, [(true word, true start)])``."""
    folder = tmp_path_factory.mktemp("times")
    shutil.copy(yesno_model, folder / "model.pt")
    pieces, truth, offset, rate = [], [], 0.0, None
    rng = np.random.default_rng(0)
    for path, text in split_files(yesno_data):
        audio, rate = sf.read(path, dtype="float32")  # (samples,) at 8 kHz
        onsets, words = word_onsets(audio, rate), text.split()
        if len(onsets) != len(words):
            continue
        if pieces:
            noise = audio[: int(0.5 * rate)].std()  # the file's leading silence
            pieces.append(rng.normal(0, noise, int(GAP_S * rate)).astype(np.float32))
            offset += GAP_S
        pieces.append(audio)
        truth += [(word, offset + onset) for word, onset in zip(words, onsets, strict=True)]
        offset += len(audio) / rate
        if len(pieces) == 2 * FILES - 1:
            break
    assert len(pieces) == 2 * FILES - 1, "too few yesno test files with 8 words found by energy"
    sf.write(folder / "joined.wav", np.concatenate(pieces), rate)
    return folder / "model.pt", folder / "joined.wav", truth


def start_errors(words: list[dict], truth: list[tuple[str, float]]) -> list[float]:
    """``|start - true start|`` of each recognised word that matches a true one (difflib's matching blocks)."""
    hyp = [word["word"] for word in words]
    ref = [word for word, _ in truth]
    matcher = difflib.SequenceMatcher(a=ref, b=hyp, autojunk=False)
    return [
        abs(words[block.b + k]["start"] - truth[block.a + k][1])
        for block in matcher.get_matching_blocks()
        for k in range(block.size)
    ]


@pytest.mark.parametrize("decoder", ["greedy", "beam"])
def test_word_starts_are_near_the_truth(joined, capsys, decoder):
    model, audio, truth = joined
    code = main(["transcribe", "--model", str(model), "--decoder", decoder, "--output", "json", str(audio)])
    out, err = capsys.readouterr()
    assert code == 0, err
    (line,) = out.splitlines()
    result = json.loads(line)
    assert result["path"] == str(audio)
    assert " ".join(word["word"] for word in result["words"]) == result["text"]
    errors = start_errors(result["words"], truth)
    assert len(errors) >= 0.9 * len(truth), (result["text"], [word for word, _ in truth])
    mean = float(np.mean(errors))
    print(f"{decoder}: mean |word start error| {mean * 1000:.0f} ms over {len(errors)} words")
    assert mean < MAX_MEAN_START_ERROR_S, (mean, result["words"], truth)
    assert all(word["start"] < word["end"] for word in result["words"])
    # the noise between the files is longer than the segments' pause: one segment per file
    assert len(result["segments"]) == FILES, result["segments"]
    assert " ".join(segment["text"] for segment in result["segments"]) == result["text"]


def test_subtitles_are_written_per_file(joined, tmp_path, capsys):
    model, audio, truth = joined
    second = tmp_path / "second.wav"
    shutil.copy(audio, second)
    for output, suffix, header in (("srt", ".srt", "1\n00:00:"), ("vtt", ".vtt", "WEBVTT\n\n00:00:")):
        code = main(
            [
                "transcribe",
                "--model",
                str(model),
                "--output",
                output,
                "--out",
                str(tmp_path / "subs"),
                str(audio),
                str(second),
            ]
        )
        out, err = capsys.readouterr()
        assert code == 0, err
        written = [tmp_path / "subs" / f"joined{suffix}", tmp_path / "subs" / f"second{suffix}"]
        assert out.splitlines() == [f"{audio}\t{written[0]}", f"{second}\t{written[1]}"]
        text = written[0].read_text()
        assert text.startswith(header) and text == written[1].read_text()
        assert text.count(" --> ") == FILES, text


def test_subtitles_of_several_files_need_a_folder(joined, capsys):
    model, audio, _ = joined
    code = main(["transcribe", "--model", str(model), "--output", "srt", str(audio), str(audio)])
    assert code == 2
    assert "--out" in capsys.readouterr().err


def test_the_default_output_is_unchanged(joined, capsys):
    model, audio, _ = joined
    assert main(["transcribe", "--model", str(model), str(audio)]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    path, text = line.split("\t")
    assert path == str(audio) and text.split()[0] in ("YES", "NO")
