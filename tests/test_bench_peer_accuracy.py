"""bench.peer_accuracy: asrflow and SpeechBrain's own training loop for the same minutes, scored alike."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from lhotse import MonoCut, Recording, SupervisionSegment
from lhotse.audio import AudioSource

from bench.common import ratio
from bench.peer.install import PEER_VERSION, install_peer
from bench.peer_accuracy import main, speechbrain_options, write_csv
from tests.support.repo import repo_params
from tests.test_bench_accuracy_at_time import check_scored_run


def skip_without_the_peer(record: dict | None = None) -> None:
    """Skip, saying why, where SpeechBrain cannot be installed or imported here (before a run), or where the
    run's ``record`` says it was not (then it has no ratio)."""
    problem = install_peer() if record is None else record.get("reason")
    if record is not None and record.get("status") == "peer unavailable":
        assert problem and "wer_ratio" not in record and "speechbrain" not in record, record
        pytest.skip(f"SpeechBrain {PEER_VERSION} became unavailable during the run: {problem}")
    if record is None and problem is not None:
        pytest.skip(f"SpeechBrain {PEER_VERSION} is not available here: {problem}")


def cut_of(source: AudioSource, *, start: float = 0.0, duration: float = 1.0, text: str = "YES NO") -> MonoCut:
    """A cut of ``duration`` s from ``start`` of a 2 s, 8 kHz recording read from ``source``."""
    recording = Recording(id="r1", sources=[source], sampling_rate=8000, num_samples=16000, duration=2.0)
    supervision = SupervisionSegment(id="s1", recording_id="r1", start=0.0, duration=duration, text=text)
    return MonoCut(id="c1", start=start, duration=duration, channel=0, recording=recording, supervisions=[supervision])


def test_csv_rows_name_the_file_the_span_in_samples_and_the_transcript(tmp_path):
    cut = cut_of(AudioSource(type="file", channels=[0], source="/audio/r1.wav"), start=0.5, duration=1.25)
    mean = write_csv([cut], tmp_path / "train.csv")
    with open(tmp_path / "train.csv") as rows:
        (row,) = csv.DictReader(rows)
    assert mean == 1.25
    assert row == {
        "ID": "c1",
        "duration": "1.25",
        "wav": "/audio/r1.wav",
        "start": "4000",
        "stop": "14000",
        "sample_rate": "8000",
        "wrd": "YES NO",
    }


def test_audio_that_is_not_one_file_is_refused_naming_the_cut(tmp_path):
    cut = cut_of(AudioSource(type="command", channels=[0], source="sox r1.sph -t wav - |"))
    with pytest.raises(ValueError, match="cut c1: its audio is not one file"):
        write_csv([cut], tmp_path / "train.csv")


def test_speechbrain_gets_asrflows_settings_and_time_masks_of_the_mean_utterance():
    params = repo_params()
    data, optim = params["train"]["data"], params["train"]["optim"]
    options = speechbrain_options(params, {"mean_train_s": 6.0, "tokenizer": "t.model"}, minutes=30)
    assert options["model"] == params["train"]["model"] and options["minutes"] == 30
    assert options["optim"]["lr"] == optim["lr"] and options["optim"]["warmup_steps"] == optim["warmup_steps"]
    assert options["data"]["max_duration_s"] == data["max_duration_s"]
    assert options["data"]["freq_mask_width"] == data["freq_mask_width"]
    assert options["data"]["time_mask_frames"] == round(data["time_mask_ratio"] * 600)  # 10 ms frames
    assert options["sampling_rate"] == params["features"]["sampling_rate"] and options["tokenizer"] == "t.model"
    assert options["frame_shift_s"] == params["features"]["frame_shift_s"]


@pytest.mark.pipeline
@pytest.mark.bench
def test_quick_run_trains_both_sides_for_the_same_minutes_and_scores_both(tmp_path):
    skip_without_the_peer()
    records = main(["--quick", "--workdir", str(tmp_path), "--precisions", "fp32"])
    (found,) = [record for record in records if record["benchmark"] == "peer_accuracy"]
    skip_without_the_peer(found)
    ours = found["asrflow"]
    assert ours["train_exit_code"] == 75  # stopped by SIGTERM at its time, its step saved
    check_scored_run(ours, tmp_path / "peer-accuracy-asrflow-fp32", Path(found["data"]))
    theirs = found["speechbrain"]
    assert theirs["steps"] > 0 and theirs["params"] > 0 and theirs["peak_tree_pss_mb"] > 0
    assert found["wer_ratio"] == pytest.approx(ratio(ours["wer"], theirs["wer"]), rel=1e-3)  # printed: 4 digits
    assert found["cer_ratio"] == pytest.approx(ratio(ours["cer"], theirs["cer"]), rel=1e-3)
    assert (tmp_path / "speechbrain-csv" / "test.csv").read_text().count("\n") == 1 + 30  # yesno's 30 test files


@pytest.mark.pipeline
def test_one_side_alone_is_trained_scored_and_given_no_ratio(tmp_path):
    skip_without_the_peer()
    records = main(["--quick", "--workdir", str(tmp_path), "--precisions", "fp32", "--sides", "speechbrain"])
    (found,) = [record for record in records if record["benchmark"] == "peer_accuracy"]
    skip_without_the_peer(found)
    assert "asrflow" not in found and "wer_ratio" not in found
    assert not (tmp_path / "peer-accuracy-asrflow-fp32").exists()
    assert found["speechbrain"]["steps"] > 0 and found["speechbrain"]["params"] > 0
