"""``asrflow corpus``: the report of a corpus read as prepare reads it (asrflow.data.prepare.corpus_report)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import yaml

from asrflow.cli import EXIT_CORPUS_NOT_USABLE, main
from asrflow.data.prepare.corpus_report import (
    EXIT_NOTHING_USABLE,
    duration_bin,
    is_out_of_place,
    suggested_rate,
    suggested_splits,
)
from tests.support.repo import REPO

#: Good mono files of the generated corpus: (name, sampling rate).
GOOD = [(f"a{i:02d}", 16000) for i in range(20)] + [(f"b{i:02d}", 8000) for i in range(6)]


def _tone(path: Path, seconds: float, rate: int, channels: int = 1) -> str:
    samples = 0.1 * np.sin(np.arange(int(seconds * rate)) * 0.05)
    sf.write(path, np.stack([samples] * channels, axis=1) if channels > 1 else samples, rate)
    return path.name


def make_corpus(root: Path) -> Path:
    """A folder corpus: 26 good mono files (16 kHz and 8 kHz), a stereo file, a zero-length file, an unreadable
    file, an empty transcript and a too short file in train; a test split of two files."""
    root.mkdir()
    lines = [f"{_tone(root / f'{name}.wav', 1.5, rate)}\tHELLO WORLD NUMBER {name}" for name, rate in GOOD]
    lines.append(f"{_tone(root / 'stereo.wav', 3.0, 16000, channels=2)}\tTWO CHANNELS HERE")
    sf.write(root / "empty.wav", np.zeros(0), 16000)
    lines.append("empty.wav\tNOTHING IN IT")
    (root / "broken.wav").write_bytes(b"RIFF\x00\x00 not a wav at all")
    lines.append("broken.wav\tBROKEN FILE")
    lines.append(f"{_tone(root / 'silent.wav', 1.0, 16000)}\t")
    lines.append(f"{_tone(root / 'short.wav', 0.05, 16000)}\tTOO SHORT")
    (root / "train.tsv").write_text("\n".join(lines) + "\n")
    tests = [_tone(root / f"t{i}.wav", 2.5, 16000) + "\tA TEST LINE" for i in range(2)]
    (root / "test.tsv").write_text("\n".join(tests) + "\n")
    return root


def listing(folder: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(folder)), p.stat().st_size) for p in folder.rglob("*"))


@pytest.fixture
def params(tmp_path: Path) -> Path:
    copy = tmp_path / "params.yaml"
    shutil.copy(REPO / "params.yaml", copy)
    return copy


def run_report(capsys, *args: str) -> tuple[int, str]:
    code = main(["corpus", *args])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_report_counts_rates_channels_rejections_and_suggestions(tmp_path, params, capsys, monkeypatch) -> None:
    corpus = make_corpus(tmp_path / "mine")
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    before, cwd_before = listing(corpus), listing(work)
    code, out = run_report(capsys, str(corpus), "--params", str(params))
    assert code == 0, out
    assert "items: 33 read, 29 usable, 4 rejected" in out
    assert "train: 27 kept, 4 rejected" in out and "test: 2 kept, 0 rejected" in out
    assert "sampling rates (recordings): 8000 Hz: 6, 16000 Hz: 23" in out
    assert "channels (recordings): 1: 28, 2: 1" in out
    for reason in ("zero_length_audio: 1", "unreadable_audio: 1", "empty_transcript: 1", "too_short: 1"):
        assert reason in out
    assert "mixed sampling rates" in out and "features.sampling_rate (suggested: 16000)" in out
    assert "multi-channel audio" in out and "prepare.channel = 'mix'" in out
    assert "prepare would stop" in out  # 4 of 33 rejected > 0.05
    assert "prepare.corpus: folder" in out and "prepare.splits: {train: train, dev: null, test: test}" in out
    assert "features.sampling_rate: 16000" in out
    assert "size: small (under 10 h): no preset for this size yet" in out
    assert "1-2 s | " + "#" * 40 + " 26" in out and "0-1 s | " + " " * 40 + " 0" in out  # the 1.5 s files
    assert "out-of-place words" in out and "A00 x1" in out and "NUMBER x" not in out  # digits are out of place
    assert listing(corpus) == before and listing(work) == cwd_before


def test_write_sets_the_suggested_keys_and_keeps_comments(tmp_path, params, capsys) -> None:
    corpus = make_corpus(tmp_path / "mine")
    code, out = run_report(capsys, str(corpus), "--params", str(params), "--write")
    assert code == 0, out
    written = yaml.safe_load(params.read_text())
    assert written["prepare"]["corpus"] == "folder"
    assert written["prepare"]["corpus_dir"] == "mine"  # relative to the params file's folder, where stages run
    assert written["prepare"]["splits"] == {"train": "train", "dev": None, "test": "test"}
    assert written["features"]["sampling_rate"] == 16000
    assert written["tokenizer"] == yaml.safe_load((REPO / "params.yaml").read_text())["tokenizer"]
    assert "# drop | split" in params.read_text()  # a comment of params.yaml kept
    assert "prepare.corpus, prepare.corpus_dir" in out and "features.sampling_rate" in out


def test_without_write_params_stay(tmp_path, params, capsys) -> None:
    corpus = make_corpus(tmp_path / "mine")
    text = params.read_text()
    assert run_report(capsys, str(corpus), "--params", str(params))[0] == 0
    assert params.read_text() == text


def test_empty_folder_and_no_transcripts_exit_nonzero(tmp_path, params, capsys) -> None:
    assert EXIT_NOTHING_USABLE == EXIT_CORPUS_NOT_USABLE != 0
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out = run_report(capsys, str(empty), "--params", str(params))
    assert code == EXIT_NOTHING_USABLE and "is empty" in out
    audio_only = tmp_path / "audio"
    audio_only.mkdir()
    for i in range(3):
        _tone(audio_only / f"x{i}.wav", 1.0, 16000)
    code, out = run_report(capsys, str(audio_only), "--params", str(params))
    assert code == EXIT_NOTHING_USABLE and "no transcripts" in out and "3 audio file(s)" in out


def test_every_item_rejected_exits_nonzero_and_write_does_nothing(tmp_path, params, capsys) -> None:
    corpus = tmp_path / "bad"
    corpus.mkdir()
    (corpus / "broken.wav").write_bytes(b"not audio")
    (corpus / "train.tsv").write_text("broken.wav\tSOMETHING\nmissing.wav\tELSE\n")
    text = params.read_text()
    code, out = run_report(capsys, str(corpus), "--params", str(params), "--write")
    assert code == EXIT_NOTHING_USABLE
    assert "unreadable_audio: 1" in out and "missing_audio: 1" in out and "nothing usable" in out
    assert params.read_text() == text


def test_a_wrong_path_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    code, out = run_report(capsys, str(tmp_path / "nowhere"))
    assert code == 2 and out.strip().count("\n") == 0 and out.startswith("error:")


def test_kaldi_folders_are_found_and_read(tmp_path, params, capsys) -> None:
    corpus = tmp_path / "kaldi"
    (corpus / "train").mkdir(parents=True)
    _tone(corpus / "u1.wav", 2.0, 16000)
    (corpus / "train" / "wav.scp").write_text(f"u1 {corpus / 'u1.wav'}\n")
    (corpus / "train" / "text").write_text("u1 A KALDI LINE\n")
    code, out = run_report(capsys, str(corpus), "--params", str(params))
    assert code == 0, out
    assert "(kaldi; splits: train)" in out and "items: 1 read, 1 usable" in out


def test_rules() -> None:
    assert suggested_splits(["dev", "test-a", "test-b", "train"]) == {
        "train": "train",
        "dev": "dev",
        "test": ["test-a", "test-b"],
    }
    assert suggested_splits(["all"]) == {"train": "all", "dev": None, "test": None}
    assert suggested_rate(__import__("collections").Counter({44100: 3, 8000: 1})) == 16000
    assert suggested_rate(__import__("collections").Counter({8000: 3, 16000: 1})) == 8000
    assert [duration_bin(s) for s in (0.5, 1.0, 29.9, 61.0)] == [0, 1, 6, 8]
    assert is_out_of_place("B2B") and is_out_of_place("A-B") and not is_out_of_place("DON'T")
