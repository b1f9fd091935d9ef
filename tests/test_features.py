"""Fbank extraction with Lhotse: every split, one rate, CMVN statistics, whole-folder output."""

from __future__ import annotations

import json
import os

import pytest
import torch

from asrflow.data.features.cmvn import CMVN_FILE, load_cmvn
from asrflow.data.features.config import check_same_features
from asrflow.data.features.extract import compute_features
from asrflow.data.manifests import load_cuts
from asrflow.errors import EXIT_USER_ERROR, AsrflowError
from tests.support.corpora import feature_config
from tests.support.repo import write_shipped_params


def test_yesno_features_are_80_dim_at_the_target_rate(yesno_data):
    fbank = yesno_data / "fbank"
    for split, count in (("train", 27), ("dev", 3), ("test", 30)):
        cuts = load_cuts(fbank, split)
        assert len(cuts) == count
        cut = next(iter(cuts))
        assert cut.has_features and cut.num_features == 80
        assert cut.sampling_rate == 16000
        assert cut.load_features().shape == (cut.num_frames, 80)
    stats = json.loads((fbank / CMVN_FILE).read_text())
    assert len(stats["norm_means"]) == len(stats["norm_stds"]) == 80
    train_feats = torch.cat([torch.from_numpy(c.load_features()) for c in load_cuts(fbank, "train")])
    normalised = load_cmvn(fbank / CMVN_FILE)(train_feats)
    assert normalised.mean(0).abs().max() < 1e-2
    assert (normalised.std(0) - 1).abs().max() < 1e-2


def test_missing_manifests_are_a_user_error_and_leave_no_output(tmp_path):
    with pytest.raises(AsrflowError, match="train_cuts.jsonl.gz not found"):
        compute_features(tmp_path / "nowhere", tmp_path / "fbank", feature_config(num_jobs=1))
    assert not (tmp_path / "fbank").exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_two_processes_extract_the_same_features_as_one(yesno_data, tmp_path):
    import numpy as np

    compute_features(yesno_data / "manifests", tmp_path / "fbank2", feature_config(num_jobs=2))
    for split in ("dev", "test"):
        one = {cut.id: cut.load_features() for cut in load_cuts(yesno_data / "fbank", split)}
        two = {cut.id: cut.load_features() for cut in load_cuts(tmp_path / "fbank2", split)}
        assert one.keys() == two.keys()
        assert all(np.array_equal(one[key], two[key]) for key in one)


def test_automatic_job_count_follows_the_amount_of_audio(yesno_data):
    from asrflow.data.features.extract import AUDIO_S_PER_JOB, jobs_for

    assert jobs_for(180.0, 8) == 1  # about 3 minutes
    assert jobs_for(4 * AUDIO_S_PER_JOB + 1, 8) == 4
    assert jobs_for(4 * AUDIO_S_PER_JOB + 1, 2) == 2


def test_num_jobs_zero_uses_every_available_core_on_a_large_split():
    import os

    from asrflow.cores import available_cores
    from asrflow.data.features.extract import AUDIO_S_PER_JOB, resolve_jobs

    cores = available_cores()
    assert cores == len(os.sched_getaffinity(0))
    assert resolve_jobs(feature_config(num_jobs=0), cores * AUDIO_S_PER_JOB + 1) == cores
    assert resolve_jobs(feature_config(num_jobs=0), 180.0) == 1  # 3 minutes: one process
    assert resolve_jobs(feature_config(num_jobs=3), 180.0) == 3  # an explicit count is taken as it is


def test_num_jobs_zero_stays_inside_the_threads_snakemake_granted(monkeypatch):
    from asrflow.cores import GRANTED_THREADS_ENV, available_cores
    from asrflow.data.features.extract import AUDIO_S_PER_JOB, resolve_jobs

    monkeypatch.setenv(GRANTED_THREADS_ENV, "1")
    assert available_cores() == 1
    assert resolve_jobs(feature_config(num_jobs=0), 64 * AUDIO_S_PER_JOB) == 1
    for ignored in ("", "0", "all"):  # not a grant: the affinity mask decides
        monkeypatch.setenv(GRANTED_THREADS_ENV, ignored)
        assert available_cores() == len(os.sched_getaffinity(0))


