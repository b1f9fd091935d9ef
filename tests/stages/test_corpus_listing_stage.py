"""The corpus_listing stage: the listing changes exactly when a corpus file is added, removed,
resized or touched, its file is rewritten only then, and a missing corpus is one clear line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asrflow.errors import EXIT_USER_ERROR
from stages import corpus_listing
from tests.support.repo import write_shipped_params

REPO = Path(__file__).resolve().parents[2]


def listing_after(tmp_path: Path, params: Path) -> tuple[str, int]:
    """Run the stage; the listing's text and its modification time (ns)."""
    out = tmp_path / "listing.tsv"
    corpus_listing.main(["--params", str(params), "--out", str(out)])
    return out.read_text(), out.stat().st_mtime_ns


def test_the_listing_follows_the_files_and_is_rewritten_only_when_it_changes(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "spk1").mkdir(parents=True)
    (corpus / "spk1" / "a.wav").write_bytes(b"RIFF" + bytes(100))
    (corpus / "b.wav").write_bytes(b"RIFF" + bytes(50))
    params = write_shipped_params(tmp_path, {"prepare.corpus_dir": str(corpus)})

    text, written = listing_after(tmp_path, params)
    lines = text.splitlines()
    assert lines[0] == f"# {corpus}"
    assert [line.split("\t")[:2] for line in lines[1:]] == [["b.wav", "54"], ["spk1/a.wav", "104"]]
    os.utime(tmp_path / "listing.tsv", ns=(written - 10**9, written - 10**9))
    assert listing_after(tmp_path, params) == (text, written - 10**9)  # unchanged: the file is kept

    stat = (corpus / "b.wav").stat()
    os.utime(corpus / "b.wav", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    touched, _ = listing_after(tmp_path, params)
    assert touched != text and touched.splitlines()[2] == lines[2]
    (corpus / "spk1" / "a.wav").unlink()
    assert [line.split("\t")[0] for line in listing_after(tmp_path, params)[0].splitlines()] == [f"# {corpus}", "b.wav"]


def test_a_missing_corpus_is_one_line_and_exit_2(tmp_path):
    params = write_shipped_params(tmp_path, {"prepare.corpus_dir": str(tmp_path / "nowhere")})
    result = subprocess.run(
        [sys.executable, "-m", "stages.corpus_listing", "--params", str(params), "--out", str(tmp_path / "l.tsv")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == EXIT_USER_ERROR, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{tmp_path / 'nowhere'}" in errors[0] and "prepare.corpus_dir" in errors[0], (
        result.stderr
    )
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "l.tsv").exists()


def test_a_corpus_dir_left_out_is_named(tmp_path, capsys):
    params = write_shipped_params(tmp_path, {"prepare": {"corpus": "yesno"}})
    with pytest.raises(SystemExit) as stopped:
        corpus_listing.main(["--params", str(params), "--out", str(tmp_path / "l.tsv")])
    assert stopped.value.code == EXIT_USER_ERROR
    assert "prepare.corpus_dir is not set" in capsys.readouterr().err
