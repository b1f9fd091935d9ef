"""The espeak-ng spoken corpus: deterministic by seed, split by voice, exact transcripts, read by prepare;
its sentence source (Debian's fortunes): normalised unique sentences, test voices and sentences unseen in
train, sizes it cannot reach refused."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import soundfile as sf

from asrflow.data.prepare.text import TextConfig, normalize_text
from asrflow.errors import AsrflowError
from asrflow.generate import sentences, spoken_corpus
from tests.support.repo import write_shipped_params

REPO = Path(__file__).resolve().parents[2]
MISSING = spoken_corpus.espeak_missing()
needs_espeak = pytest.mark.skipif(
    MISSING is not None, reason=f"{MISSING}; `make test` installs it where it runs as root with apt"
)
NO_FORTUNES = sentences.fortunes_missing()
needs_fortunes = pytest.mark.skipif(
    NO_FORTUNES is not None, reason=f"{NO_FORTUNES}; `make test` installs it where it runs as root with apt"
)

SIZE = {"utterances": 40, "voices": 4, "jobs": 2}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spoken")
    made = {"a": (7, root / "a"), "a_again": (7, root / "a_again"), "b": (8, root / "b")}
    for name, (seed, folder) in made.items():
        spoken_corpus.generate(folder, seed=seed, **{**SIZE, **({"utterances": 12} if name == "b" else {})})
    return {name: folder for name, (_, folder) in made.items()}


def rows(corpus: Path) -> dict[str, list[list[str]]]:
    return {
        split: [line.split("\t") for line in (corpus / f"{split}.tsv").read_text().splitlines()]
        for split in spoken_corpus.SPLITS
    }


@pytest.mark.slow
@needs_espeak
def test_same_seed_same_transcripts_and_audio_lengths(corpora: dict[str, Path]) -> None:
    a, again, b = corpora["a"], corpora["a_again"], corpora["b"]
    for split in spoken_corpus.SPLITS:
        assert (a / f"{split}.tsv").read_bytes() == (again / f"{split}.tsv").read_bytes()
    for split_rows in rows(a).values():
        for path, _, _ in split_rows:
            assert sf.info(str(a / path)).frames == sf.info(str(again / path)).frames
    assert rows(a) != rows(b)


@needs_espeak
def test_sixteen_khz_flac_and_sizes_as_recorded(corpora: dict[str, Path]) -> None:
    corpus = corpora["a"]
    info = spoken_corpus.read_info(corpus)
    all_rows = [row for split_rows in rows(corpus).values() for row in split_rows]
    assert info.utterances == len(all_rows) == SIZE["utterances"]
    total = 0
    for path, _, _ in all_rows:
        audio = sf.info(str(corpus / path))
        assert (audio.format, audio.samplerate, audio.channels, audio.subtype) == ("FLAC", 16000, 1, "PCM_16")
        assert audio.frames > 0.3 * 16000
        total += audio.frames
    assert info.audio_s == pytest.approx(total / 16000, abs=1e-3)


@needs_espeak
def test_split_by_voice_and_transcripts_from_the_word_list(corpora: dict[str, Path]) -> None:
    words = set(spoken_corpus.load_words())
    voices_of = {split: {voice for _, _, voice in split_rows} for split, split_rows in rows(corpora["a"]).items()}
    assert all(voices_of.values()), voices_of
    assert not (
        voices_of["train"] & voices_of["dev"]
        or voices_of["train"] & voices_of["test"]
        or voices_of["dev"] & voices_of["test"]
    )
    assert len(set().union(*voices_of.values())) <= SIZE["voices"]
    for split, split_rows in rows(corpora["a"]).items():
        for path, text, voice in split_rows:
            assert path.startswith(f"audio/{split}/{voice}/")
            assert 2 <= len(text.split()) <= 12 and set(text.split()) <= words, text


@pytest.mark.slow
@needs_espeak
def test_prepare_reads_it_with_no_rejection(corpora: dict[str, Path], tmp_path: Path) -> None:
    params = write_shipped_params(
        tmp_path,
        {
            "prepare.corpus": "folder",
            "prepare.corpus_dir": str(corpora["a"]),
            "prepare.splits": {"train": "train", "dev": "dev", "test": "test"},
        },
    )
    out = tmp_path / "manifests"
    result = subprocess.run(
        [sys.executable, "-m", "stages.prepare", "--params", str(params), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rejected"]["total"] == 0 and summary["items_total"] == SIZE["utterances"], summary
    assert sum(split["utterances"] for split in summary["splits"].values()) == SIZE["utterances"]


@needs_espeak
def test_a_folder_not_empty_is_refused(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(AsrflowError, match="not empty"):
        spoken_corpus.generate(tmp_path, utterances=3, voices=3)
    assert (tmp_path / "keep.txt").read_text() == "mine"


#: A tiny corpus of sentences: seed 3 gives its 30 voices' 24 utterances 3 test and 4 dev ones.
SENTENCE_SIZE = {"utterances": 24, "voices": 30, "jobs": 2, "text": "sentences", "seed": 3}
NORMAL = re.compile(r"[a-z]+('[a-z]+)*( [a-z]+('[a-z]+)*)*")


@pytest.fixture(scope="module")
def sentence_corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sentences")
    for name in ("a", "a_again"):
        spoken_corpus.generate(root / name, **SENTENCE_SIZE)
    return {name: root / name for name in ("a", "a_again")}


def test_a_fortune_becomes_normalised_sentences_and_unplain_ones_are_dropped() -> None:
    fortune = (
        "Don't panic.  It's only \u2018a\u2019 test -- of the well-known kind!\n"
        "\t\t-- Someone Famous\n%\nCall 555 1234 now.  The IBM way is here.  Ok go.\n"
        "Mr. Smith went home.  Is this (really) it?\n%\n"
    )
    raw = sentences.raw_sentences(fortune)
    assert raw[0] == "Don't panic." and "Someone" not in " ".join(raw), raw
    kept = [sentences.normalise_sentence(sentence) for sentence in raw]
    assert [sentence for sentence in kept if sentence] == [
        "it's only a test of the well known kind",
        "smith went home",
        "is this really it",
    ], kept


@needs_fortunes
def test_the_fortunes_yield_normalised_unique_sentences_enough_for_fifty_hours() -> None:
    found = sentences.load_sentences()
    assert len(found) == len(set(found)) and len(found) > 10_000, len(found)
    config = TextConfig(case="lower")
    for sentence in found:
        assert NORMAL.fullmatch(sentence) and normalize_text(sentence, config) == sentence, sentence
        assert 3 <= len(sentence.split()) <= 20, sentence
    voices = spoken_corpus.make_voices(100, 0)
    splits = spoken_corpus.split_of_voices(voices, 0)
    for hours in (10, 25, 50):
        size = {"hours": hours, "utterances": None, "source": "fortunes"}
        pools = spoken_corpus.sentence_pools(found, seed=0, voices=voices, splits=splits, size=size, max_repeats=5)
        assert not set(pools["test"]) & (set(pools["train"]) | set(pools["dev"])), hours
        assert not set(pools["dev"]) & set(pools["train"]), hours


def test_a_size_needing_test_sentences_in_train_is_refused_naming_the_counts() -> None:
    found = [
        f"sentence number {word} here" for word in (["one", "two", "three", "four", "five", "six", "seven", "eight"])
    ]
    voices = spoken_corpus.make_voices(3, 0)
    splits = spoken_corpus.split_of_voices(voices, 0)
    fits = {"hours": None, "utterances": 8, "source": "mine.txt"}
    pools = spoken_corpus.sentence_pools(found, seed=0, voices=voices, splits=splits, size=fits, max_repeats=1)
    assert sorted(sentence for pool in pools.values() for sentence in pool) == sorted(found)
    with pytest.raises(AsrflowError, match=r"mine\.txt: found 8 usable sentences, 9 utterances need 9 "):
        spoken_corpus.sentence_pools(
            found, seed=0, voices=voices, splits=splits, size={**fits, "utterances": 9}, max_repeats=1
        )


@needs_espeak
def test_a_text_with_too_few_sentences_for_the_hours_is_refused(tmp_path: Path) -> None:
    text = tmp_path / "few.txt"
    text.write_text("One short sentence here. Another one there!\n%\nA third one is here.\nNo 42 digits.\n")
    with pytest.raises(AsrflowError, match=r"few\.txt: found 3 usable sentences, 1 h \(about \d+ utterances\) need"):
        spoken_corpus.generate(tmp_path / "out", hours=1, voices=30, text=text)
    assert not (tmp_path / "out").exists()


@needs_espeak
@needs_fortunes
def test_sentences_same_seed_same_corpus_test_voices_and_sentences_unseen(sentence_corpora: dict[str, Path]) -> None:
    a, again = sentence_corpora["a"], sentence_corpora["a_again"]
    for split in spoken_corpus.SPLITS:
        assert (a / f"{split}.tsv").read_bytes() == (again / f"{split}.tsv").read_bytes()
    found = set(sentences.load_sentences())
    split_rows = rows(a)
    voices = {split: {voice for _, _, voice in lines} for split, lines in split_rows.items()}
    texts = {split: [text for _, text, _ in lines] for split, lines in split_rows.items()}
    assert all(texts.values()) and sum(map(len, texts.values())) == SENTENCE_SIZE["utterances"], texts
    assert not voices["test"] & (voices["train"] | voices["dev"]) and not voices["dev"] & voices["train"]
    assert not set(texts["test"]) & (set(texts["train"]) | set(texts["dev"]))
    assert not set(texts["dev"]) & set(texts["train"])
    assert set().union(*texts.values()) <= found
    assert len(set(texts["test"])) == len(texts["test"]) and len(set(texts["dev"])) == len(texts["dev"])
    info = spoken_corpus.read_info(a)
    assert info.options["text"] == "sentences" and info.options["sentences"] == len(found)
