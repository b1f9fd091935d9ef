"""``asrflow transcribe`` on a yesno model trained in this session (``yesno_model``, tests.support.trained_model).

The model and the audio are copied to a temporary folder that is also the working
directory, so these tests also show that a bundle works outside the repository.
Accuracy is checked on held-out (test split) files; invariance to format, rate and
batching on train-split files, where the small model is confident, so that a flip of a
borderline word cannot pass for a pipeline difference.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
import torchaudio.functional as AF

from asrflow.evaluation.metrics import score_corpus
from asrflow.serving.cli import main
from tests.support.trained_model import split_files

#: Files of each split copied into the working folder.
NUM_FILES = 5
#: Word error rate the model must stay under on the held-out files (>= 90% of words right).
MAX_WER = 0.10


@pytest.fixture(scope="module")
def workdir(yesno_model, yesno_data, tmp_path_factory) -> Path:
    """A folder outside the repository: ``model.pt``, ``test/*.wav`` and ``train/*.wav`` (8 kHz mono)."""
    folder = tmp_path_factory.mktemp("transcribe")
    shutil.copy(yesno_model, folder / "model.pt")
    for split in ("test", "train"):
        (folder / split).mkdir()
        for path, _ in split_files(yesno_data, split)[:NUM_FILES]:
            shutil.copy(path, folder / split / path.name)
    return folder


@pytest.fixture
def refs(yesno_data) -> dict[str, str]:
    """Held-out file (relative to ``workdir``) -> reference transcript."""
    return {f"test/{path.name}": text for path, text in split_files(yesno_data)[:NUM_FILES]}


@pytest.fixture
def train_files(yesno_data) -> list[str]:
    """Train-split files, relative to ``workdir``."""
    return [f"train/{path.name}" for path, _ in split_files(yesno_data, "train")[:NUM_FILES]]


def transcribe(capsys, *args: str) -> tuple[int, list[tuple[str, str]], str]:
    """Run ``asrflow transcribe ARGS`` in this process: (exit code, (path, text) per stdout line, stderr)."""
    code = main(["transcribe", *args])
    out, err = capsys.readouterr()
    rows = [tuple(line.split("\t")) for line in out.splitlines()]
    assert all(len(row) == 2 for row in rows), out
    return code, rows, err


def test_transcribes_held_out_files_from_another_folder(workdir, refs, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    code, rows, err = transcribe(capsys, "--model", "model.pt", *refs)
    assert code == 0, err
    assert [path for path, _ in rows] == list(refs)
    assert score_corpus(refs, dict(rows)).wer <= MAX_WER, rows


def test_beam_search_transcribes_too(workdir, refs, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    code, rows, err = transcribe(capsys, "--model", "model.pt", "--decoder", "beam", "--beam-size", "4", *refs)
    assert code == 0, err
    assert [path for path, _ in rows] == list(refs)
    assert score_corpus(refs, dict(rows)).wer <= MAX_WER, rows


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_the_device_gives_the_same_transcripts(workdir, refs, monkeypatch, capsys, device):
    """``--device`` runs the encoder there (its default, auto, picks a GPU when there is one); the transcripts are
    the CPU's."""
    monkeypatch.chdir(workdir)
    code, on_cpu, err = transcribe(capsys, "--model", "model.pt", "--device", "cpu", *refs)
    assert code == 0, err
    code, on_device, err = transcribe(capsys, "--model", "model.pt", "--device", device, *refs)
    assert code == 0, err
    assert on_device == on_cpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
def test_a_gpu_asked_for_where_there_is_none_is_one_line(workdir, refs, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    code = main(["transcribe", "--model", "model.pt", "--device", "cuda", *refs])
    out, err = capsys.readouterr()
    assert code == 2 and not out
    assert err.count("\n") == 1 and err.startswith("error: --device = cuda, but torch "), err


def test_batching_keeps_input_order_and_transcripts(workdir, train_files, monkeypatch, capsys):
    """One file per batch vs all in one batch: same lines, in the order given (not by duration)."""
    monkeypatch.chdir(workdir)
    paths = sorted(train_files, key=lambda name: -sf.info(name).duration)
    _, one_per_batch, _ = transcribe(capsys, "--model", "model.pt", "--batch-seconds", "1", *paths)
    _, one_batch, _ = transcribe(capsys, "--model", "model.pt", "--batch-seconds", "1000", *paths)
    assert [path for path, _ in one_batch] == paths
    assert one_per_batch == one_batch


def _write_variants(source: Path, folder: Path) -> list[str]:
    """The same (mono) audio as 16 kHz FLAC, 22.05 kHz 24-bit WAV and 44.1 kHz WAV; names relative to cwd."""
    audio, rate = sf.read(source, dtype="float32")  # (samples,) at 8 kHz
    signal = torch.from_numpy(audio)
    folder.mkdir(exist_ok=True)
    names = []
    for suffix, sampling_rate, subtype in (
        ("16k.flac", 16000, "PCM_16"),
        ("22k.wav", 22050, "PCM_24"),
        ("44k.wav", 44100, "PCM_16"),
    ):
        name = folder / f"{source.stem}_{suffix}"
        sf.write(name, AF.resample(signal, rate, sampling_rate).numpy(), sampling_rate, subtype=subtype)
        names.append(str(name))
    return names


def test_formats_and_rates_give_the_original_transcript(workdir, train_files, monkeypatch, capsys):
    """8 kHz WAV originals and their 16 kHz FLAC, 22.05 kHz and 44.1 kHz WAV copies: equal transcripts."""
    monkeypatch.chdir(workdir)
    variants = {original: _write_variants(Path(original), Path("variants")) for original in train_files[:3]}
    args = [name for original, names in variants.items() for name in (original, *names)]
    code, rows, err = transcribe(capsys, "--model", "model.pt", *args)
    assert code == 0, err
    texts = dict(rows)
    assert len(texts) == len(args)
    for original, names in variants.items():
        assert texts[original]
        assert {name: texts[name] for name in names} == {name: texts[original] for name in names}


def test_stereo_is_averaged_to_mono(workdir, train_files, monkeypatch, capsys):
    """Two equal channels are the mono signal: the same samples after the downmix, the same transcript."""
    from asrflow.serving.inference import audio_cut

    monkeypatch.chdir(workdir)
    original = train_files[0]
    audio, rate = sf.read(original, dtype="float32")  # (samples,)
    sf.write("stereo.wav", np.stack([audio, audio], axis=1), rate)  # (samples, 2)
    code, rows, err = transcribe(capsys, "--model", "model.pt", original, "stereo.wav")
    assert code == 0, err
    np.testing.assert_allclose(audio_cut("stereo.wav").load_audio()[0], audio, atol=1e-4)
    assert rows[1][1] == rows[0][1]


@pytest.mark.slow
def test_bad_files_are_named_and_the_good_one_is_still_transcribed(workdir, refs, tmp_path):
    """The installed command, in a fresh process: one line per bad file naming it, why and what to do, no
    traceback; the good files (before, between and after the bad ones) transcribed; then exit 1."""
    names = list(refs)
    good = [workdir / names[0], workdir / names[1]]
    corrupt = tmp_path / "corrupt.wav"
    corrupt.write_bytes(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes())
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    no_samples = tmp_path / "no_samples.wav"
    sf.write(no_samples, np.zeros(0, dtype=np.float32), 16000)
    short = tmp_path / "short.wav"
    sf.write(short, np.zeros(800, dtype=np.float32), 16000)  # 0.05 s
    bad = {
        tmp_path / "missing.wav": "no such file; check the path (a relative one is read from the current folder)",
        corrupt: "cannot read audio (Format not recognised); check the file or convert it to WAV/FLAC",
        empty: "the file is empty (0 bytes); write it again or leave it out",
        no_samples: "cannot read audio (it holds no audio); check the file or convert it to WAV/FLAC",
        short: "too short to transcribe (0.050 s of audio; at least 0.1 s is needed); leave it out or pad it",
        tmp_path: "is a folder, not an audio file; name the audio files in it",
    }
    missing, *others = bad
    paths = [missing, good[0], *others[:2], good[1], *others[2:]]

    script = Path(sys.executable).with_name("asrflow")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "asrflow.serving.cli"]
    result = subprocess.run(
        [*command, "transcribe", "--model", str(workdir / "model.pt"), *map(str, paths)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    rows = [tuple(line.split("\t")) for line in result.stdout.splitlines()]
    assert [path for path, _ in rows] == [str(path) for path in good], result.stdout
    transcripts = {f"good{index}": text for index, (_, text) in enumerate(rows)}
    references = {f"good{index}": refs[name] for index, name in enumerate(names[:2])}
    assert score_corpus(references, transcripts).wer <= 0.25, rows
    errors = result.stderr.splitlines()
    assert errors == [f"error: {path}: {why}" for path, why in bad.items()] + [
        f"error: {len(bad)} of {len(paths)} files could not be transcribed"
    ], result.stderr


def test_missing_model_is_a_usage_error(tmp_path, capsys):
    code = main(["transcribe", "--model", str(tmp_path / "nope.pt"), str(tmp_path / "a.wav")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "nope.pt" in err and "not found" in err


def test_help_documents_commands_and_exit_codes(capsys):
    from asrflow.decoding.ctc import DECODER_KINDS
    from asrflow.serving import cli
    from asrflow.serving.export import FORMATS

    assert cli.DECODERS == DECODER_KINDS and cli.EXPORT_FORMATS == FORMATS
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "transcribe" in text and "export" in text
    with pytest.raises(SystemExit):
        main(["transcribe", "--help"])
    text = capsys.readouterr().out
    assert "exit status" in text and "--decoder" in text and "--beam-size" in text
    with pytest.raises(SystemExit) as exit_info:
        main(["transcribe", "--model", "m.pt", "--decoder", "viterbi", "a.wav"])
    assert exit_info.value.code == 2
