"""prepare_corpus end to end on real corpora: yesno, a LibriSpeech-shaped tree, folder TSVs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from lhotse import CutSet, RecordingSet, SupervisionSegment, SupervisionSet

from asrflow.data.manifests import list_test_sets
from asrflow.data.prepare.carving import carve_ids
from asrflow.data.prepare.config import PrepareConfig
from asrflow.data.prepare.corpus import prepare_corpus
from asrflow.errors import AsrflowError

REPO = Path(__file__).resolve().parents[2]
YESNO = REPO / "data" / "corpora" / "yesno"
KINDS = ("recordings", "supervisions", "cuts")
OUTPUT_FILES = sorted(
    [f"{split}_{kind}.jsonl.gz" for split in ("train", "dev", "test") for kind in KINDS]
    + ["rejected.jsonl", "summary.json"]
)


def write_tone(path: Path, seconds: float, rate: int = 16000) -> Path:
    """Write a mono sine tone of ``seconds`` at ``rate`` Hz (format from the suffix)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    t = np.arange(int(round(seconds * rate))) / rate
    sf.write(path, (0.2 * np.sin(2 * np.pi * 200.0 * t)).astype(np.float32), rate)
    return path


def ids(path: Path) -> list[str]:
    return [cut.id for cut in CutSet.from_file(path)]


def test_yesno_gives_27_3_30_deterministically_and_byte_identical(tmp_path: Path) -> None:
    config = PrepareConfig.from_section({"corpus": "yesno", "corpus_dir": str(YESNO)})
    first = prepare_corpus(config, tmp_path / "a", seed=42)
    prepare_corpus(config, tmp_path / "b", seed=42)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == OUTPUT_FILES
    counts = {name: split.utterances for name, split in first.splits.items()}
    assert counts == {"train": 27, "dev": 3, "test": 30}
    assert first.splits["dev"].carved_from_train
    for name in OUTPUT_FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name

    dev = ids(tmp_path / "a" / "dev_cuts.jsonl.gz")
    train = ids(tmp_path / "a" / "train_cuts.jsonl.gz")
    assert train == sorted(train) and not set(dev) & set(train)
    cut = CutSet.from_file(tmp_path / "a" / "test_cuts.jsonl.gz")[0]
    assert len(cut.supervisions) == 1 and cut.supervisions[0].id == cut.id
    assert set(cut.supervisions[0].text.split()) <= {"YES", "NO"}
    assert cut.sampling_rate == 8000
    assert cut.load_audio().shape[1] == cut.num_samples

    prepare_corpus(config, tmp_path / "c", seed=7)
    assert ids(tmp_path / "c" / "dev_cuts.jsonl.gz") != dev  # the seed picks the dev set
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["splits"]["test"]["sampling_rates"] == [8000]
    assert summary["total_hours"] == pytest.approx(first.total_hours)


def build_librispeech(root: Path) -> Path:
    """A LibriSpeech-shaped tree: ``root/LibriSpeech/<part>/<spk>/<chapter>/...``; returns the LibriSpeech folder."""
    corpus = root / "LibriSpeech"
    layout = {
        "train-clean-100": {("19", "198"): ["HELLO, WORLD", "A SECOND LINE"], ("26", "495"): ["THIRD ONE", "FOURTH"]},
        "dev-clean": {("84", "121"): ["DEV ONE", "DEV TWO"]},
        "test-clean": {("61", "70"): ["TEST ONE", "TEST TWO", "LONG TEST"]},
    }
    for part, chapters in layout.items():
        for (speaker, chapter), texts in chapters.items():
            folder = corpus / part / speaker / chapter
            lines = []
            for index, text in enumerate(texts):
                utt = f"{speaker}-{chapter}-{index:04d}"
                seconds = 2.5 if text == "LONG TEST" else 0.4 + 0.1 * index
                write_tone(folder / f"{utt}.flac", seconds)
                lines.append(f"{utt} {text}")
            (folder / f"{speaker}-{chapter}.trans.txt").write_text("\n".join(lines) + "\n")
    return corpus


def librispeech_config(corpus: Path, **overrides) -> PrepareConfig:
    return PrepareConfig.from_section(
        {
            "corpus": "librispeech",
            "corpus_dir": str(corpus),
            "splits": {"train": "train-clean-100", "dev": "dev-clean", "test": "test-clean"},
            "max_duration_s": 3.0,
            **overrides,
        }
    )


