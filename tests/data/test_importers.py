"""Importers: folder + TSV, Kaldi data folders, Lhotse recipes (asrflow.data.prepare.importers)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from lhotse import CutSet

from asrflow.data.features.extract import compute_features
from asrflow.data.manifests import load_cuts
from asrflow.data.prepare.config import PrepareConfig
from asrflow.data.prepare.corpus import prepare_corpus
from asrflow.data.prepare.importers.common import read_lines
from asrflow.data.prepare.importers.folder import import_folder
from asrflow.data.prepare.importers.kaldi import import_kaldi
from asrflow.data.prepare.importers.recipes import find_recipe, run_recipe
from asrflow.errors import AsrflowError
from tests.support.corpora import feature_config

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


#: What `sox IN -t wav -` does, for machines without sox: any format libsndfile reads, written to stdout as
#: 16-bit WAV whose length fields do not match the data (sox cannot seek back on a pipe to fill them in).
SOX_STAND_IN = """
import io, struct, sys
import soundfile
data, rate = soundfile.read(sys.argv[1], dtype="int16")
out = io.BytesIO()
soundfile.write(out, data, rate, format="WAV", subtype="PCM_16")
wav = bytearray(out.getvalue())
at = wav.index(b"data")
wav[4:8] = wav[at + 4 : at + 8] = struct.pack("<I", 0x7FFFF000)
sys.stdout.buffer.write(wav)
"""


@pytest.fixture
def sox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """``sox`` on PATH: the real one, or :data:`SOX_STAND_IN` as ``sox`` in a folder put first on PATH."""
    if shutil.which("sox") is None:
        folder = tmp_path / "bin"
        folder.mkdir()
        (folder / "sox").write_text(f"#!{sys.executable}\n{SOX_STAND_IN}")
        (folder / "sox").chmod(0o755)
        monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return "sox"


def kaldi_commands_folder(corpus: Path, name: str, *, good_only: bool = False) -> dict[str, np.ndarray]:
    """A Kaldi folder ``corpus/name`` whose ``wav.scp`` holds only commands (``cat x.wav |``, ``sox x.flac -t wav
    - |``, a recording cut by ``segments``) and, unless ``good_only``, commands that fail; returns each good
    utterance's samples as the audio files hold them (float32, shape (samples,), 16 kHz)."""
    audio = corpus / "audio" / name
    a = write_tone(audio / "a.wav", 0.5)
    b = write_tone(audio / "b.flac", 0.7, freq=300.0)
    long = write_tone(audio / "long.wav", 1.5, freq=200.0)
    scp = [f"{name}-a cat {a} |", f"{name}-b sox {b} -t wav - |", f"{name}-long cat {long} |"]
    text = [f"{name}-a FIRST", f"{name}-b SECOND", f"{name}-u1 THIRD", f"{name}-u2 FOURTH"]
    segments = [f"{name}-{u} {name}-{u} 0 -1" for u in ("a", "b")] + [f"{name}-u1 {name}-long 0 0.5"]
    segments += [f"{name}-u2 {name}-long 0.75 -1"]
    if not good_only:
        for utt, command in {
            "exits": f"cat {audio / 'missing.wav'} |",  # cat fails: exit 1, says why on stderr
            "silent": "true |",  # exit 0, writes nothing
            "junk": "echo not audio |",
        }.items():
            scp.append(f"{name}-{utt} {command}")
            text.append(f"{name}-{utt} LOST")
            segments.append(f"{name}-{utt} {name}-{utt} 0 -1")
    folder = corpus / name
    folder.mkdir(parents=True)
    (folder / "wav.scp").write_text("\n".join(scp) + "\n")
    (folder / "text").write_text("\n".join(text) + "\n")
    (folder / "segments").write_text("\n".join(segments) + "\n")
    (folder / "utt2spk").write_text("".join(f"{line.split()[0]} spk-{name}\n" for line in text))
    whole = {path.stem: sf.read(path, dtype="float32")[0] for path in (a, b, long)}
    return {
        f"{name}-a": whole["a"],
        f"{name}-b": whole["b"],
        f"{name}-u1": whole["long"][:8000],
        f"{name}-u2": whole["long"][12000:],
    }


