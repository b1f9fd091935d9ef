"""prepare at realistic shapes: a killed run, carving by speaker (its memory: tests/test_stage_memory.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import yaml
from lhotse import CutSet, Recording, RecordingSet, SupervisionSegment, SupervisionSet
from lhotse.cut import MultiCut

from asrflow.data.prepare.audio_checks import open_recording
from asrflow.data.prepare.config import PrepareConfig
from asrflow.data.prepare.corpus import prepare_corpus
from asrflow.data.prepare.split_writer import cut_dict, recording_dict, utterance_cut
from asrflow.data.prepare.spool import SortedSpool
from tests.support.corpora import copied_folder_corpus

REPO = Path(__file__).resolve().parents[2]


def folder_config(corpus: Path, **overrides) -> PrepareConfig:
    splits = {"train": "train", "dev": "dev", "test": "test"}
    return PrepareConfig.from_section({"corpus": "folder", "corpus_dir": str(corpus), "splits": splits, **overrides})


@pytest.mark.slow
def test_a_killed_prepare_leaves_no_partial_output_and_a_rerun_succeeds(tmp_path: Path) -> None:
    corpus = copied_folder_corpus(tmp_path, 2000)
    out = tmp_path / "manifests"
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["prepare"].update(
        corpus="folder", corpus_dir=str(corpus), splits={"train": "train", "dev": "dev", "test": "test"}
    )
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(params))
    command = [sys.executable, "-m", "stages.prepare", "--params", str(params_file), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not any(tmp_path.glob(".manifests.*.tmp/manifests/rejected.jsonl")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # well into reading the corpus
    assert process.poll() is None, "prepare ended before it could be killed mid-way"
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not out.exists()
    assert not (tmp_path / "manifests.rejected.jsonl").exists()

    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["splits"]["train"]["utterances"] == 2000 * 48 // 50
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".manifests")) == []  # swept


def test_carved_splits_never_share_a_speaker(tmp_path: Path) -> None:
    corpus = copied_folder_corpus(tmp_path, 400)
    config = folder_config(corpus, splits={"train": "train", "dev": None, "test": None}, dev_fraction=0.1)
    summary = prepare_corpus(config, tmp_path / "out", seed=3)
    speakers = {
        split: {c.supervisions[0].speaker for c in CutSet.from_file(tmp_path / "out" / f"{split}_cuts.jsonl.gz")}
        for split in ("train", "dev", "test")
    }
    assert speakers["train"] and speakers["dev"] and speakers["test"]
    assert not speakers["train"] & speakers["dev"] and not speakers["train"] & speakers["test"]
    assert not speakers["dev"] & speakers["test"]
    assert summary.splits["dev"].utterances >= round(0.1 * 392)


def test_without_speakers_carving_keeps_each_recording_in_one_split(tmp_path: Path) -> None:
    rate = 8000
    data = tmp_path / "train"
    data.mkdir()
    with open(data / "wav.scp", "w") as scp, open(data / "segments", "w") as seg, open(data / "text", "w") as txt:
        for rec in range(12):
            sf.write(tmp_path / f"r{rec}.wav", 0.1 * np.ones(4 * rate, dtype=np.float32), rate)
            scp.write(f"r{rec} r{rec}.wav\n")
            for k in range(3):
                seg.write(f"r{rec}-u{k} r{rec} {k:.1f} {k + 1:.1f}\n")
                txt.write(f"r{rec}-u{k} HELLO\n")
    config = PrepareConfig.from_section(
        {"corpus": "kaldi", "corpus_dir": str(tmp_path), "splits": {"train": "train", "dev": None, "test": None}}
    )
    prepare_corpus(config, tmp_path / "out", seed=0)
    recordings = {
        split: {c.recording_id for c in CutSet.from_file(tmp_path / "out" / f"{split}_cuts.jsonl.gz")}
        for split in ("train", "dev", "test")
    }
    assert all(recordings.values())
    assert sum(len(r) for r in recordings.values()) == 12  # no recording in two splits


def test_utterance_cut_is_what_lhotse_trims(tmp_path: Path) -> None:
    sf.write(tmp_path / "mono.wav", 0.1 * np.ones(16000, dtype=np.float32), 16000)
    sf.write(tmp_path / "stereo.wav", 0.1 * np.ones((16000, 2), dtype=np.float32), 16000)
    for name, channel in (("mono", 0), ("stereo", [0, 1]), ("stereo", 1)):
        recording = RecordingSet.from_recordings([Recording.from_file(tmp_path / f"{name}.wav")])
        supervision = SupervisionSegment(
            "u", recording[0].id, start=0.25, duration=0.5, channel=channel, text="HI", speaker="s1", language="en"
        )
        lhotse_cut = next(
            iter(
                CutSet.from_manifests(recordings=recording, supervisions=SupervisionSet.from_segments([supervision]))
                .trim_to_supervisions(keep_overlapping=False)
                .to_eager()
            )
        )
        ours = utterance_cut(recording[0], supervision)
        assert ours.to_dict() == lhotse_cut.to_dict()
        assert cut_dict(recording_dict(recording[0]), supervision) == lhotse_cut.to_dict()
        assert isinstance(ours, MultiCut) == isinstance(channel, list)


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_sorted_spool_is_a_stable_sort(tmp_path: Path, chunk: int) -> None:
    spool = SortedSpool(tmp_path, "x", chunk_lines=chunk)
    pairs = [("b", "1"), ("a", "2"), ("b", "3"), ("c", "4"), ("a", "5"), ("a", "6"), ("b", "7")]
    for key, line in pairs:
        spool.add(key, line)
    assert list(spool.drain()) == sorted(pairs, key=lambda pair: pair[0])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("suffix", "rate", "channels"), [(".wav", 16000, 1), (".flac", 22050, 2), (".ogg", 44100, 1)])
def test_open_recording_gives_what_lhotse_reads(tmp_path: Path, suffix: str, rate: int, channels: int) -> None:
    path = tmp_path / f"a{suffix}"
    sf.write(path, 0.1 * np.ones((int(0.73 * rate), channels), dtype=np.float32), rate)
    assert open_recording(path, "a").to_dict() == Recording.from_file(path, recording_id="a").to_dict()


def test_a_recipe_runs_again_only_when_its_corpus_changes(tmp_path: Path) -> None:
    corpus = tmp_path / "yesno"
    shutil.copytree(REPO / "data" / "corpora" / "yesno", corpus)
    config = PrepareConfig.from_section({"corpus": "yesno", "corpus_dir": str(corpus)})
    out = tmp_path / "manifests"
    key = tmp_path / "manifests.recipe" / "key.json"
    prepare_corpus(config, out, seed=0)
    first = key.stat().st_mtime_ns
    moved = PrepareConfig.from_section({"corpus": "yesno", "corpus_dir": str(corpus), "text": {"case": "lower"}})
    prepare_corpus(moved, out, seed=0)  # a params change: the recipe's own manifests are reused
    assert key.stat().st_mtime_ns == first
    audio = next(corpus.rglob("*.wav"))
    os.utime(audio, ns=(audio.stat().st_atime_ns, audio.stat().st_mtime_ns + 10**9))
    prepare_corpus(config, out, seed=0)
    assert key.stat().st_mtime_ns != first