def test_librispeech_shaped_tree_through_the_recipe(tmp_path: Path) -> None:
    corpus = build_librispeech(tmp_path)
    out = tmp_path / "out"
    summary = prepare_corpus(librispeech_config(corpus, text={"case": "lower"}), out, seed=42)
    assert {name: s.utterances for name, s in summary.splits.items()} == {"train": 4, "dev": 2, "test": 3}
    assert not summary.splits["dev"].carved_from_train
    train = {c.id: c for c in CutSet.from_file(out / "train_cuts.jsonl.gz")}
    assert sorted(train) == ["19-198-0000", "19-198-0001", "26-495-0000", "26-495-0001"]
    sup = train["19-198-0000"].supervisions[0]
    assert (sup.text, sup.speaker) == ("hello world", "19")
    assert train["19-198-0000"].sampling_rate == 16000


def test_librispeech_split_parts_name_the_available_keys(tmp_path: Path) -> None:
    corpus = build_librispeech(tmp_path)
    config = librispeech_config(corpus, splits={"train": "train", "dev": None, "test": "test-clean"})
    with pytest.raises(AsrflowError, match="dev-clean, test-clean, train-clean-100"):
        prepare_corpus(config, tmp_path / "out", seed=42)


def test_long_utterance_split_by_librispeech_word_alignment(tmp_path: Path) -> None:
    corpus = build_librispeech(tmp_path)
    chapter = corpus / "train-clean-100" / "19" / "198"
    write_tone(chapter / "19-198-0001.flac", 2.5)
    # LibriSpeech alignment format: id "word,word,..." "end times"; empty words are silences.
    (chapter / "19-198.alignment.txt").write_text('19-198-0001 ",A,SECOND,,LINE," "0.1,0.5,1.0,1.6,2.3,2.5"\n')
    out = tmp_path / "out"
    config = librispeech_config(corpus, max_duration_s=1.2, long_utterances="split")
    summary = prepare_corpus(config, out, seed=42)
    train = {c.id: c for c in CutSet.from_file(out / "train_cuts.jsonl.gz")}
    pieces = [(c.id, c.start, c.duration, c.supervisions[0].text) for c in train.values() if "-part" in c.id]
    assert pieces == [
        ("19-198-0001-part0", 0.0, 0.5, "A"),
        ("19-198-0001-part1", 0.5, 0.8, "SECOND"),
        ("19-198-0001-part2", 1.3, 1.2, "LINE"),
    ]
    assert all(c.duration <= 1.2 + 1e-6 for c in train.values())
    assert summary.rejected_total == 0
    test = {c.id: c for c in CutSet.from_file(out / "test_cuts.jsonl.gz")}
    assert test["61-70-0002"].duration == pytest.approx(2.5)  # the corpus' test split is never cut


@pytest.mark.parametrize("carve", [False, True])
def test_duration_limits_apply_to_train_only(tmp_path: Path, carve: bool) -> None:
    """A corpus' own dev and test stay as published (no length filter); carved ones come from filtered train."""
    corpus = build_librispeech(tmp_path)
    write_tone(corpus / "train-clean-100" / "26" / "495" / "26-495-0001.flac", 2.5)
    write_tone(corpus / "dev-clean" / "84" / "121" / "84-121-0000.flac", 0.05)  # below min_duration_s
    (corpus / "dev-clean" / "84" / "121" / "84-121.trans.txt").write_text("84-121-0000 DEV ONE\n84-121-0001 ,,,\n")
    splits = {"train": "train-clean-100", "dev": "dev-clean", "test": None if carve else "test-clean"}
    config = librispeech_config(
        corpus, max_duration_s=1.0, long_utterances="drop", splits=splits, max_rejected_fraction=0.5
    )
    out = tmp_path / "out"
    summary = prepare_corpus(config, out, seed=0)
    rejected = {r["id"]: r["reason"] for r in map(json.loads, (out / "rejected.jsonl").read_text().splitlines())}
    assert rejected == {"26-495-0001": "too_long", "84-121-0001": "empty_transcript"}
    assert ids(out / "dev_cuts.jsonl.gz") == ["84-121-0000"]
    test = {c.id: c.duration for c in CutSet.from_file(out / "test_cuts.jsonl.gz")}
    if carve:
        assert summary.splits["test"].carved_from_train and max(test.values()) <= 1.0
    else:
        assert test["61-70-0002"] == pytest.approx(2.5)