def write_split_manifests(folder, audio_dir, names_by_split) -> None:
    """Cut manifests (one cut per generated 1 s tone) for train/dev/test, as the prepare stage writes them."""
    import numpy as np
    import soundfile as sf
    from lhotse import CutSet, Recording, RecordingSet, SupervisionSegment, SupervisionSet

    from asrflow.data.manifests import cuts_path

    audio_dir.mkdir(parents=True, exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    for split, names in names_by_split.items():
        recordings, supervisions = [], []
        for name in names:
            path = audio_dir / f"{name}.wav"
            sf.write(path, (0.1 * np.sin(np.arange(16000) / 7.0)).astype(np.float32), 16000)
            recordings.append(Recording.from_file(path, recording_id=name))
            supervisions.append(SupervisionSegment(name, name, 0.0, 1.0, channel=0, text="YES"))
        cuts = CutSet.from_manifests(
            recordings=RecordingSet.from_recordings(recordings), supervisions=SupervisionSet.from_segments(supervisions)
        ).trim_to_supervisions(keep_overlapping=False)
        cuts.to_file(cuts_path(folder, split))


def test_a_cut_whose_audio_vanished_is_dropped_and_named(tmp_path, caplog):
    splits = {"train": ["a", "b", "c"], "dev": ["d"], "test": ["e"]}
    write_split_manifests(tmp_path / "manifests", tmp_path / "audio", splits)
    (tmp_path / "audio" / "b.wav").unlink()
    with caplog.at_level("WARNING", logger="asrflow.data.features.extract"):
        counts = compute_features(tmp_path / "manifests", tmp_path / "fbank", feature_config(num_jobs=1))
    assert counts == {"train": 3, "dev": 1, "test": 1}
    assert sorted(cut.recording_id for cut in load_cuts(tmp_path / "fbank", "train")) == ["a", "c"]
    assert "train: 1 cut(s) dropped because their audio could not be read: b" in caplog.text
    assert sorted(p.name for p in (tmp_path / "fbank").iterdir()) == [
        "cmvn.json",
        "config.json",
        "dev_cuts.jsonl.gz",
        "dev_feats.lca",
        "test_cuts.jsonl.gz",
        "test_feats.lca",
        "train_cuts.jsonl.gz",
        "train_feats.lca",
    ]  # no staging files left


def test_manifests_are_read_lazily(yesno_data):
    lazy = load_cuts(yesno_data / "manifests", "train")
    assert lazy.is_lazy
    assert [cut.id for cut in lazy] == [cut.id for cut in lazy.to_eager()] and len(lazy) == 27


@pytest.mark.slow
def test_the_job_count_changes_no_manifest_order_statistic_digest_or_plan(yesno_data, tmp_path):
    """Issue 13, item 2, at the data level: a corpus (the yesno train audio listed 3 times
    under new ids) extracted by 1 and by 2 processes gives cuts in the same (id) order,
    byte-identical CMVN statistics, the same content digest and epoch plans, and equal
    feature matrices; only where the features are stored differs. (With ``num_jobs: 0``
    a split of 2 hours or more gets 2 processes on 2 cores: the job count is what matters,
    tested here directly; 2 hours of audio would cost a minute on 2 busy cores.)"""
    import shutil

    import numpy as np
    from lhotse import CutSet

    from asrflow.data.loading.cut_index import CutIndex, data_digest
    from asrflow.data.loading.planner import plan_digest, plan_epoch
    from asrflow.data.manifests import cuts_path

    manifests = tmp_path / "manifests"
    manifests.mkdir()
    train = load_cuts(yesno_data / "manifests", "train").to_eager()
    long = sorted((cut.with_id(f"{cut.id}-r{r:02d}") for r in range(3) for cut in train), key=lambda c: c.id)
    CutSet.from_cuts(long).to_file(cuts_path(manifests, "train"))
    for split in ("dev", "test"):
        shutil.copy(cuts_path(yesno_data / "manifests", split), cuts_path(manifests, split))

    results = {}
    for jobs in (1, 2):
        out = tmp_path / f"fbank{jobs}"
        # Coarse frames (0.1 s, 10 bins) keep 4 hours of extraction to seconds; the order is what is tested.
        compute_features(manifests, out, feature_config(num_jobs=jobs, frame_shift_s=0.1, num_mel_bins=10))
        index = CutIndex.build(cuts_path(out, "train"), tmp_path / f"store{jobs}.jsonl")
        results[jobs] = (
            [cut.id for cut in load_cuts(out, "train")],
            (out / CMVN_FILE).read_bytes(),
            data_digest(index, out / CMVN_FILE),
            [plan_digest(plan_epoch(index, epoch, seed=42, max_duration_s=60.0, num_buckets=30)) for epoch in (0, 1)],
        )
    assert results[1] == results[2]
    assert results[1][0] == sorted(cut.id for cut in long)
    one, two = load_cuts(tmp_path / "fbank1", "train"), load_cuts(tmp_path / "fbank2", "train")
    storages = set()
    for a, b in zip(one, two, strict=True):
        assert np.array_equal(a.load_features(), b.load_features())
        storages.add((a.features.storage_path, b.features.storage_path))
    assert len({b for _, b in storages}) == 2  # two jobs really wrote two storage files


def test_an_unsorted_manifest_is_refused_by_name(tmp_path):
    splits = {"train": ["b", "a"], "dev": ["d"], "test": ["e"]}
    write_split_manifests(tmp_path / "manifests", tmp_path / "audio", splits)
    with pytest.raises(AsrflowError, match="train_cuts.jsonl.gz: cut 'a' comes after 'b'.*re-run prepare"):
        compute_features(tmp_path / "manifests", tmp_path / "fbank", feature_config(num_jobs=1))
    assert not (tmp_path / "fbank").exists()


def test_training_on_features_computed_with_other_settings_is_refused_by_name(yesno_data, tmp_path, capsys):
    """The shipped params (8 kHz, 40 bins) against features computed at 16 kHz / 80 bins:
    one error naming both keys, before anything is written."""
    from stages import train

    params = write_shipped_params(tmp_path, {})
    with pytest.raises(SystemExit) as exit_info:
        train.main(
            ["--params", str(params), "--fbank", str(yesno_data / "fbank"), "--lang", str(yesno_data / "lang")]
            + ["--exp", str(tmp_path / "exp")]
        )
    assert exit_info.value.code == EXIT_USER_ERROR
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert "features.sampling_rate = 8000 but 16000 there" in errors[0]
    assert "features.num_mel_bins = 40 but 80 there" in errors[0]
    assert "Run the features stage again" in errors[0]
    assert not (tmp_path / "exp").exists()


def test_features_of_the_same_settings_pass_and_an_older_folder_is_not_checked(yesno_data, tmp_path):
    check_same_features(feature_config(num_jobs=3, on_the_fly=False), yesno_data / "fbank")  # num_jobs: how, not what
    with pytest.raises(AsrflowError, match=r"features.frame_shift_s = 0.02 but 0.01 there"):
        check_same_features(feature_config(frame_shift_s=0.02), yesno_data / "fbank")
    check_same_features(feature_config(num_mel_bins=40), tmp_path)  # no config.json: written before the check
