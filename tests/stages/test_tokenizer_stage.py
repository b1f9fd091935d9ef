"""The tokenizer stage as a user runs it: a vocabulary too small for the characters is a clear error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from lhotse import CutSet, Recording, RecordingSet, SupervisionSegment, SupervisionSet

from asrflow.data.manifests import cuts_path
from asrflow.errors import EXIT_USER_ERROR
from stages.tokenizer import main
from tests.support.repo import write_shipped_params

REPO = Path(__file__).resolve().parents[2]
TEXTS = ["YES NO YES", "NO NO YES", "YES YES NO"]


@pytest.fixture
def manifests(tmp_path: Path) -> Path:
    """A train cuts manifest with yesno-like transcripts over generated silence."""
    sf.write(tmp_path / "a.wav", np.zeros(16000, dtype=np.float32), 16000)
    recording = Recording.from_file(tmp_path / "a.wav", recording_id="a")
    supervisions = [SupervisionSegment(f"u{i}", "a", 0.0, 1.0, channel=0, text=text) for i, text in enumerate(TEXTS)]
    cuts = CutSet.from_manifests(
        recordings=RecordingSet.from_recordings([recording]), supervisions=SupervisionSet.from_segments(supervisions)
    ).trim_to_supervisions(keep_overlapping=False)
    folder = tmp_path / "manifests"
    folder.mkdir()
    cuts.to_file(cuts_path(folder, "train"))
    return folder


def params(tmp_path: Path, **tokenizer) -> Path:
    return write_shipped_params(tmp_path, {f"tokenizer.{key}": value for key, value in tokenizer.items()})


def test_char_vocabulary_below_the_characters_exits_2_naming_a_size(tmp_path, manifests, capsys):
    out = tmp_path / "lang"
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "--params",
                str(params(tmp_path, model_type="char", vocab_size=5)),
                "--manifests",
                str(manifests),
                "--out",
                str(out),
            ]
        )
    assert exit_info.value.code == EXIT_USER_ERROR
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "tokenizer.vocab_size = 5" in errors[0] and errors[0].endswith("at least 8")
    assert not out.exists()


def test_the_size_named_works(tmp_path, manifests):
    out = tmp_path / "lang"
    main(
        [
            "--params",
            str(params(tmp_path, model_type="char", vocab_size=8)),
            "--manifests",
            str(manifests),
            "--out",
            str(out),
        ]
    )
    pieces = [line.split()[0] for line in (out / "tokens.txt").read_text().splitlines()]
    assert pieces == ["<blk>", "<unk>", "▁", "E", "S", "Y", "N", "O"]
