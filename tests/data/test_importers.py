"""Importers: folder + TSV, Kaldi data folders, Lhotse recipes (asrflow.data.prepare.importers)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from asrflow.data.prepare.importers.common import read_lines
from asrflow.data.prepare.importers.folder import import_folder
from asrflow.data.prepare.importers.kaldi import import_kaldi
from asrflow.data.prepare.importers.recipes import find_recipe, run_recipe
from asrflow.errors import AsrflowError

YESNO = Path(__file__).resolve().parents[2] / "data" / "corpora" / "yesno"


def write_tone(path: Path, seconds: float, *, rate: int = 16000, channels: int = 1, freq: float = 440.0) -> Path:
    """Write a sine tone of ``seconds`` at ``rate`` Hz with ``channels`` channels."""
    path.parent.mkdir(parents=True, exist_ok=True)
    t = np.arange(int(round(seconds * rate))) / rate
    tone = 0.3 * np.sin(2 * np.pi * freq * t)
    data = np.stack([tone * (k + 1) / channels for k in range(channels)], axis=1)
    sf.write(path, data.astype(np.float32), rate)
    return path


def reasons(rejected) -> dict[str, str]:
    return {r.id: r.reason for r in rejected}


def test_read_lines_decodes_each_line_alone(tmp_path: Path) -> None:
    file = tmp_path / "t.tsv"
    file.write_bytes(b"\xef\xbb\xbfa\tone\r\n\nb\t\xff\xfe bad\nc\tthree")
    lines = list(read_lines(file))
    assert [(line.number, line.text) for line in lines] == [(1, "a\tone"), (3, None), (4, "c\tthree")]
    assert "0xff" in lines[1].error


def test_folder_tsv_with_header_speaker_column_and_subfolders(tmp_path: Path) -> None:
    write_tone(tmp_path / "spk1" / "a.wav", 0.5)
    write_tone(tmp_path / "spk2" / "b.flac", 0.7, rate=8000)
    (tmp_path / "train.tsv").write_text("path\ttext\nspk1/a.wav\tHello there\tanna\nspk2/b.flac\tbye\n")
    split = import_folder(tmp_path, "train", "train")
    assert split.rejected == []
    assert sorted(split.recordings.ids) == ["spk1/a", "spk2/b"]
    sups = {s.id: s for s in split.supervisions}
    assert sups["spk1/a"].text == "Hello there"  # raw: normalisation comes later
    assert sups["spk1/a"].speaker == "anna"
    assert sups["spk2/b"].speaker is None
    assert split.recordings["spk2/b"].sampling_rate == 8000
    assert sups["spk2/b"].duration == pytest.approx(0.7)


def test_folder_missing_tsv_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "train.tsv").write_text("")
    with pytest.raises(AsrflowError, match=r"test\.tsv not found.*train\.tsv"):
        import_folder(tmp_path, "test", "test")


def test_kaldi_without_segments(tmp_path: Path) -> None:
    write_tone(tmp_path / "audio" / "r1.wav", 0.6)
    write_tone(tmp_path / "audio" / "r2.wav", 0.4)
    data = tmp_path / "train"
    data.mkdir()
    (data / "wav.scp").write_bytes(
        b"r1 audio/r1.wav\nr2 audio/r2.wav\nr3 sox x.sph -t wav - |\nr5 audio/\xff.wav\nr6\n"
    )
    (data / "text").write_bytes(b"r1 HELLO WORLD\nr2 ONE\nr3 PIPED\nr4 \xff\xff\nr5 BAD PATH\nr6 NO PATH\n")
    (data / "utt2spk").write_text("r1 s1\nr2 s2\nr3 s3\n")
    split = import_kaldi(tmp_path, "train", "train")
    assert sorted(s.id for s in split.supervisions) == ["r1", "r2"]
    sup = next(s for s in split.supervisions if s.id == "r1")
    assert (sup.recording_id, sup.start, sup.text, sup.speaker) == ("r1", 0.0, "HELLO WORLD", "s1")
    assert sup.duration == pytest.approx(0.6)
    assert reasons(split.rejected) == {
        "r3": "piped_command",
        "r4": "non_utf8_text",
        "r5": "non_utf8_text",
        "r6": "malformed_line",
    }
    assert len(split.rejected) == 4
    piped = next(r for r in split.rejected if r.id == "r3")
    assert "convert the audio to files" in piped.detail


def test_kaldi_with_segments(tmp_path: Path) -> None:
    write_tone(tmp_path / "long.wav", 3.0)
    data = tmp_path / "dev"
    data.mkdir()
    (data / "wav.scp").write_text(f"long {tmp_path / 'long.wav'}\n")  # absolute, inside corpus_dir
    (data / "segments").write_text(
        "u1 long 0.0 1.0\nu2 long 1.2 2.0\nu3 long 2.5 -1\nu4 nowhere 0 1\nu5 long 0 1\nu6 long x y\n"
    )
    (data / "text").write_text("u1 FIRST\nu2 SECOND\nu3 THIRD\nu4 LOST\nu6 BAD TIMES\nu7 NO SEGMENT\n")
    split = import_kaldi(tmp_path, "dev", "dev")
    sups = {s.id: s for s in split.supervisions}
    assert sorted(sups) == ["u1", "u2", "u3"]
    assert (sups["u2"].start, sups["u2"].duration) == (1.2, 0.8)
    assert sups["u3"].duration == pytest.approx(0.5)  # end -1 = end of recording
    assert list(split.recordings.ids) == ["long"]
    assert reasons(split.rejected) == {
        "u4": "missing_recording",
        "u5": "missing_transcript",
        "u6": "malformed_line",
        "u7": "missing_recording",
    }


def test_kaldi_missing_folder_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(AsrflowError, match=r"wav\.scp"):
        import_kaldi(tmp_path, "train", "train")


def test_recipe_yesno_and_unknown_recipe(tmp_path: Path) -> None:
    splits = run_recipe("yesno", YESNO, {})
    assert sorted(splits) == ["test", "train"]
    assert len(splits["train"].supervisions) == 30
    with pytest.raises(AsrflowError, match="not a Lhotse recipe.*librispeech"):
        find_recipe("no_such_corpus")
    with pytest.raises(AsrflowError, match="not accepted.*prepare_yesno"):
        run_recipe("yesno", YESNO, {"dataset_parts": ["x"]})
    with pytest.raises(AsrflowError, match="recipe prepare_yesno failed"):
        run_recipe("yesno", tmp_path, {})
