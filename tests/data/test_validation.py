"""Item checks and the rejected-items report (asrflow.data.prepare.validator and its checks, via prepare_corpus)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from lhotse import CutSet, SupervisionSegment
from lhotse.supervision import AlignmentItem

from asrflow.data.prepare.alignment import split_by_alignment
from asrflow.data.prepare.config import PrepareConfig
from asrflow.data.prepare.corpus import prepare_corpus
from asrflow.data.prepare.path_checks import resolve_inside
from asrflow.data.prepare.rejections import ItemRejected
from asrflow.errors import AsrflowError


def write_tone(path: Path, seconds: float, rate: int = 16000, channels: int = 1) -> Path:
    """Write a sine tone of ``seconds`` at ``rate`` Hz with ``channels`` channels (channel k has gain k+1)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    t = np.arange(int(round(seconds * rate))) / rate
    tone = 0.2 * np.sin(2 * np.pi * 300.0 * t)
    sf.write(path, np.stack([tone * (k + 1) for k in range(channels)], axis=1).astype(np.float32), rate)
    return path


def config(**overrides) -> PrepareConfig:
    section = {
        "corpus": "folder",
        "splits": {"train": "train", "dev": None, "test": "test"},
        "min_duration_s": 0.1,
        "max_duration_s": 2.0,
        "max_rejected_fraction": 1.0,
        **overrides,
    }
    return PrepareConfig.from_section(section)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_bad_item_is_rejected_with_its_reason_and_good_items_survive(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    outside = write_tone(tmp_path / "outside.wav", 0.5)
    good = {
        "good/a": write_tone(corpus / "good" / "a.wav", 0.5),
        "good/b": write_tone(corpus / "good" / "b.wav", 0.8),
        "good/c8k": write_tone(corpus / "good" / "c8k.wav", 0.6, rate=8000),  # rate mismatch is fine
        "good/three_ch": write_tone(corpus / "good" / "three_ch.wav", 0.5, channels=3),
        "good/d": write_tone(corpus / "good" / "d.wav", 0.4),
    }
    os.symlink(corpus / "good" / "a.wav", corpus / "inside_link.wav")  # a link that stays inside
    good["inside_link"] = corpus / "inside_link.wav"
    # bad audio
    (corpus / "corrupt.wav").write_bytes(b"RIFF not really audio" * 20)
    sf.write(corpus / "full.flac", np.zeros(16000, dtype=np.float32) + 0.1, 16000)
    flac = (corpus / "full.flac").read_bytes()
    (corpus / "truncated.flac").write_bytes(flac[: len(flac) // 3])
    sf.write(corpus / "zero.wav", np.zeros(0, dtype=np.float32), 16000)
    write_tone(corpus / "short.wav", 0.05)
    write_tone(corpus / "long.wav", 3.0)
    write_tone(corpus / "stereo.wav", 0.5, channels=2)
    write_tone(corpus / "empty_text.wav", 0.5)
    write_tone(corpus / "latin1.wav", 0.5)
    os.symlink(outside, corpus / "escape_link.wav")

    lines = [
        b"path\ttranscript",
        b"good/a.wav\tHello, World!",
        b"good/b.wav\tsecond good one",
        b"good/c8k.wav\teight kilohertz",
        b"good/three_ch.wav\tthree channels",
        b"good/d.wav\tfourth",
        b"inside_link.wav\tlinked inside",
        b"good/a.wav\tduplicate of the first",
        b"missing.wav\tnot there",
        b"corrupt.wav\tgarbage bytes",
        b"truncated.flac\tcut short",
        b"zero.wav\tno samples",
        b"short.wav\ttoo short",
        b"long.wav\tway too long",
        b"stereo.wav\tonly two channels",
        b"empty_text.wav\t ?! ...",
        b"latin1.wav\tcaf\xe9 au lait",
        b"../outside.wav\tclimbs out",
        str(outside).encode() + b"\tabsolute elsewhere",
        b"escape_link.wav\tlink to outside",
        b"no tab on this line",
    ]
    (corpus / "train.tsv").write_bytes(b"\n".join(lines) + b"\n")
    write_tone(corpus / "test" / "t1.wav", 0.5)
    (corpus / "test.tsv").write_text("test/t1.wav\ttest item\n")

    out = tmp_path / "manifests"
    summary = prepare_corpus(config(corpus_dir=str(corpus), channel=2, dev_fraction=0.2), out, seed=1)

    rejected = read_jsonl(out / "rejected.jsonl")
    got = {(r["id"], r["reason"]) for r in rejected}
    assert got == {
        ("good/a", "duplicate_id"),
        ("missing", "missing_audio"),
        ("corrupt", "unreadable_audio"),
        ("truncated", "unreadable_audio"),
        ("zero", "zero_length_audio"),
        ("short", "too_short"),
        ("long", "too_long"),
        ("stereo", "channel_out_of_range"),
        ("empty_text", "empty_transcript"),
        ("latin1", "non_utf8_text"),
        ("../outside", "path_outside_corpus"),
        (outside.with_suffix("").as_posix(), "path_outside_corpus"),
        ("escape_link", "path_outside_corpus"),
        ("no tab on this line", "malformed_line"),
    }
    assert all(r["split"] == "train" and r["detail"] for r in rejected)
    assert next(r for r in rejected if r["id"] == "missing")["path"] == "missing.wav"
    assert "symlink" in next(r for r in rejected if r["id"] == "escape_link")["detail"]
    assert "Format not recognised" in next(r for r in rejected if r["id"] == "corrupt")["detail"]

    cuts = {}
    for split in ("train", "dev", "test"):
        cuts.update({c.id: c for c in CutSet.from_file(out / f"{split}_cuts.jsonl.gz")})
    assert set(cuts) == set(good) | {"test/t1"}
    assert cuts["good/a"].supervisions[0].text == "HELLO WORLD"  # first of the duplicates kept
    assert cuts["good/three_ch"].channel == 2  # channel: 2 selects the third channel
    assert cuts["good/c8k"].sampling_rate == 8000
    assert summary.rejected_total == 14
    assert summary.rejected_by_reason["path_outside_corpus"] == 3
    assert summary.items_total == 14 + len(good) + 1
    saved = json.loads((out / "summary.json").read_text())
    assert saved["rejected"]["by_reason"]["unreadable_audio"] == 2
    assert {rate for split in saved["splits"].values() for rate in split["sampling_rates"]} == {8000, 16000}


def test_channel_mix_keeps_all_channels_for_a_downmix(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    write_tone(corpus / "st.wav", 0.5, channels=2)
    for name in ("m1", "m2", "m3"):
        write_tone(corpus / f"{name}.wav", 0.5)
    (corpus / "train.tsv").write_text("st.wav\tstereo\nm1.wav\tone\nm2.wav\ttwo\n")
    (corpus / "test.tsv").write_text("m3.wav\tthree\n")
    out = tmp_path / "out"
    prepare_corpus(config(corpus_dir=str(corpus), channel="mix", dev_fraction=0.3), out, seed=0)
    cuts = {c.id: c for s in ("train", "dev") for c in CutSet.from_file(out / f"{s}_cuts.jsonl.gz")}
    stereo = cuts["st"]
    assert stereo.channel == [0, 1]
    assert stereo.load_audio().shape == (2, 8000)
    mono = stereo.to_mono(mono_downmix=True)
    assert mono.load_audio().shape == (1, 8000)


def test_a_split_left_empty_is_a_user_error_and_writes_nothing(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    write_tone(corpus / "ok1.wav", 0.5)
    write_tone(corpus / "ok2.wav", 0.5)
    (corpus / "train.tsv").write_text("ok1.wav\tfine\nok2.wav\tfine too\n")
    (corpus / "test.tsv").write_text("ok1.wav\tthe same id again, in test\n")  # duplicate across splits
    out = tmp_path / "out"
    with pytest.raises(AsrflowError, match="split 'test' is empty after preparation"):
        prepare_corpus(config(corpus_dir=str(corpus)), out, seed=0)
    assert not out.exists()


def test_split_without_alignment_reason_in_report(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    write_tone(corpus / "long.wav", 2.5)
    for name in ("ok1", "ok2", "ok3"):
        write_tone(corpus / f"{name}.wav", 0.5)
    (corpus / "train.tsv").write_text("long.wav\tlong talk\nok1.wav\tfine\nok2.wav\tfine too\n")
    (corpus / "test.tsv").write_text("ok3.wav\ttest\n")
    out = tmp_path / "out"
    prepare_corpus(config(corpus_dir=str(corpus), long_utterances="split"), out, seed=0)
    (row,) = read_jsonl(out / "rejected.jsonl")
    assert (row["id"], row["reason"]) == ("long", "too_long_no_alignment")
    assert "no word alignment to split the transcript" in row["detail"]


def test_split_by_alignment_packs_words_into_windows() -> None:
    words = [
        AlignmentItem("", 0.0, 0.1),
        AlignmentItem("HELLO", 0.1, 0.4),
        AlignmentItem("WORLD", 0.5, 0.5),
        AlignmentItem("", 1.0, 0.6),
        AlignmentItem("AGAIN", 1.6, 0.7),
        AlignmentItem("", 2.3, 0.2),
    ]
    sup = SupervisionSegment("u", "r", 0.0, 2.5, text="hello world again", alignment={"word": words})
    pieces = split_by_alignment(sup, 1.2)
    assert [(p.id, p.start, p.duration, p.text) for p in pieces] == [
        ("u-part0", 0.0, 0.5, "HELLO"),
        ("u-part1", 0.5, 0.8, "WORLD"),
        ("u-part2", 1.3, 1.2, "AGAIN"),
    ]
    assert [p.id for p in split_by_alignment(sup, 1.3)] == ["u-part0", "u-part1"]
    with pytest.raises(ItemRejected) as info:
        split_by_alignment(sup, 0.3)
    assert info.value.reason == "too_long"
    with pytest.raises(ItemRejected) as info:
        split_by_alignment(SupervisionSegment("v", "r", 0.0, 2.5, text="x"), 1.0)
    assert info.value.reason == "too_long_no_alignment"


def test_resolve_inside(tmp_path: Path) -> None:
    root = tmp_path.resolve()
    write_tone(root / "sub" / "a.wav", 0.2)
    assert resolve_inside(root, "sub/../sub/a.wav") == root / "sub" / "a.wav"
    assert resolve_inside(root, str(root / "sub" / "a.wav")) == root / "sub" / "a.wav"
    for raw, reason in [
        ("../x.wav", "path_outside_corpus"),
        ("/etc/passwd", "path_outside_corpus"),
        ("sub/none.wav", "missing_audio"),
        ("sub", "missing_audio"),
    ]:
        with pytest.raises(ItemRejected) as info:
            resolve_inside(root, raw)
        assert info.value.reason == reason


def test_first_valid_copy_of_an_id_wins_and_an_invalid_copy_claims_nothing(tmp_path: Path) -> None:
    from lhotse import Recording, RecordingSet, SupervisionSet

    from asrflow.data.prepare.supervision_checks import ValidationRules
    from asrflow.data.prepare.text import TextConfig
    from asrflow.data.prepare.validator import validate_split

    recording = Recording.from_file(write_tone(tmp_path / "r.wav", 1.0), recording_id="r")
    rules = ValidationRules(
        min_duration_s=0.1, max_duration_s=2.0, long_utterances="drop", channel="mix", text=TextConfig()
    )

    def supervision(item_id: str, text: str, duration: float = 0.5) -> SupervisionSegment:
        return SupervisionSegment(id=item_id, recording_id="r", start=0.0, duration=duration, channel=0, text=text)

    seen: set[str] = set()
    train = validate_split(
        "train",
        RecordingSet.from_recordings([recording]),
        supervisions=SupervisionSet.from_segments(
            [
                supervision("u1", " ?! "),  # invalid: empty transcript
                supervision("u1", "second copy"),  # the first valid copy: kept
                supervision("u1", "third copy"),  # a duplicate of a kept item
                supervision("u2", "too short", 0.05),  # invalid here...
            ]
        ),
        rules=rules,
        seen_ids=seen,
    )
    test = validate_split(
        "test",
        RecordingSet.from_recordings([recording]),
        supervisions=SupervisionSet.from_segments(
            [
                supervision("u2", "valid in test"),  # ...so its id is free for this valid copy
                supervision("u1", "kept in train"),  # a duplicate across splits
            ]
        ),
        rules=rules,
        seen_ids=seen,
    )

    assert [(s.id, s.text) for s in train.supervisions] == [("u1", "SECOND COPY")]
    assert [(r.id, r.reason) for r in train.rejected] == [
        ("u1", "empty_transcript"),
        ("u1", "duplicate_id"),
        ("u2", "too_short"),
    ]
    assert [(s.id, s.text) for s in test.supervisions] == [("u2", "VALID IN TEST")]
    assert [(r.id, r.reason) for r in test.rejected] == [("u1", "duplicate_id")]
    assert seen == {"u1", "u2"}


def _rejections(out: Path) -> list[tuple[str, str]]:
    return [(r["id"], r["reason"]) for r in read_jsonl(out / "rejected.jsonl")]


def test_tsv_importer_keeps_the_first_valid_copy_of_an_id(tmp_path: Path) -> None:
    """Issue 13, item 4: an invalid first line no longer takes the id with it."""
    corpus = tmp_path / "corpus"
    for name in ("a", "b", "c", "d", "f", "g"):
        write_tone(corpus / f"{name}.wav", 1.0)
    write_tone(corpus / "e.flac", 1.0)
    (corpus / "train.tsv").write_text(
        "a.wav\t ?!\n"  # normalises to nothing: rejected, claims nothing
        "a.wav\thello there\n"  # kept
        "a.wav\tthird copy\n"  # a duplicate of a kept item
        "b.wav\tbee\n"
        "e.wav\tmissing file\n"  # no e.wav: rejected
        "e.flac\tthe flac one\n"  # same id e, another file: kept
        "c.wav\tsee\nd.wav\tdee\n"
    )
    (corpus / "test.tsv").write_text("c.wav\tsee again\ng.wav\tgee\n")  # c: a duplicate across splits
    (corpus / "dev.tsv").write_text("f.wav\tef\n")
    out = tmp_path / "out"
    prepare_corpus(config(corpus_dir=str(corpus), splits={"train": "train", "dev": "dev", "test": "test"}), out, seed=1)
    train = {cut.id: cut for cut in CutSet.from_file(out / "train_cuts.jsonl.gz")}
    assert train["a"].supervisions[0].text == "HELLO THERE"
    assert train["e"].supervisions[0].text == "THE FLAC ONE"
    assert train["e"].recording.sources[0].source.endswith("e.flac")
    assert sorted(_rejections(out)) == sorted(
        [
            ("a", "empty_transcript"),
            ("a", "duplicate_id"),
            ("e", "missing_audio"),
            ("c", "duplicate_id"),
        ]
    )


def test_kaldi_importer_keeps_the_first_valid_transcript_of_an_utterance(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    for name in ("r1", "r2", "r3", "r4"):
        write_tone(corpus / "audio" / f"{name}.wav", 1.0)
    for split in ("train", "dev", "test"):
        (corpus / split).mkdir()
    (corpus / "train" / "wav.scp").write_text("r1 audio/r1.wav\nr2 audio/r2.wav\n")
    (corpus / "train" / "text").write_bytes(b"r1 ?!\nr1 hello there\nr1 third copy\nr2 bad \xff byte\nr2 fine\n")
    (corpus / "test" / "wav.scp").write_text("r3 audio/r3.wav\n")
    (corpus / "test" / "text").write_text("r3 test line\n")
    (corpus / "dev" / "wav.scp").write_text("r4 audio/r4.wav\n")
    (corpus / "dev" / "text").write_text("r4 dev line\n")
    out = tmp_path / "out"
    prepare_corpus(
        config(corpus="kaldi", corpus_dir=str(corpus), splits={"train": "train", "dev": "dev", "test": "test"}),
        out,
        seed=1,
    )
    train = {cut.id: cut.supervisions[0].text for cut in CutSet.from_file(out / "train_cuts.jsonl.gz")}
    assert train == {"r1": "HELLO THERE", "r2": "FINE"}
    assert sorted(_rejections(out)) == sorted(
        [
            ("r1", "empty_transcript"),
            ("r1", "duplicate_id"),
            ("r2", "non_utf8_text"),
        ]
    )
