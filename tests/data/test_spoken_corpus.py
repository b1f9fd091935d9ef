"""The espeak-ng spoken corpus: deterministic by seed, split by voice, exact transcripts, read by prepare."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import soundfile as sf

from asrflow.errors import AsrflowError
from asrflow.generate import spoken_corpus
from tests.support.repo import write_shipped_params

REPO = Path(__file__).resolve().parents[2]
MISSING = spoken_corpus.espeak_missing()
pytestmark = pytest.mark.skipif(
    MISSING is not None, reason=f"{MISSING}; `make test` installs it where it runs as root with apt"
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


def test_same_seed_same_transcripts_and_audio_lengths(corpora: dict[str, Path]) -> None:
    a, again, b = corpora["a"], corpora["a_again"], corpora["b"]
    for split in spoken_corpus.SPLITS:
        assert (a / f"{split}.tsv").read_bytes() == (again / f"{split}.tsv").read_bytes()
    for split_rows in rows(a).values():
        for path, _, _ in split_rows:
            assert sf.info(str(a / path)).frames == sf.info(str(again / path)).frames
    assert rows(a) != rows(b)


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


def test_a_folder_not_empty_is_refused(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(AsrflowError, match="not empty"):
        spoken_corpus.generate(tmp_path, utterances=3, voices=3)
    assert (tmp_path / "keep.txt").read_text() == "mine"