def test_kaldi_commands_are_refused_unless_allowed_and_a_failing_one_is_named(tmp_path: Path, sox: str) -> None:
    kaldi_commands_folder(tmp_path, "train")

    refused = import_kaldi(tmp_path, "train", "train")
    assert len(refused.supervisions) == 0
    assert set(reasons(refused.rejected).values()) == {"piped_command"}
    assert len(refused.rejected) == 7
    assert all("prepare.allow_commands: true" in r.detail and "code" in r.detail for r in refused.rejected)

    split = import_kaldi(tmp_path, "train", "train", allow_commands=True)
    assert sorted(s.id for s in split.supervisions) == ["train-a", "train-b", "train-u1", "train-u2"]
    recording = split.recordings["train-b"]
    flac = tmp_path / "audio" / "train" / "b.flac"
    assert [(s.type, s.source) for s in recording.sources] == [("command", f"{sox} {flac} -t wav -")]
    assert (recording.sampling_rate, recording.num_samples) == (16000, 11200)
    assert next(s for s in split.supervisions if s.id == "train-u2").duration == pytest.approx(0.75)
    assert reasons(split.rejected) == {
        "train-exits": "command_failed",
        "train-silent": "command_failed",
        "train-junk": "unreadable_audio",
    }
    details = {r.id: r.detail for r in split.rejected}
    assert "exits with status 1" in details["train-exits"] and "No such file" in details["train-exits"]
    assert "writes nothing to stdout" in details["train-silent"]
    assert "drop its wav.scp line" in details["train-exits"]


def test_kaldi_commands_through_prepare_and_features_load_the_same_samples(tmp_path: Path, sox: str) -> None:
    corpus = tmp_path / "corpus"
    expected = kaldi_commands_folder(corpus, "train")
    for name in ("dev", "test"):
        expected |= kaldi_commands_folder(corpus, name, good_only=True)
    section = {
        "corpus": "kaldi",
        "corpus_dir": str(corpus),
        "splits": {"train": "train", "dev": "dev", "test": "test"},
        "max_rejected_fraction": 0.5,
    }
    with pytest.raises(AsrflowError, match="piped_command"):  # every item refused: far above the limit
        prepare_corpus(PrepareConfig.from_section(section), tmp_path / "refused", seed=0)
    refusals = [json.loads(line) for line in (tmp_path / "refused.rejected.jsonl").read_text().splitlines()]
    assert refusals and all("prepare.allow_commands" in r["detail"] for r in refusals)

    manifests = tmp_path / "manifests"
    prepare_corpus(PrepareConfig.from_section({**section, "allow_commands": True}), manifests, seed=0)
    rejected = [json.loads(line) for line in (manifests / "rejected.jsonl").read_text().splitlines()]
    assert sorted((r["id"], r["reason"]) for r in rejected) == [
        ("train-exits", "command_failed"),
        ("train-junk", "unreadable_audio"),
        ("train-silent", "command_failed"),
    ]
    for split in ("train", "dev", "test"):
        cuts = CutSet.from_file(manifests / f"{split}_cuts.jsonl.gz")
        assert sorted(cut.id for cut in cuts) == sorted(u for u in expected if u.startswith(f"{split}-"))
        for cut in cuts:
            assert cut.recording.sources[0].type == "command"
            np.testing.assert_array_equal(cut.load_audio()[0], expected[cut.id])

    counts = compute_features(manifests, tmp_path / "fbank", feature_config(num_jobs=1))
    assert counts == {"train": 4, "dev": 4, "test": 4}
    for cut in load_cuts(tmp_path / "fbank", "train"):
        assert cut.load_features().shape == (cut.num_frames, 80)