def test_too_many_rejections_fail_with_counts_and_reasons(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    for name in ("a", "b", "c", "t"):
        write_tone(corpus / f"{name}.wav", 0.5)
    (corpus / "train.tsv").write_text("a.wav\tone\nb.wav\ttwo\nc.wav\tthree\ngone1.wav\tx\ngone2.wav\ty\n")
    (corpus / "test.tsv").write_text("t.wav\ttest\n")
    out = tmp_path / "manifests"
    out.mkdir()
    (out / "old.txt").write_text("previous run")
    config = PrepareConfig.from_section({"corpus": "folder", "corpus_dir": str(corpus), "max_rejected_fraction": 0.05})
    with pytest.raises(AsrflowError) as info:
        prepare_corpus(config, out, seed=0)
    message = str(info.value)
    assert "2 of 6 items rejected" in message
    assert "max_rejected_fraction" in message and "missing_audio: 2" in message
    assert "manifests.rejected.jsonl" in message
    assert (out / "old.txt").read_text() == "previous run"  # the old output is untouched
    report = [json.loads(line) for line in (tmp_path / "manifests.rejected.jsonl").read_text().splitlines()]
    assert {r["id"] for r in report} == {"gone1", "gone2"}

    relaxed = PrepareConfig.from_section({"corpus": "folder", "corpus_dir": str(corpus), "max_rejected_fraction": 0.5})
    prepare_corpus(relaxed, out, seed=0)
    assert not (tmp_path / "manifests.rejected.jsonl").exists()
    assert not (out / "old.txt").exists()


def test_carving_keeps_recordings_together() -> None:
    sups = [
        SupervisionSegment(f"r{r}-u{u}", f"r{r}", start=u, duration=1.0, text="x") for r in range(5) for u in range(4)
    ]
    moved = carve_ids(sups, 0.1, seed=3)
    assert len(moved) == 4 and len({m.split("-")[0] for m in moved}) == 1
    assert carve_ids(sups, 0.1, seed=3) == moved
    assert carve_ids(sups[:1], 0.5, seed=3) == set()
    one_recording = [SupervisionSegment(f"u{u}", "r", start=u, duration=1.0) for u in range(10)]
    assert len(carve_ids(one_recording, 0.2, seed=0)) == 2


@pytest.mark.parametrize(
    ("section", "pattern"),
    [
        ({"dev_fraction": 1.5}, "prepare.dev_fraction"),
        ({"long_utterances": "chop"}, "prepare.long_utterances"),
        ({"channel": "left"}, "prepare.channel"),
        ({"max_duration_s": 0.05}, "prepare.max_duration_s"),
        ({"splits": {"train": "train", "valid": "dev"}}, "unknown key.*valid"),
        ({"splits": {"train": None, "test": "test"}}, "splits.train must name"),
        ({"splits": {"train": "a", "test": "a"}}, "names 'a' for both"),
        ({"text": {"case": "title"}}, "prepare.text.case"),
        ({"text": {"lowercase": True}}, "prepare.text.lowercase"),
        ({"colour": 1}, "unknown key.*prepare.colour"),
    ],
)
def test_bad_params_are_user_errors(section: dict, pattern: str) -> None:
    with pytest.raises(AsrflowError, match=pattern):
        PrepareConfig.from_section(section)


def test_missing_corpus_dir_and_unknown_recipe(tmp_path: Path) -> None:
    config = PrepareConfig.from_section({"corpus_dir": str(tmp_path / "nope")})
    with pytest.raises(AsrflowError, match="corpus_dir .*nope does not exist"):
        prepare_corpus(config, tmp_path / "out", seed=0)
    config = PrepareConfig.from_section({"corpus": "yesnope", "corpus_dir": str(tmp_path)})
    with pytest.raises(AsrflowError, match="not a Lhotse recipe.*yesno"):
        prepare_corpus(config, tmp_path / "out", seed=0)


def test_written_manifests_load_back_with_lhotse(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    for name in ("a", "b", "t"):
        write_tone(corpus / f"{name}.wav", 0.5)
    (corpus / "train.tsv").write_text("a.wav\tone\nb.wav\ttwo\n")
    (corpus / "test.tsv").write_text("t.wav\tthree\n")
    out = tmp_path / "out"
    prepare_corpus(PrepareConfig.from_section({"corpus": "folder", "corpus_dir": str(corpus)}), out, seed=0)
    recordings = RecordingSet.from_file(out / "train_recordings.jsonl.gz")
    supervisions = SupervisionSet.from_file(out / "train_supervisions.jsonl.gz")
    assert len(recordings) == len(supervisions) == 1
    assert Path(recordings[0].sources[0].source).is_absolute()  # outside the working directory


@pytest.mark.parametrize(
    ("test", "expected"),
    [
        ("test-clean", {"test": ["test-clean"]}),
        (None, {"test": []}),
        (["test-clean", "test-other"], {"test-clean": ["test-clean"], "test-other": ["test-other"]}),
        (["en/test"], {"en/test": ["en/test"]}),
        (
            {"clean": "test-clean", "rest": ["test-other", "dev-other"]},
            {"clean": ["test-clean"], "rest": ["test-other", "dev-other"]},
        ),
    ],
)
def test_splits_test_names_one_or_several_test_sets(test, expected) -> None:
    config = PrepareConfig.from_section({"splits": {"train": "train", "dev": "dev", "test": test}})
    assert config.test_sources() == expected
    assert list(config.split_sources()) == ["train", "dev", *expected]


@pytest.mark.parametrize(
    ("test", "pattern"),
    [
        ({"train": "test-clean"}, "prepare.splits.test: 'train' cannot name a test set"),
        (["test clean"], "'test clean' cannot name a test set.*use a mapping \\{name: split\\}"),
        ({"../up": "x"}, "'../up' cannot name a test set"),
        ({}, "names no test set"),
        ({"clean": None}, "prepare.splits.test.clean = None must be a split name or a list of names"),
        ({"a": "x", "b": "x"}, "names 'x' for both a and b"),
        (["dev", "x"], "'dev' cannot name a test set"),
    ],
)
def test_bad_test_set_names_are_user_errors(test, pattern) -> None:
    with pytest.raises(AsrflowError, match=pattern):
        PrepareConfig.from_section({"splits": {"train": "train", "dev": "dev", "test": test}})


def test_several_test_sets_get_a_manifest_each_kept_whole(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    for name, seconds in (("a", 0.5), ("b", 0.5), ("c", 0.5), ("d", 0.5), ("t1", 0.5), ("t2", 40.0), ("t3", 0.5)):
        write_tone(corpus / f"{name}.wav", seconds, rate=8000)
    (corpus / "train.tsv").write_text("a.wav\tone\nb.wav\ttwo\nc.wav\tthree\nd.wav\tfour\n")
    (corpus / "clean.tsv").write_text("t1.wav\tfive\nt2.wav\tsix\n")
    (corpus / "other.tsv").write_text("t3.wav\tseven\n")
    section = {"corpus": "folder", "corpus_dir": str(corpus), "max_duration_s": 30.0}
    named = {"train": "train", "dev": None, "test": {"clean": "clean", "more/other": "other"}}
    summary = prepare_corpus(PrepareConfig.from_section({**section, "splits": named}), tmp_path / "out", seed=0)

    assert list_test_sets(tmp_path / "out") == ["clean", "more/other"]
    assert json.loads((tmp_path / "out" / "splits.json").read_text()) == {"test": ["clean", "more/other"]}
    assert {name: s.utterances for name, s in summary.splits.items()} == {
        "train": 3,
        "dev": 1,
        "clean": 2,
        "more/other": 1,
    }
    assert ids(tmp_path / "out" / "clean_cuts.jsonl.gz") == ["t1", "t2"]  # the 40 s one is kept: a test set is whole
    assert ids(tmp_path / "out" / "more" / "other_cuts.jsonl.gz") == ["t3"]
    assert len(RecordingSet.from_file(tmp_path / "out" / "more" / "other_recordings.jsonl.gz")) == 1
    assert not (tmp_path / "out" / "test_cuts.jsonl.gz").exists()
    assert set(json.loads((tmp_path / "out" / "summary.json").read_text())["splits"]) == set(summary.splits)

    # One test set named test: the layout of before, no splits.json.
    single = {"train": "train", "dev": None, "test": "clean"}
    prepare_corpus(PrepareConfig.from_section({**section, "splits": single}), tmp_path / "one", seed=0)
    assert not (tmp_path / "one" / "splits.json").exists() and list_test_sets(tmp_path / "one") == ["test"]
    assert ids(tmp_path / "one" / "test_cuts.jsonl.gz") == ["t1", "t2"]
